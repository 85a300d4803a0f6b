"""Token files: random access to a stream of token ids stored in a .bin, .npy or HDF5 file, checked on opening.

    source = ArraySource("data/corpus.bin")  # .bin (raw, uint16 unless `<path>.json` says otherwise) or .npy
    source = HDF5Source("data/notes.h5")     # dataset "tokens", optional vocab_size attribute
    source.read(start, count)                # tokens[start:start + count] as int64; len(source) tokens in all
    ArraySource(path, scan=False).max_id     # None when no record proves the ids: nothing reads them (login node)

Opening a file checks its shape and its sidecar or attributes, then finds the range of its ids (min >= 0, max_id)
without reading them when a record proves it: the one `hpctrain data build` wrote (the sidecar's "ids" entry, or
the HDF5 dataset's min_id/max_id/ids_sample attributes), the result of an earlier scan (`<path>.ids.json`, the
user's cache directory, or a run directory's `ids/`), or this process's own check at job start (remember). A
record counts only for the file it names: its size, mtime and a hash of its first and last MiB (file_identity;
HDF5 attributes, inside the file they describe: the token count and the hash of the first and last MiB of its
tokens). Otherwise the ids are scanned once (with scan=True; read() in slices, never mapped whole) and the result
cached. Every JSON file is read through hpctrain.untrusted (size and depth bounded, no symbolic link): a bad
sidecar is refused, a bad or stale record or cache only means the ids are not known yet. Nothing read is trusted
beyond that identity: the loader checks every batch's ids again (hpctrain.data.loader.TokenLoader).
TokenSource is the interface every source follows. Most callers want hpctrain.data.sources.open_source, which
picks the class from the config and checks the file against the model; hpctrain.data.build writes these files
(build_dataset) and hpctrain.data.loader checks unrecorded files once per job (check_ids_at_start).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Callable, Iterator

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
    vocab_size: int  # 0 while max_id is None and the file records none
    max_id: int | None  # None: not known yet (a file opened with scan=False that no record describes)

    def read(self, start: int, count: int) -> np.ndarray:
        """tokens[start:start + count] as int64."""
        raise NotImplementedError

    def __len__(self) -> int:
        return self.num_tokens


SAMPLE_BYTES = 1 << 20  # a file's identity hashes its first and its last this many bytes
SCAN_TOKENS = 1 << 22  # tokens per slice of a scan (8-32 MB): between slices a caller reports progress
_IDS_ATTRS = ("min_id", "max_id", "ids_sample")  # what data build adds to an HDF5 dataset's attributes


def _sample(read_at: Callable[[int, int], bytes], size: int) -> str:
    """blake2b of the first SAMPLE_BYTES of `size` bytes and of the last SAMPLE_BYTES that do not overlap them;
    read_at(offset, count) gives the bytes."""
    h = hashlib.blake2b(digest_size=16)
    h.update(read_at(0, min(size, SAMPLE_BYTES)))
    tail = max(SAMPLE_BYTES, size - SAMPLE_BYTES)
    if tail < size:
        h.update(read_at(tail, size - tail))
    return h.hexdigest()


def file_identity(path: str | os.PathLike) -> dict[str, Any]:
    """{"size", "mtime_ns", "sample"}: what a record of a file's ids must match to count for that file. Costs a
    stat and 2 MiB read whatever the size. A changed file, or one copied again (a new mtime), matches no record."""
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())

        def read_at(offset: int, count: int) -> bytes:
            f.seek(offset)
            return f.read(count)
        return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sample": _sample(read_at, st.st_size)}


def tokens_sample(read_tokens: Callable[[int, int], np.ndarray], num_tokens: int, dtype: np.dtype) -> str:
    """_sample of a token stream as little-endian bytes of `dtype`, read_tokens(start, count) giving the tokens: the
    same hash as file_identity's of a raw file holding them (an HDF5 dataset's ids_sample attribute)."""
    le = np.dtype(dtype).newbyteorder("<")
    return _sample(lambda offset, count: np.asarray(read_tokens(offset // le.itemsize, count // le.itemsize),
                                                    dtype=le).tobytes(), num_tokens * le.itemsize)


def _entry_range(entry: Any, key: dict[str, Any]) -> tuple[int, int] | None:
    """(min_id, max_id) of a record or cache entry read from a file when it is one for `key` (file_identity and
    dtype); None when it is not, or is damaged. min_id is the smallest id if negative, else 0; max_id -1: empty."""
    if not isinstance(entry, dict):
        return None
    if any(type(entry.get(k)) is not type(v) or entry.get(k) != v for k, v in key.items()):
        return None
    low, high = entry.get("min_id"), entry.get("max_id")
    if type(low) is not int or type(high) is not int or low > 0 or high < -1:
        return None
    return low, high


# Ranges this process checked (or was sent by the rank that checked them) at job start, by absolute path: later
# openings of the same file in this process (the trainer's, the evaluator's) take them instead of scanning.
_checked_here: dict[str, dict[str, Any]] = {}


def remember(path: str | os.PathLike, entry: dict[str, Any]) -> None:
    """Keeps `entry` (the file's key, as TokenSource.identity, with min_id and max_id) for this process's later
    openings of `path`; they take it only while the file's identity still matches."""
    _checked_here[os.fsdecode(Path(path).absolute())] = dict(entry)


def _caches(path: Path, run_dir: str | os.PathLike | None) -> list[Path]:
    """Where a scan's result is kept, in the order tried: beside the file, the user's cache directory, the run
    directory (when the other two are not writable)."""
    home = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")  # stays "~/..." without a home
    digest = hashlib.blake2b(os.fsencode(path.absolute()), digest_size=10).hexdigest()
    out = [Path(f"{path}.ids.json")]
    if os.path.isabs(home):
        out.append(Path(home, "hpctrain", "ids", f"{digest}.json"))
    if run_dir is not None:
        out.append(Path(run_dir, "ids", f"{digest}.json"))
    return out


def known_range(path: Path, key: dict[str, Any], run_dir: str | os.PathLike | None = None) -> tuple[int, int] | None:
    """The range of ids an earlier check of this very file found (this process's, or a cache's), else None."""
    found = _entry_range(_checked_here.get(os.fsdecode(path.absolute())), key)
    for cache in _caches(path, run_dir):
        if found is not None:
            break
        try:
            found = _entry_range(read_json(cache, _MAX_CACHE_BYTES), key)
        except ValueError:
            pass  # missing, a link, too large, damaged (untrusted.Untrusted is a ValueError): not known
    return found


def write_cache(path: Path, entry: dict[str, Any], run_dir: str | os.PathLike | None = None) -> Path | None:
    """Keeps a scan's result in the first writable place of _caches; where, or None when none was."""
    for cache in _caches(path, run_dir):
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            # unique: two jobs may check the same file at once
            write_atomic(cache, json.dumps(entry) + "\n", unique=True)
            return cache
        except OSError:
            pass  # not writable: try the next place
    return None


def _scan_ids(source: "_PerProcess") -> Iterator[tuple[int, int, int]]:
    """The scan of a file's ids, a slice at a time: (tokens read, smallest id if negative else 0, largest id or -1
    when empty) after each slice, so a caller reports progress (or answers its peers) between slices."""
    low, high, done = 0, -1, 0
    for part in source._slices(SCAN_TOKENS):
        if part.size:
            low = min(low, int(np.min(part))) if part.dtype.kind == "i" else low
            high = max(high, int(np.max(part)))
        done += int(part.size)
        yield done, low, high


def scan(source: "_PerProcess", progress: Callable[[int], None] | None = None) -> tuple[int, int]:
    """(min_id, max_id) of the whole file, progress(tokens read) after each slice."""
    low, high = 0, -1
    for done, low, high in _scan_ids(source):
        if progress is not None:
            progress(done)
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
    """What a token file records about its tokenizer (hpctrain.data.tokenize writes it), checked: tokenizer,
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
    """A token file, opened on first use in each process: handles must not cross fork, and pickling drops them.
    Its ids: max_id, or None with `unchecked` saying why when no record proves them and none were scanned."""
    name: str
    path: Path
    num_tokens: int
    identity: dict[str, Any]  # file_identity and the dtype: the key every record of this file's ids must match
    unchecked: str = ""  # why max_id is None ("no record of its ids from data build"); "" once they are known

    def __init__(self) -> None:
        self._pid, self._handle = -1, None

    def _open(self) -> Any:
        raise NotImplementedError

    def _slices(self, step: int) -> Iterator[np.ndarray]:
        """The file's tokens in order, `step` at a time (the scan's reads)."""
        raise NotImplementedError

    def _get(self) -> Any:
        if self._pid != os.getpid():
            self._pid, self._handle = os.getpid(), self._open()
        return self._handle

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_pid": -1, "_handle": None}

    def _find_ids(self, dtype: np.dtype, recorded_vocab: int | None,
                  recorded: Callable[[dict[str, Any]], tuple[tuple[int, int] | None, str]], scan_ids: bool,
                  run_dir: str | os.PathLike | None) -> None:
        """The range of ids from data build's record (recorded(identity): the range when the record is for this
        file, and why not otherwise), an earlier check or, with scan_ids, a scan (cached); vocab_size the recorded
        one unless too small (metadata can understate it). Without any: max_id None, `unchecked` why, and not one
        id read."""
        if dtype.kind not in "iu":
            raise ValueError(f"{self.name!r} holds {dtype} tokens; token ids must be integers")
        self.identity = file_identity(self.path) | {"dtype": dtype.str}
        self._recorded_vocab = recorded_vocab
        found, why = recorded(self.identity)
        found = found or known_range(self.path, self.identity, run_dir)
        if found is None and scan_ids:
            found = scan(self)
            write_cache(self.path, self.identity | {"min_id": found[0], "max_id": found[1]}, run_dir)
        self.max_id, self.unchecked, self.vocab_size = None, why, recorded_vocab or 0
        if found is not None:
            self.set_range(*found)

    def set_range(self, low: int, high: int) -> None:
        """The file's ids are in [low, high] (low: the smallest if negative, else 0): negative ones are refused."""
        if low < 0:
            raise ValueError(f"{self.name!r} holds the negative token id {low}: ids must be >= 0")
        self.max_id, self.unchecked = high, ""
        self.vocab_size = max(self._recorded_vocab or 0, high + 1)


NO_RECORD = "no record of its ids from data build"
STALE_RECORD = "its record from data build is for another file (changed, or copied with a new mtime, since)"


class ArraySource(_PerProcess, TokenSource):
    """A .npy file or a raw little-endian file (.bin), each with an optional `<path>.json` sidecar.

    Without a sidecar a raw file is read as uint16. The ids' range comes from the sidecar's "ids" entry when it
    names this file (tokenfiles.file_identity), else as _find_ids finds it (scan=False: maybe not at all).
    """

    def __init__(self, path: str | Path, scan: bool = True, run_dir: str | os.PathLike | None = None) -> None:
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
        vocab = _count(meta.get("vocab_size"), f"sidecar {str(sidecar)!r}: vocab_size", 1)
        ids = meta.get("ids")  # data build's record: {file_identity, dtype, min_id, max_id}
        self._find_ids(array.dtype, vocab, lambda key: (_entry_range(ids, key), NO_RECORD if ids is None else
                                                        STALE_RECORD), scan, run_dir)
        self.record = _record(meta, self.name)

    def _open(self) -> np.ndarray:
        if self.dtype is None:
            return np.load(self.path, mmap_mode="r")
        return np.memmap(self.path, dtype=self.dtype, mode="r")

    def _slices(self, step: int) -> Iterator[np.ndarray]:
        # read() into one buffer, not the memmap: every page of a mapping walked to its end counts as this
        # process's memory (8.6 GB resident for an 8 GB file)
        array = self._get()
        dtype, n = array.dtype, self.num_tokens
        buf = bytearray(step * dtype.itemsize)
        with open(self.path, "rb") as f:
            f.seek(array.offset)  # .npy: past its header
            for start in range(0, n, step):
                want = min(step, n - start) * dtype.itemsize
                got = f.readinto(memoryview(buf)[:want])
                if got != want:
                    raise ValueError(f"{self.name!r} ended after {start + got // dtype.itemsize} of its {n} tokens "
                                     f"while its ids were checked: was it changed or truncated?")
                yield np.frombuffer(buf, dtype=dtype, count=want // dtype.itemsize)

    def read(self, start: int, count: int) -> np.ndarray:
        return np.asarray(self._get()[start:start + count], dtype=np.int64)


class HDF5Source(_PerProcess, TokenSource):
    """Dataset "tokens" of an HDF5 file (see build_dataset), with an optional vocab_size attribute, and the
    min_id, max_id and ids_sample attributes data build records (they count while num_tokens and ids_sample
    match the dataset)."""

    def __init__(self, path: str | Path, scan: bool = True, run_dir: str | os.PathLike | None = None) -> None:
        super().__init__()
        self.path = Path(path)
        self.name = str(self.path)
        with h5py.File(self.path, "r") as f:  # closed again: the real handle is opened per process
            dset = self._tokens(f)
            if dset.ndim != 1:
                raise ValueError(f"{self.name!r}: 'tokens' has shape {dset.shape}; tokens must be 1-d")
            self.num_tokens = int(dset.shape[0])
            recorded = _count(dset.attrs.get("vocab_size"), f"{self.name!r}: attribute vocab_size", 1)
            self._find_ids(dset.dtype, recorded, lambda key: self._attrs_range(dset), scan, run_dir)
            self.record = _record(dict(dset.attrs), self.name)

    def _attrs_range(self, dset: h5py.Dataset) -> tuple[tuple[int, int] | None, str]:
        """(min_id, max_id) from data build's attributes when they describe these tokens (the count and the
        sample hash match), else None and why not. Nothing of the ids is read but their first and last MiB."""
        attrs = {k: dset.attrs.get(k) for k in ("num_tokens", *_IDS_ATTRS)}
        if any(v is None for v in attrs.values()):
            return None, NO_RECORD
        values = {k: v.item() if isinstance(v, np.generic) else v for k, v in attrs.items()}
        sample = values.pop("ids_sample")
        sample = sample.decode("ascii", "replace") if isinstance(sample, bytes) else sample
        if (type(values["num_tokens"]) is not int or values["num_tokens"] != self.num_tokens
                or not isinstance(sample, str)  # an array attribute, say: crafted, no record
                or sample != tokens_sample(lambda i, k: dset[i:i + k], self.num_tokens, dset.dtype)):
            return None, STALE_RECORD
        found = _entry_range(values, {})
        return (found, "") if found is not None else (None, STALE_RECORD)

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

    def _slices(self, step: int) -> Iterator[np.ndarray]:
        dset = self._get()
        for start in range(0, self.num_tokens, step):
            yield dset[start:start + step]

    def read(self, start: int, count: int) -> np.ndarray:
        return np.asarray(self._get()[start:start + count], dtype=np.int64)
