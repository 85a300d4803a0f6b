"""Run directories and per-rank logs.

A run directory is created once per submission and never reused:
    <run_root>/<name>-<YYYYmmdd-HHMMSS>-<6 hex>/
        config.toml      the resolved config
        job.json         executor, job id, submission time
        logs/rank00000.log ...
        summary.json     written by rank 0 at the end
        submitit/        submitit's pickles and raw task output
"""
from __future__ import annotations

import json
import logging
import secrets
import sys
import time
from pathlib import Path
from typing import Any

from hpctrain.fsutil import write_atomic


def new_run_dir(run_root: str | Path, name: str) -> Path:
    """A fresh directory; mkdir without exist_ok, so two runs can never share one.

    A run_root that cannot hold it (a file, under a file, not writable) is a ValueError naming run_root."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    root = Path(run_root).absolute()
    path = root / f"{name}-{stamp}-{secrets.token_hex(3)}"
    try:
        path.mkdir(parents=True, exist_ok=False)
    except OSError as e:
        why = _why_not(root, e)
        raise ValueError(f"job.run_root = {str(run_root)!r} cannot hold run directories: {why}") from None
    return path


def _why_not(root: Path, error: OSError) -> str:
    """The reason mkdir failed, in the user's terms: errno alone says 'Not a directory' without naming the file."""
    existing = next((p for p in (root, *root.parents) if p.exists() or p.is_symlink()), None)
    if existing is not None and not existing.is_dir():
        where = "it" if existing == root else f"{str(existing)!r} above it"
        return f"{where} is " + ("a file, not a directory" if existing.exists() else "a dangling symbolic link")
    return f"{error.strerror or error} ({str(error.filename or root)!r})"


def write_json(path: Path, obj: Any) -> None:
    """Writes through a temporary file and a rename, so readers never see half a file."""
    write_atomic(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def rank_log_path(run_dir: Path, rank: int) -> Path:
    return run_dir / "logs" / f"rank{rank:05d}.log"


def setup_logging(run_dir: Path | None, rank: int, level: int = logging.INFO) -> None:
    """Every rank logs to its own file; rank 0 also to stdout (which Slurm/submitit keep too)."""
    root = logging.getLogger()
    root.setLevel(level)
    for h in list(root.handlers):
        root.removeHandler(h)
    fmt = logging.Formatter(f"%(asctime)s rank{rank} %(levelname)s %(message)s", "%H:%M:%S")
    handlers: list[logging.Handler] = []
    if run_dir is not None:
        path = rank_log_path(run_dir, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(path))
    if rank == 0:
        handlers.append(logging.StreamHandler(sys.stdout))
    for h in handlers:
        h.setFormatter(fmt)
        root.addHandler(h)
