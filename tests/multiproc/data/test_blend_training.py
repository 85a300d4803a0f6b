"""Training runs on a blend in the test process: a run resumed from its checkpoint gives the uninterrupted run's
losses, also with a read-ahead thread and blended evaluation (then its validation losses and loader state too).
The blend itself: tests/pure/data/test_blend.py.

    PATH=$PWD/.venv/bin:$PATH .venv/bin/python -m pytest -q tests/multiproc/data/test_blend_training.py
"""
from __future__ import annotations

import json
from pathlib import Path

from helpers.blends import BASE
from helpers.training import SMALL
from hpctrain.config import load_config
from hpctrain.job import session
from hpctrain.train.trainer import Trainer


def _run(tmp_path, files, *sets):
    paths = [str(f) for f in files]
    cfg = load_config(None, SMALL + ["model.vocab_size=2100", "data.source=bin", f"data.paths={paths}",
                                     "data.weights=[3.0, 1.0]", "data.seq_len=8", "train.micro_batch_size=4",
                                     f"job.run_root={tmp_path / 'runs'}", f"checkpoint.dir={tmp_path / 'ck'}",
                                     *sets])
    with session.start(cfg) as s:
        return Trainer(cfg, s).fit()


def test_training_on_a_blend_resumes_exactly(files, tmp_path) -> None:
    full = _run(tmp_path / "a", files, "train.steps=6", "checkpoint.every_steps=3", "checkpoint.at_end=false")
    step3 = tmp_path / "a" / "ck" / "step_00000003"
    resumed = _run(tmp_path / "b", files, "train.steps=6", f"train.resume={step3}", "checkpoint.at_end=false")
    assert resumed["resumed_from"] == 3 and resumed["losses"] == full["losses"][3:]


def _run_with_eval(root: Path, paths: list[str], *sets: str) -> tuple[dict, dict]:
    cfg = load_config(None, SMALL + BASE + [f"data.paths={paths}", "data.weights=[5.0, 1.0, 2.0]",
                                            "train.micro_batch_size=4", "train.prefetch=2", "train.eval_every=2",
                                            "train.eval_batches=2", f"job.run_root={root / 'runs'}",
                                            f"checkpoint.dir={root / 'ck'}", "checkpoint.at_end=false", *sets])
    with session.start(cfg) as s:
        tr = Trainer(cfg, s)
        return tr.fit(), tr.loader.state_dict()


def test_training_on_a_blend_with_evaluation_resumes_exactly(blend, tmp_path) -> None:
    full, end = _run_with_eval(tmp_path / "a", blend, "train.steps=8", "checkpoint.every_steps=4")
    step4 = tmp_path / "a" / "ck" / "step_00000004"
    saved = json.loads((step4 / "train_state.json").read_text())["data"]
    assert saved["drawn"] == [10, 2, 4]  # 4 steps of 4 samples at 5:1:2
    resumed, end2 = _run_with_eval(tmp_path / "b", blend, "train.steps=8", f"train.resume={step4}", "train.prefetch=0")
    assert resumed["resumed_from"] == 4 and resumed["losses"] == full["losses"][4:]
    assert resumed["val_losses"] == [v for v in full["val_losses"] if v[0] > 4]
    assert end2 == end and end["drawn"] == [20, 4, 8]
