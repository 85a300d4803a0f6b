"""One rank of tests/multiproc/train/test_eval_layouts.py: trains each case (a layout) a few steps with
train.eval_every and records, on rank 0, the run summary's training and validation losses."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers
from helpers.launch import each_case  # noqa: E402
from helpers.training import TINY  # noqa: E402
from hpctrain.config import load_config  # noqa: E402
from hpctrain.job import session
from hpctrain.train.trainer import Trainer  # noqa: E402


def main(out: str, cases_json: str, base_port: int) -> None:
    def case(c: dict) -> None:
        cfg = load_config(None, TINY + c["overrides"] + [f"job.run_root={out}/{c['name']}-runs",
                                                         f"checkpoint.dir={out}/{c['name']}-ck"])
        with session.start(cfg) as s:
            res = Trainer(cfg, s).fit()
            if s.rank == 0:
                torch.save({"losses": res["losses"], "val_losses": res["val_losses"]}, Path(out) / f"{c['name']}.pt")
    each_case(out, cases_json, base_port, case)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
