"""Dataset files from text: the byte tokenizer (token id = byte value, EOS = 0) and `hpctrain data build OUT
[INPUTS...]` without --tokenizer, which writes the bundled corpus and any text files as byte-level tokens.

    python -m hpctrain.databuild data/corpus.bin              # the bundled corpus: this project's own text files
    python -m hpctrain.databuild data/notes.h5 notes/ a.txt   # any text files or directories

The formats are the ones hpctrain.tokenfiles reads: .bin or .npy with a `<out>.json` sidecar, or HDF5 (dataset
"tokens", the record in its attributes). Tokenizer-built datasets (BPE): hpctrain.tokenized. No torch here.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Iterable

import h5py
import numpy as np

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


def write_tokens(tokens: np.ndarray, out: Path) -> None:
    """Writes `tokens` (byte-tokenizer ids, stored as little-endian uint16; the record says vocab_size VOCAB_SIZE,
    tokenizer "bytes") to `out` in the format its suffix picks, as build_dataset describes: .bin or .npy with a
    `<out>.json` sidecar, anything else HDF5 (dataset "tokens", the record in its attrs). Writes to a temporary
    name first so a reader never sees half a file."""
    meta = {"dtype": "uint16", "byteorder": "little", "num_tokens": int(tokens.size),
            "vocab_size": VOCAB_SIZE, "tokenizer": "bytes"}
    if out.suffix in (".bin", ".npy"):  # HDF5 keeps the same record in attributes
        write_atomic(Path(str(out) + ".json"), json.dumps(meta, indent=1) + "\n")
    with replacing(out) as tmp:
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
    write_tokens(tokens, out)
    return {"files": len(docs), "skipped": skipped, "tokens": int(tokens.size),
            "bytes": out.stat().st_size, "path": str(out)}


def main(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):
        print("usage: python -m hpctrain.databuild OUT.{bin,npy,h5} [INPUT ...]  (no inputs: the bundled corpus)")
        return 2
    inputs = [Path(a) for a in argv[1:]] or project_corpus_inputs()
    print(json.dumps(build_dataset(inputs, Path(argv[0]))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
