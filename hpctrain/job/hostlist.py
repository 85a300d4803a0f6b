"""Slurm host lists: "n[1-3,7],gpu01" <-> ["n1", "n2", "n3", "n7", "gpu01"], as sbatch --exclude and
`scontrol show job`'s ExcNodeList write them. Pure: imports nothing.

    expand("gpu[001-003],login1")      # ['gpu001', 'gpu002', 'gpu003', 'login1']
    compress(["n1", "n3", "n4"])       # 'n[1,3-4]'

One bracket per name (the form Slurm itself prints for node names); names are kept in the order given, duplicates
dropped.
"""
from __future__ import annotations

import re

_RANGE = re.compile(r"(\d+)(?:-(\d+))?")
_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def _split_top(text: str) -> list[str]:
    """Commas outside brackets separate entries: "n[1,3],m2" -> ["n[1,3]", "m2"]."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch == "["
        depth -= ch == "]"
        if depth < 0 or depth > 1:
            raise ValueError(f"host list {text!r}: unbalanced or nested brackets")
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"host list {text!r}: unbalanced brackets")
    return parts + [text[start:]]


def expand(text: str) -> list[str]:
    """The names of a Slurm host list; "" and "(null)" (scontrol's empty value) give []."""
    if text.strip() in ("", "(null)"):
        return []
    out: list[str] = []
    for entry in _split_top(text.strip()):
        m = re.fullmatch(r"([^\[\]]*)\[([^\[\]]+)\]([^\[\]]*)", entry)
        if m is None:
            if not _NAME.fullmatch(entry):
                raise ValueError(f"host list {text!r}: {entry!r} is not a host name")
            names = [entry]
        else:
            prefix, ranges, suffix = m.groups()
            names = []
            for part in ranges.split(","):
                r = _RANGE.fullmatch(part)
                if r is None:
                    raise ValueError(f"host list {text!r}: {part!r} is not a number or a range a-b")
                lo, hi = r.group(1), r.group(2) or r.group(1)
                if int(hi) < int(lo):
                    raise ValueError(f"host list {text!r}: range {part!r} runs backwards")
                width = len(lo) if lo.startswith("0") else 0  # "001-010" keeps three digits
                names += [f"{prefix}{i:0{width}d}{suffix}" for i in range(int(lo), int(hi) + 1)]
        out += [n for n in names if n not in out]
    return out


def compress(names: list[str]) -> str:
    """The shortest usual Slurm form: names sharing a prefix and digit width become one bracket of ranges."""
    groups: dict[tuple[str, int], list[int]] = {}
    order: list[tuple[str, int] | str] = []
    for name in dict.fromkeys(names):
        m = re.fullmatch(r"(.*?)(\d+)", name)
        if m is None:
            order.append(name)
            continue
        prefix, digits = m.groups()
        width = len(digits) if digits.startswith("0") and len(digits) > 1 else 0
        key = (prefix, width)
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append(int(digits))
    out = []
    for key in order:
        if isinstance(key, str):
            out.append(key)
            continue
        prefix, width = key
        nums = sorted(set(groups[key]))
        if len(nums) == 1:
            out.append(f"{prefix}{nums[0]:0{width}d}")
            continue
        runs, start = [], nums[0]
        for i, n in enumerate(nums):
            if i + 1 < len(nums) and nums[i + 1] == n + 1:
                continue  # the run goes on
            runs.append(f"{start:0{width}d}" + (f"-{n:0{width}d}" if n != start else ""))
            start = nums[i + 1] if i + 1 < len(nums) else start
        out.append(f"{prefix}[{','.join(runs)}]")
    return ",".join(out)
