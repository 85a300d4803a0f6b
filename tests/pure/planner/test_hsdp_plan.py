"""Pure tier: what the planner says of HSDP (parallel.dp_replicate): each rank holds the shards of its shard group
(dp / replicas ranks), and the time model runs FSDP's traffic in the shard group plus the gradient shards'
all-reduce across the replicas, on the links each crosses.

    .venv/bin/python -m pytest -q tests/pure/planner/test_hsdp_plan.py
"""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from helpers.launch import REPO
from hpctrain.cli.main import main as cli
from hpctrain.config import load_config
from hpctrain.planner import timing
from hpctrain.planner.hardware import profile
from hpctrain.planner.report import evaluate

EXAMPLE = REPO / "slurm" / "examples" / "llama-70b.toml"
FSDP = ["parallel.dp=-1", "parallel.tp=1", "parallel.pp=1", "parallel.zero_stage=3", "train.ac=full",
        "train.global_batch_size=0", "train.micro_batch_size=1", "train.grad_accum=4"]


def test_each_rank_holds_its_shard_groups_share() -> None:
    """4 nodes, 4 replicas of an 8-GPU shard group: per GPU the model states of FSDP over one node's 8 GPUs."""
    hsdp = evaluate(load_config(EXAMPLE, FSDP + ["job.nodes=4", "parallel.dp_replicate=4"]), profile("h100-sxm"), 5.0)
    node = evaluate(load_config(EXAMPLE, FSDP + ["job.nodes=1"]), profile("h100-sxm"), 5.0)
    full = evaluate(load_config(EXAMPLE, FSDP + ["job.nodes=4"]), profile("h100-sxm"), 5.0)
    assert hsdp["model_states_gib"] == node["model_states_gib"]
    # and the step's peak: the unsharded gradients FSDP accumulates are the shard group's (shard x 8), not dp's
    assert hsdp["peak_gib"] == pytest.approx(node["peak_gib"])
    assert full["model_states_gib"]["total"] < hsdp["model_states_gib"]["total"]
    assert hsdp["layout"]["dp_replicate"] == 4 and "dp_replicate" not in full["layout"]


def test_traffic_is_fsdp_in_the_shard_group_plus_the_replicas_all_reduce() -> None:
    hw = profile("h100-sxm")
    shape = timing.Shape(32, 4096, 14336, 32, 8, 128256)
    common = dict(seq_len=8192, micro_batch=1, zero_stage=3, accumulate_unsharded=True)
    hsdp = timing.estimate(shape, hw, global_batch=128, dp=32, dp_replicate=4, **common)
    node = timing.estimate(shape, hw, global_batch=32, dp=8, **common)  # one shard group, the same micro-batches
    assert hsdp.basis["microbatches"] == node.basis["microbatches"] == 4
    # the shard group of 8 is one node's: FSDP's traffic on NVLink, as one node's FSDP
    assert hsdp.basis["dp_link_gbps"] == node.basis["dp_link_gbps"] == hw.intra_node_gbps
    rep = hsdp.terms["dp_replicate_comm_total_s"]
    # each rank's fp32 gradient shard (P / 8), all-reduced over 4 replicas, one per node: a NIC each
    assert rep == pytest.approx(2 * 3 / 4 * shape.params() / 8 * 4 / (hw.inter_node_gbps * 1e9))
    assert hsdp.terms["dp_comm_total_s"] == pytest.approx(node.terms["dp_comm_total_s"] + rep)
    assert node.terms["dp_replicate_comm_total_s"] == 0
    with pytest.raises(ValueError, match="dp_replicate = 3"):
        timing.estimate(shape, hw, global_batch=128, dp=32, dp_replicate=3, **common)


def test_dry_run_and_json_show_the_replicas() -> None:
    res = CliRunner().invoke(cli, ["plan", str(EXAMPLE), "--gpu", "h100-sxm", "--json", "--set", "job.nodes=4",
                                   *[x for s in FSDP + ["parallel.dp_replicate=2"] for x in ("--set", s)]])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["layout"]["dp_replicate"] == 2 and out["time_terms"]["dp_replicate_comm_total_s"] > 0
    text = CliRunner().invoke(cli, ["plan", str(EXAMPLE), "--gpu", "h100-sxm", "--set", "job.nodes=4",
                                    *[x for s in FSDP + ["parallel.dp_replicate=2"] for x in ("--set", s)]])
    assert "hsdp: 2 replicas" in text.output, text.output
