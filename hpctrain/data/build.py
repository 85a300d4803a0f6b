"""Dataset files from text: the byte tokenizer (token id = byte value, EOS = 0) and `hpctrain data build OUT
[INPUTS...]` without --tokenizer, which writes the bundled corpus and any text files as byte-level tokens.

    python -m hpctrain.data.build data/corpus.bin              # the bundled corpus: this project's own text files
    python -m hpctrain.data.build data/notes.h5 notes/ a.txt   # any text files or directories

The formats are the ones hpctrain.data.tokenfiles reads: .bin or .npy with a `<out>.json` sidecar, or HDF5 (dataset
"tokens", the record in its attributes). The record includes the range of the ids written, tied to the file it
describes (write_token_file), so submission and job start check the ids without reading them. Files are read
in pieces and tokens written as they come: memory stays bounded whatever the size of a file. Tokenizer-built
datasets (BPE): hpctrain.data.tokenize. No torch here.
"""
from __future__ import annotations

import codecs
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any, BinaryIO, Iterable

import h5py
import numpy as np

from hpctrain.data.tokenfiles import file_identity
from hpctrain.fsutil import replacing, write_atomic

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
    """The bundled training corpus: the hpctrain package and, beside it, README.md, docs/, Makefile and slurm/ (the
    docs/ pages hold what README.md held before it became a front page: the corpus keeps the same text)."""
    package = Path(__file__).resolve().parents[1]
    beside = [package.parent / name for name in ("README.md", "docs", "Makefile", "slurm")]
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


READ_BYTES = 1 << 20  # a file is read, checked and written in pieces of this size: memory never holds a whole file


def _append_text(path: Path, sink: BinaryIO, separator: bool) -> tuple[int, int] | None:
    """Appends the file's bytes to `sink` as uint16 tokens, preceded by EOS when `separator`; returns how many bytes
    of text it held and the largest, or None when it is unreadable or not text (not UTF-8, or holding NUL), after
    cutting `sink` back to where it was. Read in pieces: the whole file is never in memory."""
    start, n, high = sink.tell(), 0, 0
    check = codecs.getincrementaldecoder("utf-8")()  # strict: the same verdict as decoding the whole file
    try:
        with open(path, "rb") as f:
            while chunk := f.read(READ_BYTES):
                check.decode(chunk)
                if b"\x00" in chunk:
                    raise UnicodeError("NUL")
                if separator and n == 0:
                    sink.write(np.array([EOS], dtype="<u2").tobytes())
                ids = np.frombuffer(chunk, dtype=np.uint8)
                sink.write(ids.astype("<u2").tobytes())
                n, high = n + len(chunk), max(high, int(ids.max()))
        check.decode(b"", final=True)  # a character cut off at the end
    except (OSError, UnicodeError):
        sink.seek(start)
        sink.truncate()
        return None
    return n, high


def write_token_file(raw: Path, out: Path, record: dict[str, Any], attrs: tuple[str, ...]) -> int:
    """Makes `out` from `raw`, a file of little-endian token ids of record["dtype"] (record["num_tokens"] of them),
    in the format out's suffix picks, with `record` as its sidecar (.bin, .npy) or the `attrs` keys of it as the
    HDF5 dataset's attributes; returns out's size. `raw` is consumed: .bin takes it by rename, .npy puts a header
    before a copy, HDF5 copies it into a chunked dataset in pieces. Nothing is ever held whole in memory.

    record["min_id"] and record["max_id"], when given (the range of the ids written: the builder saw each), become
    the record of the ids that spares every later reader a scan (hpctrain.data.tokenfiles): the sidecar's "ids" entry,
    naming the finished file by tokenfiles.file_identity (taken before its rename, which keeps size and mtime), or
    the attributes min_id, max_id and ids_sample (the hash of the tokens' first and last MiB) of an HDF5 dataset."""
    dtype = np.dtype(record["dtype"]).newbyteorder("<")
    n = record["num_tokens"]
    ids = {k: record[k] for k in ("min_id", "max_id") if k in record}
    sidecar = {k: v for k, v in record.items() if k not in ids}
    with replacing(out) as tmp:
        if out.suffix == ".bin":
            os.replace(raw, tmp)
        elif out.suffix == ".npy":
            with open(tmp, "wb") as f, open(raw, "rb") as src:  # np.save on a path would append ".npy" to tmp
                np.lib.format.write_array_header_1_0(f, {"descr": dtype.str, "fortran_order": False,
                                                         "shape": (n,)})
                shutil.copyfileobj(src, f, 1 << 24)
        else:
            step = 1 << 22
            # read(), not a memmap: the pages of a memmap walked to its end all count as this process's memory
            with h5py.File(tmp, "w") as f, open(raw, "rb") as src:
                dset = f.create_dataset("tokens", shape=(n,), dtype=dtype, chunks=(max(1, min(n, 1 << 16)),))
                for i in range(0, n, step):
                    dset[i:i + step] = np.frombuffer(src.read(step * dtype.itemsize), dtype=dtype)
                for key in attrs:
                    dset.attrs[key] = record[key]
                if ids:  # raw holds the tokens as little-endian bytes: its sample is theirs
                    dset.attrs.update(ids | {"num_tokens": n, "ids_sample": file_identity(raw)["sample"]})
        if out.suffix in (".bin", ".npy"):
            if ids:
                sidecar["ids"] = file_identity(tmp) | {"dtype": dtype.str} | ids
            write_atomic(Path(f"{out}.json"), json.dumps(sidecar, indent=1) + "\n")
    return out.stat().st_size


def build_dataset(inputs: list[Path], out: Path) -> dict[str, Any]:
    """Tokenizes text files (directories are walked) into one token file, documents joined by EOS.

    The suffix of `out` picks the format: .bin (raw little-endian uint16) or .npy, each with a `<out>.json`
    sidecar (dtype, num_tokens, vocab_size, tokenizer), or .h5/.hdf5 (dataset "tokens", the same in attrs).
    Files that are unreadable or not UTF-8 text are skipped and counted; empty files are left out. Files are
    streamed in pieces into a temporary file beside `out`: memory stays bounded whatever their size.
    Returns {"files", "skipped", "tokens", "bytes" (size of the token file written), "path"}.
    """
    out = Path(out)
    if out.suffix not in OUT_SUFFIXES:
        raise ValueError(f"dataset output {str(out)!r}: suffix {out.suffix!r} is not one of {', '.join(OUT_SUFFIXES)}")
    files = _input_files(inputs)
    out.parent.mkdir(parents=True, exist_ok=True)
    raw = out.with_name(f".{out.name}.{os.getpid()}.raw")
    docs = skipped = tokens = 0
    high = EOS  # the largest id written
    try:
        with open(raw, "wb") as sink:
            for path in files:
                got = _append_text(path, sink, separator=docs > 0)
                if got is None:
                    skipped += 1
                elif got[0]:
                    tokens += got[0] + (docs > 0)
                    docs += 1
                    high = max(high, got[1])
        if not docs:
            raise ValueError(f"no readable text in {[str(p) for p in inputs]} ({skipped} files skipped)")
        record = {"dtype": "uint16", "byteorder": "little", "num_tokens": tokens, "vocab_size": VOCAB_SIZE,
                  "tokenizer": "bytes", "min_id": EOS, "max_id": high}
        size = write_token_file(raw, out, record, attrs=("vocab_size", "tokenizer", "num_tokens"))
    finally:
        raw.unlink(missing_ok=True)
    return {"files": docs, "skipped": skipped, "tokens": tokens, "bytes": size, "path": str(out)}


def main(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):
        print("usage: python -m hpctrain.data.build OUT.{bin,npy,h5} [INPUT ...]  (no inputs: the bundled corpus)")
        return 2
    inputs = [Path(a) for a in argv[1:]] or project_corpus_inputs()
    print(json.dumps(build_dataset(inputs, Path(argv[0]))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
