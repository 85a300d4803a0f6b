"""Inputs for data builds: for byte-level ones (`hpctrain data build`) a small tree of text files; for tokenized
ones (`--tokenizer`) documents cut from this repository's own files,
the same documents written as text files, JSON lines (field "body") and gzip/bz2/xz inputs, and the split of a
built token stream back into documents."""
from __future__ import annotations

import bz2
import gzip
import json
import lzma
from pathlib import Path

import numpy as np
import pytest
from hfcheck import project_paragraphs, train_bpe

EOS = "<|endoftext|>"


def project_docs() -> list[str]:
    return project_paragraphs(60)


def write_inputs(root: Path) -> dict:
    """Under root: texts/ (documents 0-9), more.jsonl and more.jsonl.gz (10-39), a.txt.bz2 (40), b.txt.xz (41)."""
    docs = project_docs()
    texts = root / "texts"
    texts.mkdir()
    for i, d in enumerate(docs[:10]):
        (texts / f"d{i:02d}.txt").write_text(d)
    lines = "\n".join(json.dumps({"body": d, "id": i}) for i, d in enumerate(docs[10:40]))
    (root / "more.jsonl").write_text(lines + "\n")
    (root / "more.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
    (root / "a.txt.bz2").write_bytes(bz2.compress(docs[40].encode()))
    (root / "b.txt.xz").write_bytes(lzma.compress(docs[41].encode()))
    return {"root": root, "texts": texts, "docs": docs}


def split_docs(tokens: np.ndarray, eos: int) -> list[np.ndarray]:
    ends = np.flatnonzero(tokens == eos)
    assert ends.size and ends[-1] == tokens.size - 1  # every document, the last too, ends with EOS
    return np.split(tokens, ends + 1)[:-1]


def write_text_tree(root: Path) -> Path:
    """A small tree under root/src for byte-level builds: two text files, a nested one, a binary file under a text
    suffix and a cache directory, both of which a build must skip."""
    src = root / "src"
    (src / "sub").mkdir(parents=True)
    (src / "__pycache__").mkdir()
    (src / "b.md").write_text("# heading\nsome words\n")
    (src / "a.py").write_text("print('h\u00e9llo \u4e16\u754c')\n")
    (src / "sub" / "c.toml").write_text("[x]\ny = 1\n")
    (src / "blob.txt").write_bytes(b"\x89PNG\x00\x01\x02")  # binary under a text suffix: skipped
    (src / "ignored.bin").write_bytes(b"not a text suffix")
    (src / "__pycache__" / "d.py").write_text("cache = True\n")
    return src


# module-scoped fixtures of the tokenized-data tests (pure, worker and training tiers), offered to every test
# module by tests/conftest.py (pytest_plugins)
@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> Path:
    """A BPE tokenizer trained on this repository's own files, with EOS."""
    return train_bpe(tmp_path_factory.mktemp("tok") / "tokenizer.json", project_docs(), eos=EOS)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict:
    """write_inputs' files: text, JSON lines, compressed."""
    return write_inputs(tmp_path_factory.mktemp("inputs"))
