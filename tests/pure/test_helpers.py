"""The helpers' own checks: a test helper that compares too little makes every test that uses it pass."""
from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch

from helpers.ckpt_bytes import assert_bitwise_equal, stored_datasets


def test_bitwise_comparison_sees_every_dtype(tmp_path) -> None:
    """The helper itself: a flipped byte in a uint8 (RNG) or uint16 (bf16) dataset, or an extra dataset, fails."""
    arrays = {"w/0_0": np.arange(6, dtype=np.float32).reshape(2, 3), "rng/0_0": np.arange(8, dtype=np.uint8),
              "bf16/0_0": torch.ones(4, dtype=torch.bfloat16).view(torch.uint16).numpy()}

    def write(name: str, changes: dict) -> dict:
        (tmp_path / name).mkdir()
        with h5py.File(tmp_path / name / "shard-0.h5", "w") as f:
            for key, arr in (arrays | changes).items():
                f.create_dataset(key, data=arr).attrs["dtype"] = "uint8" if arr.dtype == np.uint8 else "x"
        return stored_datasets(tmp_path / name)
    base = write("base", {})
    assert_bitwise_equal(base, write("same", {}))
    for i, (key, dtype) in enumerate([("rng/0_0", np.uint8), ("bf16/0_0", np.uint16)]):
        changed = arrays[key].copy()
        changed[1] ^= np.array(1, dtype=dtype)
        with pytest.raises(AssertionError, match=f"1 of 3 datasets differ: \\['shard-0.h5/{key}'\\]"):
            assert_bitwise_equal(base, write(f"flip{i}", {key: changed}))
    with pytest.raises(AssertionError, match="only in one"):
        assert_bitwise_equal(base, write("extra", {"extra/0": np.zeros(1, dtype=np.uint8)}))
