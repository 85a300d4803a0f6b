"""One rank of tests/multiproc/test_eval.py: trains each case (a layout) a few steps with train.eval_every and
records, on rank 0, the run summary's training and validation losses."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers
from helpers import TINY  # noqa: E402
from hpctrain import session  # noqa: E402
from hpctrain.config import load_config  # noqa: E402
from hpctrain.train import Trainer  # noqa: E402


def main(out: str, cases_json: str, base_port: int) -> None:
    rank = int(os.environ["RANK"])
    errors = {}
    for i, case in enumerate(json.loads(cases_json)):
        os.environ["MASTER_PORT"] = str(base_port + i)
        cfg = load_config(None, TINY + case["overrides"] + [f"job.run_root={out}/{case['name']}-runs",
                                                            f"checkpoint.dir={out}/{case['name']}-ck"])
        try:
            with session.start(cfg) as s:
                res = Trainer(cfg, s).fit()
                if s.rank == 0:
                    torch.save({"losses": res["losses"], "val_losses": res["val_losses"]},
                               Path(out) / f"{case['name']}.pt")
        except Exception as e:  # recorded so the test names the case that failed
            errors[case["name"]] = f"{type(e).__name__}: {e}"
    Path(out, f"errors-rank{rank}.json").write_text(json.dumps(errors))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
