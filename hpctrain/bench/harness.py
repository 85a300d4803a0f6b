"""The one benchmark harness: for each size and placement (out of place, in place), fill seeded inputs, warm up,
synchronise the device, pass a barrier, time `iters` calls and combine the ranks' times per call (world_time:
the mean by default, opts.average); then, unless check is off, fill the receive buffer with a sentinel, refill the
inputs, run once and count wrong elements summed over the ranks (world_sum).
The inputs are closed-form (pattern.py): filling and checking work chunk by chunk on the buffers' device, with
memory O(chunk) per rank whatever the world size and message size.

    opts = Options(colls=["all_reduce"], sizes=size_sweep(1024, 1 << 20), average=1, blocking=0)
    rows = run_benchmark(opts, ctx, device, world_time, world_sum, barrier, emit=print)

The timed loop is nccl-tests' (BenchTime in src/common.cu, NVIDIA/nccl-tests a0b82b2): the host clock from the
barrier to the end of the last call, divided by the calls. With -z 0 (opts.blocking = 0) every call is launched
back to back (torch's async_op=True) and the loop waits once at the end (each call's work, then the device); with
-z 1 each call is waited for, the device synchronised and a barrier passed before the next, all inside the timed
loop. MPI's calls return complete: -z 0 issues them back to back, -z 1 adds the wait for the device (none: host
buffers) and the barrier.

The group comes in as an argument, inside ctx (colls.Ctx: the members, a torch group from the mesh, or an mpi4py
communicator over the same members); benchjob.py builds ctx and the three control functions from a session.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch

from hpctrain import dtypes
from hpctrain.bench.colls import COLLS, Coll, Ctx
from hpctrain.bench.pattern import Pattern, sentinel
from hpctrain.bench.sweep import AVERAGES, BLOCKING, Row, bandwidths

DTYPES = dtypes.TORCH  # -d names (nccl-tests' spelling); dtypes.canonical maps the others
MPI_DTYPES = ("float", "double", "int32", "int64", "int8", "uint8")
GROUPS = ("world", "pp", "dp", "tp", "cp", "intra", "inter")


@dataclass
class Options:
    colls: list[str]
    sizes: list[int]
    iters: int = 20
    warmup: int = 5
    check: bool = True
    dtype: str = "float"
    op: str = "sum"
    root: int = 0
    group: str = "world"
    backend: str = "torch"  # torch (gloo/NCCL as started) | mpi (mpi4py on host buffers)
    algo: str = "flat"  # flat | hier (all_reduce on world only)
    seed: int = 0
    average: int = 1  # -a: the ranks' times combined as nccl-tests does: 0 rank 0, 1 mean, 2 min, 3 max
    blocking: int = 0  # -z: 0 back-to-back launches and one wait, 1 wait and barrier after each call
    placements: tuple[str, ...] = field(default=("out", "in"))

    def __post_init__(self) -> None:
        self.dtype = dtypes.canonical(self.dtype)
        unknown = [c for c in self.colls if c not in COLLS]
        if unknown:
            raise ValueError(f"unknown collective(s) {', '.join(unknown)}; valid: {', '.join(COLLS)}, all")
        if self.dtype not in DTYPES:
            raise ValueError(f"-d {self.dtype}: unknown type; valid: {', '.join(DTYPES)}")
        if self.op not in ("sum", "prod", "min", "max", "avg"):
            raise ValueError(f"-o {self.op}: valid reductions are sum, prod, min, max, avg")
        if self.op == "avg" and not DTYPES[self.dtype].is_floating_point:
            raise ValueError(f"-o avg needs a floating type, not -d {self.dtype}")
        if self.group not in GROUPS:
            raise ValueError(f"--group {self.group}: valid groups are {', '.join(GROUPS)}")
        if self.backend not in ("torch", "mpi"):
            raise ValueError(f"--backend {self.backend}: valid backends are torch and mpi")
        if self.backend == "mpi" and self.op == "avg":
            raise ValueError("-o avg: MPI has no averaging reduction (use sum, prod, min or max)")
        if self.backend == "mpi" and self.dtype not in MPI_DTYPES:
            raise ValueError(f"--backend mpi works on host buffers of {', '.join(MPI_DTYPES)}, not -d {self.dtype}")
        if self.algo not in ("flat", "hier"):
            raise ValueError(f"--algo {self.algo}: valid algorithms are flat and hier")
        if self.algo == "hier" and (self.colls != ["all_reduce"] or self.group != "world" or self.backend != "torch"):
            raise ValueError("--algo hier is the two-level all_reduce: use it with all_reduce, --group world and "
                             f"--backend torch (got {', '.join(self.colls)}, --group {self.group}, "
                             f"--backend {self.backend})")
        if self.iters < 1 or self.warmup < 0:
            raise ValueError(f"-n {self.iters} -w {self.warmup}: need at least 1 iteration and >= 0 warmup")
        if self.root < 0:
            raise ValueError(f"-r {self.root}: the root must be >= 0")
        if self.average not in AVERAGES:
            raise ValueError(f"-a {self.average}: valid values are "
                             + ", ".join(f"{k} ({v})" for k, v in AVERAGES.items()))
        if self.blocking not in BLOCKING:
            raise ValueError(f"-z {self.blocking}: valid values are "
                             + ", ".join(f"{k} ({v})" for k, v in BLOCKING.items()))


def check_chunk(device: torch.device) -> int:
    """Elements filled or checked per step: on a host ~2.5 MiB of temporaries (two threads' worth of work per
    op); an accelerator takes bigger steps so that 8 GiB messages do not pay kernel launches per 64K elements."""
    return 1 << 16 if device.type == "cpu" else 1 << 22


def wrong_mask(got: torch.Tensor, want: torch.Tensor, op: str) -> torch.Tensor:
    """Elements of `got` that differ from the reference (read as float64, on got's device); exact except for avg
    (rounded division)."""
    dtype = got.dtype
    got, want = got.detach().double(), want.to(got.device).double()
    if op == "avg":
        return ~torch.isclose(got, want, rtol=4 * torch.finfo(dtype).eps, atol=0)
    return got != want


def count_wrong(got: torch.Tensor, want: torch.Tensor, op: str) -> int:
    """How many elements of `got` differ from the reference (see wrong_mask)."""
    return int(wrong_mask(got, want, op).sum())


def check_recv(coll: Coll, inputs: Pattern, ctx: Ctx, T: int, recv: torch.Tensor, chunk: int) -> int | None:
    """Wrong elements of this rank's receive buffer, `chunk` positions at a time; None if it holds no result."""
    flat = recv.view(-1)
    wrong = torch.zeros((), dtype=torch.int64, device=recv.device)  # summed on the device: one sync at the end
    for start in range(0, flat.numel(), chunk):
        stop = min(start + chunk, flat.numel())
        want = coll.expected(inputs, ctx, T, torch.arange(start, stop, device=recv.device))
        if want is None:
            return None
        wrong += wrong_mask(flat[start:stop], want, ctx.op).sum()
    return int(wrong)


def buffer_device(backend: str, device: torch.device) -> torch.device:
    """Where a placement's buffers live and whose work the clock waits for: the job's device for torch; the host
    for MPI, which is handed numpy views of the buffers (a CUDA tensor has none)."""
    return torch.device("cpu") if backend == "mpi" else device


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # every stream of the device: NCCL's own ones too


def _wait(handle) -> None:
    """Completes what one launch returned: a torch Work, a list of them (a batched exchange), or None (a call that
    returned complete: MPI, or a collective made of dependent steps)."""
    for work in handle if isinstance(handle, list) else [handle] if handle is not None else []:
        work.wait()


def timed_loop(launch: Callable[[], Any], iters: int, blocking: int, sync: Callable[[], None],
               barrier: Callable[[], None]) -> None:
    """nccl-tests' timed loop over `iters` calls of launch(): blocking 0 launches them all, then waits for each
    launch's work and synchronises the device once; blocking 1 waits, synchronises and passes a barrier after
    each call. The caller's clock runs around it (its end is the last wait)."""
    if blocking:
        for _ in range(iters):
            _wait(launch())
            sync()
            barrier()
        return
    pending = [launch() for _ in range(iters)]
    for handle in pending:
        _wait(handle)
    sync()


class Inputs:
    """The seeded inputs of a group of nranks members, one closed-form Pattern per collective (nothing stored).
    Every member builds its own from the same (opts.seed, opts.op, dtype, nranks) and gets the same patterns, so
    the expected results can be checked without any exchange; run_placement takes one."""

    def __init__(self, opts: Options, dtype: torch.dtype, nranks: int) -> None:
        self.opts, self.dtype, self.nranks = opts, dtype, nranks

    def pattern(self, coll: Coll) -> Pattern:
        """The Pattern of coll's inputs and expected outputs (with opts.op for a reducing collective, else none)."""
        return Pattern(self.opts.seed, self.dtype, self.opts.op if coll.reduces else None, self.nranks)


def alloc_buffers(coll: Coll, ctx: Ctx, T: int, dtype, device, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """New zeroed (send, recv) tensors of `dtype` for coll with T elements per rank in ctx's group, on `device`
    (on the host for MPI: buffer_device), sized by coll.sizes; for an in-place ctx, two views of one buffer
    (coll.views). What run_placement allocates when it is not given `buffers`, and what a caller allocates once to
    reuse across run_placement calls."""
    device = buffer_device(backend, device)
    send_n, recv_n = coll.sizes(T, ctx.n)
    if ctx.inplace:
        buf = torch.zeros(max(send_n, recv_n), dtype=dtype, device=device)
        return coll.views(buf, ctx, backend)
    return torch.zeros(send_n, dtype=dtype, device=device), torch.zeros(recv_n, dtype=dtype, device=device)


def run_placement(coll: Coll, ctx: Ctx, T: int, opts: Options, device, inputs: Inputs,
                  world_time: Callable[[float], float], world_sum: Callable[[int], int],
                  barrier: Callable[[], None], buffers: tuple[torch.Tensor, torch.Tensor] | None = None
                  ) -> dict[str, Any]:
    """Times and checks one placement; `buffers` (send, recv) may be given to reuse memory across calls.
    world_time turns this rank's seconds per call into the reported ones (benchjob.world_control: by
    opts.average over the ranks)."""
    dtype = DTYPES[opts.dtype]
    device = buffer_device(opts.backend, device)
    send, recv = buffers or alloc_buffers(coll, ctx, T, dtype, device, opts.backend)
    run = coll.run_torch if opts.backend == "torch" else coll.run_mpi
    launch = lambda: run(send, recv, ctx)  # noqa: E731
    pattern, chunk = inputs.pattern(coll), check_chunk(send.device)
    pattern.fill(send, ctx.idx, chunk)
    timed_loop(launch, opts.warmup, 0, lambda: _sync(device), barrier)
    barrier()
    t0 = time.perf_counter()
    timed_loop(launch, opts.iters, opts.blocking, lambda: _sync(device), barrier)
    elapsed = world_time((time.perf_counter() - t0) / opts.iters)
    wrong = None
    if opts.check:
        recv.fill_(sentinel(dtype))  # so an element the collective never wrote counts as wrong
        pattern.fill(send, ctx.idx, chunk)
        _wait(launch())
        _sync(device)
        wrong = world_sum(check_recv(coll, pattern, ctx, T, recv, chunk) or 0)
    return {"time_us": elapsed * 1e6, "wrong": wrong}


def run_benchmark(opts: Options, ctx: Ctx, device: torch.device, world_time: Callable[[float], float],
                  world_sum: Callable[[int], int], barrier: Callable[[], None],
                  emit: Callable[[Row], None] = lambda row: None) -> list[Row]:
    """All sizes of all requested collectives; `emit` sees each row as soon as it is measured."""
    dtype = DTYPES[opts.dtype]
    elem = torch.empty(0, dtype=dtype).element_size()
    rows = []
    for name in opts.colls:
        coll = COLLS[name]
        if name == "sendrecv" and ctx.n < 2:
            raise ValueError(f"sendrecv needs a group of >= 2 ranks; --group {opts.group} has {ctx.n}")
        if opts.root >= ctx.n:
            raise ValueError(f"-r {opts.root}: the root must be below the group size {ctx.n}")
        align = coll.align(ctx.n) * (dist_size(ctx.hier[0]) if ctx.hier else 1)
        for size in opts.sizes:
            T = (size // elem) // align * align
            if T == 0:
                continue
            inputs = Inputs(opts, dtype, ctx.n)
            res = {}
            for placement in ("out", "in"):
                if placement in coll.placements[opts.backend] and placement in opts.placements:
                    pctx = replace(ctx, inplace=placement == "in")
                    res[placement] = run_placement(coll, pctx, T, opts, device, inputs, world_time, world_sum,
                                                   barrier)
            row = Row(coll=name, size=T * elem, count=coll.chunk(T, ctx.n), dtype=opts.dtype, op=opts.op,
                      root=opts.root, nranks=ctx.n, group=opts.group, backend=opts.backend, algo=opts.algo,
                      average=opts.average, blocking=opts.blocking)
            for placement, r in res.items():
                algbw, busbw = bandwidths(row.size, r["time_us"] / 1e6, name, ctx.n)
                r.update(algbw=algbw, busbw=busbw)
            row.out, row.inp = res.get("out"), res.get("in")
            rows.append(row)
            emit(row)
    if not rows:
        raise ValueError(f"no size in the sweep ({opts.sizes[0]} to {opts.sizes[-1]} bytes) holds a whole "
                         f"element group of {opts.dtype} for {', '.join(opts.colls)} on {ctx.n} ranks")
    return rows


def dist_size(group) -> int:
    import torch.distributed as dist
    return dist.get_world_size(group)
