"""Token files: random access to a stream of token ids stored in a .bin, .npy or HDF5 file, checked on opening.

    source = ArraySource("data/corpus.bin")  # .bin (raw, uint16 unless `<path>.json` says otherwise) or .npy
    source = HDF5Source("data/notes.h5")     # dataset "tokens", optional vocab_size attribute
    source.read(start, count)                # tokens[start:start + count] as int64; len(source) tokens in all

Opening a file checks its shape and its sidecar or attributes and scans its ids once (min >= 0, max_id), keeping
the result in `<path>.ids.json` or the user's cache directory. Both JSON files are read through hpctrain.untrusted
(size and depth bounded, no symbolic link): a bad sidecar is refused, a bad id cache only means a new scan.
TokenSource is the interface every source follows. Most callers want hpctrain.data.open_source, which picks the
class from the config and checks the file against the model; hpctrain.data writes these files (build_dataset).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from hpctrain.fsutil import write_atomic
from hpctrain.untrusted import HDF5_BUILTIN_FILTERS, hdf5_dataset, read_json

# A sidecar or an id cache is a few hundred bytes of JSON: anything much larger is not one.
_MAX_SIDECAR_BYTES = 1 << 20
_MAX_CACHE_BYTES = 1 << 16


def val_file(path: str) -> str:
    """Where `hpctrain data build --val-fraction` puts the validation split of `path`: "<stem>.val<suffix>"."""
    p = Path(path)
    return str(p.with_name(p.stem + ".val" + p.suffix))


def tokenizer_file(path: str | Path) -> Path:
    """Where `hpctrain data build --tokenizer` keeps a copy of the tokenizer of token file `path` (and of its
    validation split "<stem>.val<suffix>"): "<stem>.tokenizer.json" beside it."""
    p = Path(path)
    return p.with_name(p.stem.removesuffix(".val") + ".tokenizer.json")


class TokenSource:
    """Random access to one long token stream by offset. Every id is in [0, vocab_size); max_id is the largest."""
    name: str  # for messages: the file, or "synthetic data"
    record: dict[str, Any] = {}  # what the file records about its tokenizer (_record); {} without one
    num_tokens: int
    vocab_size: int
    max_id: int

    def read(self, start: int, count: int) -> np.ndarray:
        """tokens[start:start + count] as int64."""
        raise NotImplementedError

    def __len__(self) -> int:
        return self.num_tokens


def _scan_ids(array: Any, n: int, step: int = 1 << 24) -> tuple[int, int]:
    """(smallest id if negative else 0, largest id or -1 when empty), in slices so a memmap or an HDF5 dataset is
    never loaded whole."""
    low, high = 0, -1
    for i in range(0, n, step):
        part = array[i:i + step]
        low = min(low, int(np.min(part))) if part.dtype.kind == "i" else low
        high = max(high, int(np.max(part)))
    return low, high


def _id_range(path: Path, array: Any, n: int, dtype: np.dtype) -> tuple[int, int]:
    """_scan_ids of a file, done once: remembered by (size, mtime_ns, dtype) in `<file>.ids.json`, or, when the
    file's directory is not writable, in the user's cache directory (scanning a large file at every start costs
    minutes)."""
    st = path.stat()  # before the scan: a file changed while scanned gets a new mtime and is scanned again
    key = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "dtype": dtype.str}
    home = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")  # stays "~/..." without a home
    digest = hashlib.blake2b(os.fsencode(path.absolute()), digest_size=10).hexdigest()
    caches = [Path(f"{path}.ids.json")] + [Path(home, "hpctrain", "ids", f"{digest}.json")] * os.path.isabs(home)
    for cache in caches:
        try:
            entry = read_json(cache, _MAX_CACHE_BYTES)
            if {k: entry[k] for k in key} == key and type(entry["min_id"]) is type(entry["max_id"]) is int:
                return entry["min_id"], entry["max_id"]
        except (ValueError, KeyError, TypeError):
            pass  # missing, a link, too large, damaged (untrusted.Untrusted is a ValueError): scan
    low, high = _scan_ids(array, n)
    for cache in caches:
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            # unique: ranks may scan at once
            write_atomic(cache, json.dumps(key | {"min_id": low, "max_id": high}) + "\n", unique=True)
            break
        except OSError:
            pass  # not writable: try the next place
    return low, high


def _count(value: Any, what: str, low: int) -> int | None:
    """A count read from a sidecar or an HDF5 attribute, untrusted: None when absent, else an int >= low."""
    if isinstance(value, np.integer):
        value = int(value)
    if value is not None and (type(value) is not int or value < low):
        raise ValueError(f"{what} = {value!r:.80} must be an integer >= {low}")
    return value


def _sidecar(sidecar: Path) -> tuple[dict[str, Any], np.dtype]:
    """A raw file's `<path>.json` ({} when absent) and its dtype: uint16 little-endian unless it says otherwise."""
    try:  # lexists: a dangling link is refused, not taken for no sidecar
        meta = read_json(sidecar, _MAX_SIDECAR_BYTES) if os.path.lexists(sidecar) else {}
    except ValueError as e:  # Untrusted: a link, too large, not UTF-8, not JSON, too deep, a lone surrogate
        raise ValueError(f"sidecar {str(sidecar)!r} is not readable JSON: {e}") from None
    if not isinstance(meta, dict):
        raise ValueError(f"sidecar {str(sidecar)!r} holds {meta!r:.80}, not a JSON object")
    name, order = meta.get("dtype", "uint16"), meta.get("byteorder", "little")
    try:
        dtype = np.dtype(name) if isinstance(name, str) else None
    except TypeError:
        dtype = None
    if dtype is None or dtype.kind not in "iu":
        raise ValueError(f"sidecar {str(sidecar)!r}: dtype = {name!r:.80} is not an integer type such as 'uint16'")
    if order not in ("little", "big"):
        raise ValueError(f"sidecar {str(sidecar)!r}: byteorder = {order!r:.80} must be 'little' or 'big'")
    return meta, dtype.newbyteorder("<" if order == "little" else ">")


def _record(meta: dict[str, Any], name: str) -> dict[str, Any]:
    """What a token file records about its tokenizer (hpctrain.tokenized writes it), checked: tokenizer,
    tokenizer_sha256 (64 hex digits), vocab_size, eos_id (< vocab_size), num_docs, split. Absent keys stay out."""
    out: dict[str, Any] = {}
    for key, value in meta.items():
        value = value.item() if isinstance(value, np.generic) else value
        value = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
        if key in ("vocab_size", "eos_id", "num_docs", "num_tokens"):
            out[key] = _count(value, f"{name!r}: {key}", 1 if key == "vocab_size" else 0)
        elif key in ("tokenizer", "tokenizer_sha256", "split"):
            if not isinstance(value, str):
                raise ValueError(f"{name!r}: {key} = {value!r:.80} must be text")
            out[key] = value
    sha = out.get("tokenizer_sha256")
    if sha is not None and not re.fullmatch(r"[0-9a-f]{64}", sha):
        raise ValueError(f"{name!r}: tokenizer_sha256 = {sha!r:.80} is not a sha256 (64 hex digits)")
    if out.get("eos_id") is not None and out.get("vocab_size") is not None and out["eos_id"] >= out["vocab_size"]:
        raise ValueError(f"{name!r}: eos_id = {out['eos_id']} is not below its vocab_size = {out['vocab_size']}")
    return out


def check_records(sources: list[TokenSource], vocab_size: int, hf_tokenizer_sha256: str | None = None) -> None:
    """Refuses token files made by different tokenizers (a blend, or a training file and its validation split),
    an EOS id the model cannot embed, and a tokenizer other than the one of the HF directory a run starts from.
    Files without a record (byte-level or foreign) are only checked by their ids."""
    made = {s.name: s.record["tokenizer_sha256"] for s in sources if getattr(s, "record", {}).get("tokenizer_sha256")}
    if len(set(made.values())) > 1:
        raise ValueError("token files made with different tokenizers: " +
                         ", ".join(f"{n} ({sha[:12]})" for n, sha in made.items()))
    for s in sources:
        eos = getattr(s, "record", {}).get("eos_id")
        if eos is not None and eos >= vocab_size:
            raise ValueError(f"{s.name!r} records eos_id = {eos}, not below model.vocab_size = {vocab_size}")
    if hf_tokenizer_sha256 and made and hf_tokenizer_sha256 not in made.values():
        name, sha = next(iter(made.items()))
        raise ValueError(f"{name!r} was made with tokenizer {sha[:12]}..., but train.init_from's tokenizer.json is "
                         f"{hf_tokenizer_sha256[:12]}...: the model would read other ids than it was trained on")


class _PerProcess:
    """A token file, opened on first use in each process: handles must not cross fork, and pickling drops them."""
    name: str
    path: Path
    num_tokens: int

    def __init__(self) -> None:
        self._pid, self._handle = -1, None

    def _open(self) -> Any:
        raise NotImplementedError

    def _get(self) -> Any:
        if self._pid != os.getpid():
            self._pid, self._handle = os.getpid(), self._open()
        return self._handle

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_pid": -1, "_handle": None}

    def _check_ids(self, array: Any, recorded_vocab: int | None) -> None:
        """max_id from the file itself (metadata can understate it); vocab_size the recorded one unless too small."""
        if array.dtype.kind not in "iu":
            raise ValueError(f"{self.name!r} holds {array.dtype} tokens; token ids must be integers")
        low, self.max_id = _id_range(self.path, array, self.num_tokens, array.dtype)
        if low < 0:
            raise ValueError(f"{self.name!r} holds the negative token id {low}: ids must be >= 0")
        self.vocab_size = max(recorded_vocab or 0, self.max_id + 1)


class ArraySource(_PerProcess, TokenSource):
    """A .npy file or a raw little-endian file (.bin), each with an optional `<path>.json` sidecar.

    Without a sidecar a raw file is read as uint16. Either way the ids are scanned once (see _id_range).
    """

    def __init__(self, path: str | Path) -> None:
        super().__init__()
        self.path = Path(path)
        self.name = str(self.path)
        sidecar = Path(f"{self.path}.json")
        meta, dtype = _sidecar(sidecar)
        self.dtype = None  # .npy: its header knows
        if self.path.suffix != ".npy":
            self.dtype = dtype
            if self.path.stat().st_size == 0:  # np.memmap's own message would not name the file
                raise ValueError(f"{self.name!r} is empty: it holds no tokens")
        try:
            array = self._get()
        except ValueError as e:  # numpy's messages (a bad .npy header, a size not a multiple of the dtype) do not
            raise ValueError(f"{self.name!r} cannot be read as tokens: {e}") from None
        if array.ndim != 1:
            raise ValueError(f"{self.name!r} holds an array of shape {array.shape}; tokens must be 1-d")
        self.num_tokens = int(array.shape[0])
        recorded = _count(meta.get("num_tokens"), f"sidecar {str(sidecar)!r}: num_tokens", 0)
        if recorded is not None and recorded != self.num_tokens:
            raise ValueError(f"{self.name!r} holds {self.num_tokens} tokens but its sidecar records "
                             f"{recorded}: the file is truncated or the sidecar is stale")
        self._check_ids(array, _count(meta.get("vocab_size"), f"sidecar {str(sidecar)!r}: vocab_size", 1))
        self.record = _record(meta, self.name)

    def _open(self) -> np.ndarray:
        if self.dtype is None:
            return np.load(self.path, mmap_mode="r")
        return np.memmap(self.path, dtype=self.dtype, mode="r")

    def read(self, start: int, count: int) -> np.ndarray:
        return np.asarray(self._get()[start:start + count], dtype=np.int64)


class HDF5Source(_PerProcess, TokenSource):
    """Dataset "tokens" of an HDF5 file (see build_dataset), with an optional vocab_size attribute."""

    def __init__(self, path: str | Path) -> None:
        super().__init__()
        self.path = Path(path)
        self.name = str(self.path)
        with h5py.File(self.path, "r") as f:  # closed again: the real handle is opened per process
            dset = self._tokens(f)
            if dset.ndim != 1:
                raise ValueError(f"{self.name!r}: 'tokens' has shape {dset.shape}; tokens must be 1-d")
            self.num_tokens = int(dset.shape[0])
            recorded = _count(dset.attrs.get("vocab_size"), f"{self.name!r}: attribute vocab_size", 1)
            self._check_ids(dset, recorded)
            self.record = _record(dict(dset.attrs), self.name)

    def _tokens(self, f: h5py.File) -> h5py.Dataset:
        """Dataset "tokens", checked to hold its bytes in this file before any is read (no soft or external link,
        no external raw storage, not virtual, no filter plugin): ValueError naming the file otherwise."""
        try:
            return h5py.Dataset(hdf5_dataset(f, "/tokens", repr(self.name), HDF5_BUILTIN_FILTERS))
        except KeyError:
            raise ValueError(f"{self.name!r} has no dataset 'tokens' (it holds {sorted(f.keys())})") from None

    def _open(self) -> h5py.Dataset:
        # kept open (the dataset keeps its file open): one handle per process for its whole life, checked again
        # since the file may have been replaced after __init__ looked at it
        return self._tokens(h5py.File(self.path, "r"))

    def read(self, start: int, count: int) -> np.ndarray:
        return np.asarray(self._get()[start:start + count], dtype=np.int64)
