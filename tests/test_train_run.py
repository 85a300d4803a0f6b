"""Training through the product's own entry points: `hpctrain train` writes metrics, a profiler trace and a
summary; `hpctrain plot` draws them; bad training input is refused before anything starts."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from conftest import EXAMPLE, hpctrain, only_run_dir
from hpctrain.cli import main as cli

TINY = ["--set", "model.dim=32", "--set", "model.n_layers=1", "--set", "model.n_heads=2", "--set", "data.seq_len=32",
        "--set", "data.source=synthetic", "--set", "train.peak_tflops=1", "--set", "parallel.tp=1"]


def test_train_writes_metrics_trace_and_plot(tmp_path) -> None:
    out = hpctrain("train", str(EXAMPLE), *TINY, "--set", f"job.run_root={tmp_path}", "--set", "train.steps=12",
                   "--set", "train.log_every=4", "--set", "train.profile_steps=[3, 4]", timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    run = only_run_dir(tmp_path)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 4, 8, 12]
    for key in ("loss", "grad_norm", "lr", "tokens_per_s", "tflops_per_rank", "mfu", "peak_mem_gb"):
        assert all(isinstance(r[key], float) for r in rows), key
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert rows[-1]["tokens_seen"] == 12 * 8 * 32
    summary = json.loads((run / "summary.json").read_text())
    assert summary["ok"] and summary["train"]["steps"] == 12
    traces = list((run / "profile").glob("*.json"))
    assert traces and traces[0].stat().st_size > 1000  # torch.profiler's chrome trace of steps 3-4
    assert "step 12/12" in out.stdout  # the progress line
    res = CliRunner().invoke(cli, ["plot", str(run)])
    assert res.exit_code == 0, res.output
    png = run / "training.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("sets, fragment", [
    (["model.n_heads=3", "model.dim=96"], "model.n_heads = 3 is not divisible by parallel.tp = 2"),
    (["train.global_batch_size=30", "train.grad_accum=4"],
     "train.global_batch_size = 30 is not divisible by dp(2) x train.grad_accum(4) = 8"),
    (["parallel.zero_stage=1"], "parallel.zero_stage = 1 with parallel.tp = 2 is not supported"),
    (["parallel.pp=2", "parallel.dp=1"], "train.grad_accum = 1 micro-batches: 1F1B needs at least pp = 2"),
    (["parallel.pp=2", "parallel.dp=1", "parallel.pp_layers=[3, 3]"], "parallel.pp_layers = [3, 3] sums to 6"),
    (["train.precision=fp8"], "train.precision = 'fp8' is not one of fp32, bf16, fp16"),
    (["parallel.zero_stage=4"], "parallel.zero_stage = 4 must be 0, 1, 2 or 3"),
])
def test_bad_training_input_refused_at_dry_run(sets, fragment, tmp_path) -> None:
    args = ["submit", str(EXAMPLE), "--dry-run", "--set", f"job.run_root={tmp_path}"]
    for s in sets:
        args += ["--set", s]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 2, res.output
    assert fragment in res.output
    assert "#SBATCH" not in res.output and not any(tmp_path.iterdir())


def test_missing_data_warns_at_dry_run_and_refuses_submission(tmp_path) -> None:
    sets = ["--set", "data.path=/nonexistent/tokens.bin", "--set", f"job.run_root={tmp_path}"]
    dry = CliRunner().invoke(cli, ["submit", str(EXAMPLE), "--dry-run", *sets])
    assert dry.exit_code == 0 and "warning: data.path = '/nonexistent/tokens.bin' does not exist" in dry.output
    real = CliRunner().invoke(cli, ["submit", str(EXAMPLE), *sets])
    assert real.exit_code == 2 and "data.path = '/nonexistent/tokens.bin' does not exist" in real.output
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_vocab_padding_is_announced(tmp_path) -> None:
    res = CliRunner().invoke(cli, ["submit", str(EXAMPLE), "--dry-run", "--set", "model.vocab_size=250",
                                   "--set", "data.source=synthetic"])
    assert res.exit_code == 0, res.output
    assert "model.vocab_size = 250 padded to 256" in res.output
