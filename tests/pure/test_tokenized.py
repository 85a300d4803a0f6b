"""`hpctrain data build OUT INPUTS... --tokenizer tokenizer.json`, in this process: a BPE tokenizer trained here
(on this repository's own files) encodes text files, JSON lines (--field) and gzip/bz2/xz inputs; every document
decodes back to its text and ends with the tokenizer's EOS; 1 and 2 worker processes write the same bytes; the
validation split takes the same documents every time, about the fraction asked; the record names the tokenizer
(sha256, vocab, EOS, documents) and a copy of it lies beside the data; uint32 ids when the vocabulary needs them;
mixed tokenizers, an EOS the model cannot embed and a tokenizer other than init_from's are refused; and the
built dataset (with its validation split) trains.

    PATH=$PWD/.venv/bin:$PATH .venv/bin/python -m pytest -q tests/pure/test_tokenized.py
"""
from __future__ import annotations

import bz2
import gzip
import hashlib
import json
import lzma
import math
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from hfcheck import project_paragraphs, train_bpe

from helpers import SMALL, refused
from hpctrain import session, tokenized
from hpctrain.cli import main as cli
from hpctrain.config import load_config
from hpctrain.tokenfiles import ArraySource, HDF5Source, check_records, tokenizer_file, val_file
from hpctrain.train import Trainer

EOS = "<|endoftext|>"


def _docs() -> list[str]:
    return project_paragraphs(60)


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> Path:
    return train_bpe(tmp_path_factory.mktemp("tok") / "tokenizer.json", _docs(), eos=EOS)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("inputs")
    docs = _docs()
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


def _split_docs(tokens: np.ndarray, eos: int) -> list[np.ndarray]:
    ends = np.flatnonzero(tokens == eos)
    assert ends.size and ends[-1] == tokens.size - 1  # every document, the last too, ends with EOS
    return np.split(tokens, ends + 1)[:-1]


def test_documents_round_trip_and_end_with_eos(bpe, inputs, tmp_path) -> None:
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(bpe))
    out = tmp_path / "all.bin"
    s = tokenized.build_tokenized([inputs["texts"], inputs["root"] / "more.jsonl.gz", inputs["root"] / "a.txt.bz2",
                                   inputs["root"] / "b.txt.xz"], out, bpe, field="body", workers=1)
    docs = inputs["docs"]
    want = docs[:10] + docs[10:40] + [docs[40], docs[41]]
    src = ArraySource(out)
    tokens = src.read(0, len(src))
    eos = tok.token_to_id(EOS)
    got = [tok.decode(d[:-1].tolist()) for d in _split_docs(tokens, eos)]
    assert got == want
    assert s["documents"] == len(want) and s["tokens"] == len(src) and s["dtype"] == "uint16"
    record = src.record
    assert record["tokenizer"] == "bpe" and record["eos_id"] == eos and record["num_docs"] == len(want)
    assert record["vocab_size"] == tok.get_vocab_size() and record["split"] == "train"
    assert record["tokenizer_sha256"] == hashlib.sha256(bpe.read_bytes()).hexdigest()
    assert tokenizer_file(out).read_bytes() == bpe.read_bytes()


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


def test_uint32_when_the_vocabulary_needs_it(tmp_path) -> None:
    ids = np.array([1, 70000, 5, 65536, 2], dtype="<u4")
    raw = tmp_path / "raw"
    record = {"dtype": "uint32", "byteorder": "little", "vocab_size": 70001, "tokenizer": "bpe",
              "tokenizer_sha256": "0" * 64, "eos_id": 2, "num_tokens": 5, "num_docs": 1, "split": "train"}
    assert tokenized._dtype(65536) == np.dtype("<u2") and tokenized._dtype(65537) == np.dtype("<u4")
    for suffix, reader in ((".bin", ArraySource), (".npy", ArraySource), (".h5", HDF5Source)):
        raw.write_bytes(ids.tobytes())  # a .bin takes it by rename
        tokenized._finish(raw, tmp_path / f"t{suffix}", record)
        src = reader(tmp_path / f"t{suffix}")
        assert src.read(0, 5).tolist() == ids.tolist() and src.vocab_size == 70001 and src.record["eos_id"] == 2


def test_bad_inputs_are_refused(bpe, inputs, tmp_path) -> None:
    root = inputs["root"]
    refused(tokenized.build_tokenized, [root / "more.jsonl"], tmp_path / "x.bin", bpe,
            fragments=["no string field 'text'"])
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\nnot json\n')
    refused(tokenized.build_tokenized, [tmp_path / "bad.jsonl"], tmp_path / "x.bin", bpe, fragments=["bad.jsonl:2"])
    refused(tokenized.build_tokenized, [inputs["texts"]], tmp_path / "x.bin", bpe, eos="<s>",
            fragments=["--eos '<s>' is not a token"])
    refused(tokenized.build_tokenized, [inputs["texts"]], tmp_path / "x.bin", bpe, val_fraction=1.0,
            fragments=["--val-fraction 1.0"])
    refused(tokenized.build_tokenized, [inputs["texts"]], tmp_path / "x.txt", bpe, fragments=["'.txt'"])
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    refused(tokenized.build_tokenized, [tmp_path / "latin1.txt"], tmp_path / "x.bin", bpe, fragments=["not UTF-8"])
    assert not (tmp_path / "x.bin").exists()


def test_records_are_checked_across_files_and_against_the_model(bpe, inputs, tmp_path) -> None:
    a = tokenized.build_tokenized([inputs["texts"]], tmp_path / "a.bin", bpe, workers=1)
    b = tmp_path / "b.bin"
    b.write_bytes(Path(a["path"]).read_bytes())
    meta = json.loads(Path(a["path"] + ".json").read_text())
    Path(str(b) + ".json").write_text(json.dumps(meta | {"tokenizer_sha256": "f" * 64}))
    sa, sb = ArraySource(a["path"]), ArraySource(b)
    check_records([sa], 512)
    refused(check_records, [sa, sb], 512, fragments=["different tokenizers", "a.bin", "b.bin"])
    refused(check_records, [sa], a["eos_id"], fragments=[f"eos_id = {a['eos_id']}", "model.vocab_size"])
    refused(check_records, [sa], 512, "e" * 64, fragments=["train.init_from's tokenizer.json"])
    Path(str(b) + ".json").write_text(json.dumps(meta | {"eos_id": 10 ** 6}))
    refused(ArraySource, b, fragments=["eos_id = 1000000 is not below its vocab_size"])


def test_cli_builds_and_the_dataset_trains(bpe, inputs, tmp_path) -> None:
    out = tmp_path / "data" / "corpus.bin"
    res = CliRunner().invoke(cli, ["data", "build", str(out), str(inputs["texts"]), str(inputs["root"] / "more.jsonl"),
                                   "--tokenizer", str(bpe), "--field", "body", "--val-fraction", "0.2",
                                   "--workers", "1"])
    assert res.exit_code == 0, res.output
    assert "documents" in res.output and "validation" in res.output
    bad = CliRunner().invoke(cli, ["data", "build", str(tmp_path / "b.bin"), str(inputs["texts"]), "--val-fraction",
                                   "0.1"])
    assert bad.exit_code == 2 and "--val-fraction need --tokenizer" in bad.output
    vocab = ArraySource(out).record["vocab_size"]
    cfg = load_config(None, SMALL + [f"model.vocab_size={vocab}", "data.source=bin", f"data.path={out}",
                                     "train.steps=3", "train.eval_every=3", "train.eval_batches=2",
                                     f"job.run_root={tmp_path / 'runs'}", f"checkpoint.dir={tmp_path / 'ck'}"])
    with session.start(cfg) as s:
        res = Trainer(cfg, s).fit()
    assert all(math.isfinite(v) for v in res["losses"]) and res["losses"][0] < math.log(vocab) + 0.5
    assert res["val_losses"][0][0] == 3 and math.isfinite(res["val_loss"])


def test_text_spelling_the_eos_token_stays_text(bpe, tmp_path) -> None:
    from tokenizers import Tokenizer
    doc = f"a document about tokenizers mentions {EOS} in its text"
    (tmp_path / "d.txt").write_text(doc)
    tokenized.build_tokenized([tmp_path / "d.txt"], tmp_path / "d.bin", bpe, workers=1)
    tokens = ArraySource(tmp_path / "d.bin").read(0, 10 ** 6)
    tok = Tokenizer.from_file(str(bpe))
    eos = tok.token_to_id(EOS)
    assert int((tokens == eos).sum()) == 1 and tokens[-1] == eos  # only the separator the builder adds
    assert tok.decode(tokens[:-1].tolist()) == doc


def test_progress_redraws_on_a_terminal_and_prints_lines_otherwise() -> None:
    import io

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    plain, tty = io.StringIO(), Tty()
    for stream in (plain, tty):
        show = tokenized.Progress(3, stream, every_s=0.0)
        show.last = -1e9  # the first update is due at once
        show.update(2, 100, 1000)
        show.update(0, 0, 0, final=True)
    text, redrawn = plain.getvalue(), tty.getvalue()
    lines = text.splitlines()
    assert len(lines) >= 2 and lines[0].startswith("files 1/3  documents 2  tokens 100") and "\r" not in text
    assert redrawn.startswith("\rfiles 1/3") and redrawn.endswith("\n") and redrawn.count("\n") == 1
