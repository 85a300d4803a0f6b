"""Pure tests of hpctrain.data.loader and hpctrain.data.tokenfiles: tokenizer, dataset files, token sources and the
resumable
sharded loader. A source read in a forked child: tests/multiproc/data/test_data_fork.py; the tiny model learning the
synthetic data: tests/multiproc/data/test_data_training.py.

    .venv/bin/python -m pytest tests/pure/data/test_data.py -q
"""
from __future__ import annotations

import json
import pickle
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from faults import record

from helpers.launch import REPO
from helpers.refusals import refused
from helpers.tokenized import write_text_tree
from hpctrain.config import DataConfig
from hpctrain.data.build import build_dataset, project_corpus_inputs
from hpctrain.data.loader import EOS, VOCAB_SIZE, TokenLoader, decode, encode
from hpctrain.data.sources import SyntheticSource, open_source
from hpctrain.data.tokenfiles import ArraySource, HDF5Source, file_identity

SUFFIX_SOURCE = {".bin": "bin", ".npy": "bin", ".h5": "hdf5", ".hdf5": "hdf5"}



def batches(loader: TokenLoader, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [loader.next_batch() for _ in range(n)]


def same(a: list[tuple[torch.Tensor, torch.Tensor]], b: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    return len(a) == len(b) and all(torch.equal(x1, x2) and torch.equal(y1, y2) for (x1, y1), (x2, y2) in zip(a, b))


@pytest.fixture
def texts(tmp_path: Path) -> Path:
    return write_text_tree(tmp_path)


def expected_tokens(*docs: str) -> list[int]:
    out: list[int] = []
    for i, doc in enumerate(docs):
        out += ([EOS] if i else []) + encode(doc)
    return out


# --- tokenizer ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text", ["", "plain ascii\n", "h\u00e9llo w\u00f6rld \u4e16\u754c \U0001f600", "tab\tand\r\n"])
def test_tokenizer_round_trip(text):
    ids = encode(text)
    assert all(0 <= i < VOCAB_SIZE for i in ids)
    assert EOS not in ids
    assert decode(ids) == text
    assert decode(torch.tensor(ids, dtype=torch.int64)) == text  # model output comes back as a tensor


def test_decode_of_a_cut_character_replaces_it():
    ids = encode("\u00e9")  # two bytes
    assert decode(ids[:1]) == "\ufffd"


# --- building datasets ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("suffix", [".bin", ".npy", ".h5", ".hdf5"])
def test_build_and_read_back_through_the_source(texts, tmp_path, suffix):
    out = tmp_path / "out" / f"corpus{suffix}"
    stats = build_dataset([texts], out)
    want = expected_tokens("print('h\u00e9llo \u4e16\u754c')\n", "# heading\nsome words\n", "[x]\ny = 1\n")
    assert stats["files"] == 3 and stats["skipped"] == 1 and stats["tokens"] == len(want)
    assert stats["bytes"] == out.stat().st_size > 0
    source = open_source(DataConfig(source=SUFFIX_SOURCE[suffix], path=str(out), seq_len=4), VOCAB_SIZE)
    assert len(source) == len(want) and source.vocab_size == VOCAB_SIZE
    got = source.read(0, len(want))
    assert got.dtype == np.int64 and got.tolist() == want
    assert source.read(5, 7).tolist() == want[5:12]
    # a source crosses a pickle (spawned workers) and reopens its file there
    assert pickle.loads(pickle.dumps(source)).read(3, 4).tolist() == want[3:7]


def test_formats_hold_what_plain_tools_expect(texts, tmp_path):
    build_dataset([texts], tmp_path / "c.bin")
    meta = json.loads((tmp_path / "c.bin.json").read_text())
    assert meta["dtype"] == "uint16" and meta["tokenizer"] == "bytes" and meta["vocab_size"] == 256
    raw = np.fromfile(tmp_path / "c.bin", dtype="<u2")
    assert raw.size == meta["num_tokens"]
    build_dataset([texts], tmp_path / "c.npy")
    assert np.load(tmp_path / "c.npy").dtype == np.uint16
    build_dataset([texts], tmp_path / "c.h5")
    with h5py.File(tmp_path / "c.h5", "r") as f:
        assert list(f.keys()) == ["tokens"]
        dset = f["tokens"]
        assert dset.dtype == np.uint16 and dset.chunks is not None
        assert dset.attrs["vocab_size"] == 256 and dset.attrs["tokenizer"] == "bytes"
        assert dset.attrs["num_tokens"] == raw.size
        assert np.array_equal(dset[...], raw)


def test_build_is_deterministic_and_takes_named_files(texts, tmp_path):
    build_dataset([texts], tmp_path / "one.bin")
    build_dataset([texts], tmp_path / "two.bin")
    assert (tmp_path / "one.bin").read_bytes() == (tmp_path / "two.bin").read_bytes()
    makefile = tmp_path / "Makefile"
    makefile.write_text("all:\n\ttrue\n")
    stats = build_dataset([makefile, texts / "b.md", texts / "b.md"], tmp_path / "named.npy")
    assert stats["files"] == 2  # named twice, counted once; a named file needs no text suffix
    assert np.load(tmp_path / "named.npy").tolist() == expected_tokens("all:\n\ttrue\n", "# heading\nsome words\n")


def test_bundled_corpus_is_the_project_itself(tmp_path):
    inputs = project_corpus_inputs()
    assert inputs[0] == REPO / "hpctrain"
    tokens = {}
    for suffix in (".bin", ".npy", ".h5"):
        stats = build_dataset(inputs, tmp_path / f"corpus{suffix}")
        assert stats["files"] > 5 and stats["tokens"] > 10_000
        source = open_source(DataConfig(source=SUFFIX_SOURCE[suffix], path=str(tmp_path / f"corpus{suffix}")), 256)
        tokens[suffix] = source.read(0, len(source))
    assert np.array_equal(tokens[".bin"], tokens[".npy"]) and np.array_equal(tokens[".bin"], tokens[".h5"])
    assert "def build_dataset" in decode(tokens[".bin"])


def test_build_refuses_bad_input(texts, tmp_path):
    refused(build_dataset, [texts], tmp_path / "c.txt", fragments=["c.txt", "'.txt'"])
    refused(build_dataset, [tmp_path / "missing"], tmp_path / "c.bin", fragments=["missing", "does not exist"])
    (tmp_path / "empty").mkdir()
    refused(build_dataset, [tmp_path / "empty"], tmp_path / "c.bin", fragments=["no text files", "empty"])
    refused(build_dataset, [texts / "blob.txt"], tmp_path / "c.bin", fragments=["no readable text", "1 files skipped"])
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary file left


def test_files_are_read_in_pieces_and_a_bad_one_is_cut_back_out(tmp_path, monkeypatch):
    """Byte level reads 1 MiB at a time (here 5 bytes): a multi-byte character across a piece boundary is text; a
    bad byte or a NUL found after earlier pieces were written leaves nothing of that file behind."""
    from hpctrain.data import build as databuild
    monkeypatch.setattr(databuild, "READ_BYTES", 5)
    root = tmp_path / "src"
    root.mkdir()
    a = "caf\u00e9 \u4e16\u754c \U0001f600 r\u00e9sum\u00e9\n" * 3
    d = "the last one\n"
    (root / "a.txt").write_text(a)
    (root / "b.txt").write_bytes(b"fine text for a while " * 3 + b"\xff and more")
    (root / "c.txt").write_bytes(b"fine text for a while " * 3 + b"\x00 and more")
    (root / "d.txt").write_text(d)
    (root / "e.txt").write_bytes("cut at the end \u00e9".encode()[:-1])
    (root / "f.txt").write_bytes(b"")
    stats = build_dataset([root], tmp_path / "c.bin")
    assert stats["files"] == 2 and stats["skipped"] == 3
    assert ArraySource(tmp_path / "c.bin").read(0, 10 ** 6).tolist() == expected_tokens(a, d)


# --- sources: checks ------------------------------------------------------------------------------------------

def test_vocab_too_big_for_the_model_names_both_numbers(texts, tmp_path):
    build_dataset([texts], tmp_path / "c.h5")
    cfg = DataConfig(source="hdf5", path=str(tmp_path / "c.h5"), seq_len=4)
    top = max(encode("print('h\u00e9llo \u4e16\u754c')\n"))  # the largest byte of the texts
    refused(open_source, cfg, 100, fragments=["c.h5", f"ids up to {top}", "model.vocab_size = 100"])
    # every id fits, but the file's tokenizer has more ids than the model can embed
    refused(open_source, cfg, top + 1, fragments=["records vocab_size 256", f"model.vocab_size = {top + 1}"])
    assert open_source(cfg, 256).max_id == top
    # without metadata the vocab is the largest id + 1, found by scanning
    np.save(tmp_path / "big.npy", np.array([1, 2, 999, 3, 4, 5], dtype=np.uint16))
    cfg = DataConfig(source="bin", path=str(tmp_path / "big.npy"), seq_len=2)
    refused(open_source, cfg, 512, fragments=["big.npy", "ids up to 999", "model.vocab_size = 512"])
    assert open_source(cfg, 1000).vocab_size == 1000


def test_data_build_records_the_ids_and_a_scan_caches_them_beside_the_file(texts, tmp_path):
    build_dataset([texts], tmp_path / "c.bin")
    source = open_source(DataConfig(source="bin", path=str(tmp_path / "c.bin"), seq_len=4), 256)
    ids = json.loads((tmp_path / "c.bin.json").read_text())["ids"]  # data build's record: no scan, no cache
    st = (tmp_path / "c.bin").stat()
    sample = file_identity(tmp_path / "c.bin")["sample"]
    assert ids == {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sample": sample, "dtype": "<u2", "min_id": 0,
                   "max_id": source.max_id}
    assert source.max_id == int(source.read(0, len(source)).max()) and not (tmp_path / "c.bin.ids.json").exists()
    (tmp_path / "raw.bin").write_bytes((tmp_path / "c.bin").read_bytes())  # no sidecar: scanned once, cached
    source = open_source(DataConfig(source="bin", path=str(tmp_path / "raw.bin"), seq_len=4), 256)
    cache = json.loads((tmp_path / "raw.bin.ids.json").read_text())
    assert cache == file_identity(tmp_path / "raw.bin") | {"dtype": "<u2", "min_id": 0, "max_id": source.max_id}
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_too_short_and_mismatched_paths_are_refused(tmp_path):
    np.arange(10, dtype=np.uint16).tofile(tmp_path / "short.bin")  # no sidecar: raw uint16
    cfg = DataConfig(source="bin", path=str(tmp_path / "short.bin"), seq_len=10)
    refused(open_source, cfg, 256, fragments=["10 tokens", "data.seq_len + 1 = 11"])
    assert len(open_source(DataConfig(source="bin", path=cfg.path, seq_len=9), 256)) == 10
    refused(open_source, DataConfig(source="hdf5", path=str(tmp_path / "short.bin")), 256,
            fragments=["short.bin", "'hdf5'"])
    refused(open_source, DataConfig(source="bin", path=str(tmp_path / "nope.bin")), 256,
            fragments=["nope.bin", "does not exist"])


def test_truncated_bin_is_caught_by_its_sidecar(texts, tmp_path):
    build_dataset([texts], tmp_path / "c.bin")
    raw = (tmp_path / "c.bin").read_bytes()
    (tmp_path / "c.bin").write_bytes(raw[:-20])
    refused(ArraySource, tmp_path / "c.bin", fragments=[f"{len(raw) // 2 - 10} tokens", f"{len(raw) // 2}"])






def test_hdf5_without_tokens_dataset(tmp_path):
    with h5py.File(tmp_path / "other.h5", "w") as f:
        f["weights"] = np.zeros(4)
    refused(HDF5Source, tmp_path / "other.h5", fragments=["'tokens'", "weights"])
    np.save(tmp_path / "grid.npy", np.zeros((4, 4), dtype=np.uint16))
    refused(ArraySource, tmp_path / "grid.npy", fragments=["(4, 4)", "1-d"])
    (tmp_path / "empty.bin").write_bytes(b"")
    refused(open_source, DataConfig(source="bin", path=str(tmp_path / "empty.bin")), 256,
            fragments=["empty.bin", "no tokens"])


# --- synthetic source -----------------------------------------------------------------------------------------

def test_synthetic_slices_are_reproducible_anywhere():
    a, b = SyntheticSource(256, seed=3), SyntheticSource(256, seed=3)
    assert np.array_equal(a.read(1000, 500), a.read(1000, 500))
    long = a.read(0, 5 * a.CHUNK)
    for start, count in [(0, 10), (a.CHUNK - 7, 20), (3 * a.CHUNK + 11, a.CHUNK + 5), (123, 1)]:
        assert np.array_equal(b.read(start, count), long[start:start + count])
    far = 2 ** 22 - 100  # read without generating anything before it
    assert np.array_equal(SyntheticSource(256, 3).read(far, 100), b.read(far, 100))
    assert len(a.read(far, 1000)) == 100  # clipped at num_tokens
    assert not np.array_equal(SyntheticSource(256, seed=4).read(0, 1000), long[:1000])


@pytest.mark.parametrize("vocab_size", [256, 7, 1000])
def test_synthetic_next_token_is_predictable(vocab_size):
    tokens = SyntheticSource(vocab_size, seed=0).read(0, 50_000)
    assert tokens.min() >= 0 and tokens.max() < vocab_size
    eos = tokens == EOS
    assert 1 / 257 < eos.mean() < 1 / 33  # documents of 32-256 tokens
    prev, cur, nxt = tokens[:-2], tokens[1:-1], tokens[2:]
    inside = (prev != EOS) & (cur != EOS) & (nxt != EOS)
    step = (cur - prev) % (vocab_size - 1)
    assert set(np.unique(step[inside]).tolist()) <= {1, 2, 3}
    # within a document the step from the two previous tokens gives the next one, always
    assert np.array_equal(((cur + step - 1) % (vocab_size - 1) + 1)[inside], nxt[inside])
    assert inside.mean() > 0.97




# --- loader ---------------------------------------------------------------------------------------------------

def loader(dp_rank: int = 0, dp_size: int = 1, micro_batch_size: int = 2, seed: int = 0, source=None) -> TokenLoader:
    source = source or SyntheticSource(256, seed=1, num_tokens=16 * 40 + 1)  # 40 samples of 16 + 1
    return TokenLoader(source, 16, micro_batch_size, dp_rank, dp_size, seed)


def test_batches_are_shifted_samples_of_the_stream():
    ld = loader(micro_batch_size=3)
    assert ld.num_samples == 40 and ld.tokens_per_global_micro_batch == 3 * 16
    x, y = ld.next_batch()
    assert x.shape == y.shape == (3, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    stream = ld.source.read(0, len(ld.source))
    for row, t in zip(x.tolist(), y[:, -1].tolist()):
        start = next(i for i in range(0, 640, 16) if stream[i:i + 16].tolist() == row)
        assert stream[start + 16] == t  # the sample's last token is the target of its last position


def test_dp_ranks_together_equal_one_process_with_the_global_batch():
    single = batches(loader(micro_batch_size=6), 5)
    for dp_size in (2, 3):
        ranks = [batches(loader(r, dp_size, micro_batch_size=6 // dp_size), 5) for r in range(dp_size)]
        for step in range(5):
            assert torch.equal(torch.cat([ranks[r][step][0] for r in range(dp_size)]), single[step][0])
            assert torch.equal(torch.cat([ranks[r][step][1] for r in range(dp_size)]), single[step][1])
    # tp/pp ranks sharing a dp rank build their own loader and must see the same batches
    assert same(batches(loader(1, 2, 3), 5), batches(loader(1, 2, 3), 5))


def test_successive_micro_batches_equal_one_bigger_batch():
    small = batches(loader(micro_batch_size=2), 8)  # 16 of 40 samples: one epoch
    big = batches(loader(micro_batch_size=8), 2)
    for k in range(2):
        assert torch.equal(torch.cat([x for x, _ in small[4 * k:4 * k + 4]]), big[k][0])
        assert torch.equal(torch.cat([y for _, y in small[4 * k:4 * k + 4]]), big[k][1])


def test_epochs_cover_samples_once_then_reshuffle():
    ld = loader(micro_batch_size=6)  # 40 samples: 6 global batches of 6 per epoch, 4 samples left over
    first = torch.cat([x for x, _ in batches(ld, 6)])
    assert ld.epoch == 0 and ld.sample_index == 36
    assert len({tuple(r) for r in first.tolist()}) == 36  # no sample twice within an epoch
    second = torch.cat([x for x, _ in batches(ld, 6)])
    assert ld.epoch == 1 and ld.samples_seen == 72
    assert not torch.equal(first, second)  # a new permutation
    again = loader(micro_batch_size=6)
    assert torch.equal(torch.cat([x for x, _ in batches(again, 12)]), torch.cat([first, second]))


def test_different_seeds_give_different_orders():
    assert not same(batches(loader(seed=0), 4), batches(loader(seed=1), 4))


@pytest.mark.parametrize("saved_dp,resumed_dp", [(1, 1), (2, 2), (2, 1), (1, 4), (4, 2)])
def test_resume_gives_the_uninterrupted_batches(saved_dp, resumed_dp):
    global_batch, steps_before, steps_after = 4, 7, 9  # crosses an epoch boundary (40 samples / 4 = 10 steps)
    reference = [batches(loader(r, resumed_dp, global_batch // resumed_dp), steps_before + steps_after)
                 for r in range(resumed_dp)]
    saved = [loader(r, saved_dp, global_batch // saved_dp, seed=0) for r in range(saved_dp)]
    for ld in saved:
        batches(ld, steps_before)
    states = [ld.state_dict() for ld in saved]
    assert all(s == states[0] for s in states)  # the position is global: every dp rank saves the same state
    assert states[0] == {"epoch": 0, "sample_index": 28, "seed": 0, "samples_seen": 28}
    for r in range(resumed_dp):
        resumed = loader(r, resumed_dp, global_batch // resumed_dp, seed=99)  # the saved seed wins
        resumed.load_state_dict(json.loads(json.dumps(states[0])))
        assert same(batches(resumed, steps_after), reference[r][steps_before:])


def test_loader_refuses_too_small_a_dataset_and_bad_ranks():
    refused(loader, micro_batch_size=21, dp_size=2, fragments=["40 samples", "21 * 2 = 42"])
    refused(loader, dp_rank=2, dp_size=2, fragments=["dp_rank = 2", "dp_size = 2"])
    ld = loader()
    refused(ld.load_state_dict, {"epoch": 0, "sample_index": 41, "seed": 0, "samples_seen": 0},
            fragments=["41", "40 samples"])


# --- sidecars and id caches are files we did not write (issue 25) ------------------------------------------------

@pytest.mark.faults
def test_sidecars_are_read_bounded_and_never_through_a_link(tmp_path):
    np.arange(100, dtype="<u2").tofile(tmp_path / "t.bin")
    side = tmp_path / "t.bin.json"
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(json.dumps({"vocab_size": 256}))
    cases = {
        "2 MiB": (lambda: side.write_text(json.dumps({"vocab_size": 256, "pad": "x" * (2 << 20)})),
                  ["bytes, more than the 1048576"]),
        "deep": (lambda: side.write_text('{"vocab_size": 256, "x": ' + "[" * 100000 + "]" * 100000 + "}"),
                 ["nested more than 64"]),
        "surrogate": (lambda: side.write_text('{"vocab_size": 256, "tokenizer": "bytes \\ud800"}'),
                      ["lone surrogate"]),
        "link": (lambda: side.symlink_to(elsewhere), ["symbolic link"]),
        "dangling link": (lambda: side.symlink_to(tmp_path / "gone.json"), ["symbolic link"]),
    }
    for name, (make, fragments) in cases.items():
        side.unlink(missing_ok=True)
        make()
        refused(ArraySource, tmp_path / "t.bin", fragments=[str(side), "not readable JSON", *fragments])
    side.unlink()
    assert ArraySource(tmp_path / "t.bin").vocab_size == 100  # no sidecar at all: raw uint16, scanned
    record("token file sidecar of 2 MiB, nested 100000 deep, holding a lone surrogate, or a (dangling) symlink",
           "ValueError naming the sidecar and what is wrong with it", tier="pure")


@pytest.mark.faults
def test_a_damaged_id_cache_is_scanned_again(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    np.array([1, 2, 300, 4], dtype="<u2").tofile(tmp_path / "t.bin")
    assert ArraySource(tmp_path / "t.bin").max_id == 300
    cache = tmp_path / "t.bin.ids.json"
    good = json.loads(cache.read_text())
    lie = tmp_path / "lie.json"
    lie.write_text(json.dumps(good | {"max_id": 5}))
    damaged = {
        "deep": lambda: cache.write_text(json.dumps(good)[:-1] + ', "x": ' + "[" * 100000 + "]" * 100000 + "}"),
        "100 KiB": lambda: cache.write_text(json.dumps(good | {"max_id": 5, "pad": "x" * 100000})),
        "link": lambda: cache.symlink_to(lie),
    }
    for name, make in damaged.items():
        cache.unlink()
        make()
        assert ArraySource(tmp_path / "t.bin").max_id == 300, name
        assert not cache.is_symlink() and json.loads(cache.read_text()) == good, name  # written anew
    assert json.loads(lie.read_text())["max_id"] == 5  # the link's target untouched
    record("token id cache nested 100000 deep, of 100 KiB with a lying max_id, or a symlink to a lying file",
           "ignored: the ids are scanned again (right max_id) and the cache rewritten as a plain file",
           tier="pure")
