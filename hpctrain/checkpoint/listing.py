"""`hpctrain ckpt ls`: a run's checkpoints listed from their directory names, their COMMITTED markers and their
files' sizes, without torch, h5py or numpy, so that the command answers at once on a login node (where importing torch
from a shared file system can take tens of seconds). The rest of `ckpt` is inspection.py.

    root, rows = list_checkpoints(Path("runs/tiny-cpu-20261122-025518-a740f3"))   # or its checkpoints/ directory
    print(format_listing(root, rows))
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpctrain.checkpoint.names import MARKER, MAX_JSON_BYTES, parse_name
from hpctrain.untrusted import Untrusted, read_json

STATUS = {"": "committed", ".partial": "partial", ".old": "replaced"}  # by name suffix; else "unusable"


def human_bytes(n: float) -> str:
    units = ("B", "KB", "MB", "GB", "TB")
    i = 0
    while n >= 1000 and i < len(units) - 1:
        n, i = n / 1000, i + 1
    return f"{n:.0f} B" if i == 0 else f"{n:.1f} {units[i]}"


def json_or_none(path: Path) -> dict | None:
    """A JSON object, for display only: None when missing, a link, huge, too deep, malformed or not an object."""
    try:
        doc = read_json(path, MAX_JSON_BYTES)
    except Untrusted:
        return None
    return doc if isinstance(doc, dict) else None


@dataclass(frozen=True)
class Listing:
    """One checkpoint directory as `ckpt ls` shows it."""
    step: int
    path: Path
    status: str  # committed | partial (a save in flight or killed) | uncommitted (renamed, marker missing) |
    #              replaced (being replaced by a new save of its step) | unusable (set aside by a refused load)
    num_bytes: int
    num_shards: int
    marker: dict = field(default_factory=dict)  # the COMMITTED marker: step and provenance


def checkpoint_root(path: Path) -> Path:
    """The directory holding step_* directories: path itself, its checkpoints/, or the run's checkpoint.dir."""
    if any(parse_name(p.name) for p in path.iterdir()):
        return path
    if (path / "config.toml").is_file():  # a run directory: checkpoint.dir may point elsewhere
        from hpctrain.config import load_config
        ckpt_dir = load_config(path / "config.toml").checkpoint.dir
        if ckpt_dir:
            return Path(ckpt_dir)
    return path / "checkpoints"


def list_checkpoints(path: Path) -> tuple[Path, list[Listing]]:
    """(root, its checkpoint directories oldest first); a partial save sorts after a committed one of its step."""
    root = checkpoint_root(path)
    out = []
    for p in root.iterdir() if root.is_dir() else ():
        parsed = parse_name(p.name)
        if not (parsed and p.is_dir()):
            continue
        # committed as manager.committed() counts it: the marker file exists
        status = STATUS.get(parsed[1], "unusable")
        if status == "committed" and not (p / MARKER).is_file():
            status = "uncommitted"
        marker = json_or_none(p / MARKER)
        files = [f for f in p.iterdir() if f.is_file()]
        out.append(Listing(parsed[0], p, status, sum(f.stat().st_size for f in files),
                           sum(f.name.startswith("shard-") and f.suffix == ".h5" for f in files), marker or {}))
    return root, sorted(out, key=lambda c: (c.step, c.status != "committed", c.path.name))


def format_layout(layout: Any) -> str:
    if not isinstance(layout, dict):
        return "-"
    return " ".join(f"{k}={v}" for k, v in layout.items()) or "-"


def format_listing(root: Path, rows: list[Listing]) -> str:
    if not rows:
        return f"no checkpoints in {root}" + ("" if root.is_dir() else " (no such directory)")
    table = [("step", "status", "size", "shards", "saved_at", "world", "layout")]
    for c in rows:
        table.append((str(c.step), c.status, human_bytes(c.num_bytes), str(c.num_shards),
                      c.marker.get("saved_at", "-"), str(c.marker.get("world_size", "-")),
                      format_layout(c.marker.get("layout", {}))))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]) - 1)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1] for row in table]
    return f"{root}\n" + "\n".join(line.rstrip() for line in lines)
