"""Evaluation inside a training run in the test process: reported, and leaving training alone (the rest of evaluation:
tests/pure/train/test_eval.py; across layouts: tests/multiproc/train/test_eval_layouts.py).

    PATH=$PWD/.venv/bin:$PATH .venv/bin/python -m pytest -q tests/multiproc/train/test_eval_training.py
"""
from __future__ import annotations

import json

import numpy as np

from helpers.training import SMALL
from hpctrain.config import load_config
from hpctrain.job import session
from hpctrain.train.plot import plot_training
from hpctrain.train.trainer import Trainer


def _fit(tmp_path, *sets: str) -> tuple[dict, Trainer]:
    cfg = load_config(None, SMALL + ["train.steps=5", "train.log_every=1", f"job.run_root={tmp_path / 'runs'}",
                                     f"checkpoint.dir={tmp_path / 'ck'}", "checkpoint.at_end=false", *sets])
    with session.start(cfg) as s:
        trainer = Trainer(cfg, s)
        return trainer.fit(), trainer


def test_evaluations_are_reported_and_leave_training_alone(tmp_path, capfd) -> None:
    res, trainer = _fit(tmp_path / "a", "train.eval_every=2", "train.eval_batches=3")
    captured = capfd.readouterr()
    said = (captured.out + captured.err).splitlines()
    plain, _ = _fit(tmp_path / "b")
    assert res["losses"] == plain["losses"]  # evaluation reads its own data and changes no weight
    steps = [s for s, _ in res["val_losses"]]
    assert steps == [2, 4, 5] and res["val_loss"] == res["val_losses"][-1][1]
    assert all(np.isfinite(v) and 0 < v < 7 for _, v in res["val_losses"])
    assert "val_losses" not in plain
    run_dir = trainer.s.run_dir
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in evals] == [2, 4, 5] and all(r["val_tokens"] == 3 * 2 * 16 for r in evals)
    assert [r["val_loss"] for r in evals] == [v for _, v in res["val_losses"]]
    assert any("eval step 2: val loss" in m for m in said)
    assert any(" val " in m and "step 3/5" in m for m in said)  # progress lines after an evaluation
    assert plot_training(run_dir).is_file()
    # the same batches every time: evaluating again at the last step gives the same number
    assert trainer.evaluate()["val_loss"] == res["val_loss"]
