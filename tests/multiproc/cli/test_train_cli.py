"""Training through the product's own entry point, in its own process: `hpctrain train` writes metrics, a profiler
trace and a summary; `hpctrain plot` draws them. The in-process half (refusals, host syncs) is
tests/multiproc/train/test_train_run.py."""
from __future__ import annotations

import json

from click.testing import CliRunner

from helpers.launch import EXAMPLE, hpctrain
from helpers.runs import only_run_dir
from hpctrain.cli.main import main as cli

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
