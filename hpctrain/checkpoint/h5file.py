"""The bytes of one HDF5 shard file, below DCP: the file layout options, torch tensors as numpy (bit patterns for
dtypes numpy lacks), crc32 checksums, dataset chunking, dataset creation through h5py's low-level API, fsync, and
read-ahead of the byte ranges a load needs. hdf5_storage.py builds DCP's StorageWriter and StorageReader on these."""
from __future__ import annotations

import math
import os
from pathlib import Path

import h5py
import numpy as np
import torch

try:  # the same CRC-32 as zlib's, computed with carry-less multiply: 30 GB/s on one core here against zlib's 4
    from zlib_ng import zlib_ng as _zlib
except ImportError:  # platforms without a zlib-ng wheel: identical values, only slower
    import zlib as _zlib

# 0: contiguous datasets. Side by side here (2 ranks, 0.99 GB, fsync), contiguous wrote at 0.84-0.90 of a raw
# file write and 4 MiB chunks at 0.58-0.61; 64 MiB and 1 GiB chunks were slower still.
CHUNK_BYTES = 0
# One writer per file and no reader before the commit, so HDF5's file locks guard nothing here; they also fail on
# Lustre or NFS mounts without flock ("unable to lock file").
LOCKING = False

# torch dtypes numpy lacks: stored as their bit pattern in the unsigned integer type of the same width
RAW_DTYPES = {torch.bfloat16: torch.uint16, torch.float8_e4m3fn: torch.uint8, torch.float8_e5m2: torch.uint8}


def plain(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor inside a wrapper subclass that holds one of the same shape and dtype (torchao's float8
    weights under FSDP's float8 all-gather keep their fp32 values so); other tensors as they are."""
    while type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        inner = getattr(t, names[0], None) if names else None
        if not isinstance(inner, torch.Tensor) or inner.shape != t.shape or inner.dtype != t.dtype:
            break
        t = inner
    return t


def numpy_view(t: torch.Tensor) -> np.ndarray:
    """The tensor's memory as numpy (bit patterns for dtypes numpy lacks); t must be a CPU tensor (or a wrapper of
    one, plain())."""
    t = plain(t)
    raw = RAW_DTYPES.get(t.dtype)
    return (t.view(raw) if raw is not None else t).numpy()


def from_numpy(arr: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    t = torch.from_numpy(arr)
    return t.view(dtype) if dtype in RAW_DTYPES else t


def crc32(arr: np.ndarray) -> int:
    """CRC-32 (zlib's polynomial and values) of the array's bytes."""
    return _zlib.crc32(arr.reshape(-1).view(np.uint8))


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


def create_file(path: Path) -> h5py.File:
    """A new shard file (replacing any of that name), open for writing. Metadata is aggregated into 1 MiB blocks
    instead of scattered small writes; datasets of 64 KiB or more start on a 4 KiB boundary; the HDF5 1.10 format
    (readable by HDF5 1.10 and later), the newest the library offers above it; no timestamps.

    Raw data is not buffered: with HDF5's sieve buffer (64 KiB) and chunk cache (1 MiB) a small write waits in
    memory until its dataset is closed, so a write that fails (ENOSPC on a full disk) fails the close instead.
    HDF5 leaves such a dataset half torn down, and releasing it again -- h5py on garbage collection, HDF5 itself
    at process exit -- crashed the process with SIGSEGV. Unbuffered, each write reaches the file inside H5Dwrite,
    which raises a plain OSError; the writer writes each dataset once, whole, so the buffers saved nothing."""
    fapl = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
    fapl.set_libver_bounds(h5py.h5f.LIBVER_V110, h5py.h5f.LIBVER_LATEST)
    fapl.set_meta_block_size(1 << 20)
    fapl.set_alignment(65536, 4096)
    fapl.set_file_locking(LOCKING, False)
    fapl.set_sieve_buf_size(0)
    mdc_nelmts, _, _, _ = fapl.get_cache()
    fapl.set_cache(mdc_nelmts, 0, 0, 1.0)  # no chunk cache: chunks reach the file inside H5Dwrite too
    fcpl = h5py.h5p.create(h5py.h5p.FILE_CREATE)
    fcpl.set_obj_track_times(False)
    return h5py.File(h5py.h5f.create(os.fsencode(path), h5py.h5f.ACC_TRUNC, fapl=fapl, fcpl=fcpl))


class DatasetMaker:
    """Creates datasets and their attributes through h5py's low-level API, with the property lists made once per
    file. For 243 small datasets with 2 attributes each this took 44 ms where h5py's high-level create_dataset and
    attrs took 145 ms: with 4 ranks on 2 cores that CPU showed in every save. Datasets carry no timestamps, so
    equal states give equal files."""

    def __init__(self, f: h5py.File):
        self.fid = f.id
        self.lcpl = h5py.h5p.create(h5py.h5p.LINK_CREATE)
        self.lcpl.set_create_intermediate_group(True)  # "/<fqn>/<leaf>": the group comes with its first dataset
        self.dcpl = self._dcpl(None)
        self.scalar = h5py.h5s.create(h5py.h5s.SCALAR)
        self.text = h5py.string_dtype()  # variable-length UTF-8: plain h5py reads it back as str
        self.text_file, self.text_mem = h5py.h5t.py_create(self.text, logical=True), h5py.h5t.py_create(self.text)

    @staticmethod
    def _dcpl(chunks: tuple[int, ...] | None):
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_obj_track_times(False)
        if chunks is None:
            dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)  # every element is written at once
        else:
            # FILL_TIME_IFSET writes no fill either (no fill value is set). With NEVER, HDF5 2.0 without a chunk
            # cache (create_file) left datasets of one chunk unwritten: they read back as zeros
            dcpl.set_fill_time(h5py.h5d.FILL_TIME_IFSET)
            dcpl.set_chunk(chunks)
        return dcpl

    def dataset(self, name: str, arr: np.ndarray, chunks: tuple[int, ...] | None = None):
        """Creates dataset `name` (intermediate groups included) holding arr; returns its low-level id."""
        space = h5py.h5s.create_simple(arr.shape) if arr.ndim else self.scalar
        dcpl = self.dcpl if chunks is None else self._dcpl(chunks)
        dsid = h5py.h5d.create(self.fid, name.encode(), h5py.h5t.py_create(arr.dtype), space, dcpl=dcpl,
                               lcpl=self.lcpl)
        if arr.size:
            dsid.write(h5py.h5s.ALL, h5py.h5s.ALL, np.ascontiguousarray(arr))
        return dsid

    def text_attr(self, obj, key: str, value: str) -> None:
        attr = h5py.h5a.create(obj, key.encode(), self.text_file, self.scalar)
        attr.write(np.asarray(value, dtype=self.text), mtype=self.text_mem)

    def uint32_attr(self, obj, key: str, value: int) -> None:
        attr = h5py.h5a.create(obj, key.encode(), h5py.h5t.STD_U32LE, self.scalar)
        attr.write(np.asarray(value, dtype=np.uint32))


def fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)  # a read-only descriptor flushes files and directories alike on Linux
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def byte_ranges(datasets: list[h5py.h5d.DatasetID]) -> list[tuple[int, int]]:
    """(offset, length) in the file of the datasets' data, neighbours merged; what cannot be located is left out
    (the read then finds it, or reports it corrupt)."""
    ranges = []
    for dsid in datasets:
        try:
            if dsid.get_create_plist().get_layout() != h5py.h5d.CHUNKED:
                offset = dsid.get_offset()
                if offset is not None:
                    ranges.append((offset, dsid.get_storage_size()))
            else:
                for i in range(dsid.get_num_chunks()):
                    info = dsid.get_chunk_info(i)
                    ranges.append((info.byte_offset, info.size))
        except (OSError, RuntimeError):
            continue
    return merge_ranges(ranges)


def merge_ranges(ranges) -> list[tuple[int, int]]:
    """(offset, length) pairs sorted, with overlapping ones and those less than 1 MiB apart merged."""
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
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)  # a link is refused by the read itself: no hint for it
    except OSError:
        return
    try:
        for offset, length in ranges:
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
    except OSError:
        pass
    finally:
        os.close(fd)
