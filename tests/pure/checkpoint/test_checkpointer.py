"""The checkpointer's policy in one process (no process group; DCP and the HDF5 storage run for real): when it
saves (every_steps, SAVE_NOW, force, final), background saves committed once written, what a resume restores,
train.resume = 'none' refused over committed checkpoints, provenance computed once per run."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hpctrain.checkpoint import state as ckpt_state
from hpctrain.checkpoint.checkpointer import SAVE_NOW, Checkpointer, Progress, Saved
from hpctrain.checkpoint.manager import committed
from hpctrain.config import load_config

CPU = torch.device("cpu")


class Counter:
    """A JSON control object: what the scheduler, loss scaler and loader are to the checkpointer."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, state: dict) -> None:
        self.n = state["n"]


def make(tmp_path: Path, *overrides: str, seed: int = 0):
    cfg = load_config(None, ["train.steps=7", f"job.run_root={tmp_path}", *overrides])
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fills, loads = [], []
    saved = Saved(model, ckpt_state.OptimizerState(model, opt), Progress(), {"counter": Counter()},
                  fill=lambda: fills.append(1), loaded=lambda: loads.append(1))
    return cfg, model, opt, saved, fills, loads


def step(model, opt, saved: Saved) -> int:
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    saved.progress.step += 1
    saved.progress.tokens_seen += 10
    saved.control["counter"].n += 3
    return saved.progress.step


def steps_on_disk(run_dir: Path) -> list[int]:
    return [s for s, _ in committed(run_dir / "checkpoints")]


def test_when_it_saves(tmp_path, monkeypatch) -> None:
    """every_steps=3 over 6 steps saves 3 (6 is the final save's), SAVE_NOW saves the step after it appears and is
    removed, final saves with at_end; the git commit is read once for all of them."""
    calls = []
    real = ckpt_state.git_commit
    monkeypatch.setattr(ckpt_state, "git_commit", lambda: calls.append(1) or real())
    cfg, model, opt, saved, fills, _ = make(tmp_path, "train.steps=6", "checkpoint.every_steps=3", "checkpoint.keep=10")
    run = tmp_path / "run"
    said = []
    with Checkpointer(cfg, {"pp": 1, "dp": 1, "tp": 1}, run, 0, CPU, saved) as ckpt:
        assert ckpt.load() is None
        for _ in range(6):
            s = step(model, opt, saved)
            if s == 4:
                (run / SAVE_NOW).touch()
            said.append(ckpt.maybe_save(s))
        assert not (run / SAVE_NOW).exists()
        assert ckpt.maybe_save(6, final=True)
    assert said == [False, False, True, True, False, False]
    assert steps_on_disk(run) == [3, 4, 6]
    assert len(calls) == 1 and len(fills) == 3  # provenance once; the weights made whole before every save
    marker = json.loads((run / "checkpoints" / "step_00000006" / "COMMITTED").read_text())
    assert marker["layout"] == {"pp": 1, "dp": 1, "tp": 1, "zero_stage": cfg.parallel.zero_stage}
    assert marker["saved_at"] and marker["git_commit"] == real()
    state = json.loads((run / "checkpoints" / "step_00000006" / "train_state.json").read_text())
    assert list(state) == ["step", "tokens_seen", "counter", "world_size"]
    assert state == {"step": 6, "tokens_seen": 60, "counter": {"n": 18}, "world_size": 1}


def test_force_and_final(tmp_path) -> None:
    """force saves whatever the interval; final saves only with at_end and when the run stepped since it started."""
    cfg, model, opt, saved, _, _ = make(tmp_path, "checkpoint.every_steps=0", "checkpoint.at_end=false")
    run = tmp_path / "run"
    with Checkpointer(cfg, {"pp": 1, "dp": 1, "tp": 1}, run, 0, CPU, saved) as ckpt:
        ckpt.load()
        s = step(model, opt, saved)
        assert not ckpt.maybe_save(s)
        s = step(model, opt, saved)
        assert ckpt.maybe_save(s, force=True)
        assert not ckpt.maybe_save(s, final=True)  # at_end = false
    assert steps_on_disk(run) == [2]
    cfg, model, opt, saved, _, _ = make(tmp_path, "checkpoint.every_steps=0")
    with Checkpointer(cfg, {"pp": 1, "dp": 1, "tp": 1}, run, 0, CPU, saved) as ckpt:
        assert ckpt.load() == 2
        assert not ckpt.maybe_save(2, final=True)  # resumed at 2, never stepped: nothing new to save
    assert steps_on_disk(run) == [2]


def test_resume_restores_everything(tmp_path) -> None:
    cfg, model, opt, saved, _, _ = make(tmp_path, "checkpoint.every_steps=2")
    run = tmp_path / "run"
    with Checkpointer(cfg, {"pp": 1, "dp": 1, "tp": 1}, run, 0, CPU, saved) as ckpt:
        ckpt.load()
        for _ in range(2):
            ckpt.maybe_save(step(model, opt, saved))
        want_w = {k: v.clone() for k, v in model.state_dict().items()}
        want_m = opt.state_dict()["state"][0]["exp_avg"].clone()
        want_rng = torch.get_rng_state()
    torch.rand(5)  # move the RNG on
    cfg, model2, opt2, saved2, fills, loads = make(tmp_path, "checkpoint.every_steps=2", seed=1)
    with Checkpointer(cfg, {"pp": 1, "dp": 1, "tp": 1}, run, 0, CPU, saved2) as ckpt:
        assert ckpt.load() == 2
    assert loads == [1] and fills == []
    assert all(torch.equal(model2.state_dict()[k], v) for k, v in want_w.items())
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], want_m)
    assert torch.equal(torch.get_rng_state(), want_rng)
    assert saved2.progress == Progress(2, 20) and saved2.control["counter"].n == 6


def test_fresh_start_over_committed_checkpoints_is_refused(tmp_path) -> None:
    cfg, model, opt, saved, _, _ = make(tmp_path, "checkpoint.every_steps=1")
    run = tmp_path / "run"
    with Checkpointer(cfg, {"pp": 1, "dp": 1, "tp": 1}, run, 0, CPU, saved) as ckpt:
        ckpt.load()
        ckpt.maybe_save(step(model, opt, saved))
    cfg, model, opt, saved, _, _ = make(tmp_path, "train.resume=none")
    with pytest.raises(ValueError, match="train.resume = 'none' but .* holds committed checkpoints \\(steps 1\\)"):
        with Checkpointer(cfg, {"pp": 1, "dp": 1, "tp": 1}, run, 0, CPU, saved) as ckpt:
            ckpt.load()
    assert steps_on_disk(run) == [1]


def test_background_save_commits_once_written(tmp_path) -> None:
    """checkpoint.async_save: a save returns once staged; the first maybe_save after every rank has written it
    commits it (not the next save), and leaving the block commits one still in flight."""
    cfg, model, opt, saved, _, _ = make(tmp_path, "checkpoint.every_steps=2", "checkpoint.async_save=true",
                                        "checkpoint.keep=10")
    run = tmp_path / "run"
    with Checkpointer(cfg, {"pp": 1, "dp": 1, "tp": 1}, run, 0, CPU, saved) as ckpt:
        ckpt.load()
        for _ in range(2):
            ckpt.maybe_save(step(model, opt, saved))
        assert ckpt.mgr.pending is not None and steps_on_disk(run) == []
        ckpt.mgr.pending[1].result()  # written
        assert not ckpt.maybe_save(step(model, opt, saved))  # step 3: no save of its own, but the commit
        assert steps_on_disk(run) == [2] and ckpt.mgr.pending is None
        assert ckpt.maybe_save(step(model, opt, saved))
        assert ckpt.mgr.pending is not None
    assert steps_on_disk(run) == [2, 4]


def test_background_saves_survive_a_stager_that_closes_itself(tmp_path, monkeypatch) -> None:
    """torch 2.11's DefaultStager closes its state-dict stager after every staging, emptying its copy table: the
    run's second background save failed with KeyError: <class 'type'> (seen on an H100). Here the stager does what
    2.11's did; three background saves in a row commit, and the stager is closed when the manager closes."""
    from torch.distributed.checkpoint.staging import DefaultStager

    real = DefaultStager.stage

    def stage_then_close(self, state_dict, **kw):
        staged = real(self, state_dict, **kw)
        self._state_dict_stager.close()
        return staged

    monkeypatch.setattr(DefaultStager, "stage", stage_then_close)
    cfg, model, opt, saved, _, _ = make(tmp_path, "checkpoint.every_steps=1", "checkpoint.async_save=true",
                                        "checkpoint.keep=10")
    run = tmp_path / "run"
    with Checkpointer(cfg, {"pp": 1, "dp": 1, "tp": 1}, run, 0, CPU, saved) as ckpt:
        ckpt.load()
        for _ in range(3):
            ckpt.maybe_save(step(model, opt, saved))
            ckpt.mgr.pending[1].result()
    assert steps_on_disk(run) == [1, 2, 3] and ckpt.mgr.stager is None
