"""Non-finite steps, one rank: a run whose steps are all non-finite stops with NonFiniteSteps naming the step
(`hpctrain train` exits 1) after train.max_nonfinite_steps of them, or at its end when it has fewer steps, and no
checkpoint of those steps is committed (a periodic save inside the streak waits; a final one below the limit keeps
the last finite weights and the data position); on the fused optimizer's path the count stays on the device and is
read on log steps; a streak below the limit trains on and its periodic save lands on the first finite step; a
preemption during a short streak commits, one after nothing but non-finite steps does not; a run preempted before
its first step says that it wrote nothing. The non-finite steps come from a train.lr so large that the first step's
update overflows the next forward, from weights set to nan after the seeded init, or from gradients set to inf by a
hook (all test-side).

    .venv/bin/python -m pytest -q tests/multiproc/train/test_nonfinite.py
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from faults import record

from helpers.launch import REPO, env_with_venv
from helpers.refusals import refused
from helpers.runs import only_run_dir
from hpctrain.checkpoint.manager import committed
from hpctrain.config import load_config
from hpctrain.job import runs, session
from hpctrain.parallel import compose
from hpctrain.train.trainer import NonFiniteSteps, Trainer

pytestmark = pytest.mark.faults

CASE = ["model.vocab_size=256", "model.dim=32", "model.n_layers=1", "model.n_heads=2", "model.max_seq_len=32",
        "data.source=synthetic", "data.seq_len=32", "train.micro_batch_size=2", "train.warmup_steps=1",
        "train.peak_tflops=1", "parallel.pp=1", "parallel.tp=1", "parallel.dp=-1"]
OVERFLOW = "train.lr=1e30"  # finite and > 0, so accepted: step 1's update makes every later forward inf/nan


def _cfg(tmp_path: Path, *sets: str):
    return load_config(None, CASE + [f"job.run_root={tmp_path / 'runs'}", f"checkpoint.dir={tmp_path / 'ck'}",
                                     *sets])


def _fit(cfg, arm=None) -> tuple[dict, str]:
    """Trainer.fit in this process, and the run's rank-0 log; arm(trainer, session) runs before it (hooks, flags)."""
    with session.start(cfg) as s:
        tr = Trainer(cfg, s)
        if arm is not None:
            arm(tr, s)
        out = tr.fit()
    return out, runs.rank_log_path(s.run_dir, 0).read_text()


def _steps(tmp_path: Path) -> list[int]:
    return [step for step, _ in committed(tmp_path / "ck")]


def nan_weights(monkeypatch) -> None:
    """The seeded init, then the embedding set to nan: every step's loss is nan, from the first."""
    fill = compose.ParallelModel.fill

    def poisoned(self) -> bool:
        filled = fill(self)
        if filled:
            with torch.no_grad():
                next(self.model.parameters()).fill_(float("nan"))
        return filled
    monkeypatch.setattr(compose.ParallelModel, "fill", poisoned)


def inf_gradients(steps: set[int]):
    """An arm(): the first parameter's gradient is inf in the given steps (each is skipped, weights untouched)."""
    def arm(tr: Trainer, s) -> None:
        tr.params[0].register_hook(lambda g: torch.full_like(g, float("inf")) if tr.step + 1 in steps else g)
    return arm


def preempt_after(step: int, also=None):
    """An arm(): the preemption flag is set (as USR2 would) once the step before `step` has run, after also(tr, s):
    the ranks agree on it a step later (train/agreement.py), so the run is preempted after `step`."""
    def arm(tr: Trainer, s) -> None:
        if also is not None:
            also(tr, s)
        fit = tr.fit

        def on_step(row) -> None:
            if tr.step == step - 1:
                s.preempt.received = signal.SIGUSR2
        tr.fit = lambda: fit(on_step)
    return arm


def test_max_nonfinite_steps_is_checked_against_fp16_start_up() -> None:
    refused(load_config, None, ["train.max_nonfinite_steps=0"], fragments=["train.max_nonfinite_steps = 0", ">= 1"])
    # fp16 from a scale of 65536 skips up to 16 steps while the scale halves down to 1
    refused(load_config, None, ["train.precision=fp16", "train.max_nonfinite_steps=16"],
            fragments=["train.max_nonfinite_steps = 16", "train.loss_scale = 65536.0", "up to 16 skipped steps"])
    assert load_config(None, ["train.precision=fp16", "train.max_nonfinite_steps=17"]).train.max_nonfinite_steps == 17
    refused(load_config, None, ["train.precision=fp16", "train.loss_scale=1e30"],
            fragments=["train.max_nonfinite_steps = 50", "up to 100 skipped steps"])
    assert load_config(None, ["train.max_nonfinite_steps=1"]).train.max_nonfinite_steps == 1  # fp32: no start-up


def test_nonfinite_steps_stop_the_run_at_the_limit_with_no_checkpoint_of_them(tmp_path) -> None:
    cfg = _cfg(tmp_path, OVERFLOW, "train.steps=20", "train.max_nonfinite_steps=3", "checkpoint.every_steps=2",
               "train.log_every=100")
    with pytest.raises(NonFiniteSteps) as info:
        _fit(cfg)
    # step 1 is finite, 2-4 are not: stopped at 4 (the foreach optimizer skips on the host: checked every step)
    assert "training stopped at step 4: its last 3 steps (2 to 4) were non-finite" in str(info.value)
    assert "train.max_nonfinite_steps = 3" in str(info.value)
    assert _steps(tmp_path) == []  # step 2's periodic save waited for a finite step that never came
    summary = json.loads((only_run_dir(tmp_path / "runs") / "summary.json").read_text())
    assert not summary["ok"] and "NonFiniteSteps: training stopped at step 4" in summary["error"]
    record("every step non-finite after the first (train.lr = 1e30 overflows the weights)", "NonFiniteSteps naming "
           "the step after train.max_nonfinite_steps; no checkpoint committed (the periodic one inside the streak "
           "waited)", tier="multiproc")


def test_a_run_whose_every_step_is_nonfinite_fails_below_the_limit(tmp_path, monkeypatch) -> None:
    nan_weights(monkeypatch)
    cfg = _cfg(tmp_path, "train.steps=3", "train.log_every=100")
    with pytest.raises(NonFiniteSteps) as info:
        _fit(cfg)
    assert "training ended at step 3 with nothing trained: every step of this run (1 to 3) was non-finite" in str(
        info.value)
    assert _steps(tmp_path) == []  # the final save was not made
    record("every step non-finite (nan weights), fewer steps than the limit", "NonFiniteSteps at the end; no final "
           "checkpoint", tier="multiproc")


def test_fused_optimizer_counts_on_the_device_and_is_read_on_log_steps(tmp_path) -> None:
    cfg = _cfg(tmp_path, OVERFLOW, "train.steps=20", "train.max_nonfinite_steps=3", "train.log_every=5")
    with pytest.raises(NonFiniteSteps) as info:
        _fit(cfg)
    # skipped on the device from step 2; the count is read at log step 5, not at step 4 (no extra host sync)
    assert "training stopped at step 5: its last 4 steps (2 to 5) were non-finite" in str(info.value)
    assert _steps(tmp_path) == []


def test_a_short_streak_trains_on_and_its_periodic_save_waits_for_a_finite_step(tmp_path) -> None:
    cfg = _cfg(tmp_path, "train.steps=7", "train.max_nonfinite_steps=3", "checkpoint.every_steps=3",
               "checkpoint.keep=3", "train.log_every=100")
    out, log = _fit(cfg, inf_gradients({2, 3}))
    assert out["steps"] == 7
    assert _steps(tmp_path) == [4, 6, 7]  # step 3's save waited for step 4, the first finite one
    assert "checkpoint of step 3 waits for the first finite step: the last 2 steps were non-finite" in log
    record("two non-finite steps (inf gradients) with train.max_nonfinite_steps = 3", "the run trains on; the "
           "periodic save due inside the streak is committed at the first finite step", tier="multiproc")


def test_the_final_save_after_a_short_streak_keeps_the_work(tmp_path) -> None:
    """A skipped last step (ordinary with fp16 loss scaling) does not cost the steps since the previous checkpoint:
    the final save holds step 3's weights (step 4 changed nothing) and step 4's data position."""
    cfg = _cfg(tmp_path, "train.steps=4", "checkpoint.every_steps=2", "train.log_every=100")
    out, log = _fit(cfg, inf_gradients({4}))
    assert out["steps"] == 4 and _steps(tmp_path) == [2, 4]
    assert "checkpoint of step 4 holds the weights of step 3: its last 1 steps were non-finite (skipped)" in log


def test_preemption_saves_during_a_short_streak_but_not_after_nothing_but_nonfinite_steps(tmp_path,
                                                                                           monkeypatch) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    cfg = _cfg(tmp_path / "a", "train.steps=8", "train.log_every=100")
    out, log = _fit(cfg, preempt_after(3, inf_gradients({2, 3})))
    # the weights are step 1's (skipped steps change nothing); the data position of steps 2-3 is kept
    assert out["preempted"] and out["preempt_checkpoint"] == 3 and _steps(tmp_path / "a") == [3]
    assert "preempted at step 3: checkpoint of step 3 committed" in log
    nan_weights(monkeypatch)
    cfg = _cfg(tmp_path / "b", "train.steps=8", "train.log_every=100")
    out, log = _fit(cfg, preempt_after(2))
    assert out["preempted"] and out["preempt_checkpoint"] is None and _steps(tmp_path / "b") == []
    assert "preempted at step 2: no checkpoint written: every step of this attempt was non-finite" in log
    record("preemption after 2 non-finite steps, with and without a finite step before them", "the checkpoint "
           "is committed after a finite step, not when nothing was trained; the log says which", tier="multiproc")


def test_preemption_before_the_first_step_says_nothing_was_written(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)

    def flag(tr, s) -> None:
        s.preempt.received = signal.SIGUSR2
    cfg = _cfg(tmp_path, "train.steps=4", "train.log_every=100")
    out, log = _fit(cfg, flag)
    assert out["preempted"] and out["steps"] == 0 and out["preempt_checkpoint"] is None
    assert _steps(tmp_path) == []
    assert "preempted at step 0: no checkpoint written: nothing was trained" in log
    assert "committed" not in log
    _fit(_cfg(tmp_path, "train.steps=2", "train.log_every=100"))
    out, log = _fit(_cfg(tmp_path, "train.steps=4", "train.log_every=100"), flag)
    assert out["resumed_from"] == 2 and out["preempt_checkpoint"] is None and _steps(tmp_path) == [2]
    assert "preempted at step 2: no checkpoint written: nothing trained since the resume, step 2's checkpoint " \
           "stays the newest" in log
    record("preemption before the first step (fresh, and right after a resume)", "no checkpoint written and the "
           "log says so (it said \"checkpoint committed\")", tier="multiproc")


def test_hpctrain_train_exits_1_naming_the_step(tmp_path) -> None:
    """`hpctrain train` in its own process, nothing patched: train.lr = 1e30 makes steps 2 on non-finite."""
    sets = [x for s in CASE + [OVERFLOW, "train.steps=20", "train.max_nonfinite_steps=3", "checkpoint.every_steps=2",
                               f"job.run_root={tmp_path / 'runs'}", f"checkpoint.dir={tmp_path / 'ck'}"]
            for x in ("--set", s)]
    (tmp_path / "c.toml").write_text("")
    out = subprocess.run([sys.executable, "-m", "hpctrain.cli", "train", str(tmp_path / "c.toml"), *sets],
                         env=env_with_venv(), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "NonFiniteSteps: training stopped at step 4" in out.stderr
    assert _steps(tmp_path) == []
    record("every step non-finite after the first, through `hpctrain train`", "exit status 1 naming the step; no "
           "checkpoint committed", tier="cli")
