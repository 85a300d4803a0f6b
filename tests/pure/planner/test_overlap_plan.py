"""Pure tier: the planner follows the overlap settings: parallel.fsdp_prefetch holds more gathered blocks at the
peak (ZeRO-3), parallel.ddp_bucket_mb sets what stays exposed after backward under DDP.

    .venv/bin/python -m pytest -q tests/pure/planner/test_overlap_plan.py
"""
from __future__ import annotations

import pytest

from helpers.launch import REPO
from hpctrain.config import load_config
from hpctrain.model.dims import ModelDims
from hpctrain.planner import timing
from hpctrain.planner.activations import block_weights
from hpctrain.planner.hardware import profile
from hpctrain.planner.report import evaluate

EXAMPLE = REPO / "slurm" / "examples" / "llama-70b.toml"
FSDP = ["job.nodes=4", "parallel.dp=-1", "parallel.tp=1", "parallel.pp=1", "parallel.zero_stage=3", "train.ac=full",
        "train.global_batch_size=0", "train.micro_batch_size=1", "train.grad_accum=1", "train.precision=bf16"]


def test_prefetching_more_blocks_holds_them_at_the_peak() -> None:
    one = evaluate(load_config(EXAMPLE, FSDP), profile("h100-sxm"), 5.0)
    three = evaluate(load_config(EXAMPLE, FSDP + ["parallel.fsdp_prefetch=3"]), profile("h100-sxm"), 5.0)
    cfg = load_config(EXAMPLE, FSDP)
    block = block_weights(ModelDims.from_config(cfg.model, 1)) + 2 * cfg.model.dim  # one block's bf16 elements
    assert one["peak_phase"] == three["peak_phase"] == "backward"
    assert (three["peak_gib"] - one["peak_gib"]) * 2**30 == pytest.approx(2 * 2 * block, rel=1e-6)
    assert three["step_time_s"] == one["step_time_s"]  # the time model already hides all-gathers but one block's


def test_ddp_bucket_is_what_stays_exposed_after_backward() -> None:
    hw = profile("a100-80g")
    shape = timing.Shape(4, 1024, 4096, 16, 16, 32000)
    kw = dict(seq_len=1024, global_batch=64, micro_batch=8, dp=8, zero_stage=0)
    small = timing.estimate(shape, hw, ddp_bucket_mb=1, **kw)
    big = timing.estimate(shape, hw, ddp_bucket_mb=1000, **kw)  # one bucket: the whole all-reduce after backward
    plain = timing.estimate(shape, hw, **kw)
    assert big.terms["dp_comm_s"] == pytest.approx(big.terms["dp_comm_total_s"])
    assert small.terms["dp_comm_s"] < big.terms["dp_comm_s"]
    link = hw.intra_node_gbps * 1e9
    assert small.terms["dp_comm_s"] == pytest.approx(max(2 * 7 / 8 * 2**20 / link,
                                                         small.terms["dp_comm_total_s"] - small.terms["compute_s"]))
    assert plain.terms["dp_comm_total_s"] == small.terms["dp_comm_total_s"]
