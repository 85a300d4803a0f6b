"""Blends (data.paths + data.weights) through hpctrain.data.loader's entry points, in this process; what
tests/pure/test_blend.py leaves out: the same seed gives the same samples and another seed others from the same
files in the same mix; the sample stream is one global sequence whatever the batch, so a state saved by the
read-ahead loader or by one dp size resumes exactly in the other loader and at other dp sizes, across a small
file's epoch; the single-file loader's saved state still loads and the two kinds of state are refused by the
other loader; every file is checked as data.path is, named in the message, and files of different tokenizers
are refused; a blended validation split is the same batches every time, sharded as training; a training run on
a blend with a read-ahead thread and blended evaluation resumes from its checkpoint with the uninterrupted run's
losses, validation losses and loader state.

    PATH=$PWD/.venv/bin:$PATH .venv/bin/python -m pytest -q tests/pure/test_data_blend.py
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers.refusals import refused
from helpers.training import SMALL
from hpctrain.config import load_config
from hpctrain.data import loader as data
from hpctrain.data.blend import BlendedSamples, BlendLoader
from hpctrain.data.tokenfiles import val_file
from hpctrain.job import session
from hpctrain.train.trainer import Trainer

SEQ, VOCAB = 8, 4200
BASE = [f"model.vocab_size={VOCAB}", "data.source=bin", f"data.seq_len={SEQ}"]


def _file(path: Path, n_samples: int, offset: int) -> str:
    """n_samples samples of tokens offset, offset+1, ...: a row's first token names its file and sample."""
    path.write_bytes((np.arange(n_samples * SEQ + 1) + offset).astype("<u2").tobytes())
    return str(path)


@pytest.fixture(scope="module")
def blend(tmp_path_factory) -> list[str]:
    """A big file (300 samples), a small one (7 samples) and a middle one (40), each with a validation sibling
    (40, 12 and 20 samples: a blend of 64 samples before the big one runs out)."""
    root = tmp_path_factory.mktemp("blend")
    paths = [_file(root / "big.bin", 300, 0), _file(root / "small.bin", 7, 3000), _file(root / "mid.bin", 40, 3500)]
    for p, n, offset in zip(paths, (40, 12, 20), (3600, 3930, 4030)):
        _file(Path(val_file(p)), n, offset)
    return paths


def _cfg(paths: list[str], *sets: str):
    return load_config(None, BASE + [f"data.paths={paths}", "data.weights=[5.0, 1.0, 2.0]", *sets]).data


def _loaders(paths, micro: int, dp: int, seed: int = 0) -> list[BlendLoader]:
    cfg = _cfg(paths)
    sources = data.open_sources(cfg, VOCAB)
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


def test_same_seed_same_samples_another_seed_other_samples_in_the_same_mix(blend) -> None:
    a, b = _stream(_global(_loaders(blend, 8, 1), 10)), _stream(_global(_loaders(blend, 8, 1), 10))
    assert torch.equal(a, b)
    other = _stream(_global(_loaders(blend, 8, 1, seed=1), 10))
    assert not torch.equal(a, other)
    file_of = lambda rows: (rows[:, 0] >= 3000).long() + (rows[:, 0] >= 3500).long()  # noqa: E731
    assert torch.equal(file_of(a), file_of(other))  # which file each sample comes from depends on counts alone
    assert file_of(a).bincount().tolist() == [50, 10, 20]  # 80 samples at 5:1:2, exactly
    assert torch.equal(a[:, 1:], a[:, :-1] + 1)  # every row is one contiguous sample of seq_len + 1 tokens


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
    loader = data.make_loader(single, data.open_sources(single, VOCAB), 4, 0, 1, 0)
    assert isinstance(loader, data.TokenLoader)
    loader.load_state_dict(old)
    ref = data.TokenLoader(data.open_source(single, VOCAB), SEQ, 4, 0, 1, 3)
    ref.epoch, ref.sample_index, ref.samples_seen = 1, 28, 328
    assert torch.equal(loader.next_batch()[0], ref.next_batch()[0]) and loader.state_dict() == ref.state_dict()
    (blended,) = _loaders(blend, 4, 1)
    refused(blended.load_state_dict, old, fragments=["single data.path loader", "not a blend"])
    blended.next_batch()
    refused(loader.load_state_dict, blended.state_dict(), fragments=["drawn = [", "data.paths", "not data.path"])


def test_every_file_is_checked_and_named(blend, tmp_path) -> None:
    short = _file(tmp_path / "short.bin", 0, 0)  # one token: not one sample
    refused(data.open_sources, _cfg([blend[0], blend[1], short]), VOCAB,
            fragments=["data.paths[2]", "short.bin", "fewer than one sequence"])
    refused(data.open_sources, _cfg(blend), 3050, fragments=["data.paths[1]", "small.bin", "< vocab_size"])
    h5 = tmp_path / "x.h5"
    h5.write_bytes(b"")
    refused(data.open_sources, _cfg([blend[0], blend[1], str(h5)]), VOCAB,
            fragments=["data.paths[2]", "x.h5", "does not fit data.source = 'bin'"])


def test_files_of_different_tokenizers_are_refused(tmp_path) -> None:
    paths = [_file(tmp_path / f"{n}.bin", 10, 0) for n in "abc"]
    sidecar = lambda p, sha: Path(p + ".json").write_text(json.dumps({"tokenizer_sha256": sha}))  # noqa: E731
    sidecar(paths[0], "a" * 64)
    cfg = _cfg(paths)
    assert len(data.open_sources(cfg, VOCAB)) == 3  # a file without a record is checked by its ids only
    sidecar(paths[2], "a" * 64)
    assert data.open_sources(cfg, VOCAB)[2].record["tokenizer_sha256"] == "a" * 64
    sidecar(paths[2], "b" * 64)
    refused(data.open_sources, cfg, VOCAB, fragments=["different tokenizers", "a.bin", "c.bin"])


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
    only = _file(tmp_path / "only.val.bin", 5, 3600)
    assert not isinstance(data.open_val_source(_cfg(blend, f"data.val_path={only}"), VOCAB), BlendedSamples)
    gone = [blend[0], _file(tmp_path / "noval.bin", 10, 0), blend[2]]
    refused(data.open_val_source, _cfg(gone), VOCAB, fragments=["noval.val.bin", "does not exist"])


def _run(root: Path, paths: list[str], *sets: str) -> tuple[dict, dict]:
    cfg = load_config(None, SMALL + BASE + [f"data.paths={paths}", "data.weights=[5.0, 1.0, 2.0]",
                                            "train.micro_batch_size=4", "train.prefetch=2", "train.eval_every=2",
                                            "train.eval_batches=2", f"job.run_root={root / 'runs'}",
                                            f"checkpoint.dir={root / 'ck'}", "checkpoint.at_end=false", *sets])
    with session.start(cfg) as s:
        tr = Trainer(cfg, s)
        return tr.fit(), tr.loader.state_dict()


def test_training_on_a_blend_with_evaluation_resumes_exactly(blend, tmp_path) -> None:
    full, end = _run(tmp_path / "a", blend, "train.steps=8", "checkpoint.every_steps=4")
    step4 = tmp_path / "a" / "ck" / "step_00000004"
    saved = json.loads((step4 / "train_state.json").read_text())["data"]
    assert saved["drawn"] == [10, 2, 4]  # 4 steps of 4 samples at 5:1:2
    resumed, end2 = _run(tmp_path / "b", blend, "train.steps=8", f"train.resume={step4}", "train.prefetch=0")
    assert resumed["resumed_from"] == 4 and resumed["losses"] == full["losses"][4:]
    assert resumed["val_losses"] == [v for v in full["val_losses"] if v[0] > 4]
    assert end2 == end and end["drawn"] == [20, 4, 8]
