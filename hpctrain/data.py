"""Tokens for training: a byte tokenizer, dataset files, random-access token sources and a resumable loader.

    python -m hpctrain.data data/corpus.bin              # the bundled corpus: this project's own text files
    python -m hpctrain.data data/notes.h5 notes/ a.txt   # any text files or directories

    source = open_source(cfg.data, cfg.model.vocab_size)  # synthetic data: seed= picks another stream
    loader = TokenLoader(source, cfg.data.seq_len, cfg.train.micro_batch_size, dp_rank, dp_size, cfg.train.seed)
    x, y = loader.next_batch()  # (micro_batch_size, seq_len) int64 each, y = x shifted by one

The loader's position is global (samples consumed by all dp ranks together), so a checkpoint taken with one dp
size resumes exactly with another. This module knows nothing of torch.distributed: ranks come in as ints.
"""
from __future__ import annotations

import hashlib
import json
import os
import secrets
import sys
from pathlib import Path
from typing import Any, Iterable

import h5py
import numpy as np
import torch

from hpctrain.config import DataConfig

# --- tokenizer --------------------------------------------------------------------------------------------

VOCAB_SIZE = 256
EOS = 0  # NUL: never part of text (files holding it are taken for binary and skipped)


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode(ids: Iterable[int]) -> str:
    # A window of a token stream can cut a multi-byte character: show U+FFFD rather than fail.
    return bytes(list(map(int, ids))).decode("utf-8", errors="replace")


# --- building dataset files -------------------------------------------------------------------------------

TEXT_SUFFIXES = (".py", ".md", ".toml", ".txt", ".sh", ".cfg")
OUT_SUFFIXES = (".bin", ".npy", ".h5", ".hdf5")
_SKIP_DIRS = ("__pycache__",)  # plus every hidden directory (.git, .venv)


def project_corpus_inputs() -> list[Path]:
    """The bundled training corpus: the hpctrain package and, beside it, README.md, Makefile and slurm/."""
    package = Path(__file__).resolve().parent
    beside = [package.parent / name for name in ("README.md", "Makefile", "slurm")]
    return [package] + [p for p in beside if p.exists()]


def _walk(directory: Path) -> list[Path]:
    found = []
    for path in directory.rglob("*"):
        parts = path.relative_to(directory).parts
        if any(p.startswith(".") or p in _SKIP_DIRS for p in parts[:-1]):
            continue
        if path.suffix in TEXT_SUFFIXES and path.is_file():
            found.append(path)
    return sorted(found)  # rglob order depends on the file system


def _input_files(inputs: list[Path]) -> list[Path]:
    files: list[Path] = []
    for item in map(Path, inputs):
        if item.is_dir():
            files.extend(_walk(item))
        elif item.is_file():
            files.append(item)  # named explicitly: taken whatever its suffix (Makefile)
        else:
            raise ValueError(f"dataset input {str(item)!r} does not exist")
    unique = list(dict.fromkeys(f.resolve() for f in files))  # a file named twice counts once
    if not unique:
        raise ValueError(f"no text files ({', '.join(TEXT_SUFFIXES)}) found in {[str(p) for p in inputs]}")
    return unique


def _read_text(path: Path) -> bytes | None:
    """The file's UTF-8 bytes, or None when it is unreadable or not text."""
    try:
        raw = path.read_bytes()
        raw.decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    return None if b"\x00" in raw else raw


def _write_tokens(tokens: np.ndarray, out: Path) -> None:
    """Writes to a temporary name first so a reader never sees half a file."""
    tmp = out.with_name(out.name + ".tmp")
    meta = {"dtype": "uint16", "byteorder": "little", "num_tokens": int(tokens.size),
            "vocab_size": VOCAB_SIZE, "tokenizer": "bytes"}
    if out.suffix == ".bin":
        tmp.write_bytes(tokens.astype("<u2").tobytes())
    elif out.suffix == ".npy":
        with open(tmp, "wb") as f:  # np.save on a path would append ".npy" to the temporary name
            np.save(f, tokens.astype("<u2"))
    else:
        with h5py.File(tmp, "w") as f:
            dset = f.create_dataset("tokens", data=tokens.astype("<u2"), chunks=(min(tokens.size, 1 << 16),))
            for key in ("vocab_size", "tokenizer", "num_tokens"):
                dset.attrs[key] = meta[key]
    if out.suffix in (".bin", ".npy"):  # HDF5 keeps the same record in attributes
        Path(str(out) + ".json").write_text(json.dumps(meta, indent=1) + "\n")
    os.replace(tmp, out)


def build_dataset(inputs: list[Path], out: Path) -> dict[str, Any]:
    """Tokenizes text files (directories are walked) into one token file, documents joined by EOS.

    The suffix of `out` picks the format: .bin (raw little-endian uint16) or .npy, each with a `<out>.json`
    sidecar (dtype, num_tokens, vocab_size, tokenizer), or .h5/.hdf5 (dataset "tokens", the same in attrs).
    Files that are unreadable or not UTF-8 text are skipped and counted; empty files are left out.
    Returns {"files", "skipped", "tokens", "bytes" (size of the token file written), "path"}.
    """
    out = Path(out)
    if out.suffix not in OUT_SUFFIXES:
        raise ValueError(f"dataset output {str(out)!r}: suffix {out.suffix!r} is not one of {', '.join(OUT_SUFFIXES)}")
    docs, skipped = [], 0
    for path in _input_files(inputs):
        text = _read_text(path)
        if text is None:
            skipped += 1
        elif text:
            docs.append(np.frombuffer(text, dtype=np.uint8))
    if not docs:
        raise ValueError(f"no readable text in {[str(p) for p in inputs]} ({skipped} files skipped)")
    pieces = []
    for i, doc in enumerate(docs):
        if i:
            pieces.append(np.array([EOS], dtype=np.uint8))
        pieces.append(doc)
    tokens = np.concatenate(pieces).astype(np.uint16)
    out.parent.mkdir(parents=True, exist_ok=True)
    _write_tokens(tokens, out)
    return {"files": len(docs), "skipped": skipped, "tokens": int(tokens.size),
            "bytes": out.stat().st_size, "path": str(out)}


# --- token sources ----------------------------------------------------------------------------------------

class TokenSource:
    """Random access to one long token stream by offset. Every id is in [0, vocab_size); max_id is the largest."""
    name: str  # for messages: the file, or "synthetic data"
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
            entry = json.loads(cache.read_text())
            if {k: entry[k] for k in key} == key and type(entry["min_id"]) is type(entry["max_id"]) is int:
                return entry["min_id"], entry["max_id"]
        except (OSError, ValueError, KeyError, TypeError):
            pass  # missing, unreadable or damaged: scan
    low, high = _scan_ids(array, n)
    for cache in caches:
        tmp = cache.with_name(f"{cache.name}.{secrets.token_hex(4)}.tmp")  # ranks may scan at once: own names
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(key | {"min_id": low, "max_id": high}) + "\n")
            os.replace(tmp, cache)
            break
        except OSError:
            tmp.unlink(missing_ok=True)
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
    try:
        meta = json.loads(sidecar.read_text()) if sidecar.exists() else {}
    except (OSError, ValueError) as e:
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
            dset = f.get("tokens")
            if not isinstance(dset, h5py.Dataset):
                raise ValueError(f"{self.name!r} has no dataset 'tokens' (it holds {sorted(f.keys())})")
            if dset.ndim != 1:
                raise ValueError(f"{self.name!r}: 'tokens' has shape {dset.shape}; tokens must be 1-d")
            self.num_tokens = int(dset.shape[0])
            recorded = _count(dset.attrs.get("vocab_size"), f"{self.name!r}: attribute vocab_size", 1)
            self._check_ids(dset, recorded)

    def _open(self) -> h5py.File:
        return h5py.File(self.path, "r")  # kept open: one handle per process for its whole life

    def read(self, start: int, count: int) -> np.ndarray:
        return np.asarray(self._get()["tokens"][start:start + count], dtype=np.int64)


class SyntheticSource(TokenSource):
    """Endless-looking learnable text with no file: documents of 32-256 tokens separated by EOS.

    Each document counts up from a random start by a step in {1, 2, 3}, wrapping within ids 1..vocab_size-1
    (so it never emits EOS inside a document): after two tokens the rest is predictable, and a tiny model's
    loss falls well below log(vocab_size). The stream is cut into chunks, each generated from its own
    RNG seeded by (seed, chunk index), so any slice is reproducible without generating what comes before it;
    a chunk ends with EOS, cutting its last document short.
    """
    CHUNK = 4096  # tokens; generating one costs ~0.1 ms
    MIN_DOC, MAX_DOC = 32, 256

    def __init__(self, vocab_size: int, seed: int, num_tokens: int = 2 ** 22) -> None:
        if vocab_size < 2:
            raise ValueError(f"synthetic data needs vocab_size >= 2 (EOS plus one token), got {vocab_size}")
        self.vocab_size, self.seed, self.num_tokens = vocab_size, seed, num_tokens
        self.name, self.max_id = "synthetic data", vocab_size - 1

    def _chunk(self, index: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, index])
        num_docs = self.CHUNK // (self.MIN_DOC + 1) + 1  # enough documents to fill a chunk even if all are short
        lengths = rng.integers(self.MIN_DOC, self.MAX_DOC + 1, size=num_docs)
        starts = rng.integers(0, self.vocab_size - 1, size=num_docs)
        steps = rng.integers(1, 4, size=num_docs)
        ends = np.cumsum(lengths + 1)  # each document is followed by one EOS
        pos = np.arange(self.CHUNK)
        doc = np.searchsorted(ends, pos, side="right")
        offset = pos - (ends[doc] - lengths[doc] - 1)
        body = 1 + (starts[doc] + steps[doc] * offset) % (self.vocab_size - 1)
        tokens = np.where(offset == lengths[doc], EOS, body).astype(np.int64)
        tokens[-1] = EOS  # the document cut by the chunk boundary ends here, like any other
        return tokens

    def read(self, start: int, count: int) -> np.ndarray:
        stop = min(start + count, self.num_tokens)
        if stop <= start:
            return np.zeros(0, dtype=np.int64)
        first, last = start // self.CHUNK, (stop - 1) // self.CHUNK
        joined = np.concatenate([self._chunk(i) for i in range(first, last + 1)])
        return joined[start - first * self.CHUNK:stop - first * self.CHUNK]


def open_source(cfg: DataConfig, vocab_size: int, seed: int = 0) -> TokenSource:
    """The token source [data] describes, checked against the model: ids fit its vocab, one sequence fits.

    `seed` only matters for synthetic data (the trainer passes train.seed); files carry their own tokens.
    """
    name = "synthetic data" if cfg.source == "synthetic" else f"data.path = {cfg.path!r}"
    if cfg.source == "synthetic":
        source: TokenSource = SyntheticSource(vocab_size, seed)
    else:
        path = Path(cfg.path)
        if not path.is_file():
            raise ValueError(f"data.path = {cfg.path!r} does not exist")
        is_hdf5 = path.suffix in (".h5", ".hdf5")
        if is_hdf5 != (cfg.source == "hdf5"):
            raise ValueError(f"data.path = {cfg.path!r} does not fit data.source = {cfg.source!r} "
                             f"(hdf5 reads .h5/.hdf5, bin reads .bin/.npy)")
        try:
            source = HDF5Source(path) if is_hdf5 else ArraySource(path)
        except OSError as e:
            raise ValueError(f"data.path = {cfg.path!r} cannot be read as {cfg.source}: {e}") from None
    if source.max_id >= vocab_size:
        raise ValueError(f"{name} holds token ids up to {source.max_id} but model.vocab_size = {vocab_size}: "
                         f"every id must be < vocab_size")
    if source.vocab_size > vocab_size:
        raise ValueError(f"{name} records vocab_size {source.vocab_size} (ids up to {source.max_id}) but "
                         f"model.vocab_size = {vocab_size}: the model must embed every id of its tokenizer")
    if len(source) < cfg.seq_len + 1:
        raise ValueError(f"{name} holds {len(source)} tokens, fewer than one sequence of "
                         f"data.seq_len + 1 = {cfg.seq_len + 1}")
    return source


# --- loader -----------------------------------------------------------------------------------------------

class TokenLoader:
    """Shuffled, non-overlapping samples of seq_len + 1 tokens, sharded over data-parallel ranks.

    Each next_batch() consumes one global micro-batch: the next micro_batch_size * dp_size samples of the
    epoch's permutation, of which dp rank r takes the slice [r * B:(r + 1) * B]. Hence dp ranks' batches
    concatenated equal one process with B * dp_size, and k batches of B equal one of k * B (within an epoch).
    An epoch ends when fewer than a global micro-batch of samples remain; the rest are left for that epoch.
    """

    def __init__(self, source: TokenSource, seq_len: int, micro_batch_size: int, dp_rank: int, dp_size: int,
                 seed: int) -> None:
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank = {dp_rank} must be in [0, dp_size = {dp_size})")
        if seq_len < 1 or micro_batch_size < 1:
            raise ValueError(f"seq_len = {seq_len} and micro_batch_size = {micro_batch_size} must be >= 1")
        self.source, self.seq_len, self.micro_batch_size = source, seq_len, micro_batch_size
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self.num_samples = (len(source) - 1) // seq_len  # sample i ends at token i * seq_len + seq_len
        self.global_batch = micro_batch_size * dp_size
        if self.num_samples < self.global_batch:
            raise ValueError(f"{len(source)} tokens make {self.num_samples} samples of seq_len + 1 = {seq_len + 1}, "
                             f"fewer than one global micro-batch of micro_batch_size * dp_size = "
                             f"{micro_batch_size} * {dp_size} = {self.global_batch}")
        self.epoch, self.sample_index, self.samples_seen = 0, 0, 0
        self._perm_key, self._perm = (-1, -1), np.zeros(0, dtype=np.int64)

    @property
    def tokens_per_global_micro_batch(self) -> int:
        """Predicted tokens per next_batch() over all dp ranks."""
        return self.global_batch * self.seq_len

    def _permutation(self) -> np.ndarray:
        if self._perm_key != (self.seed, self.epoch):  # load_state_dict may change either
            rng = np.random.default_rng([self.seed, self.epoch])
            self._perm_key, self._perm = (self.seed, self.epoch), rng.permutation(self.num_samples)
        return self._perm

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.sample_index + self.global_batch > self.num_samples:
            self.epoch, self.sample_index = self.epoch + 1, 0
        lo = self.sample_index + self.dp_rank * self.micro_batch_size
        indices = self._permutation()[lo:lo + self.micro_batch_size]
        self.sample_index += self.global_batch
        self.samples_seen += self.global_batch
        rows = np.stack([self.source.read(int(i) * self.seq_len, self.seq_len + 1) for i in indices])
        bad = rows[(rows < 0) | (rows >= self.source.vocab_size)]
        if bad.size:  # open_source checked the whole file, but a file rewritten since can hold anything
            raise ValueError(f"{self.source.name!r} holds token id {int(bad[0])} outside vocab_size "
                             f"{self.source.vocab_size}, checked when it was opened: was the file changed since?")
        tokens = torch.from_numpy(rows)  # (B, seq_len + 1) int64
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "sample_index": self.sample_index, "seed": self.seed,
                "samples_seen": self.samples_seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continues where the saved loader stopped, with its seed; the dp size may differ from the saver's."""
        if not 0 <= int(state["sample_index"]) <= self.num_samples:
            raise ValueError(f"loader state sample_index = {state['sample_index']} is outside this dataset's "
                             f"{self.num_samples} samples: was it saved for another dataset or seq_len?")
        self.epoch, self.sample_index = int(state["epoch"]), int(state["sample_index"])
        self.seed, self.samples_seen = int(state["seed"]), int(state["samples_seen"])


def main(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):
        print("usage: python -m hpctrain.data OUT.{bin,npy,h5} [INPUT ...]  (no inputs: the bundled corpus)")
        return 2
    inputs = [Path(a) for a in argv[1:]] or project_corpus_inputs()
    print(json.dumps(build_dataset(inputs, Path(argv[0]))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
