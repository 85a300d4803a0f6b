"""The check every refusal test makes: a call raises a ValueError whose message names the offending values."""
from __future__ import annotations

import pytest


def refused(fn, *args, fragments, **kwargs) -> str:
    """fn(*args, **kwargs) raises a ValueError whose message holds every fragment; returns the message."""
    with pytest.raises(ValueError) as info:
        fn(*args, **kwargs)
    msg = str(info.value)
    for fragment in fragments:
        assert fragment in msg, f"{fragment!r} not in {msg!r}"
    return msg
