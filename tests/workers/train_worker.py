"""One rank of a torchrun-style spawn that trains several cases in turn (helpers.run_case: each case's per-step
losses, pre-clip gradient norms and final full weights; also, on rank 0, each FSDP module's reshard_after_forward
and the all-gathers of the last step), for tests/multiproc/test_train_equivalence.py and
tests/multiproc/test_grad_scale_mutations.py. A case may name a deliberate gradient bug ("mutation":
HPCTRAIN_TEST_MUTATION, for that case only). The test process runs helpers.run_case itself as the 1-rank
reference.

    python tests/workers/train_worker.py OUT CASES_JSON BASE_PORT      # one rank of a torchrun-style spawn
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers
from helpers import run_case  # noqa: E402
from hpctrain.train.mutations import MUTATION_ENV  # noqa: E402


def main(out: str, cases_json: str, base_port: int) -> None:
    rank = int(os.environ["RANK"])
    errors = {}
    for i, case in enumerate(json.loads(cases_json)):
        os.environ["MASTER_PORT"] = str(base_port + i)
        # a case's deliberate bug (hpctrain.train.mutations.gradient_mutation), for this case only
        os.environ.pop(MUTATION_ENV, None)
        if case.get("mutation"):
            os.environ[MUTATION_ENV] = case["mutation"]
        try:
            run_case(case["overrides"], Path(out) / f"{case['name']}.pt", case.get("inject_inf_step", 0))
        except Exception as e:  # recorded so the test shows which case failed and why
            errors[case["name"]] = f"{type(e).__name__}: {e}"
    os.environ.pop(MUTATION_ENV, None)
    Path(out, f"errors-rank{rank}.json").write_text(json.dumps(errors))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
