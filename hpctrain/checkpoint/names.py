"""The names in a checkpoints directory (layout.py describes the directory): what a step directory, its marker and
its control state are called, read without torch so that `hpctrain ckpt ls` starts at once on a login node.

    parse_name("step_00000042.partial")  # (42, ".partial"); None for anything that is not a checkpoint's name
    step_name(42)                        # "step_00000042"
"""
from __future__ import annotations

import re

MARKER = "COMMITTED"
EXTRA = "train_state.json"
UNUSABLE = "UNUSABLE.txt"
MARKER_VERSION = 2  # 2: marker carries seq and the crc32 of train_state.json and index.json
_NAME = re.compile(r"step_(\d{8,})(\.partial|\.old|\.unusable(?:-\d+)?)?")
MAX_JSON_BYTES = 64 << 20  # a marker or train_state.json larger than this is damage


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def parse_name(name: str) -> tuple[int, str] | None:
    """(step, suffix) of a checkpoint directory name ("" for a checkpoint, ".partial", ".old", ".unusable..."),
    None for anything else, including non-canonical spellings of a step (step_000000042)."""
    m = _NAME.fullmatch(name)
    if m is None or m.group(1) != f"{int(m.group(1)):08d}":
        return None
    return int(m.group(1)), m.group(2) or ""
