"""The one verdict rule every benchmark follows (benchmarks/README.md says it in words, before any run):

- every round counts: one paired ratio per round, ours / baseline measured side by side in that round;
- the verdict is on the median of those ratios, printed with its distribution-free 95% interval (order
  statistics of the binomial(n, 1/2): no normality assumed, no estimator chosen after the fact);
- the target is met when the median meets it, NOT MET otherwise; the interval is printed either way, and a
  median that meets the target while its interval crosses it says so;
- the order of the two sides alternates from round to round (`balanced`), both sides configured alike.

`verdict(...)` returns the record that goes into a results JSON under "verdicts"; `readme_table.py` builds the
table in benchmarks/README.md from those records and nothing else.
"""
from __future__ import annotations

import math
import statistics
from typing import Sequence

ESTIMATOR = "median of paired per-round ratios"
RULE = "benchmarks/README.md"


def _binom_cdf(k: int, n: int) -> float:
    """P(X <= k) for X ~ Binomial(n, 1/2)."""
    return sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n


def median_ci(xs: Sequence[float], level: float = 0.95) -> tuple[float, float, float, float]:
    """(median, low, high, coverage): the sample median and the widest-needed order-statistic interval
    [x_(k), x_(n-k+1)] whose coverage 1 - 2 P(X < k) is at least `level`. Fewer than 6 values cannot reach 95%:
    the interval is then the whole range, with the coverage it really has."""
    s = sorted(float(x) for x in xs)
    n = len(s)
    if n == 0:
        raise ValueError("no values")
    med = statistics.median(s)
    best = 1  # k = 1: [min, max], coverage 1 - 2 / 2^n
    for k in range(1, n // 2 + 1):
        if 1 - 2 * _binom_cdf(k - 1, n) >= level:
            best = k
        else:
            break
    coverage = 1 - 2 * _binom_cdf(best - 1, n) if n > 1 else 0.0
    return med, s[best - 1], s[n - best], coverage


def balanced(round_index: int, sides: Sequence) -> list:
    """The two sides (or more) in this round's order: as given on even rounds, reversed on odd ones."""
    return list(sides) if round_index % 2 == 0 else list(reversed(sides))


def verdict(benchmark: str, metric: str, ratios: Sequence[float], target: float, better: str = "higher",
            note: str = "", unit: str = "x", center: float = 0.0) -> dict:
    """The verdict record for one headline quantity per round (a ratio, or a difference such as measured minus
    predicted idle fraction), printed as one line. better: "higher" (median >= target is met), "lower"
    (median <= target) or "within" (|median - center| <= target). note: what is compared, in a few words."""
    if better not in ("higher", "lower", "within"):
        raise ValueError(f"better = {better!r} must be 'higher', 'lower' or 'within'")
    ratios = [float(r) for r in ratios]
    if not ratios or not all(math.isfinite(r) for r in ratios):
        raise ValueError(f"{benchmark}: {metric}: ratios must be finite and non-empty, got {ratios}")
    med, lo, hi, coverage = median_ci(ratios)
    if better == "within":
        met = abs(med - center) <= target
        crosses = lo < center - target or hi > center + target
    else:
        met = med >= target if better == "higher" else med <= target
        crosses = lo < target < hi
    status = ("met" if met else "NOT MET") + (" (interval crosses the target)" if met and crosses else "")
    goal = {"higher": f">= {target:g}", "lower": f"<= {target:g}",
            "within": f"within {center:g} +- {target:g}"}[better]
    rec = {"benchmark": benchmark, "metric": metric, "estimator": ESTIMATOR, "rounds": len(ratios),
           "median": med, "ci95": [lo, hi], "coverage": round(coverage, 4), "target": target, "better": better,
           "center": center, "met": met, "status": status, "unit": unit, "note": note, "ratios": ratios}
    print(f"VERDICT {benchmark}: {metric}: median {med:.3f} (95% {lo:.3f}-{hi:.3f}, {len(ratios)} rounds) "
          f"target {goal}: {status}", flush=True)
    return rec
