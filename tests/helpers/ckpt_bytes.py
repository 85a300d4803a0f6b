"""Checkpoint bytes: the tensors workers/hdf5_worker.py saves and loads, a flipped byte in a shard, and the
bitwise comparison of two checkpoints' stored datasets read with plain h5py.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.tensor import Replicate, Shard

# name -> (shape, dtype, placement saved, placement loaded): the tensors of workers/hdf5_worker.py
LAYOUTS = {
    "w": ((8, 6), torch.float32, Shard(0), Shard(1)),
    "uneven": ((5, 3), torch.float32, Shard(0), Shard(1)),  # 3+2 rows saved, 2+1 columns loaded
    "bf": ((4, 6), torch.bfloat16, Shard(1), Shard(0)),
    "rep": ((3,), torch.float32, Replicate(), Shard(0)),
}


def reference() -> dict:
    """The full tensors every rank of workers/hdf5_worker.py (and the test process) builds alike."""
    gen = torch.Generator().manual_seed(1234)
    full = {name: torch.randn(shape, generator=gen).to(dtype) for name, (shape, dtype, _, _) in LAYOUTS.items()}
    return {"tensors": full, "step": torch.tensor(5), "meta": {"epoch": 2, "name": "run"}}


def flip_a_byte(ckpt: Path) -> None:
    """Flips one byte inside the data of the token embedding in a checkpoint's first shard."""
    import h5py

    shard = next(ckpt.glob("shard-*.h5"))
    with h5py.File(shard) as f:
        ds = f["model.tok_embeddings.weight"]["0_0"]
        offset = ds.id.get_offset() if ds.chunks is None else ds.id.get_chunk_info(0).byte_offset
    with shard.open("r+b") as fh:
        fh.seek(offset + 100)
        b = fh.read(1)
        fh.seek(offset + 100)
        fh.write(bytes([b[0] ^ 0xFF]))


def stored_datasets(ckpt: Path) -> dict[str, tuple]:
    """Every dataset of a checkpoint's shard files, whatever its dtype (float, uint8 RNG tables and JSON, bf16 bit
    patterns as uint16): "<shard>/<dataset>" -> (numpy dtype, shape, raw bytes, attributes), read with plain h5py."""
    import h5py
    import numpy as np

    out = {}

    def visit(name: str, obj) -> None:
        if isinstance(obj, h5py.Dataset):
            attrs = tuple(sorted((k, str(v)) for k, v in obj.attrs.items()))
            out[f"{shard.name}/{name}"] = (obj.dtype.str, obj.shape, np.asarray(obj[()]).tobytes(), attrs)
    for shard in sorted(ckpt.glob("*.h5")):
        with h5py.File(shard) as f:
            f.visititems(visit)
    return out


def assert_bitwise_equal(a: dict[str, tuple], b: dict[str, tuple]) -> None:
    """Two stored_datasets results: the same dataset names, each with the same dtype, shape, bytes and attributes."""
    assert a, "no datasets: a comparison of nothing would pass"
    assert a.keys() == b.keys(), f"only in one: {sorted(a.keys() ^ b.keys())}"
    differ = [k for k in a if a[k] != b[k]]
    assert not differ, f"{len(differ)} of {len(a)} datasets differ: {differ[:10]}"
