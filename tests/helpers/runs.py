"""What a finished run left behind: its one run directory under a run root and the summary.json in it."""
from __future__ import annotations

import json
from pathlib import Path


def only_run_dir(root: Path) -> Path:
    dirs = [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")]
    assert len(dirs) == 1, f"expected one run directory under {root}, found {dirs}"
    return dirs[0]


def read_summary(root: Path) -> dict:
    return json.loads((only_run_dir(root) / "summary.json").read_text())
