"""One rank of the checkpoint tests: runs Trainer.fit() for several cases in turn (save, resume, reshard) and
records losses, final full weights and where each run resumed from."""
from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers
from helpers.training import TINY, full_weights  # noqa: E402
from hpctrain.config import load_config  # noqa: E402
from hpctrain.job import session
from hpctrain.train.trainer import Trainer  # noqa: E402


def signal_after(step: int):
    """An on_step watcher for Trainer.fit: sends this process Slurm's warning signal (USR2) right after `step`, as
    a preemption would."""
    def watch(row: dict) -> None:
        if row["step"] == step:
            os.kill(os.getpid(), signal.SIGUSR2)
    return watch


def main(out: str, cases_json: str, base_port: int) -> None:
    rank = int(os.environ["RANK"])
    errors = {}
    for i, case in enumerate(json.loads(cases_json)):
        os.environ["MASTER_PORT"] = str(base_port + i)
        target = Path(out) / f"{case['name']}.pt"
        cfg = load_config(None, TINY + case["overrides"] + [f"job.run_root={out}/{case['name']}-runs"])
        try:
            with session.start(cfg) as s:
                trainer = Trainer(cfg, s)
                # preempt_at: the step the preemption's checkpoint is of. The ranks agree on a signal a step after it
                # arrived (train/agreement.py), so it is sent right after the step before
                preempt_at = case.get("preempt_at") if s.rank == 0 else None
                res = trainer.fit(on_step=signal_after(preempt_at - 1) if preempt_at else None)
                weights = full_weights(trainer.model)
                if s.rank == 0:
                    torch.save({"losses": res["losses"], "resumed_from": res["resumed_from"], "weights": weights,
                                "preempted": res["preempted"], "steps": res["steps"],
                                "pipeline": res.get("pipeline")}, target)
        except Exception as e:  # recorded so the test names the case that failed
            errors[case["name"]] = f"{type(e).__name__}: {e}"
    Path(out, f"errors-rank{rank}.json").write_text(json.dumps(errors))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
