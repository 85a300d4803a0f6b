"""`hpctrain plan` as far as it goes (issue 15): the Young/Daly interval and the preemption-warning check, the
model-state verdict on the 70B example, and the command's text and JSON output and its errors. Checkpoint size
against a checkpoint the trainer really writes: tests/multiproc/planner/test_planner_checkpoint_size.py; the layout
search:
tests/multiproc/planner/test_planner_search.py.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner

from helpers.launch import REPO
from hpctrain.cli.main import main as cli
from hpctrain.config import load_config
from hpctrain.planner.ckpt_cost import checkpoint_cost
from hpctrain.planner.hardware import profile
from hpctrain.planner.report import evaluate

LLAMA = REPO / "slurm" / "examples" / "llama-70b.toml"




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
    assert ok["fits"] and ok["layout"] == {"pp": 1, "dp": 16, "tp": 8, "cp": 1, "zero_stage": 3}
    # 70.55e9 parameters / tp 8: ZeRO-3 shards 16 bytes each over dp 16
    assert sum(ok["model_states_gib"][k] for k in ("params", "grads", "optimizer")) == pytest.approx(
        70.554e9 / 8 * 16 / 16 / 2 ** 30, rel=0.01)
    # memory per GPU: the step's peak (planner.peak) plus the margin; the peak holds the states and activations
    assert ok["memory_gib_per_gpu"] == pytest.approx(ok["peak_gib"] * 1.1)
    assert ok["peak_gib"] > ok["model_states_gib"]["total"] + ok["activations_gib"] and ok["peak_phase"] == "backward"
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
        "memory_gib_per_gpu", "step_time_s", "tokens_per_s", "checkpoint", "fits", "notes"}
    for args, fragment in ((["--gpu", "x100"], "unknown hardware profile 'x100'"),
                           (["--set", "parallel.tp=3"], "tp"), (["--storage-gbps", "-1"], "storage_gbps = -1")):
        r = runner.invoke(cli, ["plan", str(LLAMA), *args])
        assert r.exit_code == 2 and fragment in r.output, (args, r.output)
    assert Path(LLAMA).is_file()


def test_dry_run_prints_the_prediction_and_refuses_what_cannot_fit() -> None:
    runner = CliRunner()
    ok = runner.invoke(cli, ["submit", str(LLAMA), "--dry-run", "--set", "job.gpu=h100-sxm"])
    assert ok.exit_code == 0 and "planner: memory per GPU: 58.10 GiB of 80 GiB (GiB: parameters 2.05" in ok.output, \
        ok.output
    args = ["submit", str(LLAMA), "--dry-run", "--set", "job.gpu=a100-40g", "--set", "parallel.zero_stage=0"]
    bad = runner.invoke(cli, args)
    assert bad.exit_code == 2 and "does not fit on a100-40g: 180.7 GiB per GPU predicted of 40 GiB (GiB: " \
        "parameters 32.9" in bad.output and "#SBATCH" not in bad.output, bad.output
    forced = runner.invoke(cli, args + ["--no-memory-check"])
    assert forced.exit_code == 0 and "DOES NOT FIT" in forced.output and "#SBATCH" in forced.output
    named = runner.invoke(cli, ["submit", str(LLAMA), "--dry-run"])  # the example names its GPU
    assert named.exit_code == 0 and "planner: memory per GPU: 58.10 GiB of 80 GiB" in named.output, named.output
    unnamed = runner.invoke(cli, ["submit", str(REPO / "slurm" / "examples" / "gpu-4x8.toml"), "--dry-run"])
    assert unnamed.exit_code == 0 and "set job.gpu" in unnamed.output
    wrong = runner.invoke(cli, ["submit", str(LLAMA), "--dry-run", "--set", "job.gpu=h100"])
    assert wrong.exit_code == 2 and "job.gpu = 'h100': unknown hardware profile 'h100'" in wrong.output


def test_micro_batches_in_flight() -> None:
    """The counts tests/multiproc/planner/test_planner_memory.py measures, per pipeline rank."""
    from hpctrain.planner.peak import in_flight
    assert in_flight("1f1b", 1, 1, 8) == 1  # no pipeline: one micro-batch's forward, then its backward
    assert in_flight("gpipe", 4, 1, 8, pp_rank=3) == 8  # every forward before the first backward, on every rank
    assert [in_flight("1f1b", 4, 1, 8, r) for r in range(4)] == [4, 3, 2, 1]  # warm-up depth pp - r
    assert in_flight("1f1b", 4, 1, 2) == 2  # at most m
    # interleaved: (v - 1) x m / rounds + 2 (pp - 1 - r) warm-up chunks + 1, each 1/v of the rank's blocks
    assert in_flight("interleaved_1f1b", 4, 2, 8) == 5.5 and in_flight("interleaved_1f1b", 2, 2, 4, 1) == 1.5




def test_unmeasured_schedule_is_named_as_a_lower_bound() -> None:
    gpu = REPO / "slurm" / "examples" / "gpu-4x8.toml"
    for schedule, virtual, said in (("zbv", 2, True), ("interleaved_1f1b", 2, False), ("1f1b", 1, False)):
        cfg = load_config(gpu, [f"parallel.pp_schedule={schedule}", f"parallel.pp_virtual_stages={virtual}",
                                "parallel.zero_stage=2"])
        notes = evaluate(cfg, profile("h100-sxm"), 5.0)["notes"]
        assert any(f"parallel.pp_schedule = {schedule!r}" in n and "lower bound" in n for n in notes) == said


def test_activation_bytes_per_layer_follow_train_ac() -> None:
    """--json's activation_bytes_per_layer: what one layer keeps of one micro-batch, whole and as train.ac keeps a
    recomputed layer (its input; the partial modes more; none: no recomputed layer). The 70B example: s = 8192,
    b = 1, h = 8192, tp = 8 without sequence parallel, bf16 weights through FSDP."""
    hw = profile("h100-sxm")
    sbh = 8192 * 1 * 8192
    got = {ac: evaluate(load_config(LLAMA, [f"train.ac={ac}"]), hw, 5.0)["activation_bytes_per_layer"]
           for ac in ("none", "full", "selective", "op")}
    assert got["none"]["recomputed"] is None and got["full"]["recomputed"] == 2 * sbh  # the bf16 input, whole
    assert len({g["kept"] for g in got.values()}) == 1
    kept = got["none"]["kept"]
    assert got["full"]["recomputed"] < got["op"]["recomputed"] < got["selective"]["recomputed"]
    # without sequence parallel the four h-wide tensors stay whole: 8 of the kept bytes per s*b*h, the rest / tp
    assert kept == pytest.approx(sbh * (8 + 2 * (2 + 2 * 1 / 8 + 3 * 28672 / 8192) / 8) + 8192 * (8 + 4 * 64 / 8))
