"""Validation loss (train.eval_every, train.eval_batches), one process: evaluations land every eval_every steps
and after the last, on metrics.jsonl rows of their own, the progress line, the summary and the plot; that they leave
training alone is tests/multiproc/train/test_eval_training.py's; the same batches every time (an evaluation repeated at
one step gives the same loss); a missing validation split is refused at submission. Equal across layouts:
tests/multiproc/train/test_eval_layouts.py.

    PATH=$PWD/.venv/bin:$PATH .venv/bin/python -m pytest -q tests/pure/train/test_eval.py
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from helpers.refusals import refused
from helpers.training import SMALL
from hpctrain.cli.main import main as cli
from hpctrain.config import load_config
from hpctrain.data import loader as data
from hpctrain.data.sources import open_source
from hpctrain.data.tokenfiles import ArraySource


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
    train, val = open_source(cfg.data, 256, seed=0), data.open_val_source(cfg.data, 256, seed=0)
    assert not np.array_equal(train.read(0, 512), val.read(0, 512))
