"""Writes the "Measured here" table of benchmarks/README.md from the verdict records in benchmarks/results/*.json,
and nothing else: every row is one `_verdict.verdict` record (median of paired per-round values, 95% interval,
rounds, target, met or NOT MET). `make bench` runs it after the benchmarks; tests/pure/test_readme_bench.py fails
when that README and the JSON files disagree. The table lives beside the rule that judges it and the benchmarks
that fill it; the project's front page only links to it.

    python benchmarks/readme_table.py            # rewrite the table between the markers in benchmarks/README.md
    python benchmarks/readme_table.py --check    # exit 1 when benchmarks/README.md is not what the JSON files give
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
README = HERE / "README.md"
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"
# table order: the order `make bench` runs them (run_all.py); files not listed come after, by name
ORDER = ["collectives", "train_overhead", "zero_memory", "activation_checkpointing", "checkpoint_io",
         "async_stall", "pipeline_bubble", "loader_prefetch", "init_scale"]


def earlier(doc: dict) -> dict[str, dict]:
    """The verdict records of a run that was repeated (kept under "earlier_run", with the reason), by metric: the
    table shows them beside the run that replaced them, so a re-run can never quietly hide a miss."""
    old = doc.get("earlier_run") or {}
    recs = list(old.get("verdicts", [])) + [v for v in old.values() if isinstance(v, dict) and "metric" in v]
    return {r["metric"]: r for r in recs}


def load(results: Path = RESULTS) -> list[dict]:
    """Every verdict record of every results file, in table order, each with the earlier run's record if any."""
    files = sorted(results.glob("*.json"), key=lambda f: (ORDER.index(f.stem) if f.stem in ORDER else len(ORDER),
                                                           f.stem))
    rows = []
    for f in files:
        doc = json.loads(f.read_text())
        if not isinstance(doc, dict):
            continue
        first = earlier(doc)
        for rec in doc.get("verdicts", []):
            rows.append({**rec, "file": f.name, "earlier": first.get(rec["metric"])})
    return rows


def _num(x: float) -> str:
    return f"{x:.3g}" if abs(x) >= 1e-3 or x == 0 else f"{x:.1e}"


def target_text(rec: dict) -> str:
    t = _num(rec["target"])
    return {"higher": f">= {t}", "lower": f"<= {t}",
            "within": f"{_num(rec.get('center', 0.0))} ± {t}"}[rec["better"]]


def render(rows: list[dict]) -> str:
    lines = ["| benchmark | what is compared (per round) | median | 95% interval | rounds | target | verdict |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lo, hi = r["ci95"]
        what = r["metric"] + (f"; {r['note']}" if r.get("note") else "")
        status = r["status"] if r["met"] else f"**{r['status']}**"
        if r.get("earlier"):
            e = r["earlier"]
            status += f"; re-run, the first run: {_num(e['median'])} {e['status']}"
        interval = "-" if r["rounds"] == 1 else f"{_num(lo)} to {_num(hi)}"
        lines.append(f"| `{r['file']}` | {what} | {_num(r['median'])} | {interval} | {r['rounds']} | "
                     f"{target_text(r)} | {status} |")
    missed = sum(not r["met"] for r in rows)
    lines.append("")
    reruns = sum(bool(r.get("earlier")) for r in rows)
    lines.append(f"{len(rows)} verdicts, {missed} NOT MET, {reruns} from a repeated run (the first run's verdict "
                 "shown beside it, its reason in the JSON). Every row: the median of paired per-round values, all "
                 "rounds counted, its distribution-free 95% interval (one-round rows are deterministic counts); "
                 "the rule is in `benchmarks/README.md`, the raw rounds in the JSON file named.")
    return "\n".join(lines)


def splice(text: str, table: str) -> str:
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise SystemExit(f"{README} needs exactly one {BEGIN} ... {END} section")
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    return f"{head}{BEGIN}\n{table}\n{END}{tail}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when benchmarks/README.md differs from the JSON files")
    args = ap.parse_args()
    text = README.read_text()
    new = splice(text, render(load()))
    if args.check:
        if new != text:
            print("benchmarks/README.md's table is not what benchmarks/results/*.json give: "
                  "run `python benchmarks/readme_table.py`", file=sys.stderr)
            return 1
        return 0
    if new != text:
        README.write_text(new)
        print(f"# wrote the table in {README}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
