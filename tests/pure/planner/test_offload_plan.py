"""Pure tier: what the planner says of CPU offload (parallel.offload = "all"): a 70B model with FSDP on one 8-GPU
node fits its H100s only with the shards in host memory, and the plan states the host memory per node it needs
(JSON host_memory_gb_per_node), refusing a job whose job.mem_gb is smaller; the time model moves the shards over
the GPU's host link and says so when a profile lacks it; the config refuses offload without FSDP.

    .venv/bin/python -m pytest -q tests/pure/planner/test_offload_plan.py
"""
from __future__ import annotations

import math

import pytest
from click.testing import CliRunner

from helpers.launch import REPO
from hpctrain.cli.main import main as cli
from hpctrain.config import load_config
from hpctrain.parallel import mesh
from hpctrain.parallel.plan import make_plan
from hpctrain.planner.hardware import profile
from hpctrain.planner.memory import Coords, host_states
from hpctrain.planner.report import evaluate, time_estimate

ONE_NODE = ["job.nodes=1", "parallel.dp=-1", "parallel.tp=1", "parallel.zero_stage=3", "train.ac=full",
            "train.global_batch_size=0", "train.micro_batch_size=1", "train.grad_accum=4"]
EXAMPLE = REPO / "slurm" / "examples" / "llama-70b.toml"


def test_70b_on_one_node_fits_with_offload_and_states_the_host_memory() -> None:
    plain = evaluate(load_config(EXAMPLE, ONE_NODE), profile("h100-sxm"), 5.0)
    assert not plain["fits"] and plain["host_memory_gb_per_node"] == 0
    cfg = load_config(EXAMPLE, ONE_NODE + ["parallel.offload=all"])
    out = evaluate(cfg, profile("h100-sxm"), 5.0)
    print(f"\n70B, FSDP on 8 H100, offload all: {out['memory_gib_per_gpu']:.1f} GiB per GPU, "
          f"{out['host_memory_gb_per_node']:.0f} GiB host memory per node")
    assert out["fits"] and out["memory_gib_per_gpu"] < 80
    assert out["model_states_gib"]["total"] == 0  # ZeRO-3 without pp: nothing of the states stays on the GPU
    plan = make_plan(cfg, mesh.block_placement(1, 8), training=True)
    per_rank = host_states(plan, Coords(0, 0), 3, "all")
    assert per_rank == pytest.approx(16 * plan.dims.num_params() / 8, rel=0.01)  # fp32 shard, grad, 2 moments
    assert out["host_memory_gb_per_node"] == pytest.approx(8 * per_rank / 2**30)
    assert any("GiB of host memory per node" in n for n in out["notes"])


def test_a_node_without_the_host_memory_is_refused(tmp_path) -> None:
    small = load_config(EXAMPLE, ONE_NODE + ["parallel.offload=all", "job.mem_gb=1000"])
    out = evaluate(small, profile("h100-sxm"), 5.0)
    assert not out["fits"] and any("does not fit in host memory" in n and "job.mem_gb = 1000" in n
                                   for n in out["notes"])
    res = CliRunner().invoke(cli, ["submit", str(EXAMPLE), "--dry-run", *sum((["--set", s] for s in ONE_NODE), []),
                                   "--set", "parallel.offload=all", "--set", "job.mem_gb=1000",
                                   "--set", f"job.run_root={tmp_path}", "--set", f"checkpoint.dir={tmp_path / 'ck'}"])
    assert res.exit_code != 0 and "host memory" in res.output, res.output
    res = CliRunner().invoke(cli, ["submit", str(EXAMPLE), "--dry-run", *sum((["--set", s] for s in ONE_NODE), []),
                                   "--set", "parallel.offload=all", "--set", "job.mem_gb=1900",
                                   "--set", f"job.run_root={tmp_path}", "--set", f"checkpoint.dir={tmp_path / 'ck'}"])
    assert res.exit_code == 0 and "-> fits" in res.output, res.output


def test_offload_traffic_goes_over_the_host_link() -> None:
    cfg = load_config(EXAMPLE, ONE_NODE + ["parallel.offload=all"])
    plan = make_plan(cfg, mesh.block_placement(1, 8), training=True)
    est = time_estimate(cfg, plan, profile("h100-sxm"))
    shard = plan.dims.num_params() / 8
    moved = shard * (4 * 2 * 4 + 4 * 4)  # 2 gathers of fp32 shards per micro-batch, fp32 gradient shards back
    assert est.terms["offload_total_s"] == pytest.approx(moved / 64e9, rel=0.01)
    assert 0 < est.terms["offload_s"] <= est.terms["offload_total_s"]
    slower = time_estimate(cfg, plan, profile("h100-sxm", {"host_link_gbps": 16}))
    assert slower.terms["offload_total_s"] == pytest.approx(4 * est.terms["offload_total_s"])
    with pytest.raises(ValueError, match="give --hw host_link_gbps"):
        time_estimate(cfg, plan, profile("b200"))


def test_offload_needs_fsdp() -> None:
    with pytest.raises(ValueError, match="parallel.offload = 'all' moves FSDP's shards to host memory: it needs "
                                         "parallel.zero_stage = 2 or 3 \\(got 1\\)"):
        load_config(None, ["parallel.offload=all", "parallel.zero_stage=1"])
    with pytest.raises(ValueError, match="parallel.offload = 'optimizer' with parallel.zero_stage = 1"):
        load_config(None, ["parallel.offload=optimizer", "parallel.zero_stage=1"])
    with pytest.raises(ValueError, match="parallel.offload = 'cpu' is not one of"):
        load_config(None, ["parallel.offload=cpu", "parallel.zero_stage=3"])


def test_optimizer_offload_keeps_the_weights_and_moves_adamw() -> None:
    """parallel.offload = "optimizer": the device keeps parameters and gradients, the host AdamW's moments and the
    fp32 masters (20 bytes per parameter of the rank's share with the gradients' copy and the step's temporary);
    the step's gradients go down and the parameters up over the host link."""
    sets = ["job.nodes=16", "parallel.dp=-1", "parallel.tp=8", "parallel.zero_stage=3", "train.ac=full"]
    plain = evaluate(load_config(EXAMPLE, sets), profile("h100-sxm"), 5.0)
    cfg = load_config(EXAMPLE, sets + ["parallel.offload=optimizer"])
    out = evaluate(cfg, profile("h100-sxm"), 5.0)
    assert out["model_states_gib"]["optimizer"] == 0 < plain["model_states_gib"]["optimizer"]
    assert out["model_states_gib"]["params"] == plain["model_states_gib"]["params"]
    plan = make_plan(cfg, mesh.block_placement(16, 8), training=True)
    per_rank = host_states(plan, Coords(0, 0), 3, "optimizer")
    assert per_rank == pytest.approx(20 * plan.dims.num_params() / 128, rel=0.01)
    assert out["host_memory_gb_per_node"] == pytest.approx(8 * per_rank / 2**30)
    est = time_estimate(cfg, plan, profile("h100-sxm"))
    shard = plan.dims.num_params() / 128
    down = 4 * shard / 64e9
    assert est.terms["offload_total_s"] == pytest.approx(2 * down, rel=0.01)
    # HostAdamW's pipeline over 64 MiB buckets: one bucket's download and upload exposed beyond the downloads (the
    # host step is not timed without host_memory_gbps)
    buckets = math.ceil(4 * shard / 2**26)
    assert buckets > 10
    assert est.terms["offload_s"] == pytest.approx(down + down / buckets, rel=0.01)
    timed = time_estimate(cfg, plan, profile("h100-sxm", {"host_memory_gbps": 100}))
    step = 8 * shard * 32 / 100e9  # the node's 8 ranks stream their shares through host memory: slower than PCIe
    assert step > down
    assert timed.terms["offload_s"] == pytest.approx(step + 2 * down / buckets, rel=0.01)
    assert timed.terms["offload_total_s"] == pytest.approx(step + 2 * down, rel=0.01)


def test_search_offloads_only_when_nothing_fits_without() -> None:
    """--search tries CPU offload as the last resort (its host step is not in the time model): a 70B model on one
    8-GPU node fits only with it, so every layout found offloads (where layouts fit without, the search's rows say
    offload "none": tests/golden/planner_datasheet.json, gpu-4x8's search)."""
    from hpctrain.planner import search
    cfg = load_config(EXAMPLE, ["job.nodes=1", "parallel.dp=-1", "train.global_batch_size=16"])
    fit, _ = search.search(cfg, profile("h100-sxm"), 5.0, 1e6, 16)
    assert fit and all(o["layout"]["offload"] == "all" for o in fit)
    assert "3+off" in search.describe(fit, {}).splitlines()[2]


def test_the_host_step_is_timed_where_the_host_memory_bandwidth_is_given() -> None:
    """The offloaded AdamW step streams 32 bytes a parameter of the node's ranks through host memory: timed with
    --hw host_memory_gbps, and the plan says it is left out without."""
    cfg = load_config(EXAMPLE, ONE_NODE + ["parallel.offload=all"])
    plan = make_plan(cfg, mesh.block_placement(1, 8), training=True)
    base = time_estimate(cfg, plan, profile("h100-sxm"))
    timed = time_estimate(cfg, plan, profile("h100-sxm", {"host_memory_gbps": 400}))
    step = 8 * plan.dims.num_params() / 8 * 32 / 400e9
    assert timed.terms["offload_s"] - base.terms["offload_s"] == pytest.approx(step, rel=0.01)
    assert timed.step_time_s - base.step_time_s == pytest.approx(step, rel=0.01)
    assert any("host_memory_gbps" in n for n in evaluate(cfg, profile("h100-sxm"), 5.0)["notes"])
    assert not any("host_memory_gbps" in n for n in evaluate(
        cfg, profile("h100-sxm", {"host_memory_gbps": 400}), 5.0)["notes"])
