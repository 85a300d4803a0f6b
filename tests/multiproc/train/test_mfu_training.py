"""MFU and memory as short training runs in the test process report them (the peaks and probes:
tests/pure/train/test_mfu.py).

    PATH=$PWD/.venv/bin:$PATH .venv/bin/python -m pytest -q tests/multiproc/train/test_mfu_training.py
"""
from __future__ import annotations

import json

import pytest

from hpctrain.config import load_config
from hpctrain.job import session
from hpctrain.train import metrics
from hpctrain.train.metrics import Peak
from hpctrain.train.trainer import Trainer

TINY = ["model.vocab_size=256", "model.dim=32", "model.n_layers=1", "model.n_heads=2", "model.max_seq_len=32",
        "data.source=synthetic", "data.seq_len=32", "train.steps=3", "train.log_every=1", "train.micro_batch_size=2",
        "checkpoint.at_end=false", "parallel.pp=1", "parallel.tp=1", "parallel.dp=-1"]


def _fit(tmp_path, *overrides: str, events: list | None = None) -> tuple[dict, list[dict]]:
    cfg = load_config(None, TINY + list(overrides) + [f"job.run_root={tmp_path}"])
    with session.start(cfg) as s:
        tr = Trainer(cfg, s)
        if events is not None:  # the order of probe, memory reset and steps
            step, probe, reset = tr.train_step, metrics.gemm_probe, metrics.reset_peak_memory
            tr.train_step = lambda *a, **k: events.append("step") or step(*a, **k)
            metrics.gemm_probe = lambda *a, **k: events.append("probe") or probe(*a, **k)
            metrics.reset_peak_memory = lambda *a, **k: events.append("reset") or reset(*a, **k)
            try:
                out = tr.fit()
            finally:
                metrics.gemm_probe, metrics.reset_peak_memory = probe, reset
        else:
            out = tr.fit()
        rows = [json.loads(line) for line in (s.run_dir / "metrics.jsonl").read_text().splitlines()]
    return out, rows


def test_cpu_run_reports_measured_peak_gemm_and_memory_baseline(tmp_path) -> None:
    events: list[str] = []
    out, rows = _fit(tmp_path, events=events)
    # the rank's log names a CPU's rate in GFLOP/s, never "0.0 TFLOP/s"
    (rank_log,) = tmp_path.glob("*/logs/rank00000.log")
    line = metrics.describe_peak(Peak(out["peak_tflops"], out["peak_source"]), out["gemm"], None)
    assert "GFLOP/s per rank" in line and line in rank_log.read_text()
    assert events == ["probe", "reset", "step", "step", "step"]  # memory counts from after initialisation
    assert out["peak_source"] == "measured: float32 GEMM 1024^3 (a CPU)" and out["tf32"] is False
    assert out["gemm"]["n"] == 1024 and out["gemm"]["tflops"] == out["peak_tflops"] > 0
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["peak_source"] == out["peak_source"]
        assert r["mfu"] == pytest.approx(r["tflops_per_rank"] / out["peak_tflops"])
        assert r["mfu_gemm"] == pytest.approx(r["mfu"])  # the same figure here: the peak is the GEMM
    mem = out["memory"]
    assert "cannot be reset" in mem["peak_mem"] and 0 < mem["baseline_gb"] <= rows[-1]["peak_mem_gb"]


def test_recognised_device_reports_datasheet_mfu_beside_gemm(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(metrics, "device_name", lambda device: "NVIDIA H100 80GB HBM3")
    out, rows = _fit(tmp_path)
    # on this CPU fp32 runs without TF32: the H100's plain FP32 figure
    assert (out["peak_tflops"], out["peak_source"]) == (67.0, "datasheet: NVIDIA H100 SXM fp32 dense")
    for r in rows:
        assert r["mfu"] == pytest.approx(r["tflops_per_rank"] / 67.0)
        assert r["mfu_gemm"] == pytest.approx(r["tflops_per_rank"] / out["gemm"]["tflops"])
    out, rows = _fit(tmp_path, "train.peak_tflops=2")
    assert out["peak_source"] == "config: train.peak_tflops" and rows[0]["mfu"] == pytest.approx(
        rows[0]["tflops_per_rank"] / 2)
