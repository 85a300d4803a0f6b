"""One rank of a torchrun-style spawn that trains several cases in turn (helpers.training.run_case: each case's per-step
losses, pre-clip gradient norms and final full weights; also, on rank 0, each FSDP module's reshard_after_forward
and the all-gathers of the last step), for tests/multiproc/parallel/test_train_equivalence.py and
tests/multiproc/parallel/test_grad_scale_mutations.py. A case may name a deliberate gradient bug ("mutation": patched in
by
tests/plugins/seams.py's gradient_mutation, for that case only). The test process runs
helpers.training.run_case itself as
the 1-rank reference.

    python tests/workers/train_worker.py OUT CASES_JSON BASE_PORT      # one rank of a torchrun-style spawn
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins"))  # for seams
import seams  # noqa: E402

from helpers.training import run_case  # noqa: E402


def main(out: str, cases_json: str, base_port: int) -> None:
    rank = int(os.environ["RANK"])
    errors = {}
    for i, case in enumerate(json.loads(cases_json)):
        os.environ["MASTER_PORT"] = str(base_port + i)
        if "train.compile=true" in case["overrides"]:
            # a job's process compiles one model; this one compiles a case after another, and dynamo's state from
            # the earlier ones made inductor overflow Python's recursion limit on the eighth compiled case here
            # (pp2 x tp2 with fused projections, which compiles alone): each case starts as a job's process does
            import torch._dynamo
            torch._dynamo.reset()
        try:
            with seams.gradient_mutation(case.get("mutation")):  # a case's deliberate bug, for this case only
                run_case(case["overrides"], Path(out) / f"{case['name']}.pt", case.get("inject_inf_step", 0),
                         case.get("fp8", ""), case.get("fp8_all_gather", False))
        except Exception as e:  # recorded so the test shows which case failed and why
            errors[case["name"]] = f"{type(e).__name__}: {e}"
    Path(out, f"errors-rank{rank}.json").write_text(json.dumps(errors))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
