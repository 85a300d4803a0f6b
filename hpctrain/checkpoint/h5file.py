"""The bytes of one HDF5 shard file, below DCP: the file layout options, torch tensors as numpy (bit patterns for
dtypes numpy lacks), crc32 checksums, dataset chunking, fsync, and read-ahead of the byte ranges a load needs.
hdf5_storage.py builds DCP's StorageWriter and StorageReader on these."""
from __future__ import annotations

import math
import os
import zlib
from pathlib import Path

import h5py
import numpy as np
import torch

# 0: contiguous datasets. Side by side here (2 ranks, 0.99 GB, fsync), contiguous wrote at 0.84-0.90 of a raw
# file write and 4 MiB chunks at 0.58-0.61; 64 MiB and 1 GiB chunks were slower still.
CHUNK_BYTES = 0
# Metadata aggregated into 1 MiB blocks instead of scattered small writes; datasets of 64 KiB or more start on a
# 4 KiB boundary; the HDF5 1.10 format (readable by HDF5 1.10 and later), the newest the library offers above it.
FILE_OPTIONS = {"libver": ("v110", "latest"), "meta_block_size": 1 << 20, "alignment_threshold": 65536,
                "alignment_interval": 4096}
# One writer per file and no reader before the commit, so HDF5's file locks guard nothing here; they also fail on
# Lustre or NFS mounts without flock ("unable to lock file").
LOCKING = False

# torch dtypes numpy lacks: stored as their bit pattern in the unsigned integer type of the same width
RAW_DTYPES = {torch.bfloat16: torch.uint16, torch.float8_e4m3fn: torch.uint8, torch.float8_e5m2: torch.uint8}


def numpy_view(t: torch.Tensor) -> np.ndarray:
    """The tensor's memory as numpy (bit patterns for dtypes numpy lacks); t must be a CPU tensor."""
    raw = RAW_DTYPES.get(t.dtype)
    return (t.view(raw) if raw is not None else t).numpy()


def from_numpy(arr: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    t = torch.from_numpy(arr)
    return t.view(dtype) if dtype in RAW_DTYPES else t


def crc32(arr: np.ndarray) -> int:
    return zlib.crc32(arr.reshape(-1).view(np.uint8))


def chunk_shape(shape: tuple[int, ...], itemsize: int, chunk_bytes: int) -> tuple[int, ...] | None:
    """Whole trailing dims, as many leading rows as fit in chunk_bytes. Scalars and empty arrays are contiguous."""
    if not shape or 0 in shape:
        return None
    chunk, target = list(shape), max(1, chunk_bytes // itemsize)
    for dim in range(len(shape)):
        if math.prod(chunk) <= target:
            break
        rows = max(1, target // math.prod(shape[dim + 1:]))
        # equal chunks: a short last chunk is still stored at full size (1408 rows in 1024-row chunks took 23%
        # more disk than data), so split the dim evenly instead
        chunk[dim] = math.ceil(shape[dim] / math.ceil(shape[dim] / rows))
    return tuple(chunk)


def fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)  # a read-only descriptor flushes files and directories alike on Linux
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def byte_ranges(f: h5py.File, datasets: list[str]) -> list[tuple[int, int]]:
    """(offset, length) in the file of the datasets' data, neighbours merged; what cannot be located is left out
    (the read then finds it, or reports it corrupt)."""
    ranges = []
    for name in datasets:
        try:
            dsid = f[name].id
            if f[name].chunks is None:
                offset = dsid.get_offset()
                if offset is not None:
                    ranges.append((offset, dsid.get_storage_size()))
            else:
                for i in range(dsid.get_num_chunks()):
                    info = dsid.get_chunk_info(i)
                    ranges.append((info.byte_offset, info.size))
        except (KeyError, OSError, RuntimeError):
            continue
    merged: list[list[int]] = []
    for offset, length in sorted(ranges):
        if merged and offset <= merged[-1][0] + merged[-1][1] + (1 << 20):  # gaps under 1 MiB: read through
            merged[-1][1] = max(merged[-1][1], offset + length - merged[-1][0])
        else:
            merged.append([offset, length])
    return [(o, n) for o, n in merged]


def prefetch(path: Path, ranges: list[tuple[int, int]]) -> None:
    """Asks the kernel to start reading these ranges now (posix_fadvise WILLNEED), so the disk streams ahead while
    HDF5 reads dataset by dataset. A hint only: errors are ignored."""
    if not hasattr(os, "posix_fadvise"):
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        for offset, length in ranges:
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
    except OSError:
        pass
    finally:
        os.close(fd)
