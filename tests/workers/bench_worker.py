"""One rank of the multi-process benchmark tests (started 2 or 4 times by tests/multiproc/bench/test_bench_dist.py
with torchrun's variables).

Runs several cases in one process to pay for `import torch` once; each case gets its own port and run root.
A case is either a `hpctrain bench` command line (run in-process through the click command), "hier", which
compares the two-level all-reduce with the flat one on the session's own intra/inter groups, or "world_time",
which combines the known times rank + 1 over the ranks for each -a. The case named "inject" runs with one wrong
element in the check (tests/plugins/seams.py's wrong_element). Writes what happened per case to
<out>/rank<r>.json.
"""
import contextlib
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins"))
import seams  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist

from hpctrain.bench import colls, harness, pattern
from hpctrain.bench import job as benchjob
from hpctrain.cli import main as cli
from hpctrain.config import load_config
from hpctrain.job import session

HIER_NUMEL = 1000  # divisible by the intra group size (2)


def _hier_case(s: session.Session) -> dict:
    """Hierarchical vs flat all-reduce of the same tensors, and both vs a single-process reference."""
    intra, inter = s.mesh.group("intra"), s.mesh.group("inter")
    world = s.ident.world_size
    record = {"intra": s.mesh.members("intra", s.rank), "inter": s.mesh.members("inter", s.rank)}
    # seeded small integers: every order of summation gives the same bits
    for dtype, op in [("int64", "sum"), ("int32", "max"), ("float", "sum"), ("float", "min"), ("double", "prod")]:
        inputs = [pattern.make_data(r, HIER_NUMEL, harness.DTYPES[dtype], op, seed=11, nranks=world)
                  for r in range(world)]
        hier, flat = inputs[s.rank].clone(), inputs[s.rank].clone()
        colls.hierarchical_all_reduce(hier, intra, inter, op)
        dist.all_reduce(flat, op=colls.TORCH_OPS[op])
        ref = pattern.reduce_inputs(inputs, op)
        record[f"{dtype}_{op}"] = {"hier_eq_flat": torch.equal(hier, flat),
                                   "hier_eq_ref": torch.equal(hier.double(), ref),
                                   "changed": not torch.equal(hier, inputs[s.rank])}
    # random floats: equal within rounding (the two algorithms add in different orders)
    for op in ("sum", "avg"):
        inputs = [torch.randn(HIER_NUMEL, generator=torch.Generator().manual_seed(100 + r)) for r in range(world)]
        hier, flat = inputs[s.rank].clone(), inputs[s.rank].clone()
        colls.hierarchical_all_reduce(hier, intra, inter, op)
        dist.all_reduce(flat, op=colls.TORCH_OPS[op])
        ref = pattern.reduce_inputs(inputs, op)
        record[f"randn_{op}"] = {"max_diff_flat": (hier - flat).abs().max().item(),
                                 "max_diff_ref": (hier.double() - ref).abs().max().item(),
                                 "max_abs_ref": ref.abs().max().item()}
    return record


def _world_time_case(s: session.Session) -> dict:
    """benchjob's time combination over real ranks for each -a, from the per-rank times rank + 1 seconds."""
    combined = {}
    for average in range(4):
        opts = harness.Options(colls=["all_reduce"], sizes=[8], average=average)
        world_time = benchjob.world_control(opts, s.device)[0]
        combined[str(average)] = world_time(float(s.rank + 1))
    return combined


def main(out: str, example: str, base_port: int, cases_json: str) -> None:
    rank = int(os.environ["RANK"])
    record = {}
    for i, (name, argv) in enumerate(json.loads(cases_json)):
        os.environ["MASTER_PORT"] = str(base_port + i)
        sets = ["--set", f"job.run_root={out}/{name}", "--set", "parallel.timeout_s=120"]
        try:
            if argv in ("hier", "world_time"):
                cfg = load_config(example, [f"job.run_root={out}/{name}", "parallel.timeout_s=120"])
                with session.start(cfg) as s:
                    record[name] = _hier_case(s) if argv == "hier" else _world_time_case(s)
            else:
                with seams.wrong_element() if name == "inject" else contextlib.nullcontext():
                    cli.main(["bench", *argv, "--config", example, *sets], standalone_mode=False)
                record[name] = {"ok": True}
        except Exception as e:  # recorded for the test to judge; every rank must fail alike
            record[name] = {"error": f"{type(e).__name__}: {e}"}
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
