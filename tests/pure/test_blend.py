"""Blends (data.paths + data.weights), in this process: every prefix of the mix is within one sample of each
file's share; the sequence depends on the seed and counts only, so dp ranks' batches concatenated equal one
process's, and a loader resumed from its state (also through the read-ahead thread, also with another dp size)
gives the batches an uninterrupted one gives; a small file starts its next epoch while a large one does not; a
training run on a blend resumes from its checkpoint with the uninterrupted run's losses; blended validation
splits; refusals.

    PATH=$PWD/.venv/bin:$PATH .venv/bin/python -m pytest -q tests/pure/test_blend.py
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from faults import record

from helpers.refusals import refused
from helpers.training import SMALL
from hpctrain.config import load_config
from hpctrain.data import loader as data
from hpctrain.data.blend import BlendedSamples, BlendLoader, blend_order
from hpctrain.data.tokenfiles import ArraySource
from hpctrain.job import session
from hpctrain.train.trainer import Trainer

SEQ = 8


def _file(path: Path, n_tokens: int, offset: int) -> Path:
    """Tokens offset, offset+1, ...: each sample's first token says which file and where it came from."""
    path.write_bytes((np.arange(n_tokens) + offset).astype("<u2").tobytes())
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("blend")
    return [_file(root / "big.bin", 8 * 200 + 1, 0), _file(root / "small.bin", 8 * 5 + 1, 2000)]


def _loader(files, micro, rank=0, dp=1, seed=0, shares=(0.75, 0.25)) -> BlendLoader:
    return BlendLoader([ArraySource(f) for f in files], list(shares), SEQ, micro, rank, dp, seed)


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
    wide = [_loader(files, 2, r, 2) for r in range(2)]  # resharded: dp 1 -> 2
    for w in wide:
        w.load_state_dict(state)
    assert torch.equal(torch.cat([w.next_batch()[0] for w in wide]), want[5])
    pre = data.PrefetchLoader(_loader(files, 4), depth=3)
    for _ in range(5):
        pre.next_batch()
    assert pre.state_dict() == first.state_dict()
    pre.close()
    assert _loader(files, 4, seed=1).next_batch()[0].tolist() != want[0].tolist()


def test_shares_hold_and_the_small_file_wraps(files) -> None:
    loader = _loader(files, 4)
    rows = torch.cat([loader.next_batch()[0] for _ in range(10)])  # 40 samples: 30 big, 10 small (5 per epoch)
    small = rows[:, 0] >= 2000
    assert int(small.sum()) == 10 and loader.drawn == [30, 10]
    starts = sorted(int(r[0]) for r in rows[small])
    assert starts == sorted([2000 + 8 * k for k in range(5)] * 2)  # every small sample twice: two epochs
    big_starts = [int(r[0]) for r in rows[~small]]
    assert len(set(big_starts)) == 30  # the big file repeats nothing in its first epoch
    refused(loader.load_state_dict, {"seed": 0, "drawn": [1], "samples_seen": 1}, fragments=["another blend"])
    swapped = _loader(files[::-1], 4)
    refused(swapped.load_state_dict, loader.state_dict(), fragments=["['big.bin', 'small.bin']", "same order"])
    refused(loader.load_state_dict, {"epoch": 0, "sample_index": 0, "seed": 0, "samples_seen": 0},
            fragments=["single data.path loader"])


def test_blended_validation_reads_every_file_in_order(files) -> None:
    val = BlendedSamples([ArraySource(f) for f in files], [0.5, 0.5], SEQ)
    assert (len(val) - 1) // SEQ == 11  # until the small file runs out: its 5 samples and 6 of the big one
    firsts = [int(val.read(i * SEQ, SEQ + 1)[0]) for i in range(10)]
    assert firsts == [0, 2000, 8, 2008, 16, 2016, 24, 2024, 32, 2032]
    loader = data.EvalLoader(val, SEQ, 2, 0, 1, 3)
    assert [int(x[0, 0]) for x, _ in loader.batches()] == [0, 8, 16]


def _run(tmp_path, files, *sets):
    paths = [str(f) for f in files]
    cfg = load_config(None, SMALL + ["model.vocab_size=2100", "data.source=bin", f"data.paths={paths}",
                                     "data.weights=[3.0, 1.0]", "data.seq_len=8", "train.micro_batch_size=4",
                                     f"job.run_root={tmp_path / 'runs'}", f"checkpoint.dir={tmp_path / 'ck'}",
                                     *sets])
    with session.start(cfg) as s:
        return Trainer(cfg, s).fit()


def test_training_on_a_blend_resumes_exactly(files, tmp_path) -> None:
    full = _run(tmp_path / "a", files, "train.steps=6", "checkpoint.every_steps=3", "checkpoint.at_end=false")
    step3 = tmp_path / "a" / "ck" / "step_00000003"
    resumed = _run(tmp_path / "b", files, "train.steps=6", f"train.resume={step3}", "checkpoint.at_end=false")
    assert resumed["resumed_from"] == 3 and resumed["losses"] == full["losses"][3:]


def test_refusals(files, tmp_path) -> None:
    base = ["model.vocab_size=2100", "data.source=bin", "data.seq_len=8"]
    cfg = load_config(None, base + [f"data.paths={[str(files[0]), str(tmp_path / 'gone.bin')]}"])
    refused(data.open_sources, cfg.data, 2100, fragments=["data.paths[1]", "gone.bin", "does not exist"])
    refused(load_config, None, base + [f"data.paths={[str(f) for f in files]}", "data.weights=[1.0]"],
            fragments=["one weight per entry"])
    refused(load_config, None, base + [f"data.paths={[str(files[0])] * 2}"], fragments=["names a file twice"])
    refused(load_config, None, base + [f"data.path={files[0]}", f"data.paths={[str(files[1])]}"],
            fragments=["not both"])
    cfg = load_config(None, base + [f"data.paths={[str(f) for f in files]}", "train.eval_every=2"])
    refused(data.open_val_source, cfg.data, 2100, fragments=["big.val.bin", "does not exist"])


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
