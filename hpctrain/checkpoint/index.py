"""index.json: torch.distributed.checkpoint's Metadata as JSON, so reading a checkpoint's layout needs no pickle.

    doc = index_to_json(metadata, checksum=True)     # written last by the coordinator
    metadata = index_from_json(doc)                   # rebuilt on load, equal to what dcp.save returned
"""
from __future__ import annotations

import dataclasses
import math
import re
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
    shape: tuple[int, ...] | None = None  # the dataset's shape (the chunk's sizes; (nbytes,) for a JSON value)


def dtype_from_name(name: Any) -> torch.dtype:
    """The torch dtype an index.json "dtype" field names (dtype_name's inverse: "bfloat16" -> torch.bfloat16).
    Raises ValueError for anything that is not the name of a torch.dtype attribute (never evaluates the string)."""
    dtype = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype {name!r}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """The name index.json stores for a torch dtype: its attribute name in torch ("bfloat16" for torch.bfloat16),
    which dtype_from_name turns back."""
    return str(dtype).removeprefix("torch.")


# index.json: DCP's Metadata without pickle. See index_to_json for the schema.

def index_to_json(metadata: Metadata, checksum: bool) -> dict[str, Any]:
    """{"format", "format_version", "dcp_version", "checksum": "crc32"|null, "storage_meta": {...},
    "files": {name: bytes}, "state_dict_metadata": {fqn: {"type": "tensor", "dtype", "requires_grad", "size",
    "chunks": [{"offsets", "sizes"}]} | {"type": "bytes"}}, "storage_data": [{"fqn", "offset", "index", "file",
    "dataset", "dtype", "nbytes", "crc32", "file_offset"}], "planner_data": tagged JSON (see json_encode)}"""
    def entry(fqn: str, md: TensorStorageMetadata | BytesStorageMetadata) -> dict[str, Any]:
        if isinstance(md, BytesStorageMetadata):
            return {"type": "bytes"}
        return {"type": "tensor", "dtype": dtype_name(md.properties.dtype),
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
        "planner_data": json_encode(metadata.planner_data),
    }


SHARD_NAME = re.compile(r"shard-(0|[1-9][0-9]{0,8})\.h5")  # what HDF5Writer names its files, nothing else
BYTES_DTYPES = ("json", "bytes")  # "json": a JSON value; "bytes": a pickle from hpctrain <= 0.3, never loaded
_MAX = 1 << 62  # any count or size in index.json above this is damage, not a checkpoint


def _need(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(what)


def _int(x: Any, what: str, low: int = 0) -> int:
    _need(type(x) is int and low <= x < _MAX, f"{what} = {x!r} is not an integer >= {low}")
    return x


def _ints(x: Any, what: str) -> list[int]:
    _need(isinstance(x, list) and len(x) <= 64, f"{what} = {x!r} is not a list of integers")
    return [_int(v, what) for v in x]


def _entry_from_json(fqn: str, d: Any) -> TensorStorageMetadata | BytesStorageMetadata:
    _need(isinstance(d, dict) and d.get("type") in ("tensor", "bytes"), f"state_dict_metadata[{fqn!r}] = {d!r}")
    if d["type"] == "bytes":
        return BytesStorageMetadata()
    size = _ints(d.get("size"), f"{fqn}: size")
    _need(isinstance(d.get("requires_grad"), bool), f"{fqn}: requires_grad = {d.get('requires_grad')!r}")
    chunks = d.get("chunks")
    _need(isinstance(chunks, list), f"{fqn}: chunks = {chunks!r}")
    out = []
    for c in chunks:
        _need(isinstance(c, dict), f"{fqn}: chunk {c!r}")
        offsets, sizes = _ints(c.get("offsets"), f"{fqn}: offsets"), _ints(c.get("sizes"), f"{fqn}: sizes")
        _need(len(offsets) == len(sizes) == len(size) and all(o + n <= s for o, n, s in zip(offsets, sizes, size)),
              f"{fqn}: chunk at {offsets} of {sizes} does not fit a tensor of size {size}")
        out.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
    props = TensorProperties(dtype=dtype_from_name(d.get("dtype")), requires_grad=d["requires_grad"])
    return TensorStorageMetadata(props, torch.Size(size), out)


def index_from_json(doc: Any) -> Metadata:
    """DCP's Metadata from an untrusted index.json: every field's type and range is checked, shard files must be
    named as HDF5Writer names them (nothing outside the checkpoint directory), every item's size must follow from
    its dtype and shape, and every chunk the metadata lists must have its stored dataset. ValueError otherwise."""
    _need(isinstance(doc, dict), "index.json is not a JSON object")
    files = doc.get("files")
    _need(isinstance(files, dict), f"files = {files!r}")
    for name, size in files.items():
        _need(SHARD_NAME.fullmatch(name) is not None, f"shard file name {name!r} is not of the form shard-<rank>.h5")
        _int(size, f"files[{name!r}]")
    sdm = doc.get("state_dict_metadata")
    _need(isinstance(sdm, dict), "state_dict_metadata is not an object")
    entries = {fqn: _entry_from_json(fqn, d) for fqn, d in sdm.items()}
    rows = doc.get("storage_data")
    _need(isinstance(rows, list), "storage_data is not a list")
    storage: dict[MetadataIndex, Stored] = {}
    for e in rows:
        _need(isinstance(e, dict), f"storage_data entry {e!r}")
        fqn, file, dataset, dtype = e.get("fqn"), e.get("file"), e.get("dataset"), e.get("dtype")
        _need(fqn in entries, f"storage_data names {fqn!r}, which state_dict_metadata lacks")
        _need(file in files, f"{fqn}: file {file!r} is not among the index's files")
        _need(isinstance(dataset, str) and dataset.startswith("/") and len(dataset) < 4096,
              f"{fqn}: dataset {dataset!r}")
        md = entries[fqn]
        offset = None if e.get("offset") is None else _ints(e["offset"], f"{fqn}: offset")
        index = e.get("index")
        _need(index is None or type(index) is int, f"{fqn}: index {index!r}")
        nbytes = _int(e.get("nbytes"), f"{fqn}: nbytes")
        crc = e.get("crc32")
        _need(crc is None or (type(crc) is int and 0 <= crc < 2**32), f"{fqn}: crc32 {crc!r}")
        file_offset = e.get("file_offset")
        _need(file_offset is None or _int(file_offset, f"{fqn}: file_offset") + nbytes <= files[file],
              f"{fqn}: file_offset {file_offset!r} lies outside {file}")
        if isinstance(md, BytesStorageMetadata):
            _need(dtype in BYTES_DTYPES, f"{fqn}: dtype {dtype!r} of a non-tensor value")
            shape: tuple[int, ...] = (nbytes,)
        else:
            _need(dtype == dtype_name(md.properties.dtype), f"{fqn}: dtype {dtype!r}, metadata says "
                                                             f"{dtype_name(md.properties.dtype)}")
            sizes = [c.sizes for c in md.chunks if list(c.offsets) == (offset or [])]
            _need(len(sizes) == 1, f"{fqn}: stored chunk at {offset} is not one of the metadata's chunks")
            shape = tuple(sizes[0])
            _need(nbytes == math.prod(shape) * md.properties.dtype.itemsize,
                  f"{fqn}: nbytes {nbytes} for a {dtype} chunk of shape {list(shape)}")
        key = MetadataIndex(fqn, offset, index)
        _need(key not in storage, f"{fqn}: chunk at {offset} stored twice")
        storage[key] = Stored(file, dataset, dtype, nbytes, crc, files[file], file_offset, shape)
    for fqn, md in entries.items():  # a chunk without its data would fail halfway through a load
        have = {tuple(k.offset or ()) for k in storage if k.fqn == fqn}
        want = {tuple(c.offsets) for c in md.chunks} if isinstance(md, TensorStorageMetadata) else {()}
        _need(want <= have, f"{fqn}: {len(want - have)} chunk(s) without stored data")
    meta = doc.get("storage_meta")
    _need(isinstance(meta, dict) and all(isinstance(meta.get(k), str) for k in ("checkpoint_id", "save_id")),
          f"storage_meta = {meta!r}")
    _need(isinstance(doc.get("dcp_version"), str), f"dcp_version = {doc.get('dcp_version')!r}")
    modules = meta.get("modules")
    _need(modules is None or (isinstance(modules, list) and all(isinstance(m, str) for m in modules)),
          f"storage_meta.modules = {modules!r}")
    return Metadata(state_dict_metadata=entries, planner_data=json_decode(doc.get("planner_data")),
                    storage_data=storage, storage_meta=StorageMeta(meta["checkpoint_id"], meta["save_id"], None,
                                                                   modules),
                    version=doc["dcp_version"])


_TAGS = ("__tuple__", "__dict__")


def json_encode(obj: Any) -> Any:
    """Planner data (and non-tensor state values) as JSON-serialisable data; json_decode undoes it exactly. DCP's
    default planner puts {fqn: key path tuple} here; tuples and dicts whose keys are not all strings get a one-key
    tag object. Anything else is refused rather than pickled."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, list):
        return [json_encode(x) for x in obj]
    if isinstance(obj, tuple):
        return {"__tuple__": [json_encode(x) for x in obj]}
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj) and not (len(obj) == 1 and next(iter(obj)) in _TAGS):
            return {k: json_encode(v) for k, v in obj.items()}
        return {"__dict__": [[json_encode(k), json_encode(v)] for k, v in obj.items()]}
    raise TypeError(f"planner data of type {type(obj).__name__} has no JSON form in index.json (no pickle here)")


def json_decode(obj: Any) -> Any:
    """json_encode's inverse: the value that json_encode was given, from the parsed JSON (tags turned back into
    tuples and non-string-keyed dicts). Anything untagged comes back as parsed."""
    if isinstance(obj, list):
        return [json_decode(x) for x in obj]
    if isinstance(obj, dict):
        if len(obj) == 1 and "__tuple__" in obj:
            return tuple(json_decode(x) for x in obj["__tuple__"])
        if len(obj) == 1 and "__dict__" in obj:
            return {json_decode(k): json_decode(v) for k, v in obj["__dict__"]}
        return {k: json_decode(v) for k, v in obj.items()}
    return obj
