"""One process: the checkpoint lifecycle around a real Trainer -- keep-last-K, a corrupt newest checkpoint
falls back to the previous committed one, a save killed before its commit leaves nothing that counts, a full
disk is refused with the numbers and leaves earlier checkpoints alone, provenance is recorded."""
from __future__ import annotations

import json
import shutil
from collections import namedtuple
from pathlib import Path

import pytest

from helpers.ckpt_bytes import flip_a_byte
from helpers.training import SMALL
from hpctrain.checkpoint import manager as mgr_mod
from hpctrain.checkpoint.hdf5_storage import CheckpointCorrupt
from hpctrain.checkpoint.manager import CheckpointManager, committed
from hpctrain.config import load_config
from hpctrain.job import session
from hpctrain.train.trainer import Trainer


def _fit(tmp: Path, *sets: str) -> dict:
    cfg = load_config(None, SMALL + [f"job.run_root={tmp / 'runs'}", f"checkpoint.dir={tmp / 'ck'}", *sets])
    with session.start(cfg) as s:
        return Trainer(cfg, s).fit()


def test_lifecycle(tmp_path) -> None:
    first = _fit(tmp_path, "train.steps=4", "checkpoint.every_steps=1", "checkpoint.keep=3")
    assert [s for s, _ in committed(tmp_path / "ck")] == [2, 3, 4]
    marker = json.loads((tmp_path / "ck" / "step_00000004" / "COMMITTED").read_text())
    assert marker["step"] == 4 and marker["world_size"] == 1 and marker["layout"]["zero_stage"] == 0
    assert marker["config"]["train"]["steps"] == 4 and marker["torch"] and marker["hosts"]

    # a save killed before its commit: a .partial directory and a half-written shard; it never counts
    partial = tmp_path / "ck" / "step_00000005.partial"
    partial.mkdir()
    (partial / "shard-0.h5").write_bytes(b"half a file")
    flip_a_byte(tmp_path / "ck" / "step_00000004")  # and the newest committed one is corrupt
    resumed = _fit(tmp_path, "train.steps=6", "checkpoint.keep=3", "checkpoint.verify=full")
    assert resumed["resumed_from"] == 3  # step 4 failed its checksum: the previous committed one was used
    assert resumed["losses"][0] == first["losses"][3]  # step 4 again, from step 3's state: the same loss
    assert [s for s, _ in committed(tmp_path / "ck")][-1] == 6


def test_full_disk_is_refused_and_keeps_old_checkpoints(tmp_path, monkeypatch) -> None:
    _fit(tmp_path, "train.steps=2", "checkpoint.every_steps=1")
    before = [s for s, _ in committed(tmp_path / "ck")]
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(mgr_mod.shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(OSError, match=r"checkpoint of step 3 needs about .* GB but .* has 0.00 GB free"):
        _fit(tmp_path, "train.steps=3")
    assert [s for s, _ in committed(tmp_path / "ck")] == before
    assert not list((tmp_path / "ck").glob("*.partial"))


def test_uncommitted_directory_is_not_loadable(tmp_path) -> None:
    _fit(tmp_path, "train.steps=1")
    ck = tmp_path / "ck" / "step_00000001"
    copy = tmp_path / "ck" / "step_00000009"
    shutil.copytree(ck, copy)
    (copy / "COMMITTED").unlink()
    assert [s for s, _ in committed(tmp_path / "ck")] == [1]
    m = CheckpointManager(load_config(None, SMALL).checkpoint, tmp_path, 0, writer=False)
    with pytest.raises(CheckpointCorrupt, match="not a committed checkpoint"):
        m.load(copy, lambda extra: {})
