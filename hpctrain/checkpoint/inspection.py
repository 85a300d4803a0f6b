"""Checkpoints seen from a login node, with no process group: describe one, verify its bytes, export its model as
one safetensors file for inference. What `hpctrain ckpt ...` runs (`ckpt ls`, without torch: listing.py).

    hpctrain ckpt ls runs/tiny-cpu-20261122-025518-a740f3          # or its checkpoints/ directory (listing.py)
    hpctrain ckpt inspect runs/.../checkpoints/step_00000004 [--json]
    hpctrain ckpt verify runs/.../checkpoints/step_00000004 [--full|--sampled]
    hpctrain ckpt export runs/.../checkpoints/step_00000004 --to safetensors [-o model.safetensors]
    hpctrain ckpt export runs/.../checkpoints/step_00000004 --format hf --out DIR   # checkpoint/hf.py

A run directory in place of a step directory means its newest committed checkpoint. Everything is read from
index.json (JSON, no pickle), train_state.json, the COMMITTED marker and the HDF5 datasets themselves.
"""
from __future__ import annotations

import json
import struct
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from hpctrain.checkpoint.h5file import crc32
from hpctrain.checkpoint.hdf5_storage import (
    INDEX,
    CheckpointCorrupt,
    HDF5Reader,
    Stored,
    check_crc32,
    open_stored,
    read_stored,
)
from hpctrain.checkpoint.layout import EXTRA, MARKER, Verdict, parse_name, read_committed, verify_data
from hpctrain.checkpoint.listing import checkpoint_root, format_layout, human_bytes, json_or_none
from hpctrain.checkpoint.manager import committed
from hpctrain.fsutil import replacing

MODEL_PREFIX = "model."  # the model's entries in a training checkpoint (train.py's state: model, optimizer, rng)
# torch dtype name -> safetensors dtype (https://huggingface.co/docs/safetensors, "Format")
SAFETENSORS_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2", "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint64": "U64",
    "uint32": "U32", "uint16": "U16", "uint8": "U8", "bool": "BOOL",
}


# -- inspect ----------------------------------------------------------------------------------------------------

def resolve(path: Path) -> Path:
    """A step directory as given, or the newest committed checkpoint of a run or checkpoints directory."""
    if parse_name(path.name) or (path / INDEX).is_file():
        return path
    done = committed(checkpoint_root(path))
    if not done:
        raise ValueError(f"{path} is not a checkpoint (no {INDEX}) and holds no committed checkpoint")
    return done[-1][1]


def read_index(ckpt: Path) -> tuple[HDF5Reader, Metadata]:
    """index.json through the loader's own reader (format checked, no pickle); CheckpointCorrupt if unusable."""
    reader = HDF5Reader(ckpt, verify="full")
    return reader, reader.read_metadata()


def describe(ckpt: Path) -> dict[str, Any]:
    """What a checkpoint holds, as JSON-ready data: tensors, totals, files, layout, provenance, train state."""
    _, md = read_index(ckpt)
    marker = json_or_none(ckpt / MARKER)
    extra = json_or_none(ckpt / EXTRA) or {}
    files: dict[str, int] = {}
    stored_bytes = 0
    for s in md.storage_data.values():
        files[s.file] = s.file_bytes
        stored_bytes += s.nbytes
    tensors, other = [], []
    params = model_bytes = 0
    for fqn, tmd in md.state_dict_metadata.items():
        if not isinstance(tmd, TensorStorageMetadata):
            other.append(fqn)
            continue
        numel = tmd.size.numel()
        nbytes = numel * tmd.properties.dtype.itemsize
        tensors.append({"fqn": fqn, "shape": list(tmd.size), "dtype": str(tmd.properties.dtype).removeprefix(
            "torch."), "num_shards": len(tmd.chunks), "bytes": nbytes})
        if fqn.startswith(MODEL_PREFIX):
            params, model_bytes = params + numel, model_bytes + nbytes
    prov = {k: v for k, v in (marker or {}).items() if k not in ("step", "config", "layout", "world_size")}
    layout = (marker or {}).get("layout")
    hosts = prov.get("hosts")
    prov["hosts"] = [str(h) for h in hosts] if isinstance(hosts, list) else []  # shown, so made plain text
    return {
        "path": str(ckpt), "committed": marker is not None,
        "step": extra.get("step", (marker or {}).get("step")), "tokens_seen": extra.get("tokens_seen"),
        "layout": layout if isinstance(layout, dict) else {}, "world_size": (marker or {}).get("world_size"),
        "provenance": prov, "files": dict(sorted(files.items())),
        "totals": {"params": params, "model_bytes": model_bytes, "num_tensors": len(tensors),
                   "num_other": len(other), "stored_bytes": stored_bytes, "file_bytes": sum(files.values())},
        "tensors": tensors, "other": other, "train_state": extra,
        "config": (marker or {}).get("config", {}),
    }


def format_description(info: dict[str, Any]) -> str:
    t, prov = info["totals"], info["provenance"]
    lines = [
        f"checkpoint  {info['path']} ({'committed' if info['committed'] else 'NOT committed'})",
        f"step        {info['step']}, tokens seen {info['tokens_seen']}",
        f"layout      {format_layout(info['layout'])}, world size {info['world_size']}, "
        f"hosts {','.join(prov.get('hosts', [])) or '-'}",
        f"saved       {prov.get('saved_at', '-')}, slurm job {prov.get('slurm_job_id') or '-'}, "
        f"git {prov.get('git_commit', '-')}, torch {prov.get('torch', '-')}",
        f"model       {t['params'] / 1e6:.2f}M parameters, {human_bytes(t['model_bytes'])}",
        f"stored      {t['num_tensors']} tensors and {t['num_other']} other values, "
        f"{human_bytes(t['stored_bytes'])} in {len(info['files'])} shard files ({human_bytes(t['file_bytes'])})",
        "",
    ]
    rows = [("fqn", "shape", "dtype", "shards")] + [
        (x["fqn"], "[" + ", ".join(map(str, x["shape"])) + "]", x["dtype"], str(x["num_shards"]))
        for x in info["tensors"]]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[3] for r in rows]
    return "\n".join(lines)


# -- verify -----------------------------------------------------------------------------------------------------

def verify(ckpt: Path, mode: str = "full") -> Verdict:
    """Every problem of a checkpoint, the checks a load makes: the marker, the checksums it recorded for
    train_state.json and index.json, the index's schema, file sizes, every dataset's size, shape and dtype against
    the index, JSON values, and in mode "full" (every dataset) or "sampled" (the subset a sampled load checks)
    their crc32."""
    v = Verdict()
    try:
        read_committed(ckpt)
    except CheckpointCorrupt as e:
        v.problems.append(str(e))
    v = verify_data(ckpt, mode, v=v)
    v.problems = list(dict.fromkeys(v.problems))  # a directory refused is refused by both checks: said once
    return v


def format_verdict(ckpt: Path, v: Verdict) -> str:
    """One line per problem, or one OK line."""
    if v.problems:
        return "\n".join(v.problems)
    return (f"OK {ckpt}: {v.num_datasets} datasets, crc32 of {v.num_hashed} ({human_bytes(v.bytes_hashed)})"
            + (f", {v.unchecksummed} saved without crc32" if v.unchecksummed else ""))


# -- export -----------------------------------------------------------------------------------------------------

@dataclass
class ModelTensors:
    """The model's tensors in a checkpoint (FQNs under "model.", in index order) and where their pieces lie."""
    ckpt: Path
    reader: HDF5Reader
    tensors: list[tuple[str, TensorStorageMetadata]]
    pieces: dict[str, list[tuple[tuple[int, ...], Stored]]]  # fqn -> (offsets, stored dataset) of each shard


def model_tensors(ckpt: Path) -> ModelTensors:
    """Reads index.json (no tensor data); ValueError when the checkpoint holds no model tensors."""
    reader, md = read_index(ckpt)
    pieces: dict[str, list[tuple[tuple[int, ...], Stored]]] = defaultdict(list)
    for index, s in md.storage_data.items():
        pieces[index.fqn].append((tuple(index.offset or ()), s))
    model = [(fqn, tmd) for fqn, tmd in md.state_dict_metadata.items()
             if fqn.startswith(MODEL_PREFIX) and isinstance(tmd, TensorStorageMetadata)]
    if not model:
        raise ValueError(f"{ckpt} holds no tensors under {MODEL_PREFIX!r}: nothing to export")
    return ModelTensors(ckpt, reader, model, pieces)


@contextmanager
def full_tensor_reader(mt: ModelTensors) -> Iterator[Callable[[str, tuple[int, ...]], np.ndarray]]:
    """read(fqn, size) -> that tensor's full value assembled from its shards, as stored (raw bits for bfloat16 and
    float8), every dataset checked against its crc32. Each shard file is opened once, on first use, and closed on
    exit; one tensor is in memory at a time when the caller drops each before reading the next."""
    with ExitStack() as files:
        opened: dict[str, h5py.File] = {}

        def open_file(s: Stored) -> h5py.File:
            if s.file not in opened:
                opened[s.file] = files.enter_context(mt.reader.open_file(s.file, s.file_bytes))
            return opened[s.file]

        yield lambda fqn, size: _assemble(mt.ckpt, fqn, size, mt.pieces[fqn], open_file)


def safetensors_dtype(dtype: Any, name: str) -> str:
    """The safetensors code of a torch dtype; ValueError naming the tensor when safetensors cannot hold it."""
    key = str(dtype).removeprefix("torch.")
    if key not in SAFETENSORS_DTYPES:
        raise ValueError(f"{name} has dtype {key}, which safetensors cannot hold")
    return SAFETENSORS_DTYPES[key]


def write_safetensors(path: Path, entries: list[tuple[str, str, tuple[int, ...], int]],
                      arrays: Iterable[np.ndarray], meta: dict[str, str]) -> None:
    """One safetensors file: entries (name, safetensors dtype, shape, bytes) back to back in the given order, their
    data taken from `arrays` one at a time (any numpy dtype of the right byte size: raw bits are written
    little-endian). Put the widest item sizes first so every tensor starts aligned (the header is padded to 8)."""
    header: dict[str, Any] = {}
    offset = 0
    for name, dtype, shape, nbytes in entries:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = meta
    text = json.dumps(header, separators=(",", ":")).encode("ascii")
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(text)) + text)
        for (name, _, _, nbytes), arr in zip(entries, arrays, strict=True):
            raw = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<")).tobytes()
            assert len(raw) == nbytes, (name, len(raw), nbytes)
            fh.write(raw)
        assert fh.tell() == 8 + len(text) + offset, (fh.tell(), len(text), offset)


def provenance_meta(ckpt: Path) -> dict[str, str]:
    """What an exported file records of its source, as safetensors metadata (strings only)."""
    marker = json_or_none(ckpt / MARKER) or {}
    meta = {"format": "pt", "source": str(ckpt.absolute()), "step": marker.get("step", ""),
            "git_commit": marker.get("git_commit", ""), "saved_at": marker.get("saved_at", "")}
    return {k: str(v) for k, v in meta.items()}


def export_safetensors(ckpt: Path, out: Path) -> dict[str, Any]:
    """The model's full tensors (FQNs under "model.", prefix dropped) assembled from their shards into one
    safetensors file, written through a temporary name. Every dataset read is checked against its crc32."""
    mt = model_tensors(ckpt)
    # widest items first, so every tensor starts aligned to its item size (the header is padded to 8 bytes)
    model = sorted(mt.tensors, key=lambda x: -x[1].properties.dtype.itemsize)
    entries = [(fqn.removeprefix(MODEL_PREFIX), safetensors_dtype(tmd.properties.dtype, fqn), tuple(tmd.size),
                tmd.size.numel() * tmd.properties.dtype.itemsize) for fqn, tmd in model]
    with full_tensor_reader(mt) as read, replacing(out) as tmp:  # fsynced, renamed; removed if writing fails
        write_safetensors(tmp, entries, (read(fqn, tuple(tmd.size)) for fqn, tmd in model), provenance_meta(ckpt))
    return {"path": str(out), "num_tensors": len(model), "bytes": out.stat().st_size,
            "params": sum(tmd.size.numel() for _, tmd in model)}


def _assemble(ckpt: Path, fqn: str, size: tuple[int, ...], pieces: list, open_file) -> np.ndarray:
    """One tensor's full value from its shards: each dataset lands at its offsets; the shards must tile it."""
    full: np.ndarray | None = None
    covered = 0
    for offsets, s in pieces:
        where = (ckpt / s.file, s.dataset)
        arr = read_stored(open_stored(open_file(s), ckpt, s), where)  # raw bits for bfloat16 and float8 (uint16/uint8)
        if s.crc32 is not None:
            check_crc32(crc32(arr), s, where)
        if full is None:
            full = np.empty(size, dtype=arr.dtype)
        full[tuple(slice(o, o + n) for o, n in zip(offsets, arr.shape))] = arr
        covered += arr.size
    numel = int(np.prod(size))
    if covered != numel:  # DCP writes each element once: fewer means lost shards, more means overlap
        raise CheckpointCorrupt(ckpt / INDEX, None, f"{fqn}: shards hold {covered} of {numel} elements")
    return full if full is not None else np.empty(size, dtype=np.uint8)
