"""Validation loss (train.eval_every, train.eval_batches), one process: evaluations land every eval_every steps
and after the last, on metrics.jsonl rows of their own, the progress line, the summary and the plot; they leave
training alone (the same losses as a run without them); the same batches every time (an evaluation repeated at
one step gives the same loss); a missing validation split is refused at submission. Equal across layouts:
tests/multiproc/test_eval_layouts.py.

    PATH=$PWD/.venv/bin:$PATH .venv/bin/python -m pytest -q tests/pure/test_eval.py
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from helpers.refusals import refused
from helpers.training import SMALL
from hpctrain.cli.main import main as cli
from hpctrain.config import load_config
from hpctrain.data import loader as data
from hpctrain.data.tokenfiles import ArraySource
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


def test_eval_loader_is_fixed_and_sharded_like_training(tmp_path) -> None:
    tokens = np.arange(1000, dtype=np.uint16) % 200
    path = tmp_path / "t.bin"
    path.write_bytes(tokens.tobytes())
    src = ArraySource(path)
    one = list(data.EvalLoader(src, 8, 4, 0, 1, 3).batches())
    halves = [list(data.EvalLoader(src, 8, 2, r, 2, 3).batches()) for r in range(2)]
    for k in range(3):
        assert torch.equal(one[k][0], torch.cat([halves[0][k][0], halves[1][k][0]]))
    assert torch.equal(one[0][0][1], torch.from_numpy(tokens[8:16].astype(np.int64)))  # in order: no shuffle
    assert data.EvalLoader(src, 8, 4, 0, 1, 1000).num_batches == 999 // 8 // 4  # as many as the split holds
    refused(data.EvalLoader, src, 500, 4, 0, 1, 2, fragments=["fewer than one global micro-batch"])


def test_missing_validation_split_is_refused_at_submission(tmp_path) -> None:
    path = tmp_path / "train.bin"
    path.write_bytes((np.arange(5000, dtype=np.uint16) % 200).tobytes())
    cfg_sets = ["--set", "data.source=bin", "--set", f"data.path={path}", "--set", "train.eval_every=10",
                "--set", f"job.run_root={tmp_path / 'runs'}", "--set", "job.executor=local"]
    from helpers.launch import EXAMPLE
    res = CliRunner().invoke(cli, ["submit", str(EXAMPLE), *cfg_sets])
    assert res.exit_code == 2 and "train.val.bin" in res.output and "does not exist" in res.output, res.output
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_pipelined_evaluation_needs_whole_schedules() -> None:
    refused(load_config, None, ["parallel.pp=2", "train.grad_accum=2", "train.eval_every=5", "train.eval_batches=3"],
            fragments=["train.eval_batches = 3 must be a multiple of train.grad_accum = 2"])


@pytest.mark.parametrize("source", ["synthetic"])
def test_synthetic_validation_is_another_stream(source) -> None:
    cfg = load_config(None, SMALL)
    train, val = data.open_source(cfg.data, 256, seed=0), data.open_val_source(cfg.data, 256, seed=0)
    assert not np.array_equal(train.read(0, 512), val.read(0, 512))
