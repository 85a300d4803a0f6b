"""A checkpoint directory on disk, and the checks that decide whether one may be loaded. Nothing read here is
trusted: every file is parsed as JSON or HDF5 (never unpickled) and read from the directory itself (no symbolic
links; HDF5 datasets only from their own file: hdf5_storage.open_stored), sizes, shapes, dtypes and checksums are
compared with what the commit recorded, and every problem is a CheckpointCorrupt naming the file.

    <checkpoints>/step_00000042/            one committed checkpoint (8 or more digits, no extra leading zeros)
        shard-<rank>.h5, index.json         hdf5_storage.py
        train_state.json                    the trainer's small control state (JSON); its world_size sizes the
                                            RNG table a load allocates, so it may not exceed what the shards hold
        COMMITTED                           written last: {"step", "seq", "files": {name: crc32}, provenance...}
    step_00000042.partial/                  a save in flight, or one that was killed: never counts
    step_00000042.old/                      a checkpoint being replaced by a new save of its step
    step_00000042.unusable[-N]/             set aside after a load refused it; UNUSABLE.txt says why

`seq` in the marker is the commit order: the newest checkpoint is the one committed last, not the highest step.
"""
from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from hpctrain.checkpoint.h5file import crc32
from hpctrain.checkpoint.hdf5_storage import (
    INDEX,
    MAX_INDEX_BYTES,
    CheckpointCorrupt,
    HDF5Reader,
    check_crc32,
    open_stored,
    plain_directory,
    read_checkpoint_json,
    read_stored,
    untrusted_corrupt,
)
from hpctrain.checkpoint.index import SHARD_NAME, Stored
from hpctrain.checkpoint.names import (  # noqa: F401 (the names' users import them from here too)
    EXTRA,
    MARKER,
    MARKER_VERSION,
    MAX_JSON_BYTES,
    UNUSABLE,
    parse_name,
    step_name,
)
from hpctrain.checkpoint.state import rng_table_bytes
from hpctrain.untrusted import Untrusted, read_bytes

_SMALL_TABLE = 64 << 20  # an RNG table this small (13,000 ranks) is allocated without looking at the shards


def file_crc(path: Path) -> int:
    """crc32 of a checkpoint's JSON file (a regular file, no link, index.json's size bound); Untrusted otherwise."""
    import numpy as np
    return crc32(np.frombuffer(read_bytes(path, MAX_INDEX_BYTES), dtype=np.uint8))


def read_json(path: Path) -> Any:
    """A small JSON file of a checkpoint (through hpctrain.untrusted: no link, size and depth bound), as
    CheckpointCorrupt when missing, a link, huge, too deep or malformed."""
    return read_checkpoint_json(path, MAX_JSON_BYTES)


def read_marker(ckpt: Path) -> dict[str, Any]:
    """The COMMITTED marker, checked: its step matches the directory's, seq and checksums are present."""
    path = ckpt / MARKER
    plain_directory(ckpt)  # what a link would lead to is no checkpoint of this directory
    marker = read_json(path)
    parsed = parse_name(ckpt.name)
    if not isinstance(marker, dict):
        raise CheckpointCorrupt(path, None, "not a JSON object")
    step, seq, files = marker.get("step"), marker.get("seq"), marker.get("files")
    if type(step) is not int or (parsed is not None and parsed[0] != step):
        raise CheckpointCorrupt(path, None, f"step {step!r} in a directory named {ckpt.name}")
    if type(seq) is not int or not isinstance(files, dict) or not all(
            type(files.get(k)) is int for k in (EXTRA, INDEX)):
        raise CheckpointCorrupt(path, None, f"no commit sequence or checksums (marker version "
                                            f"{marker.get('marker_version', 1)!r}, this reader needs {MARKER_VERSION})")
    return marker


def marker_seq(ckpt: Path) -> int | None:
    """The commit order of a checkpoint, None when its marker is unusable."""
    try:
        return read_marker(ckpt)["seq"]
    except CheckpointCorrupt:
        return None


def read_committed(ckpt: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(marker, train state) of a committed checkpoint, after checking train_state.json and index.json against the
    checksums the commit recorded and that the train state names the marker's step."""
    marker = read_marker(ckpt)
    for name in (EXTRA, INDEX):
        try:
            got = file_crc(ckpt / name)
        except Untrusted as e:
            raise untrusted_corrupt(ckpt / name, e) from None
        if got != marker["files"][name]:
            raise CheckpointCorrupt(ckpt / name, None, f"crc32 {got:#010x}, committed as {marker['files'][name]:#010x}")
    extra = read_json(ckpt / EXTRA)
    if not isinstance(extra, dict) or extra.get("step") != marker["step"]:
        raise CheckpointCorrupt(ckpt / EXTRA, None, f"step {extra.get('step') if isinstance(extra, dict) else extra!r}"
                                                    f", the marker says {marker['step']}")
    world = extra.get("world_size")
    if type(world) is int:
        # a load allocates the saved world's RNG table before it reads a byte (state.rng_table): a number read
        # sizes nothing larger than the shard files that must hold that table (beyond a size harmless anywhere,
        # so a missing or linked shard is reported by the data check, which names it)
        need, held = rng_table_bytes(world), shard_bytes(ckpt)
        if need > max(held, _SMALL_TABLE):
            raise CheckpointCorrupt(ckpt / EXTRA, None, f"world_size {world} needs an RNG table of {need} bytes; "
                                                        f"the shard files hold {held}")
    return marker, extra


def shard_bytes(ckpt: Path) -> int:
    """Bytes of the regular files named shard-<rank>.h5 in the checkpoint directory (links not followed)."""
    total = 0
    with os.scandir(ckpt) as entries:
        for e in entries:
            if SHARD_NAME.fullmatch(e.name) and e.is_file(follow_symlinks=False):
                total += e.stat(follow_symlinks=False).st_size
    return total


@dataclass
class Verdict:
    problems: list[str] = field(default_factory=list)
    num_datasets: int = 0
    num_hashed: int = 0
    bytes_hashed: int = 0
    unchecksummed: int = 0  # datasets saved without a crc32 (HDF5Writer(checksum=False))


def verify_data(ckpt: Path, mode: str = "full", share: tuple[int, int] = (0, 1), v: Verdict | None = None,
                progress: Callable[[int], Any] = lambda nbytes: None) -> Verdict:
    """index.json, then every dataset of the shard files in this share (files i with i % share[1] == share[0]):
    present, of the indexed size, shape and dtype, a JSON value where one is stored, and in mode "full" (every
    dataset) or "sampled" (the subset a sampled load checks) of the committed crc32. Problems are collected.
    progress(nbytes) is told of every dataset checked (the bytes it read: 0 when it only looked)."""
    v = v or Verdict()
    reader = HDF5Reader(ckpt, verify=mode)
    try:
        md = reader.read_metadata()
    except CheckpointCorrupt as e:
        v.problems.append(str(e))
        return v
    by_file: dict[str, list[Stored]] = defaultdict(list)
    for s in md.storage_data.values():
        by_file[s.file].append(s)
    for i, (name, items) in enumerate(sorted(by_file.items())):
        if i % share[1] != share[0]:
            continue
        v.num_datasets += len(items)
        try:
            f = reader.open_file(name, items[0].file_bytes)  # checks presence and size first
        except CheckpointCorrupt as e:
            v.problems.append(f"{e} ({len(items)} datasets not checked)")
            continue
        with f:
            for s in items:
                read = v.bytes_hashed
                try:
                    _verify_dataset(f, ckpt, s, reader.verifies(s.file, s.dataset), v)
                except CheckpointCorrupt as e:
                    v.problems.append(str(e))
                progress(v.bytes_hashed - read)
    return v


def _verify_dataset(f, ckpt: Path, s: Stored, hash_it: bool, v: Verdict) -> None:
    from hpctrain.checkpoint.hdf5_storage import from_json
    where = (ckpt / s.file, s.dataset)
    dsid = open_stored(f, ckpt, s)  # size, shape and dtype against the index; pickles refused
    if s.crc32 is None:
        v.unchecksummed += 1
        hash_it = False
    if hash_it or s.dtype == "json":
        arr = read_stored(dsid, where)
        if hash_it:
            check_crc32(crc32(arr), s, where)
            v.num_hashed += 1
            v.bytes_hashed += s.nbytes
        if s.dtype == "json":
            from_json(arr.tobytes(), where)
