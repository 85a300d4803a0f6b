"""`hpctrain data build OUT INPUTS... --tokenizer tokenizer.json`, in this process: a BPE tokenizer trained here (on
this repository's own files) encodes text files, JSON lines (--field) and gzip/bz2/xz inputs; every document decodes
back to its text and ends with the tokenizer's EOS; the validation split takes about the fraction asked; the record
names the tokenizer (sha256, vocab, EOS, documents) and a copy of it lies beside the data; uint32 ids when the
vocabulary needs them; mixed tokenizers, an EOS the model cannot embed and a tokenizer other than init_from's are
refused. Worker processes (the same bytes, a fixed split, long documents in pieces):
tests/multiproc/data/test_tokenized_workers.py; the built dataset trains:
tests/multiproc/data/test_tokenized_training.py.

    PATH=$PWD/.venv/bin:$PATH .venv/bin/python -m pytest -q tests/pure/data/test_tokenized.py
"""
from __future__ import annotations

import bz2
import gzip
import hashlib
import json
import lzma
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from faults import record

from helpers.refusals import refused
from helpers.tokenized import EOS, project_docs, split_docs
from hpctrain.cli.main import main as cli
from hpctrain.data import tokenize as tokenized
from hpctrain.data.tokenfiles import ArraySource, HDF5Source, check_records, tokenizer_file


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
    got = [tok.decode(d[:-1].tolist()) for d in split_docs(tokens, eos)]
    assert got == want
    assert s["documents"] == len(want) and s["tokens"] == len(src) and s["dtype"] == "uint16"
    record = src.record
    assert record["tokenizer"] == "bpe" and record["eos_id"] == eos and record["num_docs"] == len(want)
    assert record["vocab_size"] == tok.get_vocab_size() and record["split"] == "train"
    assert record["tokenizer_sha256"] == hashlib.sha256(bpe.read_bytes()).hexdigest()
    assert tokenizer_file(out).read_bytes() == bpe.read_bytes()




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


# --- bounded reading: documents in pieces, text in pieces, clean errors (issue 25) ------------------------------

@pytest.mark.parametrize("cap", [2, 7, 50, 1000])
def test_split_document_keeps_the_text_and_cuts_at_lines_or_spaces(cap) -> None:
    text = "first line\nsecond  line with words\n" * 5 + "x" * 120 + " tail\tend\r\n\n"
    whole = list(tokenized.split_document([text], cap))
    assert "".join(p for p, _ in whole) == text and all(0 < len(p) <= cap for p, _ in whole)
    assert [last for _, last in whole] == [False] * (len(whole) - 1) + [True]
    if cap >= len(text):
        assert whole == [(text, True)]  # a document up to the cap is given whole, as before
    if cap == 50:  # a newline in the second half of the window wins, else a space (before it), else the cap
        assert whole[0][0] == "first line\nsecond  line with words\nfirst line\n"  # the last newline in [25, 50)
        assert all(p.endswith("\n") or p[-1] != " " for p, _ in whole)
    # read in chunks of any size, the same pieces
    for size in (1, 3, 64):
        chunks = [text[i:i + size] for i in range(0, len(text), size)]
        assert list(tokenized.split_document(chunks, cap)) == whole
    assert list(tokenized.split_document([], cap)) == list(tokenized.split_document([""], cap)) == []


def test_text_read_in_pieces_decodes_as_text_mode_did(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(tokenized, "READ_BYTES", 5)  # every character and line end lands on a piece boundary
    text = "caf\u00e9 \u4e16\u754c\r\nline\rnext\r\n\r\n\U0001f600 \u00e9\u00e9\u00e9\r"
    for shift in range(6):
        path = tmp_path / f"t{shift}.txt"
        path.write_bytes(("." * shift + text).encode("utf-8"))
        with open(path, encoding="utf-8") as f:  # what the old whole-file read gave
            want = f.read()
        pieces = list(tokenized.document_pieces(path))
        assert "".join(p for p, _ in pieces) == want and pieces[-1][1]
    (tmp_path / "late.txt").write_bytes(b"a" * 13 + "\u00e9".encode() + b"b" * 20 + b"\xff tail")
    refused(list, tokenized.document_pieces(tmp_path / "late.txt"), fragments=["late.txt", "not UTF-8", "byte 35"])
    (tmp_path / "cut.txt").write_bytes(b"abcdefg" + "\u00e9".encode()[:1])
    refused(list, tokenized.document_pieces(tmp_path / "cut.txt"), fragments=["cut.txt", "not UTF-8", "byte 7"])




BAD_LINES = {
    "surrogate.jsonl": ('{"text": "fine"}\n{"text": "a \\ud800 b"}\n', ["surrogate.jsonl:2", "lone surrogate"]),
    "deep.jsonl": ('{"text": "x", "m": ' + "[" * 100000 + "]" * 100000 + "}\n", ["deep.jsonl:1", "nested more"]),
    "latin1.jsonl": (b'{"text": "ok"}\n\n{"text": "caf\xe9"}\n', ["latin1.jsonl:3", "not UTF-8"]),
    "notjson.jsonl": ('{"text": "ok"}\n{"text": \n', ["notjson.jsonl:2", "not JSON"]),
    "nofield.jsonl": ('{"text": "ok"}\n{"body": "x"}\n', ["nofield.jsonl:2", "no string field 'text'"]),
    "number.jsonl": ('{"text": 7}\n', ["number.jsonl:1", "no string field 'text'"]),
}


def _damaged_streams(tmp_path: Path) -> dict[str, list[str]]:
    """Compressed inputs that are cut short or damaged inside: each must be refused naming the file."""
    # fixed text, not the project's paragraphs (_docs): where 64 zeroed bytes land in a stream depends on the
    # compressed bytes, and with text that changes with every edit of README.md a bz2 stream was once damaged where
    # the garbage it decoded to failed as "not UTF-8" before its block checksum was reached
    words = ["rank", "shard", "token", "layer", "node", "mesh", "step", "grad", "save", "load", "queue", "batch"]
    body = "\n".join(" ".join(words[(i * 7 + j * 5) % len(words)] for j in range(40)) for i in range(300)).encode()
    gz, bz, xz = gzip.compress(body), bz2.compress(body), lzma.compress(body)
    streams = {"cut.txt.gz": gz[:len(gz) // 2], "flipped.txt.gz": gz[:200] + bytes(64) + gz[264:],
               "cut.txt.bz2": bz[:len(bz) // 2], "flipped.txt.bz2": bz[:200] + bytes(64) + bz[264:],
               "cut.txt.xz": xz[:len(xz) // 2], "flipped.txt.xz": xz[:200] + bytes(64) + xz[264:],
               "notgz.jsonl.gz": b"plain text, not gzip\n"}
    for name, data in streams.items():
        (tmp_path / name).write_bytes(data)
    return {name: [name, "cannot be read"] for name in streams}


@pytest.mark.faults
def test_bad_lines_and_damaged_streams_are_clean_errors(bpe, tmp_path) -> None:
    cases = {name: fragments for name, (_, fragments) in BAD_LINES.items()} | _damaged_streams(tmp_path)
    for name, (content, _) in BAD_LINES.items():
        (tmp_path / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    for name, fragments in cases.items():
        res = CliRunner().invoke(cli, ["data", "build", str(tmp_path / "o.bin"), str(tmp_path / name),
                                       "--tokenizer", str(bpe), "--workers", "1"])
        assert res.exit_code == 2, (name, res.output, res.exception)  # a usage error, not a traceback
        assert all(f in res.output for f in fragments), (name, res.output)
    assert not (tmp_path / "o.bin").exists()
    record("JSON line with a lone surrogate, nested 100000 deep, not UTF-8, not JSON or without the text field",
           "exit 2 naming the file and line, no output written", tier="cli")
    record("input .gz/.bz2/.xz cut short or with 64 zeroed bytes inside, or not gzip at all",
           "exit 2 naming the file (cannot be read), no output written", tier="cli")


def test_zstd_frames_are_all_read_and_a_cut_stream_is_an_error(bpe, tmp_path) -> None:
    zstandard = pytest.importorskip("zstandard")
    docs = project_docs()
    frames = [zstandard.ZstdCompressor().compress("\n".join(docs[:30]).encode()),
              zstandard.ZstdCompressor(write_checksum=True).compress(("\n" + "\n".join(docs[30:])).encode())]
    data = b"".join(frames)  # several frames, as pzstd and concatenated files have
    (tmp_path / "ok.txt.zst").write_bytes(data)
    out = tmp_path / "ok.bin"
    tokenized.build_tokenized([tmp_path / "ok.txt.zst"], out, bpe, workers=1)
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(bpe))
    assert tok.decode(ArraySource(out).read(0, 10 ** 6)[:-1].tolist()) == "\n".join(docs)
    # zstandard's own reader ends a cut stream silently: the rest of the file would be lost unnoticed. Damage is
    # found in the frame with a checksum (in the other, zeroed bytes can decode to valid text)
    for name, damaged in (("cut.txt.zst", data[:len(frames[0]) + len(frames[1]) // 2]),
                          ("zeroed.txt.zst", data[:len(frames[0]) + 100] + bytes(64) + data[len(frames[0]) + 164:])):
        (tmp_path / name).write_bytes(damaged)
        msg = refused(tokenized.build_tokenized, [tmp_path / name], tmp_path / "x.bin", bpe, workers=1,
                      fragments=[name])
        assert "cannot be read" in msg or (name.startswith("zeroed") and "not UTF-8" in msg), msg
    assert "ends inside a frame" in refused(tokenized.build_tokenized, [tmp_path / "cut.txt.zst"], tmp_path / "x.bin",
                                            bpe, workers=1, fragments=["cut.txt.zst"])
    record("input .zst cut inside its last frame (zstandard's reader ends there silently)",
           "ValueError naming the file: the stream ends inside a frame; a two-frame file reads whole", tier="pure")


def test_a_json_line_past_the_bound_is_refused_and_the_bound_can_be_raised(bpe, tmp_path) -> None:
    from tokenizers import Tokenizer
    text = ("a long document line " * 80000)[:(3 << 19)]  # 1.5 MiB: two pieces
    (tmp_path / "big.jsonl").write_text(json.dumps({"text": "short"}) + "\n" + json.dumps({"text": text}) + "\n")
    refused(tokenized.build_tokenized, [tmp_path / "big.jsonl"], tmp_path / "x.bin", bpe, max_line_mib=1,
            workers=1, fragments=["big.jsonl:2", "longer than 1 MiB", "--max-line-mib"])
    res = CliRunner().invoke(cli, ["data", "build", str(tmp_path / "x.bin"), str(tmp_path / "big.jsonl"),
                                   "--tokenizer", str(bpe), "--max-line-mib", "0"])
    assert res.exit_code == 2 and "--max-line-mib 0" in res.output
    res = CliRunner().invoke(cli, ["data", "build", str(tmp_path / "x.bin"), str(tmp_path / "big.jsonl"),
                                   "--max-line-mib", "2"])
    assert res.exit_code == 2 and "--max-line-mib need --tokenizer" in res.output
    res = CliRunner().invoke(cli, ["data", "build", str(tmp_path / "ok.bin"), str(tmp_path / "big.jsonl"),
                                   "--tokenizer", str(bpe), "--max-line-mib", "2", "--workers", "1"])
    assert res.exit_code == 0, res.output
    tok = Tokenizer.from_file(str(bpe))
    docs = split_docs(ArraySource(tmp_path / "ok.bin").read(0, 10 ** 7), tok.token_to_id(EOS))
    assert [tok.decode(d[:-1].tolist()) for d in docs] == ["short", text]
