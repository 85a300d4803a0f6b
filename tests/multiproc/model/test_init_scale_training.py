"""Initialisation in training runs in the test process: a resume skips it, a fresh run and a trainer stepped by hand
fill the weights on first use (the draws themselves: tests/pure/model/test_init_scale.py; across ranks:
tests/multiproc/model/test_init_scale_shards.py).

    PATH=$PWD/.venv/bin:$PATH .venv/bin/python -m pytest -q tests/multiproc/model/test_init_scale_training.py
"""
from __future__ import annotations

import math

import torch

from helpers.training import TINY, counting_tiles
from hpctrain.config import load_config
from hpctrain.job import session
from hpctrain.model.transformer import init_value
from hpctrain.parallel import materialize

# -- the trainer: no init under a resume -------------------------------------------------------------------------
SMALL = TINY + ["model.dim=32", "model.n_heads=2", "model.n_layers=1", "data.seq_len=16", "train.micro_batch_size=2"]


def counting_fills(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = materialize.init_weights
    monkeypatch.setattr(materialize, "init_weights", lambda *a: calls.append(1) or real(*a))
    return calls


def test_resume_skips_the_init_and_a_fresh_run_fills(tmp_path, monkeypatch) -> None:
    from hpctrain.train.trainer import Trainer
    calls, drawn = counting_fills(monkeypatch), counting_tiles(monkeypatch)

    def fit(steps: int) -> dict:
        cfg = load_config(None, SMALL + [f"job.run_root={tmp_path / 'runs'}", f"checkpoint.dir={tmp_path / 'ck'}",
                                         f"train.steps={steps}"])
        with session.start(cfg) as s:
            return Trainer(cfg, s).fit()
    fresh = fit(2)
    assert calls == [1] and drawn and fresh["resumed_from"] is None
    calls.clear(), drawn.clear()
    resumed = fit(4)
    assert resumed["resumed_from"] == 2 and resumed["steps"] == 4
    assert calls == [] and drawn == {}  # the checkpoint filled every weight: not one tile drawn


def test_a_trainer_stepped_by_hand_fills_on_first_use(tmp_path, monkeypatch) -> None:
    """Callers that step without fit() (benchmarks, workers) and readers of .model never see unfilled memory."""
    from hpctrain.train.trainer import Trainer
    calls = counting_fills(monkeypatch)
    cfg = load_config(None, SMALL + [f"job.run_root={tmp_path}"])
    with session.start(cfg) as s:
        tr = Trainer(cfg, s)
        assert calls == []  # allocated, not filled: a resume may still overwrite it
        row = tr.train_step()
        assert calls == [1] and math.isfinite(row["loss"])
        tr.train_step()
        assert calls == [1]
        read = Trainer(cfg, s)
        weights = dict(read.model.named_parameters())  # reading .model fills
        assert calls == [1, 1]
        assert torch.equal(weights["tok_embeddings.weight"].detach(),
                           init_value("tok_embeddings.weight", weights["tok_embeddings.weight"].shape,
                                      read.pm.dims, cfg.train.seed))
