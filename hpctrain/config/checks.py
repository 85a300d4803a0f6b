"""The checks every config section runs on its values; each failure is a ValueError naming the key and the value."""
from __future__ import annotations

import dataclasses
import math
import re


def check(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


def one_of(section: str, key: str, value: str, allowed: tuple[str, ...]) -> None:
    check(value in allowed, f"{section}.{key} = {value!r} is not one of {', '.join(allowed)}")


def check_fields(section: str, obj: object, one_line: bool = False) -> None:
    """Checks every str and float of a section, list entries too, whatever the key: strings must encode as UTF-8
    (config.toml is written in it and every rank reads it back), floats must be finite, and with one_line strings
    hold no CR, LF or NUL ([job] strings become #SBATCH lines and shell lines of the job script, one line each)."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        for i, v in enumerate(value) if isinstance(value, list) else [(None, value)]:
            where = f"{section}.{f.name}" + ("" if i is None else f"[{i}]")
            if isinstance(v, float):
                check(math.isfinite(v), f"{where} = {v!r} must be a finite number")
            elif isinstance(v, str):
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError as e:  # a lone surrogate: argv bytes that were not UTF-8
                    raise ValueError(f"{where} = {v!r} is not UTF-8 text: {e.reason} at character {e.start}") from None
                check(not (one_line and re.search(r"[\r\n\0]", v)),
                       f"{where} = {v!r} holds a line break or NUL: each [job] value must stay on one line of the "
                       f"job script")


def positive(section: str, obj: object, *keys: str, allow_zero: bool = False) -> None:
    for key in keys:
        value = getattr(obj, key)
        low = 0 if allow_zero else 1
        check(value >= low, f"{section}.{key} = {value!r} must be >= {low}")
