"""Pure tier: what `make install` adds beside torch. torchao (float8 layers, TORCHAO_SPEC) is installed only beside
the torch release TORCH_SPEC pins: a torchao release is built for one torch release, and beside a site's torch a
mismatched one would break train.precision = "fp8" where it matters, on the site's GPUs.

    .venv/bin/python -m pytest -q tests/pure/test_install_pins.py
"""
from __future__ import annotations

from hpctrain.install_guard import beside


def test_torchao_only_beside_the_pinned_torch() -> None:
    assert beside("torchao==0.18.0", "torch==2.13.0", "2.13.0+cpu") == ["torchao==0.18.0"]
    assert beside("torchao==0.18.0", "torch == 2.13", "2.13.0") == ["torchao==0.18.0"]
    assert beside("torchao==0.18.0", "torch==2.13.0", "2.9.1+cu128") == []  # a site's torch
    assert beside("torchao==0.18.0", "torch==2.13.0", "2.13.1") == []
    assert beside("torchao==0.18.0", "torch>=2.13", "2.13.0") == []  # no pinned release to match
    assert beside("", "torch==2.13.0", "2.13.0") == []  # TORCHAO_SPEC= : none
