"""HDF5 storage for torch.distributed.checkpoint (DCP): one HDF5 file per writing rank and a JSON index.

DCP's planners decide which rank writes which shard and, on load, which stored slice lands where, so a checkpoint
saved under one layout loads into another. This module only stores and fetches the bytes:

    <dir>/shard-<rank>.h5  one per rank that wrote something. A group per FQN (URL-quoted: "%2F" for a '/' in
                           it), a dataset per shard named by its offsets in the global tensor ("0_128"; "scalar"
                           for 0-d tensors; "bytes" for non-tensor values), shaped like the shard, with attributes
                           dtype (the torch dtype) and crc32. Datasets are contiguous by default (one write and one
                           read each, no chunk index), or chunked to chunk_bytes; HDF5 >= 1.10
                           file format, metadata in 1 MiB blocks, data 4 KiB aligned. Global sizes, dtypes and
                           which shard holds what are in index.json.
    <dir>/index.json       DCP's Metadata as JSON (no pickle), written last by the coordinator through a temporary
                           name: the checkpoint exists only once it does.

bfloat16 and float8 have no numpy type: their raw bit patterns are stored as uint16/uint8 and the `dtype` attribute
names the torch type. The shard files open with plain h5py. Non-tensor values (optimizer hyperparameters) are JSON
text: DCP's save planner pickles them in memory, the writer reads that pickle of its own process back with the
weights-only unpickler and stores JSON (uint8, dtype "json"); the reader parses the JSON and hands the planner
a fresh torch.save of the parsed value. A pickle in a file is refused, never loaded.

    dcp.save(state_dict, storage_writer=HDF5Writer(step_dir))
    dcp.load(state_dict, storage_reader=HDF5Reader(step_dir, verify="sampled"))

Both take `progress`, called with the bytes of every dataset once it is written or read (the rank's heartbeat:
a long save or load that moves bytes is not a hang; hpctrain.hang.watchdog).
"""
from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import math
import os
import pickle
import stat
import uuid
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable
from urllib.parse import quote

import h5py
import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from hpctrain.checkpoint.h5file import (
    CHUNK_BYTES,
    LOCKING,
    DatasetMaker,
    byte_ranges,
    chunk_shape,
    crc32,
    create_file,
    from_numpy,
    fsync,
    merge_ranges,
    numpy_view,
    prefetch,
)
from hpctrain.checkpoint.index import (
    BYTES_DTYPES,
    FORMAT,
    FORMAT_VERSION,
    INDEX,
    Stored,
    dtype_from_name,
    dtype_name,
    index_from_json,
    index_to_json,
    json_decode,
    json_encode,
)
from hpctrain.fsutil import write_atomic
from hpctrain.untrusted import ForeignData, Untrusted, hdf5_dataset, parse_json, read_bytes

DCP_VERSION = "1.0.0"  # what torch's own FileSystemWriter stamps on Metadata.version
VERIFY_MODES = ("full", "sampled", "none")
SAMPLE_FRACTION = 1 / 8  # share of datasets verify="sampled" checks
# an index.json larger than this is damage: ~200 bytes a stored item, so a million shards of a large job fit
MAX_INDEX_BYTES = 1 << 30


def _no_progress(nbytes: int) -> None:
    pass


class CheckpointCorrupt(Exception):
    """A checkpoint's index, file or dataset is missing, truncated, unreadable or fails its checksum."""

    def __init__(self, path: str | os.PathLike, dataset: str | None, reason: str):
        super().__init__(str(path), dataset, reason)  # args as given, so it pickles across ranks inside DCP's errors
        self.path, self.dataset, self.reason = str(path), dataset, reason

    def __str__(self) -> str:
        where = self.path if self.dataset is None else f"{self.path} dataset {self.dataset}"
        return f"corrupt checkpoint: {where}: {self.reason}"


def plain(path: Path, directory: bool = False) -> os.stat_result:
    """lstat of `path`, or CheckpointCorrupt unless it is a regular file (a directory with directory=True) and not
    a symbolic link: a checkpoint is read from a directory of its own, never through a link to somewhere else."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise CheckpointCorrupt(path, None, "missing") from None
    except OSError as e:
        raise CheckpointCorrupt(path, None, f"unreadable ({e.strerror})") from None
    if stat.S_ISLNK(st.st_mode):
        raise CheckpointCorrupt(path, None, "a symbolic link: a checkpoint and its files are read from its own "
                                            "directory, never through a link")
    if not (stat.S_ISDIR if directory else stat.S_ISREG)(st.st_mode):
        raise CheckpointCorrupt(path, None, "not a directory" if directory else "not a regular file")
    return st


def plain_directory(path: Path) -> None:
    """CheckpointCorrupt unless `path` is a directory and not a symbolic link (plain)."""
    plain(path, directory=True)


def read_checkpoint_json(path: Path, limit: int, missing: str = "missing") -> Any:
    """A checkpoint's JSON file through hpctrain.untrusted (a regular file, no link, at most `limit` bytes, nested
    at most MAX_DEPTH deep); CheckpointCorrupt naming the file otherwise (reason `missing` when it is absent)."""
    if not os.path.lexists(path):
        raise CheckpointCorrupt(path, None, missing)
    try:
        return parse_json(read_bytes(path, limit), repr(str(path)))
    except Untrusted as e:
        raise untrusted_corrupt(path, e) from None


def untrusted_corrupt(path: Path, e: Untrusted) -> CheckpointCorrupt:
    """An Untrusted refusal of a checkpoint's file as CheckpointCorrupt (its message names the file first: the
    reason is the rest)."""
    return CheckpointCorrupt(path, None, str(e).removeprefix(repr(str(path))).lstrip(": "))


class HDF5Writer(StorageWriter):
    """DCP StorageWriter: each rank writes shard-<rank>.h5; the coordinator writes index.json last."""

    def __init__(self, path: str | os.PathLike, checksum: bool = True, chunk_bytes: int = CHUNK_BYTES,
                 progress: Callable[[int], Any] = _no_progress):
        self.path, self.checksum, self.chunk_bytes = Path(path), checksum, chunk_bytes
        self.progress = progress  # told the bytes of each dataset written (from a background thread in async saves)
        self.save_id = uuid.uuid4().hex

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self.path = Path(checkpoint_id)
        self.save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not kwargs.get("use_collectives", True):
            raise ValueError("HDF5Writer needs use_collectives=True: one coordinator writes the one index.json")

    def storage_meta(self) -> StorageMeta:
        return StorageMeta(checkpoint_id=str(self.path), save_id=self.save_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self.path.mkdir(parents=True, exist_ok=True)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # Runs on the coordinator before any rank writes: whatever the directory held stops being a checkpoint.
        (self.path / INDEX).unlink(missing_ok=True)
        for old in self.path.glob("shard-*.h5"):
            old.unlink()
        return [dataclasses.replace(plan, storage_data=f"shard-{rank}.h5") for rank, plan in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        future: Future[list[WriteResult]] = Future()
        future.set_result(self._write_file(plan, planner) if plan.items else [])
        return future

    def _write_file(self, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        """Writes every item, each dataset with its crc32 computed in line (zlib-ng's vectorised crc32, small beside
        the write itself), then closes the file and flushes it once. A failed write (a full disk) raises its own
        error: every dataset is closed as soon as it is written and the metadata flushed before the file is
        closed, so no HDF5 close is left to fail (see h5file.create_file)."""
        name = plan.storage_data
        path = self.path / name
        stored = []
        f = create_file(path)
        try:
            make = DatasetMaker(f)
            for item in plan.items:
                data = planner.resolve_data(item)  # resolved one at a time: it may allocate (device -> host)
                fqn = item.index.fqn
                if item.type == WriteItemType.BYTE_IO:  # stored as JSON: a checkpoint holds no pickle
                    arr, dtype, leaf = np.frombuffer(to_json(fqn, data), dtype=np.uint8), "json", "bytes"
                else:
                    t = data.detach().to("cpu").contiguous()
                    arr, dtype = numpy_view(t), dtype_name(t.dtype)
                    leaf = "_".join(map(str, item.tensor_data.chunk.offsets)) or "scalar"
                dataset = f"/{quote(fqn, safe='')}/{leaf}"  # quote: a '/' inside an FQN is not a subgroup
                chunks = chunk_shape(arr.shape, arr.itemsize, self.chunk_bytes) if self.chunk_bytes else None
                dsid = make.dataset(dataset, arr, chunks)
                make.text_attr(dsid, "dtype", dtype)
                crc = None
                if self.checksum:
                    crc = crc32(arr)
                    make.uint32_attr(dsid, "crc32", crc)
                offset = dsid.get_offset() if chunks is None else None  # None too when nothing was stored
                dsid.close()
                self.progress(arr.nbytes)
                stored.append((item.index, Stored(name, dataset, dtype, arr.nbytes, crc, file_offset=offset,
                                                  shape=tuple(arr.shape))))
            f.flush()
        except BaseException:
            try:
                f.close()
            except Exception:  # noqa: BLE001 -- the file is abandoned, never committed; the write's error is the one
                pass
            raise
        f.close()
        fsync(path)
        size = path.stat().st_size
        return [WriteResult(index=index, size_in_bytes=s.nbytes, storage_data=dataclasses.replace(s, file_bytes=size))
                for index, s in stored]

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.version = DCP_VERSION
        metadata.storage_data = {r.index: r.storage_data for rank_results in results for r in rank_results}
        metadata.storage_meta = self.storage_meta()
        # the commit: readers see the whole index or none. Its directory's fsync makes the rename and every rank's
        # new shard file durable. json.dumps, not json.dump: one write instead of one per token.
        write_atomic(self.path / INDEX, json.dumps(index_to_json(metadata, self.checksum), separators=(",", ":")))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return "://" not in str(checkpoint_id)


class HDF5Reader(StorageReader):
    """DCP StorageReader for HDF5Writer checkpoints.

    verify: "full" checks the crc32 of every dataset this rank reads (reading the whole dataset even when only a
    slice is wanted), "sampled" only those `verifies()` picks, "none" none. File sizes are checked in every mode.
    """

    def __init__(self, path: str | os.PathLike, verify: str = "full", progress: Callable[[int], Any] = _no_progress):
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify={verify!r}; expected one of {', '.join(VERIFY_MODES)}")
        self.path, self.verify = Path(path), verify
        self.progress = progress  # told the bytes of each dataset read
        self.storage_data: dict[MetadataIndex, Stored] = {}
        self.save_id = ""
        self.load_id = uuid.uuid4().hex
        self._prefetch_started: set[str] = set()  # file + dataset names prepare_local_plan already read ahead

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self.path = Path(checkpoint_id)
        self.storage_data, self.load_id, self._prefetch_started = {}, uuid.uuid4().hex, set()

    # No **kwargs: DCP would then fall back to per-rank metadata files, which this format never writes.
    def read_metadata(self) -> Metadata:
        index = self.path / INDEX
        plain_directory(self.path)
        doc = read_checkpoint_json(index, MAX_INDEX_BYTES, missing="missing: the save never finished")
        if not isinstance(doc, dict) or (doc.get("format"), doc.get("format_version")) != (FORMAT, FORMAT_VERSION):
            got = (doc.get("format"), doc.get("format_version")) if isinstance(doc, dict) else type(doc).__name__
            raise CheckpointCorrupt(index, None, f"format {got}, this reader reads {FORMAT!r} version {FORMAT_VERSION}")
        try:
            metadata = index_from_json(doc)
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as e:
            raise CheckpointCorrupt(index, None, f"malformed: {e}") from None
        metadata.storage_meta.load_id = self.load_id
        self.save_id = metadata.storage_meta.save_id or ""
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data
        self.save_id = metadata.storage_meta.save_id or ""

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """This rank's reads are known here, before the planners' collective: the disk starts on them now."""
        self._prefetch_started = self._start_prefetch(plan)
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def _start_prefetch(self, plan: LoadPlan) -> set[str]:
        """Asks the kernel, from a thread, to read ahead the byte ranges index.json records for this plan's
        datasets; returns the datasets covered. Chunked datasets have no recorded range: read_data locates them."""
        ranges: dict[str, set[tuple[int, int]]] = defaultdict(set)
        covered = set()
        for req in plan.items:
            s = self.storage_data[req.storage_index]
            if s.file_offset is not None:
                ranges[s.file].add((s.file_offset, s.nbytes))
                covered.add(s.file + s.dataset)
        if ranges:
            prefetcher = ThreadPoolExecutor(1, thread_name_prefix="hpctrain-prefetch")
            for name, rs in ranges.items():
                prefetcher.submit(prefetch, self.path / name, merge_ranges(rs))
            prefetcher.shutdown(wait=False)  # its work is queued; nothing waits for a hint
        return covered

    def verifies(self, file: str, dataset: str) -> bool:
        """Whether read_data checks this dataset's crc32. "sampled" hashes the names with the save id: the same
        subset on every rank and every load of one checkpoint, a different subset for the next checkpoint."""
        if self.verify == "sampled":
            # a cryptographic hash, not crc32: crc32 is linear, so names that differ in a digit or two land
            # together, and a sample drawn with it held 0 to 38 of 128 datasets instead of ~16
            digest = hashlib.blake2b(f"{self.save_id}/{file}{dataset}".encode(), digest_size=8).digest()
            return int.from_bytes(digest, "big") < SAMPLE_FRACTION * 2**64
        return self.verify == "full"

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_file: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
        for req in plan.items:
            stored = self.storage_data[req.storage_index]
            by_file[stored.file][stored.dataset].append((req, stored))
        started = self._prefetch_started
        with ThreadPoolExecutor(1) as prefetcher:
            for name, by_dataset in by_file.items():
                with self.open_file(name, next(iter(by_dataset.values()))[0][1].file_bytes) as f:
                    opened = [(open_stored(f, self.path, items[0][1]), items) for items in by_dataset.values()]
                    rest = [dsid for dsid, items in opened if name + items[0][1].dataset not in started]
                    if rest:  # chunked datasets, or checkpoints whose index.json records no offsets
                        prefetcher.submit(prefetch, self.path / name, byte_ranges(rest))
                    for dsid, items in opened:
                        self._read_dataset(dsid, items[0][1], [req for req, _ in items], planner)
                        self.progress(items[0][1].nbytes)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def open_file(self, name: str, file_bytes: int) -> h5py.File:
        """The checkpoint's file `name` (relative to the checkpoint directory), opened read-only; the caller closes
        it. Raises CheckpointCorrupt when the checkpoint directory or the file is a symbolic link, the file is
        missing or not a regular file, its size is not file_bytes (index.json's record), or it is not a readable
        HDF5 file."""
        plain_directory(self.path)
        path = self.path / name
        st = plain(path)
        if st.st_size != file_bytes:
            raise CheckpointCorrupt(path, None, f"{st.st_size} bytes, index.json says {file_bytes}: truncated or "
                                                f"overwritten")
        try:
            f = h5py.File(path, "r", locking=LOCKING)
        except OSError as e:
            raise CheckpointCorrupt(path, None, f"not a readable HDF5 file ({e})") from e
        # HDF5 opens by name: the file it opened must be the one looked at above, not a link put there since
        opened = os.fstat(f.id.get_vfd_handle())
        if (opened.st_dev, opened.st_ino) != (st.st_dev, st.st_ino):
            f.close()
            raise CheckpointCorrupt(path, None, "replaced while it was opened")
        return f

    def _read_dataset(self, dsid: h5py.h5d.DatasetID, stored: Stored, reqs: list, planner: LoadPlanner) -> None:
        where = (self.path / stored.file, stored.dataset)
        unchecked = stored.crc32 is not None and self.verifies(stored.file, stored.dataset)
        whole = None  # the full stored array, read at most once
        for req in reqs:
            target, filled = None, False
            if req.type == LoadItemType.TENSOR:
                target = planner.resolve_tensor(req).detach()
                assert target.shape == torch.Size(req.lengths), (req, target.shape)
                if whole is None and _fits(target, dsid.shape, stored.dtype):
                    whole, filled = numpy_view(target), True  # common case: read straight into the destination
                    read_stored(dsid, where, out=whole)
            if whole is None and (unchecked or target is None):
                whole = read_stored(dsid, where)
            if unchecked:  # before use: the planner unpickles bytes items; tensors are committed below
                check_crc32(crc32(whole), stored, where)
                unchecked = False
            if target is None:  # a JSON value, parsed here; the planner gets it as the torch.save bytes it expects
                planner.load_bytes(req, from_json(whole.tobytes(), where))
                continue
            if not filled:
                select = tuple(slice(o, o + n) for o, n in zip(req.storage_offsets, req.lengths))
                if whole is None:
                    arr = read_stored(dsid, where, select)  # only the slice this rank needs
                else:
                    arr = whole[select] if select else whole
                target.copy_(from_numpy(arr, dtype_from_name(stored.dtype)))
            planner.commit_tensor(req, target)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return Path(checkpoint_id, INDEX).is_file()


def check_crc32(got: int, stored: Stored, where: tuple[Path, str]) -> None:
    """Raises CheckpointCorrupt at `where` (file path, dataset) unless `got`, the crc32 of the bytes read, is the
    one index.json recorded for them (stored.crc32; callers skip the check when that is None)."""
    if got != stored.crc32:
        raise CheckpointCorrupt(*where, f"crc32 {got:#010x}, saved as {stored.crc32:#010x}")


def _fits(target: torch.Tensor, shape: tuple[int, ...], dtype: str) -> bool:
    """Whether the stored dataset can be read into target's memory as is."""
    return (target.device.type == "cpu" and target.is_contiguous() and dtype_name(target.dtype) == dtype
            and tuple(target.shape) == tuple(shape) and target.numel() > 0)


def open_stored(f: h5py.File, ckpt: Path, stored: Stored) -> h5py.h5d.DatasetID:
    """The stored dataset, opened through h5py's low-level API (a third of the high-level lookup's cost), checked
    to hold its bytes in its own file (hard links only on its path, contiguous or chunked, no external storage, no
    filter: untrusted.hdf5_dataset) and to hold the bytes index.json says it does. Every reader of a checkpoint's
    datasets opens them here, before reading any of their bytes."""
    where = (ckpt / stored.file, stored.dataset)
    try:
        dsid = hdf5_dataset(f, stored.dataset, str(where[0]))
    except KeyError:
        raise CheckpointCorrupt(*where, "missing from the file") from None
    except ForeignData as e:
        raise CheckpointCorrupt(*where, e.reason) from None
    nbytes = math.prod(dsid.shape) * dsid.dtype.itemsize
    if nbytes != stored.nbytes:
        raise CheckpointCorrupt(*where, f"{nbytes} bytes, index.json says {stored.nbytes}")
    if stored.shape is not None and tuple(dsid.shape) != tuple(stored.shape):
        raise CheckpointCorrupt(*where, f"shape {list(dsid.shape)}, index.json says {list(stored.shape)}")
    want = np.dtype(np.uint8) if stored.dtype in BYTES_DTYPES else numpy_view(torch.empty(0, dtype=dtype_from_name(
        stored.dtype))).dtype
    if dsid.dtype != want:
        raise CheckpointCorrupt(*where, f"stored as {dsid.dtype}, index.json's {stored.dtype} needs {want}")
    if stored.dtype == "bytes":
        raise CheckpointCorrupt(*where, "a pickled value (hpctrain <= 0.3 or crafted): never unpickled; only JSON "
                                        "values load")
    return dsid


def to_json(fqn: str, data: io.BytesIO) -> bytes:
    """A non-tensor value as JSON. DCP's save planner hands it over as torch.save bytes made in this process from
    the live state dict; they are read back with the weights-only unpickler (plain values only) and re-encoded."""
    try:
        value = torch.load(io.BytesIO(data.getvalue()), weights_only=True)
        return json.dumps(json_encode(value), separators=(",", ":")).encode("utf-8")
    except (TypeError, pickle.UnpicklingError) as e:
        raise TypeError(f"{fqn}: a checkpoint holds tensors and JSON values only ({e})") from None


def from_json(raw: bytes, where: tuple[Path, str]) -> io.BytesIO:
    """A stored JSON value, as the torch.save bytes DCP's load planners read: made here from the parsed JSON
    (plain values only), so nothing that came from the file is ever unpickled."""
    try:
        value = json_decode(parse_json(raw, "the stored value"))  # depth bounded, no lone surrogate
    except (ValueError, TypeError, RecursionError) as e:  # Untrusted is a ValueError
        raise CheckpointCorrupt(*where, f"not a JSON value ({e}); refused unread") from None
    buf = io.BytesIO()
    torch.save(value, buf)
    buf.seek(0)
    return buf


def read_stored(dsid: h5py.h5d.DatasetID, where: tuple[Path, str], select: tuple = (),
          out: np.ndarray | None = None) -> np.ndarray:
    """The whole dataset (into `out` when given: C-contiguous, of its shape and dtype), or the slice `select`, as
    stored (raw bits for bfloat16 and float8). A read error (damaged chunk or B-tree) raises CheckpointCorrupt at
    `where` (file path, dataset)."""
    try:
        if select:
            return h5py.Dataset(dsid)[select]
        if out is None:
            out = np.empty(dsid.shape, dsid.dtype)
        if out.size:
            dsid.read(h5py.h5s.ALL, h5py.h5s.ALL, out)
        return out
    except (OSError, RuntimeError) as e:  # what h5py raises for damaged chunks and B-trees
        raise CheckpointCorrupt(*where, f"unreadable ({e})") from e
