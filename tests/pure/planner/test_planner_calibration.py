"""A CPU's figures come from a calibration of the user's machine, never from source (issue 27): `hpctrain plan
--calibrate` writes a profile file, `plan --profile FILE` and job.hw_profile read it back (untrusted JSON), and the
time model takes its efficiency and host terms from it. The measurement itself is replaced by synthetic rounds
made with known figures, so these tests judge no timing: they check the wiring and that the solver recovers the
figures the rounds were made with.

    PATH=$PWD/.venv/bin:$PATH .venv/bin/python -m pytest -q tests/pure/planner/test_planner_calibration.py
"""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from helpers.launch import REPO
from hpctrain.cli.main import main as cli
from hpctrain.config import load_config
from hpctrain.planner import hardware
from hpctrain.train import calibrate

TINY_CPU = str(REPO / "slurm" / "examples" / "tiny-cpu.toml")
TRUE = {"efficiency": 0.7, "block": 0.002, "tp_block": 0.0, "step": 0.01, "token": 0.0}
TRUE4 = TRUE | {"tp_block": 0.009, "token": 5e-8}  # 4 ranks at once, tp = 2: tp's host work measured too


def synthetic(overrides, run_root, rounds=calibrate.ROUNDS, steps=calibrate.STEPS):
    """Rounds whose step times are the planner's own for TRUE's figures, at a GEMM rate of 50 GFLOP/s."""
    rnd = {"gemm_tflops": 0.05}
    est = calibrate.predict(overrides, rnd, 1, TRUE)
    return [rnd | {"step_s": est.step_time_s} for _ in range(rounds)]


def synthetic_ranks(ranks, tp, rounds, echo):
    """measure_ranks' times for TRUE4's figures: 20 GFLOP/s per rank, links of 0.8 GB/s."""
    rnd = {"gemm_tflops": 0.02, "link_gbps": 0.8}
    return {c["name"]: {"rounds": [rnd | {"step_s": calibrate.predict(c["overrides"], rnd, ranks, TRUE4).step_time_s}
                                   for _ in range(rounds)], "threads": 1} for c in calibrate.rank_cases(tp)}


@pytest.fixture
def calibrated(tmp_path, monkeypatch):
    monkeypatch.setattr(calibrate, "measure", synthetic)
    path = tmp_path / "cpu.json"
    out = CliRunner().invoke(cli, ["plan", TINY_CPU, "--calibrate", "--ranks", "1", "-o", str(path)])
    assert out.exit_code == 0, out.output
    return path


def test_calibration_round_trip(calibrated) -> None:
    hw = hardware.load_profile(calibrated)
    assert hw.measured and hw.name == "cpu" and hw.peak("fp32") == pytest.approx(0.05)
    assert hw.efficiency == pytest.approx(TRUE["efficiency"], rel=1e-3)
    assert hw.host_block_s == pytest.approx(TRUE["block"], rel=1e-3)
    assert hw.host_step_s == pytest.approx(TRUE["step"], rel=1e-3)
    # tensor parallel's needs several ranks: unknown, not guessed; so are the links
    assert hw.host_tp_block_s is None and hw.host_tp_token_s is None and hw.intra_node_gbps is None
    assert hw.ranks_per_host is None and "hpctrain plan --calibrate" in hw.source


def test_calibration_with_the_jobs_ranks_at_once(tmp_path, monkeypatch) -> None:
    """The example's calibration (`--ranks` defaults to a CPU job's 4, tp to its 2): every figure one rank's with 4
    on the host, tensor parallel's host work and the links measured too; the example is then predicted from the
    profile as it stands (as crowded as it was measured), and a job of twice the ranks per core runs half as fast
    per rank in every CPU term."""
    seen = {}
    monkeypatch.setattr(calibrate, "measure_ranks", lambda ranks, tp, rounds, echo: (
        seen.update(ranks=ranks, tp=tp), synthetic_ranks(ranks, tp, rounds, echo))[1])
    path = tmp_path / "cpu4.json"
    out = CliRunner().invoke(cli, ["plan", TINY_CPU, "--calibrate", "-o", str(path)])
    assert out.exit_code == 0, out.output
    assert seen == {"ranks": 4, "tp": 2}
    hw = hardware.load_profile(path)
    assert hw.ranks_per_host == 4 and hw.peak("fp32") == pytest.approx(0.02) and hw.intra_node_gbps == 0.8
    for key, field in (("efficiency", "efficiency"), ("block", "host_block_s"), ("tp_block", "host_tp_block_s"),
                       ("step", "host_step_s"), ("token", "host_tp_token_s")):
        assert getattr(hw, field) == pytest.approx(TRUE4[key], rel=1e-3, abs=1e-12), field
    got = json.loads(CliRunner().invoke(cli, ["plan", TINY_CPU, "--profile", str(path), "--json"]).output)
    cfg = load_config(TINY_CPU, [])
    want = calibrate.predict(["model.dim=128", "model.n_layers=4", "model.n_heads=4", "model.max_seq_len=128",
                              "data.seq_len=128", "train.micro_batch_size=8", "parallel.tp=2"],
                             {"gemm_tflops": 0.02, "link_gbps": 0.8}, 4, TRUE4)
    assert cfg.model.dim == 128 and got["step_time_s"] == pytest.approx(want.step_time_s, rel=1e-6)
    crowded = json.loads(CliRunner().invoke(cli, ["plan", TINY_CPU, "--profile", str(path), "--json", "--set",
                                                  "job.tasks_per_node=4"]).output)  # 8 ranks on 2 cores
    # each rank its own micro-batch still (dp 4: twice the global batch), at half the per-rank rate
    for term in ("compute_s", "host_s"):
        assert crowded["time_terms"][term] == pytest.approx(2 * got["time_terms"][term], rel=1e-6), term


def test_plan_reads_the_profile_by_option_and_by_config(calibrated) -> None:
    one = ["--set", "parallel.tp=1", "--set", "job.nodes=1", "--set", "job.tasks_per_node=1", "--json"]
    by_option = CliRunner().invoke(cli, ["plan", TINY_CPU, "--profile", str(calibrated), *one])
    by_config = CliRunner().invoke(cli, ["plan", TINY_CPU, "--set", f"job.hw_profile={calibrated}", *one])
    assert by_option.exit_code == 0 and by_config.exit_code == 0, by_option.output + by_config.output
    a, b = json.loads(by_option.output), json.loads(by_config.output)
    assert a == b and a["gpu"] == "cpu"
    hw = hardware.load_profile(calibrated)
    assert a["time_basis"]["efficiency"] == hw.efficiency  # the time model's inputs are the profile's
    m, blocks = a["time_basis"]["microbatches"], a["time_basis"]["blocks_on_busiest_stage"]
    assert a["time_terms"]["host_s"] == pytest.approx(hw.host_step_s + hw.host_block_s * blocks * m)


def test_unknown_figures_are_refused_not_guessed(calibrated, tmp_path) -> None:
    cfg = load_config(TINY_CPU, [])
    out = CliRunner().invoke(cli, ["plan", TINY_CPU, "--profile", str(calibrated)])  # tp = 2
    assert out.exit_code == 2 and "host_tp_block_s" in out.output, out.output
    dp4 = ["--set", "parallel.tp=1", "--profile", str(calibrated)]  # dp = 4: links needed
    out = CliRunner().invoke(cli, ["plan", TINY_CPU, *dp4])
    assert out.exit_code == 2 and "link bandwidths are unknown" in out.output, out.output
    given = CliRunner().invoke(cli, ["plan", TINY_CPU, *dp4, "--hw", "intra_node_gbps=1", "--hw",
                                     "inter_node_gbps=1"])
    assert given.exit_code == 0, given.output
    assert cfg.job.gpus_per_node == 0
    out = CliRunner().invoke(cli, ["plan", TINY_CPU])  # a CPU job without a calibration
    assert out.exit_code == 2 and "a CPU has no datasheet figures" in out.output, out.output


def test_submission_of_a_cpu_job_without_calibration_says_so() -> None:
    from hpctrain.job.launch import predict_fit
    from hpctrain.parallel import mesh
    from hpctrain.parallel.plan import make_plan
    cfg = load_config(TINY_CPU, [])
    plan = make_plan(cfg, mesh.block_placement(cfg.job.nodes, cfg.job.tasks_per_node), training=True)
    said = []
    assert predict_fit(cfg, plan, echo=said.append) is None
    assert "a CPU has no datasheet figures" in said[0]


@pytest.mark.parametrize("edit,fragment", [
    (lambda d: d | {"format": "other"}, "format 'other' is not"),
    (lambda d: d | {"efficiency": 1.5}, "efficiency=1.5 must be in (0, 1]"),
    (lambda d: d | {"host_step_s": "fast"}, "host_step_s='fast'"),
    (lambda d: d | {"gpus_per_node": -2}, "gpus_per_node=-2"),
    (lambda d: d | {"ranks_per_host": 0}, "ranks_per_host=0 must be a whole number >= 1"),
    (lambda d: d | {"host_tp_token_s": -1e-7}, "host_tp_token_s=-1e-07"),
    (lambda d: d | {"extra": 1}, "unknown key(s) ['extra']"),
    (lambda d: {k: v for k, v in d.items() if k != "peak_tflops"}, "missing key(s) ['peak_tflops']"),
])
def test_bad_profile_files_name_the_key(calibrated, edit, fragment) -> None:
    data = json.loads(calibrated.read_text())
    calibrated.write_text(json.dumps(edit(data)))
    with pytest.raises(ValueError, match=str(calibrated)) as e:
        hardware.load_profile(calibrated)
    assert fragment in str(e.value)


def test_a_job_of_many_hosts_is_not_started_on_this_one(monkeypatch) -> None:
    """The default --ranks is a CPU job's own rank count, which is this host's only where its nodes share it (the
    local cluster): a 64-node job would start 128 processes here. Refused with the flag to use; --ranks works."""
    monkeypatch.setattr(calibrate, "measure_ranks", lambda ranks, tp, rounds, echo: (_ for _ in ()).throw(
        AssertionError(f"started {ranks} ranks")))
    out = CliRunner().invoke(cli, ["plan", TINY_CPU, "--calibrate", "--set", "job.nodes=64"])
    assert out.exit_code == 2 and "runs 128 ranks" in out.output and "--ranks N" in out.output, out.output
