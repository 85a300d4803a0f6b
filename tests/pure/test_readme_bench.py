"""Pure tier: the benchmark verdict rule (benchmarks/_verdict.py) and the table it feeds (benchmarks/README.md).

benchmarks/README.md's "Measured here" table must be exactly what benchmarks/results/*.json give, and every
verdict record in those files must be what the rule gives for its own stored rounds: median, interval, met or NOT
MET are recomputed here from the per-round values, so a hand-edited number, a best-of or a quietly changed
estimator fails.
"""
from __future__ import annotations

import math
import sys

import pytest

from helpers.launch import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import _verdict  # noqa: E402
import readme_table  # noqa: E402

FIELDS = {"benchmark", "metric", "estimator", "rounds", "median", "ci95", "coverage", "target", "better", "center",
          "met", "status", "unit", "note", "ratios"}


def test_median_interval_is_the_order_statistic_one() -> None:
    med, lo, hi, cov = _verdict.median_ci(list(range(1, 25)))  # 24 rounds: x(7) and x(18), coverage 0.977
    assert (med, lo, hi) == (12.5, 7, 18) and cov == pytest.approx(0.97734, abs=1e-4)
    med, lo, hi, cov = _verdict.median_ci([3.0, 1.0, 2.0])  # too few for 95%: the range, with its real coverage
    assert (med, lo, hi, cov) == (2.0, 1.0, 3.0, 0.75)
    for n in range(6, 60):
        assert _verdict.median_ci([float(i) for i in range(n)])[3] >= 0.95


def test_verdict_uses_the_median_of_every_round() -> None:
    rounds = [0.5, 0.96, 0.97, 0.98, 2.0, 2.5]  # best round 2.5, mean 1.32: the median (0.975) decides
    assert _verdict.verdict("b", "m", rounds, 0.97)["met"]
    assert not _verdict.verdict("b", "m", rounds, 0.98)["met"]
    rec = _verdict.verdict("b", "m", [0.9, 0.92, 0.91], 0.95)
    assert rec["status"] == "NOT MET" and rec["rounds"] == 3
    assert _verdict.verdict("b", "m", [1.02, 0.95, 1.1, 1.05], 1.0)["status"] == "met (interval crosses the target)"
    assert _verdict.verdict("b", "d", [0.04, -0.01, 0.02], 0.05, better="within")["met"]
    assert not _verdict.verdict("b", "d", [0.06, 0.07, 0.08], 0.05, better="within")["met"]
    assert _verdict.verdict("b", "lower", [0.5, 0.6, 0.7], 1.0, better="lower")["met"]
    with pytest.raises(ValueError, match="finite"):
        _verdict.verdict("b", "m", [1.0, float("nan")], 1.0)


def test_order_is_balanced() -> None:
    assert [_verdict.balanced(i, ("ours", "base"))[0] for i in range(4)] == ["ours", "base", "ours", "base"]


def test_every_stored_verdict_follows_the_rule() -> None:
    rows = readme_table.load()
    assert rows, "no verdict records in benchmarks/results/*.json: run `make bench`"
    for r in rows:
        where = f"{r['file']}: {r['metric']}"
        assert FIELDS <= set(r), f"{where}: missing {FIELDS - set(r)}"
        assert r["estimator"] == _verdict.ESTIMATOR, where
        assert r["rounds"] == len(r["ratios"]) >= 1, where
        med, lo, hi, _ = _verdict.median_ci(r["ratios"])
        assert math.isclose(r["median"], med) and r["ci95"] == pytest.approx([lo, hi]), where
        again = _verdict.verdict(r["benchmark"], r["metric"], r["ratios"], r["target"], r["better"],
                                 center=r["center"])
        assert (r["met"], r["status"]) == (again["met"], again["status"]), where
    keys = [(r["benchmark"], r["metric"]) for r in rows]
    assert len(keys) == len(set(keys)), "a headline appears twice"


def test_readme_table_is_generated_from_the_results() -> None:
    text = readme_table.README.read_text()
    assert readme_table.README == REPO / "benchmarks" / "README.md"
    assert readme_table.splice(text, readme_table.render(readme_table.load())) == text, \
        "benchmarks/README.md's table differs from benchmarks/results/*.json: run `python benchmarks/readme_table.py`"
