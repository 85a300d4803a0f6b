"""Hang limits that follow a checkpoint's work (issue 26): a save or resume on slow storage that moves bytes is no
hang, however long it takes; one whose read stops still is.

    PATH=$PWD/.venv/bin:$PATH .venv/bin/python -m pytest -q tests/multiproc/hang/test_hang_checkpoint_io.py

Storage is slowed by patching the HDF5 layer under tests/ (every dataset read or written sleeps); the watchdog
runs with a start-up limit shorter than the whole save or load. The heartbeat's progress (Heartbeat.advance,
threaded from the trainer through the checkpointer and manager to every dataset) keeps it quiet; without progress
the same load is called a hang; a read that blocks is called one within the limit.
"""
from __future__ import annotations

import threading
import time

import pytest
import torch
from faults import record

from helpers.training import SMALL
from hpctrain.checkpoint import hdf5_storage, layout
from hpctrain.checkpoint.manager import CheckpointManager
from hpctrain.config import load_config
from hpctrain.hang import ending, watchdog
from hpctrain.hang.heartbeat import Heartbeat
from hpctrain.job import session
from hpctrain.train.trainer import Trainer

DATASETS = 6
SLOW_S = 0.35  # per dataset: 6 of them take 2.1 s a pass, a resume (verify, then load) 4.2 s
LIMITS = watchdog.Limits(step_s=0.2, long_s=1.0, storage_bps=1e9)  # polls of 0.2 s; a 1 s start-up limit


def _state(fill: float | None = None) -> dict:
    g = torch.Generator().manual_seed(0)
    return {"model": {f"w{i}": torch.full((64, 64), fill) if fill is not None else torch.randn(64, 64, generator=g)
                      for i in range(DATASETS)}}


def _watched(tmp_path, monkeypatch):
    ended: list[str] = []
    released = threading.Event()
    monkeypatch.setattr(watchdog, "end_job", lambda peers, run_dir, message: (ended.append(message),
                                                                               released.wait(60)))
    monkeypatch.setattr(ending, "ENDING", threading.Event())
    hb = Heartbeat(tmp_path / "run", 0, {"node": "n1"})
    hb.begin_step(5)
    hb.enter("checkpoint", "resume")
    return hb, watchdog.Watchdog(hb, tmp_path / "run", LIMITS), ended, released


def _slow_reads(monkeypatch, gate: threading.Event | None = None, stop_at: int = 0) -> list[int]:
    """Every dataset read sleeps SLOW_S; with a gate, read number stop_at waits for it instead (a read that
    stops)."""
    calls = [0]
    real = hdf5_storage.read_stored

    def slow(*args, **kwargs):
        calls[0] += 1
        if gate is not None and calls[0] == stop_at:
            gate.wait(60)
        else:
            time.sleep(SLOW_S)
        return real(*args, **kwargs)

    monkeypatch.setattr(hdf5_storage, "read_stored", slow)
    monkeypatch.setattr(layout, "read_stored", slow)  # the verify pass, before the load
    return calls


def _saved(tmp_path) -> tuple[CheckpointManager, object]:
    cfg = load_config(None, [f"checkpoint.dir={tmp_path / 'ck'}"]).checkpoint
    mgr = CheckpointManager(cfg, tmp_path, 0)
    mgr.save(1, _state(), {"step": 1}, {})
    mgr.close()
    return cfg, tmp_path / "ck" / "step_00000001"


def _load(cfg, tmp_path, path, progress) -> dict:
    reader = CheckpointManager(cfg, tmp_path, 0, writer=False, progress=progress)
    _, state = reader.load(path, lambda extra: _state(0.0))
    return state


@pytest.mark.faults
@pytest.mark.parametrize("progress", [True, False])
def test_a_slow_resume_that_moves_bytes_is_no_hang(tmp_path, monkeypatch, progress) -> None:
    cfg, path = _saved(tmp_path)
    calls = _slow_reads(monkeypatch)
    hb, dog, ended, released = _watched(tmp_path, monkeypatch)
    t0 = time.monotonic()
    try:
        state = _load(cfg, tmp_path, path, hb.advance if progress else lambda nbytes, total=None: None)
        seconds = time.monotonic() - t0
    finally:
        dog.stop()
        released.set()
    assert calls[0] == 2 * DATASETS and seconds > 3 * LIMITS.long_s, (calls, seconds)  # verify, then load
    assert torch.equal(state["model"]["w3"], _state()["model"]["w3"])
    if not progress:  # the same load without its heartbeat's progress: the fixed limit calls it a hang
        assert ended and "no progress for 1 s in checkpoint" in ended[0], ended
        return
    assert not ended, ended
    assert hb.moved == 2 * DATASETS * 64 * 64 * 4 and hb.io_total == path.joinpath("shard-0.h5").stat().st_size
    record(f"every dataset read of a resume sleeps {SLOW_S} s ({seconds:.1f} s in all, verify then load) under a "
           f"{LIMITS.long_s:g} s start-up limit", "no hang called: the heartbeat advances per dataset (without "
           "that progress the same resume is called a hang)", None, "checkpoint")


@pytest.mark.faults
def test_a_read_that_stops_is_still_a_hang(tmp_path, monkeypatch) -> None:
    cfg, path = _saved(tmp_path)
    gate = threading.Event()
    _slow_reads(monkeypatch, gate, stop_at=DATASETS + 3)  # the load's third read, after the whole verify pass
    hb, dog, ended, released = _watched(tmp_path, monkeypatch)
    loaded = threading.Thread(target=_load, args=(cfg, tmp_path, path, hb.advance), daemon=True)
    try:
        loaded.start()
        t0 = time.monotonic()
        while not ended:
            assert time.monotonic() - t0 < 30, "a read that stopped was never called a hang"
            time.sleep(0.05)
        seconds = time.monotonic() - t0
    finally:
        dog.stop()
        released.set()
        gate.set()
        loaded.join(30)
    # the stopped read began after (DATASETS + 2) slow reads; the limit counts from the last one's progress
    stopped_after = (DATASETS + 2) * SLOW_S
    assert seconds < stopped_after + LIMITS.long_s + 3 * LIMITS.poll_s + 1.0, seconds
    assert "no progress for 1 s in checkpoint (limit 1.001 s: parallel.startup_timeout_s + 0 s for the " \
        "checkpoint's 0.00115 GB at checkpoint.storage_gbps = 1)" in ended[0], ended
    moved = (DATASETS + 2) * 64 * 64 * 4  # the verify pass and the two reads before the one that stopped
    dump = (tmp_path / "run" / "hang" / "rank00000.txt").read_text()
    assert f'"detail": "resume; {moved / 1e6:.1f} MB moved"' in dump, "the dump says how far the resume got"
    record("a resume's dataset read that never returns (after the verify pass and two slow reads)",
           f"called a hang {seconds - stopped_after:.1f} s after the last progress (limit {LIMITS.long_s:g} s "
           "plus the checkpoint's bytes at checkpoint.storage_gbps)", None, "checkpoint")


def test_a_slow_save_that_moves_bytes_is_no_hang(tmp_path, monkeypatch) -> None:
    real = hdf5_storage.DatasetMaker

    class Slow(real):
        def dataset(self, *args, **kwargs):
            time.sleep(SLOW_S)
            return super().dataset(*args, **kwargs)

    monkeypatch.setattr(hdf5_storage, "DatasetMaker", Slow)
    hb, dog, ended, released = _watched(tmp_path, monkeypatch)
    hb.enter("checkpoint", "save of step 1")
    cfg = load_config(None, [f"checkpoint.dir={tmp_path / 'ck'}"]).checkpoint
    t0 = time.monotonic()
    try:
        mgr = CheckpointManager(cfg, tmp_path, 0, progress=hb.advance)
        mgr.save(1, _state(), {"step": 1}, {})
        mgr.close()
    finally:
        dog.stop()
        released.set()
    assert time.monotonic() - t0 > 2 * LIMITS.long_s and not ended, ended
    assert hb.moved == DATASETS * 64 * 64 * 4 and hb.io_total > hb.moved


def test_the_limit_grows_with_the_checkpoint(tmp_path, monkeypatch) -> None:
    hb, dog, ended, released = _watched(tmp_path, monkeypatch)
    try:
        hb.advance(0, total=int(846e9))  # the 70B example's checkpoint at 1 GB/s
        limit, setting = dog.limit()
        assert limit == pytest.approx(LIMITS.long_s + 846) and "846 GB at checkpoint.storage_gbps = 1" in setting
        hb.enter("forward")  # a step phase: the step limit, whatever the last checkpoint moved
        assert dog.limit() == (LIMITS.step_s, "parallel.hang_timeout_s")
    finally:
        dog.stop()
        released.set()
    assert load_config(None, []).checkpoint.storage_gbps == 0.5
    for bad in ("0", "-1", "nan"):
        with pytest.raises(ValueError, match=f"checkpoint.storage_gbps = {bad}"):
            load_config(None, [f"checkpoint.storage_gbps={bad}"])


def test_the_trainer_reports_checkpoint_progress(tmp_path, monkeypatch) -> None:
    """From the trainer through the checkpointer and the manager to every dataset: a save and a resume advance
    the rank's heartbeat."""
    seen: list[tuple[int, int | None]] = []
    real = Heartbeat.advance

    def advance(self, nbytes: int = 0, total: int | None = None) -> None:
        seen.append((nbytes, total))
        real(self, nbytes, total)

    monkeypatch.setattr(Heartbeat, "advance", advance)
    for steps in (1, 2):  # a fresh run that saves at its end, then a resume of it
        cfg = load_config(None, SMALL + [f"job.run_root={tmp_path / 'runs'}", f"checkpoint.dir={tmp_path / 'ck'}",
                                         f"train.steps={steps}"])
        with session.start(cfg) as s:
            Trainer(cfg, s).fit()
        assert sum(n for n, _ in seen) > 0 and any(t for _, t in seen), seen
        seen.clear()
