"""index.json: torch.distributed.checkpoint's Metadata as JSON, so reading a checkpoint's layout needs no pickle.

    doc = index_to_json(metadata, checksum=True)     # written last by the coordinator
    metadata = index_from_json(doc)                   # rebuilt on load, equal to what dcp.save returned
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

INDEX = "index.json"
FORMAT, FORMAT_VERSION = "hpctrain-dcp-hdf5", 1


@dataclasses.dataclass(frozen=True)
class Stored:
    """Where one DCP item lives (the values of Metadata.storage_data)."""
    file: str  # relative to the checkpoint directory
    dataset: str  # HDF5 path inside the file
    dtype: str  # torch dtype name, or "bytes"
    nbytes: int
    crc32: int | None  # None when saved with checksum=False
    file_bytes: int = 0  # size of the whole file once closed: a shorter file was truncated
    file_offset: int | None = None  # where a contiguous dataset's bytes start in the file: a read-ahead hint only


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype {name!r}")
    return dtype


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# index.json: DCP's Metadata without pickle. See index_to_json for the schema.

def index_to_json(metadata: Metadata, checksum: bool) -> dict[str, Any]:
    """{"format", "format_version", "dcp_version", "checksum": "crc32"|null, "storage_meta": {...},
    "files": {name: bytes}, "state_dict_metadata": {fqn: {"type": "tensor", "dtype", "requires_grad", "size",
    "chunks": [{"offsets", "sizes"}]} | {"type": "bytes"}}, "storage_data": [{"fqn", "offset", "index", "file",
    "dataset", "dtype", "nbytes", "crc32", "file_offset"}], "planner_data": tagged JSON (see _encode)}"""
    def entry(fqn: str, md: TensorStorageMetadata | BytesStorageMetadata) -> dict[str, Any]:
        if isinstance(md, BytesStorageMetadata):
            return {"type": "bytes"}
        return {"type": "tensor", "dtype": _dtype_name(md.properties.dtype),
                "requires_grad": md.properties.requires_grad, "size": list(md.size),
                "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in md.chunks]}

    storage = metadata.storage_data.items()
    meta = metadata.storage_meta
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION, "dcp_version": metadata.version,
        "checksum": "crc32" if checksum else None,
        "storage_meta": {"checkpoint_id": str(meta.checkpoint_id), "save_id": meta.save_id, "modules": meta.modules},
        "files": {s.file: s.file_bytes for _, s in sorted(storage, key=lambda kv: kv[1].file)},
        "state_dict_metadata": {fqn: entry(fqn, md) for fqn, md in metadata.state_dict_metadata.items()},
        "storage_data": [{"fqn": i.fqn, "offset": None if i.offset is None else list(i.offset), "index": i.index,
                          "file": s.file, "dataset": s.dataset, "dtype": s.dtype, "nbytes": s.nbytes,
                          "crc32": s.crc32, "file_offset": s.file_offset} for i, s in storage],
        "planner_data": _encode(metadata.planner_data),
    }


def index_from_json(doc: dict[str, Any]) -> Metadata:
    def entry(d: dict[str, Any]) -> TensorStorageMetadata | BytesStorageMetadata:
        if d["type"] == "bytes":
            return BytesStorageMetadata()
        return TensorStorageMetadata(
            TensorProperties(dtype=_dtype(d["dtype"]), requires_grad=d["requires_grad"]), torch.Size(d["size"]),
            [ChunkStorageMetadata(torch.Size(c["offsets"]), torch.Size(c["sizes"])) for c in d["chunks"]])

    files = doc["files"]
    storage = {MetadataIndex(e["fqn"], e["offset"], e["index"]):
               Stored(e["file"], e["dataset"], e["dtype"], e["nbytes"], e["crc32"], files[e["file"]],
                      e.get("file_offset"))
               for e in doc["storage_data"]}
    meta = doc["storage_meta"]
    return Metadata(state_dict_metadata={fqn: entry(d) for fqn, d in doc["state_dict_metadata"].items()},
                    planner_data=_decode(doc["planner_data"]), storage_data=storage,
                    storage_meta=StorageMeta(meta["checkpoint_id"], meta["save_id"], None, meta["modules"]),
                    version=doc["dcp_version"])


_TAGS = ("__tuple__", "__dict__")


def _encode(obj: Any) -> Any:
    """Planner data as JSON. DCP's default planner puts {fqn: key path tuple} here; tuples and dicts whose keys are
    not all strings get a one-key tag object. Anything else is refused rather than pickled."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, list):
        return [_encode(x) for x in obj]
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(x) for x in obj]}
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj) and not (len(obj) == 1 and next(iter(obj)) in _TAGS):
            return {k: _encode(v) for k, v in obj.items()}
        return {"__dict__": [[_encode(k), _encode(v)] for k, v in obj.items()]}
    raise TypeError(f"planner data of type {type(obj).__name__} has no JSON form in index.json (no pickle here)")


def _decode(obj: Any) -> Any:
    if isinstance(obj, list):
        return [_decode(x) for x in obj]
    if isinstance(obj, dict):
        if len(obj) == 1 and "__tuple__" in obj:
            return tuple(_decode(x) for x in obj["__tuple__"])
        if len(obj) == 1 and "__dict__" in obj:
            return {_decode(k): _decode(v) for k, v in obj["__dict__"]}
        return {k: _decode(v) for k, v in obj.items()}
    return obj
