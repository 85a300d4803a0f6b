"""nccl-tests-style collective benchmarks on the job's own communicators.

`sweep` is the pure part (sizes, bandwidth formulas, the table), `colls` holds one small definition per
collective, `pattern` the closed-form seeded inputs every check is computed from, `harness` times and checks them
over torch.distributed or mpi4py, `gemm` measures matmul rates and `plot` draws busbw against size. The job
entry point is hpctrain.bench.job.
"""
