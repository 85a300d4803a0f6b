"""Token datasets made with a real tokenizer: `hpctrain data build OUT INPUTS... --tokenizer tokenizer.json`.

    stats = build_tokenized([Path("corpus/")], Path("data/web.bin"), Path("tokenizer.json"), val_fraction=0.01)

Inputs are text files (each file one document), JSON lines (`*.jsonl`, `*.json`: one document per line, its text
under `field`), either of them compressed (.gz, .bz2, .xz; .zst when the zstandard package is there), and
directories of those. Each document is encoded by the tokenizer (the `tokenizers` library's tokenizer.json,
special tokens neither added nor read from the text) and followed by the tokenizer's EOS id. Files are encoded
by `workers` processes in parallel and written in input order, so the output is the same bytes for any number
of workers. A document goes to the validation split ("<stem>.val<suffix>" beside OUT) when a hash of (seed, its
index) falls below val_fraction: the same documents whatever the workers or formats. Ids are uint16 when the
vocabulary fits (<= 65536), else uint32. The record (sidecar JSON or HDF5 attributes) holds the tokenizer's
sha256, vocab size, EOS id and the document count, and a copy of tokenizer.json goes beside OUT
(tokenfiles.tokenizer_file), so a run records and checks which tokenizer made its data. Everything is written
under temporary names and renamed.
"""
from __future__ import annotations

import bz2
import gzip
import hashlib
import json
import lzma
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import h5py
import numpy as np

from hpctrain.databuild import OUT_SUFFIXES, TEXT_SUFFIXES
from hpctrain.fsutil import replacing, write_atomic
from hpctrain.tokenfiles import tokenizer_file, val_file

EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")
JSONL_SUFFIXES = (".jsonl", ".json")
COMPRESSED = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open, ".zst": None}
_MAX_TOKENIZER_BYTES = 64 << 20


def _zstd_open(path: Path, mode: str):
    try:
        import zstandard
    except ImportError:
        raise ValueError(f"{str(path)!r} is zstd-compressed: pip install zstandard to read it") from None
    return zstandard.open(path, mode)


def _kind(path: Path) -> tuple[str, str] | None:
    """(compression suffix or "", "jsonl" | "text") of an input file, None when it is neither."""
    comp = path.suffix if path.suffix in COMPRESSED else ""
    inner = Path(path.name[:-len(comp)] if comp else path.name).suffix
    if inner in JSONL_SUFFIXES:
        return comp, "jsonl"
    if inner in TEXT_SUFFIXES or inner == "":
        return comp, "text"
    return None


def input_files(inputs: list[Path]) -> list[Path]:
    """The files to encode, in a fixed order: named files as given, directories walked (sorted), hidden ones
    skipped; a name given twice counts once."""
    files: list[Path] = []
    for item in map(Path, inputs):
        if item.is_dir():
            files += sorted(p for p in item.rglob("*") if p.is_file() and _kind(p) is not None
                            and not any(part.startswith(".") for part in p.relative_to(item).parts))
        elif item.is_file():
            files.append(item)
        else:
            raise ValueError(f"dataset input {str(item)!r} does not exist")
    unique = list(dict.fromkeys(f.resolve() for f in files))
    if not unique:
        raise ValueError(f"no input files (text, JSON lines, compressed) found in {[str(p) for p in inputs]}")
    return unique


def documents(path: Path, field: str) -> Iterator[str]:
    """The documents of one input file: the whole text, or each JSON line's `field`."""
    kind = _kind(path) or ("", "text")
    opener = _zstd_open if kind[0] == ".zst" else COMPRESSED.get(kind[0]) or open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            if kind[1] == "text":
                text = f.read()
                if text:
                    yield text
                return
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except ValueError as e:
                    raise ValueError(f"{path}:{number}: not a JSON line ({e})") from None
                text = obj.get(field) if isinstance(obj, dict) else None
                if not isinstance(text, str):
                    raise ValueError(f"{path}:{number}: no string field {field!r} (--field names it)")
                if text:
                    yield text
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except (OSError, EOFError, lzma.LZMAError) as e:
        raise ValueError(f"{path}: cannot be read: {e}") from None


def load_tokenizer(path: Path):
    """The `tokenizers` Tokenizer of a tokenizer.json, and its bytes' sha256."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ValueError("--tokenizer needs the tokenizers package: pip install 'hpctrain[hf]'") from None
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--tokenizer {str(path)!r} does not exist")
    if path.stat().st_size > _MAX_TOKENIZER_BYTES:
        raise ValueError(f"--tokenizer {str(path)!r} is {path.stat().st_size} bytes: too large for a tokenizer.json")
    raw = path.read_bytes()
    try:
        tok = Tokenizer.from_str(raw.decode("utf-8"))
    except Exception as e:  # the Rust library raises its own exception type
        raise ValueError(f"--tokenizer {str(path)!r} is not a tokenizers tokenizer.json: {e}") from None
    return tok, hashlib.sha256(raw).hexdigest()


def eos_id(tok, eos: str | None, where: str) -> int:
    names = [eos] if eos else list(EOS_CANDIDATES)
    for name in names:
        found = tok.token_to_id(name)
        if found is not None:
            return int(found)
    if eos:
        raise ValueError(f"--eos {eos!r} is not a token of {where}")
    raise ValueError(f"{where} has none of the EOS tokens {', '.join(EOS_CANDIDATES)}: name its EOS with --eos")


_WORKER: dict[str, Any] = {}


def _init_worker(tokenizer_json: str) -> None:
    from tokenizers import Tokenizer
    tok = Tokenizer.from_str(tokenizer_json)
    # text that spells a special token ("<|endoftext|>" in a document about tokenizers) stays text: only the
    # builder puts EOS ids between documents
    tok.encode_special_tokens = True
    _WORKER["tok"] = tok


def _encode_file(args: tuple[str, str]) -> tuple[list[np.ndarray], int]:
    """One input file's documents as token arrays (int64), and its size in bytes. Runs in a worker process."""
    path, field = args
    tok = _WORKER["tok"]
    docs, batch = [], []
    for text in documents(Path(path), field):
        batch.append(text)
        if len(batch) == 256:
            docs += [np.asarray(e.ids, dtype=np.int64) for e in tok.encode_batch(batch, add_special_tokens=False)]
            batch = []
    if batch:
        docs += [np.asarray(e.ids, dtype=np.int64) for e in tok.encode_batch(batch, add_special_tokens=False)]
    return docs, Path(path).stat().st_size


def in_val(seed: int, index: int, fraction: float) -> bool:
    """Whether document `index` goes to the validation split: a hash of (seed, index) below the fraction."""
    if fraction <= 0:
        return False
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0 ** 64 < fraction


class Progress:
    """Documents, tokens and input MB/s: one redrawn line on a terminal, else a plain line every `every_s`."""

    def __init__(self, total_files: int, stream=None, every_s: float = 10.0) -> None:
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.total, self.every_s, self.t0, self.last = total_files, every_s, time.monotonic(), 0.0
        self.files = self.docs = self.tokens = self.bytes = 0

    def update(self, docs: int, tokens: int, nbytes: int, final: bool = False) -> None:
        self.files += 0 if final else 1
        self.docs, self.tokens, self.bytes = self.docs + docs, self.tokens + tokens, self.bytes + nbytes
        now = time.monotonic()
        if not (final or now - self.last >= (0.2 if self.tty else self.every_s)):
            return
        self.last = now
        rate = self.bytes / 1e6 / max(now - self.t0, 1e-9)
        line = (f"files {self.files}/{self.total}  documents {self.docs}  tokens {self.tokens}  "
                f"{rate:.1f} MB/s")
        self.stream.write(("\r" + line + ("\n" if final else "")) if self.tty else line + "\n")
        self.stream.flush()


def _dtype(vocab: int) -> np.dtype:
    return np.dtype("<u2") if vocab <= 1 << 16 else np.dtype("<u4")


def _finish(raw: Path, out: Path, record: dict[str, Any]) -> int:
    """The raw little-endian tokens in `raw` as `out` in the format its suffix picks, with the record; returns its
    size. .bin is renamed into place; .npy gets its header; HDF5 a chunked dataset copied in pieces."""
    dtype = np.dtype(record["dtype"]).newbyteorder("<")
    n = record["num_tokens"]
    if out.suffix in (".bin", ".npy"):
        write_atomic(Path(f"{out}.json"), json.dumps(record, indent=1) + "\n")
    with replacing(out) as tmp:
        if out.suffix == ".bin":
            shutil.copyfile(raw, tmp)
        elif out.suffix == ".npy":
            with open(tmp, "wb") as f, open(raw, "rb") as src:
                np.lib.format.write_array_header_1_0(f, {"descr": dtype.str, "fortran_order": False,
                                                         "shape": (n,)})
                shutil.copyfileobj(src, f, 1 << 24)
        else:
            step = 1 << 24
            source = np.memmap(raw, dtype=dtype, mode="r") if n else np.zeros(0, dtype)
            with h5py.File(tmp, "w") as f:
                dset = f.create_dataset("tokens", shape=(n,), dtype=dtype, chunks=(max(1, min(n, 1 << 16)),))
                for i in range(0, n, step):
                    dset[i:i + step] = source[i:i + step]
                for key, value in record.items():
                    if key not in ("dtype", "byteorder"):
                        dset.attrs[key] = value
    return out.stat().st_size


def build_tokenized(inputs: list[Path], out: Path, tokenizer: Path, field: str = "text", val_fraction: float = 0.0,
                    seed: int = 0, workers: int = 0, eos: str | None = None,
                    progress: Callable[[int, int, int], None] | None = None) -> dict[str, Any]:
    """Encodes the inputs into `out` (and its validation split); see the module docstring. Returns
    {"path", "val_path", "documents", "val_documents", "tokens", "val_tokens", "files", "dtype", "vocab_size",
    "eos_id", "tokenizer_sha256", "bytes"}."""
    out = Path(out)
    if out.suffix not in OUT_SUFFIXES:
        raise ValueError(f"dataset output {str(out)!r}: suffix {out.suffix!r} is not one of {', '.join(OUT_SUFFIXES)}")
    if not 0 <= val_fraction < 1:
        raise ValueError(f"--val-fraction {val_fraction} must be in [0, 1)")
    tok, sha = load_tokenizer(tokenizer)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    eos_token = eos_id(tok, eos, f"--tokenizer {str(tokenizer)!r}")
    files = input_files(inputs)
    dtype = _dtype(vocab)
    workers = workers or min(os.cpu_count() or 1, 8)
    out.parent.mkdir(parents=True, exist_ok=True)
    raws = {split: out.with_name(f".{out.name}.{split}.{os.getpid()}.raw") for split in ("train", "val")}
    counts = {split: [0, 0] for split in raws}  # documents, tokens
    index = 0
    show = Progress(len(files)) if progress is None else None
    eos_arr = np.asarray([eos_token], dtype=dtype)
    try:
        with open(raws["train"], "wb") as train_f, open(raws["val"], "wb") as val_f:
            sinks = {"train": train_f, "val": val_f}
            jobs = [(str(f), field) for f in files]
            if workers > 1 and len(files) > 1:
                import multiprocessing as mp
                ctx = mp.get_context("spawn")  # no fork: the tokenizers library's threads must not cross it
                pool = ctx.Pool(min(workers, len(files)), initializer=_init_worker,
                                initargs=(Path(tokenizer).read_text(encoding="utf-8"),))
                results = pool.imap(_encode_file, jobs)  # in input order, whatever finishes first
            else:
                pool = None
                _init_worker(Path(tokenizer).read_text(encoding="utf-8"))
                results = map(_encode_file, jobs)
            try:
                for docs, nbytes in results:
                    ntok = 0
                    for doc in docs:
                        split = "val" if in_val(seed, index, val_fraction) else "train"
                        sinks[split].write(doc.astype(dtype).tobytes())
                        sinks[split].write(eos_arr.tobytes())
                        counts[split][0] += 1
                        counts[split][1] += doc.size + 1
                        ntok += doc.size + 1
                        index += 1
                    (progress or show.update)(len(docs), ntok, nbytes)
            finally:
                if pool is not None:
                    pool.terminate()
        if show is not None:
            show.update(0, 0, 0, final=True)
        if counts["train"][0] == 0:
            raise ValueError(f"no document went to the training split of {str(out)!r} ({index} documents read)")
        if val_fraction > 0 and counts["val"][0] == 0:
            raise ValueError(f"--val-fraction {val_fraction}: none of the {index} documents fell into the "
                             f"validation split; raise it or give more documents")
        base = {"dtype": dtype.name, "byteorder": "little", "vocab_size": vocab,
                "tokenizer": _model_type(tokenizer), "tokenizer_sha256": sha, "eos_id": eos_token}
        size = _finish(raws["train"], out, base | {"num_tokens": counts["train"][1],
                                                    "num_docs": counts["train"][0], "split": "train"})
        val_path = None
        if val_fraction > 0:
            val_path = Path(val_file(str(out)))
            size += _finish(raws["val"], val_path, base | {"num_tokens": counts["val"][1],
                                                           "num_docs": counts["val"][0], "split": "val"})
        with replacing(tokenizer_file(out)) as tmp:
            shutil.copyfile(tokenizer, tmp)
    finally:
        for raw in raws.values():
            raw.unlink(missing_ok=True)
    return {"path": str(out), "val_path": str(val_path) if val_path else None, "files": len(files),
            "documents": counts["train"][0], "val_documents": counts["val"][0], "tokens": counts["train"][1],
            "val_tokens": counts["val"][1], "dtype": dtype.name, "vocab_size": vocab, "eos_id": eos_token,
            "tokenizer_sha256": sha, "bytes": size}


def _model_type(tokenizer: Path) -> str:
    """"bpe", "unigram", "wordpiece"...: the model type tokenizer.json names (lower case), "unknown" otherwise."""
    try:
        kind = json.loads(Path(tokenizer).read_text(encoding="utf-8")).get("model", {}).get("type")
    except (ValueError, AttributeError):
        kind = None
    return kind.lower() if isinstance(kind, str) else "unknown"
