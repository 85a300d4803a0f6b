"""The fault campaign's record and the reliability table of docs/reliability.md.

Every test marked `faults` injects one fault and asserts its outcome; it also calls

    record("kill -9 of rank 1 during a save", "job fails; step 4 still loads", seconds=3.2)

which leaves one JSON file per fault under .faults/ (git-ignored). After `make test` (or `pytest -m faults`),

    python tests/faults.py            # prints the table
    python tests/faults.py --readme   # rewrites the table between the faults markers of docs/reliability.md

Only what a test asserted goes into its outcome text: the table is generated, never typed.
"""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RECORD_DIR = REPO / ".faults"
PAGE = REPO / "docs" / "reliability.md"  # where the table is read; the front page links to it
BEGIN, END = "<!-- faults:begin -->", "<!-- faults:end -->"


def record(fault: str, outcome: str, seconds: float | None = None, tier: str = "") -> None:
    """Notes one injected fault, the outcome the test asserted, and the time until every rank was gone."""
    RECORD_DIR.mkdir(exist_ok=True)
    name = hashlib.blake2b(fault.encode(), digest_size=8).hexdigest()
    row = {"fault": fault, "outcome": outcome, "seconds": None if seconds is None else round(seconds, 1),
           "tier": tier}
    (RECORD_DIR / f"{name}.json").write_text(json.dumps(row))


def table() -> str:
    rows = sorted((json.loads(p.read_text()) for p in RECORD_DIR.glob("*.json")),
                  key=lambda r: (r["tier"], r["fault"]))
    lines = ["| fault injected | tier | outcome asserted | time to exit (s) |", "|---|---|---|---|"]
    for r in rows:
        secs = "-" if r["seconds"] is None else f"{r['seconds']:.1f}"
        lines.append(f"| {r['fault']} | {r['tier'] or '-'} | {r['outcome']} | {secs} |")
    return "\n".join(lines)


def rewrite_page(page: Path = PAGE) -> None:
    """Puts table() between the faults markers of `page` (docs/reliability.md; the --readme flag kept its name)."""
    text = page.read_text()
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    if not rest:
        raise SystemExit(f"{page} has no {BEGIN} ... {END} section")
    page.write_text(f"{head}{BEGIN}\n{table()}\n{END}{tail}")


if __name__ == "__main__":
    if "--readme" in sys.argv[1:]:
        rewrite_page()
    print(table())
