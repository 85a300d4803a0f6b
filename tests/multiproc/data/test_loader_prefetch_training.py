"""Training with the read-ahead thread equals training without it, step for step (the loader itself:
tests/pure/data/test_loader_prefetch.py).

    PATH=$PWD/.venv/bin:$PATH .venv/bin/python -m pytest -q tests/multiproc/data/test_loader_prefetch_training.py
"""
from __future__ import annotations

import threading

from hpctrain.config import load_config
from hpctrain.data.loader import PrefetchLoader
from hpctrain.job import session
from hpctrain.train.trainer import Trainer


def prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "hpctrain-prefetch"]


CASE = ["model.vocab_size=256", "model.dim=32", "model.n_layers=1", "model.n_heads=2", "model.max_seq_len=32",
        "data.source=synthetic", "data.seq_len=32", "train.micro_batch_size=2", "train.grad_accum=2", "train.steps=5",
        "train.log_every=2", "checkpoint.at_end=false", "parallel.pp=1", "parallel.tp=1", "parallel.dp=-1"]


def test_training_with_prefetch_equals_training_without(tmp_path) -> None:
    got = {}
    for depth in (0, 2):
        cfg = load_config(None, CASE + [f"train.prefetch={depth}", f"job.run_root={tmp_path}"])
        with session.start(cfg) as s:
            tr = Trainer(cfg, s)
            assert isinstance(tr.loader, PrefetchLoader) == (depth > 0)
            out = tr.fit()
            got[depth] = (out["losses"], tr.loader.state_dict())
            assert not prefetch_threads()  # fit ended it
    assert got[0] == got[2]
    assert got[2][1]["samples_seen"] == 5 * 2 * 2
