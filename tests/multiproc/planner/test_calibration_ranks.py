"""Multi-process tier for the CPU calibration with several ranks at once (`hpctrain plan --calibrate --ranks N`):
measure_ranks starts N real processes with torchrun's variables, each probe a process group of its own on a port
below the ephemeral range, and rank 0's times come back. Two small probes here (the real ones take a minute or
two: benchmarks/planner_example.py runs them); what the figures are made of is the solver's, tested in
tests/pure/planner/test_planner_calibration.py.

    PATH=$PWD/.venv/bin:$PATH .venv/bin/python -m pytest -q tests/multiproc/planner/test_calibration_ranks.py
"""
from __future__ import annotations

from hpctrain.train import calibrate


def test_ranks_at_once_report_every_round(monkeypatch) -> None:
    cases = [c for c in calibrate.rank_cases(2) if c["name"] in ("dp_L2", "tp_L2")]
    monkeypatch.setattr(calibrate, "rank_cases", lambda tp: cases)
    said: list[str] = []
    times = calibrate.measure_ranks(2, 2, 2, said.append)
    assert sorted(times) == ["dp_L2", "tp_L2"] and "2 ranks at once" in said[0], (times, said)
    for name, got in times.items():
        assert got["threads"] >= 1 and len(got["rounds"]) == 2, (name, got)
        for r in got["rounds"]:
            assert r["gemm_tflops"] > 0 and r["link_gbps"] > 0 and r["step_s"] > 0, (name, r)
