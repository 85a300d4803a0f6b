"""`hpctrain plan` as far as it goes (issue 15): checkpoint size against a checkpoint the trainer really writes,
the Young/Daly interval and the preemption-warning check, the model-state verdict on the 70B example, and the
command's text and JSON output and its errors."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner

from helpers.launch import REPO
from helpers.training import SMALL
from hpctrain.cli.main import main as cli
from hpctrain.config import load_config
from hpctrain.job import session
from hpctrain.planner.ckpt_cost import checkpoint_bytes, checkpoint_cost, payload_bytes
from hpctrain.planner.hardware import profile
from hpctrain.planner.report import evaluate

LLAMA = REPO / "slurm" / "examples" / "llama-70b.toml"


def test_checkpoint_size_matches_a_written_checkpoint(tmp_path) -> None:
    """A model other than the one the header constant was measured on: 3 blocks, grouped-query attention."""
    from hpctrain.train.trainer import Trainer
    cfg = load_config(None, SMALL + ["model.n_layers=3", "model.dim=48", "model.n_heads=4", "model.n_kv_heads=2",
                                     "train.steps=1", f"job.run_root={tmp_path}"])
    with session.start(cfg) as s:
        Trainer(cfg, s).fit()
        ckpt = next((s.run_dir / "checkpoints").glob("step_*"))
    import h5py

    from hpctrain.model.dims import ModelDims
    real = sum(f.stat().st_size for f in ckpt.iterdir())
    stored = []
    with h5py.File(ckpt / "shard-0.h5") as f:
        f.visititems(lambda name, obj: stored.append(obj.size * obj.dtype.itemsize)
                     if isinstance(obj, h5py.Dataset) else None)
    dims = ModelDims.from_config(cfg.model)
    # the tensors' bytes to 1% (the JSON hyperparameters are the rest); with the headers, which are most of a toy
    # checkpoint (1 MB of 2.5 MB here) and nothing of a real one, to 15%
    assert abs(payload_bytes(dims, 1) / sum(stored) - 1) < 0.01, (payload_bytes(dims, 1), sum(stored))
    assert abs(checkpoint_bytes(dims, 1) / real - 1) < 0.15, (checkpoint_bytes(dims, 1), real)


def test_young_daly_and_the_warning() -> None:
    c = checkpoint_cost(100e9, storage_gbps=10, nodes=100, node_mtbf_h=5000, signal_delay_s=5)
    assert c["save_s"] == pytest.approx(10) and c["job_mtbf_h"] == pytest.approx(50)
    assert c["young_daly_interval_s"] == pytest.approx(math.sqrt(2 * 10 * 50 * 3600))
    assert c["fits_warning"] is False
    assert checkpoint_cost(100e9, 10, 100, 5000, signal_delay_s=20)["fits_warning"] is True
    assert checkpoint_cost(100e9, 10, 100, 5000)["fits_warning"] is None
    with pytest.raises(ValueError, match="storage_gbps = 0"):
        checkpoint_cost(1, 0, 1)


def test_70b_fits_with_zero3_and_not_without() -> None:
    cfg = load_config(LLAMA, [])
    ok = evaluate(cfg, profile("h100-sxm"), 5.0)
    assert ok["fits"] and ok["layout"] == {"pp": 1, "dp": 16, "tp": 8, "zero_stage": 3}
    # 70.55e9 parameters / tp 8: ZeRO-3 shards 16 bytes each over dp 16
    assert sum(ok["model_states_gb"][k] for k in ("params", "grads", "optimizer")) == pytest.approx(
        70.554e9 / 8 * 16 / 16 / 1e9, rel=0.01)
    # memory per GPU: the step's peak (planner.peak) plus the margin; the peak holds the states and activations
    assert ok["memory_gb_per_gpu"] == pytest.approx(ok["peak_gb"] * 1.1)
    assert ok["peak_gb"] > ok["model_states_gb"]["total"] + ok["activations_gb"] and ok["peak_phase"] == "backward"
    assert ok["step_time_s"] > 0 and 0 < ok["mfu"] <= ok["hfu"] < 1
    bad = evaluate(load_config(LLAMA, ["parallel.zero_stage=0"]), profile("a100-40g"), 5.0)
    assert not bad["fits"] and any("does not fit:" in n and "activations" in n for n in bad["notes"])


def test_save_longer_than_the_warning_is_named() -> None:
    out = evaluate(load_config(LLAMA, ["job.signal_delay_s=60"]), profile("h100-sxm"), 1.0)
    assert any("longer than job.signal_delay_s = 60" in n for n in out["notes"]), out["notes"]


def test_plan_command(tmp_path) -> None:
    runner = CliRunner()
    text = runner.invoke(cli, ["plan", str(LLAMA)])
    assert text.exit_code == 0 and "-> fits" in text.output and "Young/Daly" in text.output, text.output
    out = runner.invoke(cli, ["plan", str(LLAMA), "--json", "--gpu", "h200", "--set", "parallel.tp=4", "--set",
                              "parallel.dp=32"])
    got = json.loads(out.output)
    assert got["gpu"] == "h200" and got["layout"]["tp"] == 4 and set(got) >= {
        "memory_gb_per_gpu", "step_time_s", "tokens_per_s", "checkpoint", "fits", "notes"}
    for args, fragment in ((["--gpu", "x100"], "unknown hardware profile 'x100'"),
                           (["--set", "parallel.tp=3"], "tp"), (["--storage-gbps", "-1"], "storage_gbps = -1")):
        r = runner.invoke(cli, ["plan", str(LLAMA), *args])
        assert r.exit_code == 2 and fragment in r.output, (args, r.output)
    assert Path(LLAMA).is_file()


def test_dry_run_prints_the_prediction_and_refuses_what_cannot_fit() -> None:
    runner = CliRunner()
    ok = runner.invoke(cli, ["submit", str(LLAMA), "--dry-run", "--set", "job.gpu=h100-sxm"])
    assert ok.exit_code == 0 and "planner: memory per GPU: 63.33 GB of 80 GB (parameters 2.21" in ok.output, ok.output
    args = ["submit", str(LLAMA), "--dry-run", "--set", "job.gpu=a100-40g", "--set", "parallel.zero_stage=0"]
    bad = runner.invoke(cli, args)
    assert bad.exit_code == 2 and "does not fit on a100-40g: 202.1 GB per GPU predicted of 40 GB (parameters 35.3" \
        in bad.output and "#SBATCH" not in bad.output, bad.output
    forced = runner.invoke(cli, args + ["--no-memory-check"])
    assert forced.exit_code == 0 and "DOES NOT FIT" in forced.output and "#SBATCH" in forced.output
    named = runner.invoke(cli, ["submit", str(LLAMA), "--dry-run"])  # the example names its GPU
    assert named.exit_code == 0 and "planner: memory per GPU: 63.33 GB of 80 GB" in named.output, named.output
    unnamed = runner.invoke(cli, ["submit", str(REPO / "slurm" / "examples" / "gpu-4x8.toml"), "--dry-run"])
    assert unnamed.exit_code == 0 and "set job.gpu" in unnamed.output
    wrong = runner.invoke(cli, ["submit", str(LLAMA), "--dry-run", "--set", "job.gpu=h100"])
    assert wrong.exit_code == 2 and "job.gpu = 'h100': unknown hardware profile 'h100'" in wrong.output


def test_micro_batches_in_flight() -> None:
    """The counts tests/multiproc/test_planner_memory.py measures, per pipeline rank."""
    from hpctrain.planner.peak import in_flight
    assert in_flight("1f1b", 1, 1, 8) == 1  # no pipeline: one micro-batch's forward, then its backward
    assert in_flight("gpipe", 4, 1, 8, pp_rank=3) == 8  # every forward before the first backward, on every rank
    assert [in_flight("1f1b", 4, 1, 8, r) for r in range(4)] == [4, 3, 2, 1]  # warm-up depth pp - r
    assert in_flight("1f1b", 4, 1, 2) == 2  # at most m
    # interleaved: (v - 1) x m / rounds + 2 (pp - 1 - r) warm-up chunks + 1, each 1/v of the rank's blocks
    assert in_flight("interleaved_1f1b", 4, 2, 8) == 5.5 and in_flight("interleaved_1f1b", 2, 2, 4, 1) == 1.5


def test_search_ranks_what_fits_and_names_the_rest() -> None:
    from hpctrain.planner.search import SCHEDULES, search
    cfg = load_config(LLAMA, [])
    fit, why = search(cfg, profile("h100-sxm"), 5.0, 6000.0, 128)
    speeds = [o["tokens_per_s"] for o in fit]
    assert fit and speeds == sorted(speeds, reverse=True)
    assert all(o["fits"] and o["layout"]["pp"] * o["layout"]["dp"] * o["layout"]["tp"] == 128 for o in fit)
    assert all(o["layout"]["micro_batch"] * o["layout"]["grad_accum"] * o["layout"]["dp"] == 128 for o in fit)
    own = {"pp": 1, "dp": 16, "tp": 8, "zero_stage": 3, "micro_batch": 1, "grad_accum": 8, "ac": "full"}
    assert any(own.items() <= o["layout"].items() for o in fit)  # the config's own layout is among them
    assert {o["layout"]["sequence_parallel"] for o in fit if o["layout"]["tp"] > 1} == {False, True}
    assert {(o["layout"]["schedule"], o["layout"]["virtual_stages"]) for o in fit if o["layout"]["pp"] > 1} == set(
        SCHEDULES)
    assert any("does not divide the 8 ranks per node" in r for r in why)  # tp across nodes
    oom = next(e for r, e in why.items() if r.startswith("out of memory on h100-sxm"))
    assert oom[0] > 0 and 0 < oom[1] <= oom[2]
    out = CliRunner().invoke(cli, ["plan", str(LLAMA), "--search", "--json"])
    assert out.exit_code == 0 and len(json.loads(out.output)) == len(fit)


def test_unmeasured_schedule_is_named_as_a_lower_bound() -> None:
    gpu = REPO / "slurm" / "examples" / "gpu-4x8.toml"
    for schedule, virtual, said in (("zbv", 2, True), ("interleaved_1f1b", 2, False), ("1f1b", 1, False)):
        cfg = load_config(gpu, [f"parallel.pp_schedule={schedule}", f"parallel.pp_virtual_stages={virtual}",
                                "parallel.zero_stage=2"])
        notes = evaluate(cfg, profile("h100-sxm"), 5.0)["notes"]
        assert any(f"parallel.pp_schedule = {schedule!r}" in n and "lower bound" in n for n in notes) == said
