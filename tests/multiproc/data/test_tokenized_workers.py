"""Tokenized builds with worker processes (`data build --tokenizer --workers`): 1 and 2 workers write the same bytes
and the validation split is fixed; long documents are encoded in pieces with one EOS, whatever the workers (the
build in this process: tests/pure/data/test_tokenized.py).

    PATH=$PWD/.venv/bin:$PATH .venv/bin/python -m pytest -q tests/multiproc/data/test_tokenized_workers.py
"""
from __future__ import annotations

import numpy as np
import pytest

from helpers.refusals import refused
from helpers.tokenized import EOS, split_docs
from hpctrain.data import tokenize as tokenized
from hpctrain.data.tokenfiles import ArraySource, HDF5Source, val_file


@pytest.mark.parametrize("suffix", [".bin", ".h5"])
def test_workers_write_the_same_bytes_and_the_split_is_fixed(bpe, inputs, tmp_path, suffix) -> None:
    args = ([inputs["texts"], inputs["root"] / "more.jsonl"], bpe)
    one = tokenized.build_tokenized(args[0], tmp_path / f"w1{suffix}", bpe, field="body", workers=1,
                                    val_fraction=0.25, seed=3)
    two = tokenized.build_tokenized(args[0], tmp_path / f"w2{suffix}", bpe, field="body", workers=2,
                                    val_fraction=0.25, seed=3)
    read = HDF5Source if suffix == ".h5" else ArraySource
    for a, b in ((one["path"], two["path"]), (one["val_path"], two["val_path"])):
        assert np.array_equal(read(a).read(0, 10 ** 6), read(b).read(0, 10 ** 6))
    total = one["documents"] + one["val_documents"]
    assert total == 40 and 3 <= one["val_documents"] <= 18  # about a quarter of 40
    assert one["val_path"] == val_file(one["path"]) and read(one["val_path"]).record["split"] == "val"
    other = tokenized.build_tokenized(args[0], tmp_path / f"s{suffix}", bpe, field="body", val_fraction=0.25,
                                      seed=4, workers=1)
    assert other["val_documents"] != one["val_documents"] or not np.array_equal(
        read(other["val_path"]).read(0, 10 ** 6), read(one["val_path"]).read(0, 10 ** 6))


def test_long_documents_are_encoded_in_pieces_with_one_eos(bpe, inputs, tmp_path, monkeypatch) -> None:
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(bpe))
    eos = tok.token_to_id(EOS)
    long_text = "no spaces here:" + "y" * 700 + "\n" + " ".join(["word"] * 300) + "\nend"
    (tmp_path / "long.txt").write_text(long_text)
    files = [inputs["texts"], inputs["root"] / "more.jsonl", tmp_path / "long.txt"]
    want = inputs["docs"][:10] + inputs["docs"][10:40] + [long_text]
    assert sum(len(d) > 200 for d in want) >= 10
    monkeypatch.setattr(tokenized, "_COPY_TOKENS", 7)  # the main process copies a worker's documents in pieces too
    built = {}
    for workers, piece_chars in ((1, 200), (2, 200), (1, tokenized.MAX_PIECE_CHARS)):
        s = tokenized.build_tokenized(files, tmp_path / f"w{workers}p{piece_chars}.bin", bpe, field="body",
                                      workers=workers, piece_chars=piece_chars, val_fraction=0.3, seed=5)
        splits = [ArraySource(p) for p in (s["path"], s["val_path"])]
        docs = [[tok.decode(d[:-1].tolist()) for d in split_docs(src.read(0, len(src)), eos)] for src in splits]
        assert sorted(docs[0] + docs[1]) == sorted(want)  # every document whole, one EOS each
        assert [src.record["num_docs"] for src in splits] == [len(d) for d in docs]
        built[workers, piece_chars] = [src.read(0, len(src)) for src in splits], docs
    (a, docs_a), (b, _), (_, docs_whole) = built.values()
    assert all(np.array_equal(x, y) for x, y in zip(a, b))  # any number of workers, the same bytes
    assert docs_a == docs_whole  # a document goes to one split whatever its pieces
    refused(tokenized.build_tokenized, files, tmp_path / "x.bin", bpe, piece_chars=1, fragments=["piece_chars 1"])
