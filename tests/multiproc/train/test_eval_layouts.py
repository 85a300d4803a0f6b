"""Validation loss is the same number in every layout, 4 gloo ranks against one process: dp=4, tp=2 x dp=2
ZeRO-3, pp=2 x dp=2 (1F1B, the schedule's forward-only eval), pp=2 x tp=2 (loss parallel) and pp=2 x dp=2 under
ZBV (two stages a rank in a V: Pipeline runs its forwards only) evaluate the same validation samples after each of
3 steps and agree with the one-process run within fp32 reduction order. Each layout's global micro-batch is 8
samples, or 4 (2 for ZBV) under pp, eval_batches raised to match, so every evaluation covers the same 16 samples.
Reporting and the rest: tests/pure/train/test_eval.py.

    PATH=$PWD/.venv/bin:$PATH .venv/bin/python -m pytest -q tests/multiproc/train/test_eval_layouts.py
"""
from __future__ import annotations

import pytest
import torch

from helpers.launch import spawn_cases
from helpers.training import TINY
from hpctrain.config import load_config
from hpctrain.job import session
from hpctrain.train.trainer import Trainer

EVAL = ["train.steps=3", "train.eval_every=1", "checkpoint.at_end=false", "model.n_layers=4"]  # 4: ZBV's stages
LAYOUTS = {
    "dp4": ["train.micro_batch_size=2", "train.eval_batches=2"],
    "tp2dp2_zero3": ["parallel.tp=2", "parallel.zero_stage=3", "train.micro_batch_size=4", "train.eval_batches=2"],
    "pp2dp2": ["parallel.pp=2", "train.micro_batch_size=2", "train.grad_accum=2", "train.eval_batches=4"],
    "pp2tp2": ["parallel.pp=2", "parallel.tp=2", "train.micro_batch_size=4", "train.grad_accum=2",
               "train.eval_batches=4"],
    "cp2dp2": ["parallel.cp=2", "train.micro_batch_size=4", "train.eval_batches=2"],  # each a share of a sequence
    "pp2dp2_zbv": ["parallel.pp=2", "parallel.pp_schedule=zbv", "parallel.pp_virtual_stages=2",
                   "train.micro_batch_size=1", "train.grad_accum=4", "train.eval_batches=8"],
}
TOL = 2e-5  # fp32: the layouts reduce in other orders


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("eval")
    cases = [{"name": name, "overrides": EVAL + sets} for name, sets in LAYOUTS.items()]
    spawn_cases("eval_worker.py", out, cases, run_id="eval")
    cfg = load_config(None, TINY + EVAL + ["train.eval_batches=2", f"job.run_root={out}/ref-runs",
                                           f"checkpoint.dir={out}/ref-ck"])
    with session.start(cfg) as s:
        ref = Trainer(cfg, s).fit()
    return {"ref": ref} | {name: torch.load(out / f"{name}.pt") for name in LAYOUTS}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_validation_loss_equal_across_layouts(runs, layout) -> None:
    ref, got = runs["ref"], runs[layout]
    assert [s for s, _ in ref["val_losses"]] == [s for s, _ in got["val_losses"]] == [1, 2, 3]
    for (step, want), (_, have) in zip(ref["val_losses"], got["val_losses"]):
        assert abs(have - want) < TOL, (layout, step, have, want)
    assert max(abs(a - b) for a, b in zip(ref["losses"], got["losses"])) < TOL  # trained alike, too
    assert len({round(v, 4) for _, v in ref["val_losses"]}) == 3  # training moves the validation loss
