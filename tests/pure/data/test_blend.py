"""Blends (data.paths + data.weights), in this process: every prefix of the mix is within one sample of each
file's share; the same seed gives the same samples and another seed others from the same files in the same mix;
the sample stream is one global sequence whatever the batch, so dp ranks' batches concatenated equal one
process's, and a state saved by the read-ahead loader or by one dp size resumes exactly in the other loader and at
other dp sizes, across a small file's epoch; a small file starts its next epoch (reshuffled, complete) while a
large one does not; the single-file loader's saved state still loads and the two kinds of state are refused by
the other loader; every file is checked as data.path is, named in the message, and files of different tokenizers
are refused; blended validation reads every file in order, the same batches every time, sharded as training;
refusals. Training runs on a blend: tests/multiproc/data/test_blend_training.py.

Two sets of files (tests/helpers/blends.py): `files`, a big and a small one mixed 3:1; `blend`, three files with
validation siblings mixed 5:1:2.

    PATH=$PWD/.venv/bin:$PATH .venv/bin/python -m pytest -q tests/pure/data/test_blend.py
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from faults import record

from helpers.blends import BASE, SEQ, VOCAB, sample_file
from helpers.refusals import refused
from hpctrain.config import load_config
from hpctrain.data import loader as data
from hpctrain.data.blend import BlendedSamples, BlendLoader, blend_order
from hpctrain.data.sources import open_source, open_sources
from hpctrain.data.tokenfiles import ArraySource


def _loader(files, micro, rank=0, dp=1, seed=0, shares=(0.75, 0.25)) -> BlendLoader:
    return BlendLoader([ArraySource(f) for f in files], list(shares), SEQ, micro, rank, dp, seed)


def _cfg(paths: list[str], *sets: str):
    return load_config(None, BASE + [f"data.paths={paths}", "data.weights=[5.0, 1.0, 2.0]", *sets]).data


def _loaders(paths, micro: int, dp: int, seed: int = 0) -> list[BlendLoader]:
    cfg = _cfg(paths)
    sources = open_sources(cfg, VOCAB)
    return [data.make_loader(cfg, sources, micro, r, dp, seed) for r in range(dp)]


def _global(loaders, steps: int) -> list[torch.Tensor]:
    """`steps` global micro-batches: the dp ranks' rows concatenated, inputs and targets side by side."""
    out = []
    for _ in range(steps):
        parts = [ld.next_batch() for ld in loaders]
        out.append(torch.cat([torch.cat([x, y[:, -1:]], dim=1) for x, y in parts]))
    return out


def _stream(batches) -> torch.Tensor:
    return torch.cat(batches)


def test_every_prefix_is_within_one_sample_of_its_share() -> None:
    shares = [0.5, 0.3, 0.2]
    drawn = [0, 0, 0]
    order = blend_order(shares, drawn, 1000)
    counts = np.zeros(3)
    for g, f in enumerate(order, 1):
        counts[f] += 1
        assert np.all(np.abs(counts - np.array(shares) * g) <= 1.0), (g, counts)
    assert drawn == [500, 300, 200]
    assert blend_order(shares, [0, 0, 0], 10) == order[:10]  # a function of the counts alone


def test_same_seed_same_samples_another_seed_other_samples_in_the_same_mix(blend) -> None:
    a, b = _stream(_global(_loaders(blend, 8, 1), 10)), _stream(_global(_loaders(blend, 8, 1), 10))
    assert torch.equal(a, b)
    other = _stream(_global(_loaders(blend, 8, 1, seed=1), 10))
    assert not torch.equal(a, other)
    file_of = lambda rows: (rows[:, 0] >= 3000).long() + (rows[:, 0] >= 3500).long()  # noqa: E731
    assert torch.equal(file_of(a), file_of(other))  # which file each sample comes from depends on counts alone
    assert file_of(a).bincount().tolist() == [50, 10, 20]  # 80 samples at 5:1:2, exactly
    assert torch.equal(a[:, 1:], a[:, :-1] + 1)  # every row is one contiguous sample of seq_len + 1 tokens


def test_dp_shards_concatenate_and_resume_exactly(files) -> None:
    one = _loader(files, 4)
    want = [one.next_batch()[0] for _ in range(12)]
    halves = [_loader(files, 2, r, 2) for r in range(2)]
    for k in range(12):
        assert torch.equal(want[k], torch.cat([h.next_batch()[0] for h in halves]))
    first = _loader(files, 4)
    for _ in range(5):
        first.next_batch()
    state = json.loads(json.dumps(first.state_dict()))  # as train_state.json holds it
    resumed = _loader(files, 4)
    resumed.load_state_dict(state)
    assert all(torch.equal(resumed.next_batch()[0], want[k]) for k in range(5, 12))


@pytest.mark.parametrize("saved, resumed", [((8, 1), (4, 2)), ((2, 4), (8, 1)), ((4, 2), (1, 4)), ((6, 1), (3, 2))])
def test_resume_across_dp_sizes_and_the_read_ahead_thread(blend, saved, resumed) -> None:
    """(micro, dp) saved -> (micro, dp) resumed; the read-ahead loader saves and plain ones resume, then the other
    way. 9 global batches cross the small file's first epoch (7 samples, 1/8 of the mix) more than once."""
    (sm, sd), (rm, rd) = saved, resumed
    want = _stream(_global(_loaders(blend, rm, rd), 3 * (sm * sd) // (rm * rd) + 9))
    pre = [data.PrefetchLoader(ld, depth=3) for ld in _loaders(blend, sm, sd)]
    done = _stream(_global(pre, 3))
    state = json.loads(json.dumps(pre[0].state_dict()))  # as train_state.json holds it
    assert all(p.state_dict() == state for p in pre) and sum(state["drawn"]) == 3 * sm * sd
    assert all(p.close() for p in pre)
    assert torch.equal(done, want[:len(done)])
    plain = _loaders(blend, rm, rd)
    for ld in plain:
        ld.load_state_dict(state)
    got = _stream(_global(plain, 4))
    assert torch.equal(got, want[len(done):len(done) + len(got)])
    again = [data.PrefetchLoader(ld, depth=2) for ld in _loaders(blend, rm, rd)]
    for p in again:
        p.load_state_dict(json.loads(json.dumps(plain[0].state_dict())))
    rest = _stream(_global(again, 5))
    assert torch.equal(rest, want[len(done) + len(got):])
    assert all(p.close() for p in again)


def test_shares_hold_and_the_small_file_wraps(files) -> None:
    loader = _loader(files, 4)
    rows = torch.cat([loader.next_batch()[0] for _ in range(10)])  # 40 samples: 30 big, 10 small (5 per epoch)
    small = rows[:, 0] >= 2000
    assert int(small.sum()) == 10 and loader.drawn == [30, 10]
    starts = sorted(int(r[0]) for r in rows[small])
    assert starts == sorted([2000 + 8 * k for k in range(5)] * 2)  # every small sample twice: two epochs
    refused(loader.load_state_dict, {"seed": 0, "drawn": [1], "samples_seen": 1}, fragments=["another blend"])
    swapped = _loader(files[::-1], 4)
    refused(swapped.load_state_dict, loader.state_dict(), fragments=["['big.bin', 'small.bin']", "same order"])


def test_small_file_epochs_are_reshuffled_and_complete(blend) -> None:
    (ld,) = _loaders(blend, 8, 1)
    rows = _stream(_global([ld], 14))  # 112 samples: 14 of the small file (2 epochs), 70 of 300 of the big one
    small = [int(r[0]) for r in rows if 3000 <= r[0] < 3500]
    epochs = [small[:7], small[7:]]
    assert all(sorted(e) == [3000 + SEQ * k for k in range(7)] for e in epochs)  # each epoch: every sample once
    assert epochs[0] != epochs[1]  # ... in its own order
    big = [int(r[0]) for r in rows if r[0] < 3000]
    assert len(big) == 70 and len(set(big)) == 70
    assert ld.state_dict()["drawn"] == [70, 14, 28]


def test_the_single_file_state_still_loads_and_the_kinds_are_not_mixed(blend) -> None:
    old = {"epoch": 1, "sample_index": 28, "seed": 3, "samples_seen": 328}  # as the single-file loader saved it
    single = load_config(None, BASE + [f"data.path={blend[0]}"]).data
    loader = data.make_loader(single, open_sources(single, VOCAB), 4, 0, 1, 0)
    assert isinstance(loader, data.TokenLoader)
    loader.load_state_dict(old)
    ref = data.TokenLoader(open_source(single, VOCAB), SEQ, 4, 0, 1, 3)
    ref.epoch, ref.sample_index, ref.samples_seen = 1, 28, 328
    assert torch.equal(loader.next_batch()[0], ref.next_batch()[0]) and loader.state_dict() == ref.state_dict()
    (blended,) = _loaders(blend, 4, 1)
    refused(blended.load_state_dict, old, fragments=["single data.path loader", "not a blend"])
    blended.next_batch()
    refused(loader.load_state_dict, blended.state_dict(), fragments=["drawn = [", "data.paths", "not data.path"])


def test_blended_validation_reads_every_file_in_order(files) -> None:
    val = BlendedSamples([ArraySource(f) for f in files], [0.5, 0.5], SEQ)
    assert (len(val) - 1) // SEQ == 11  # until the small file runs out: its 5 samples and 6 of the big one
    firsts = [int(val.read(i * SEQ, SEQ + 1)[0]) for i in range(10)]
    assert firsts == [0, 2000, 8, 2008, 16, 2016, 24, 2024, 32, 2032]
    loader = data.EvalLoader(val, SEQ, 2, 0, 1, 3)
    assert [int(x[0, 0]) for x, _ in loader.batches()] == [0, 8, 16]


def test_blended_validation_is_fixed_and_sharded_as_training(blend, tmp_path) -> None:
    val = data.open_val_source(_cfg(blend), VOCAB)
    assert isinstance(val, BlendedSamples)
    one = [x for x, _ in data.EvalLoader(val, SEQ, 8, 0, 1, 3).batches()]
    assert [torch.equal(a, b) for a, b in zip(one, [x for x, _ in data.EvalLoader(val, SEQ, 8, 0, 1, 3).batches()])] \
        == [True] * 3
    halves = [list(data.EvalLoader(val, SEQ, 4, r, 2, 3).batches()) for r in range(2)]
    assert all(torch.equal(one[k], torch.cat([halves[0][k][0], halves[1][k][0]])) for k in range(3))
    firsts = [int(x) for x in torch.cat(one)[:, 0]]
    per_file = [[f for f in firsts if lo <= f < hi] for lo, hi in ((3600, 3930), (3930, 4030), (4030, VOCAB))]
    assert per_file == [[lo + SEQ * k for k in range(n)] for lo, n in ((3600, 15), (3930, 3), (4030, 6))]  # 5:1:2
    assert all(f >= 3600 for f in firsts)  # from the validation siblings, never a training file
    only = sample_file(tmp_path / "only.val.bin", 5, 3600)
    assert not isinstance(data.open_val_source(_cfg(blend, f"data.val_path={only}"), VOCAB), BlendedSamples)
    gone = [blend[0], sample_file(tmp_path / "noval.bin", 10, 0), blend[2]]
    refused(data.open_val_source, _cfg(gone), VOCAB, fragments=["noval.val.bin", "does not exist"])


def test_refusals(files, tmp_path) -> None:
    base = ["model.vocab_size=2100", "data.source=bin", "data.seq_len=8"]
    cfg = load_config(None, base + [f"data.paths={[str(files[0]), str(tmp_path / 'gone.bin')]}"])
    refused(open_sources, cfg.data, 2100, fragments=["data.paths[1]", "gone.bin", "does not exist"])
    refused(load_config, None, base + [f"data.paths={[str(f) for f in files]}", "data.weights=[1.0]"],
            fragments=["one weight per entry"])
    refused(load_config, None, base + [f"data.paths={[str(files[0])] * 2}"], fragments=["names a file twice"])
    refused(load_config, None, base + [f"data.path={files[0]}", f"data.paths={[str(files[1])]}"],
            fragments=["not both"])


def test_every_file_is_checked_and_named(blend, tmp_path) -> None:
    short = sample_file(tmp_path / "short.bin", 0, 0)  # one token: not one sample
    refused(open_sources, _cfg([blend[0], blend[1], short]), VOCAB,
            fragments=["data.paths[2]", "short.bin", "fewer than one sequence"])
    refused(open_sources, _cfg(blend), 3050, fragments=["data.paths[1]", "small.bin", "< vocab_size"])
    h5 = tmp_path / "x.h5"
    h5.write_bytes(b"")
    refused(open_sources, _cfg([blend[0], blend[1], str(h5)]), VOCAB,
            fragments=["data.paths[2]", "x.h5", "does not fit data.source = 'bin'"])


def test_files_of_different_tokenizers_are_refused(tmp_path) -> None:
    paths = [sample_file(tmp_path / f"{n}.bin", 10, 0) for n in "abc"]
    sidecar = lambda p, sha: Path(p + ".json").write_text(json.dumps({"tokenizer_sha256": sha}))  # noqa: E731
    sidecar(paths[0], "a" * 64)
    cfg = _cfg(paths)
    assert len(open_sources(cfg, VOCAB)) == 3  # a file without a record is checked by its ids only
    sidecar(paths[2], "a" * 64)
    assert open_sources(cfg, VOCAB)[2].record["tokenizer_sha256"] == "a" * 64
    sidecar(paths[2], "b" * 64)
    refused(open_sources, cfg, VOCAB, fragments=["different tokenizers", "a.bin", "c.bin"])


@pytest.mark.faults
def test_extreme_weights_mix_by_their_ratio_or_are_refused(files) -> None:
    """Weights are normalised by the largest first: 1.5e308 and 1e308 (their sum is inf, which made both shares 0
    and the mix 50/50) mix 60/40. A subnormal weight, or one whose share of the samples underflows beside the
    largest (the file would never be read), is refused naming data.weights."""
    base = ["model.vocab_size=2100", "data.source=bin", "data.seq_len=8", f"data.paths={[str(f) for f in files]}"]
    shares = load_config(None, base + ["data.weights=[1.5e308, 1e308]"]).data.shares
    assert shares == pytest.approx([0.6, 0.4], rel=1e-12)
    assert blend_order(shares, [0, 0], 100).count(0) == 60
    assert load_config(None, base + ["data.weights=[1e-300, 3e-300]"]).data.shares == pytest.approx([0.25, 0.75])
    refused(load_config, None, base + ["data.weights=[1e-320, 1e-320]"],
            fragments=["data.weights = [1e-320, 1e-320]", "1e-320 is below the smallest normal float"])
    refused(load_config, None, base + ["data.weights=[1e300, 1e-300]"],
            fragments=["data.weights = [1e+300, 1e-300]", "1e-300 is so small", "never be read"])
    record("blend weights [1.5e308, 1e308] (their sum overflows: mixed 50/50), subnormal weights, a share that "
           "underflows", "mixed 60/40 by their ratio; the others a ValueError at load naming data.weights",
           tier="pure")
