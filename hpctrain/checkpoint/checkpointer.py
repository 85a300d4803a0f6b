"""A run's checkpoint policy, in one place: what is saved (the objects handed over once, at construction), when
(every checkpoint.every_steps, on `touch <run dir>/SAVE_NOW`, on a preemption, at the end), how (synchronously or
in the background, one save in flight, committed as soon as every rank has written), where a run resumes from
(train.resume), and the provenance every marker records (computed once per run). The trainer asks two things:

    with Checkpointer(cfg, layout, run_dir, rank, device, saved) as ckpt:  # collective: takes the directory lock
        start = ckpt.load()                   # the step resumed from, or None (a fresh start)
        ...after every step: ckpt.maybe_save(step, force=preempted, requests=agreed)  # collective without agreed
        ckpt.local_requests()                 # this rank's (save_now, writing) for the trainer's step agreement
        ckpt.maybe_save(step, final=True)     # the end of training (checkpoint.at_end)

Leaving the block normally waits for a save in flight and commits it; leaving it on an error abandons it
(never committed) and gives the directory back. The storage lifecycle below it (temporary directory, commit
marker, pruning, verified loads) is CheckpointManager's (manager.py).

Non-finite steps (skipped: the weights stay as the last finite step left them) are asked of the trainer only when
a save is due (Saved.nonfinite; on GPUs the count lives on the device, so asking waits for it): a periodic or
requested save waits for the first finite step. The final save and a preemption's save are made during a short
streak all the same (below train.max_nonfinite_steps: the trainer stops the run at the limit before any save), as
their weights are the last finite step's and refusing would lose every step since the previous checkpoint with the
data position (with fp16 loss scaling a skipped last step is ordinary); but when every step since the start was
non-finite nothing was trained, and nothing is saved.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist

from hpctrain.checkpoint import state as ckpt_state
from hpctrain.checkpoint.manager import MARKER, CheckpointManager, NoSpace, committed
from hpctrain.config import Config, to_dict

log = logging.getLogger(__name__)

SAVE_NOW = "SAVE_NOW"  # a file in the run directory: save after the current step


class JsonStateful(Protocol):
    """Small control state saved as JSON (the scheduler, the loss scaler, the data position)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclasses.dataclass
class Progress:
    """How far training has come: the only control state the trainer itself owns."""
    step: int = 0
    tokens_seen: int = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "tokens_seen": self.tokens_seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step, self.tokens_seen = state["step"], state["tokens_seen"]


@dataclasses.dataclass
class Saved:
    """What a checkpoint holds. `model` and `optimizer` go through DCP as sharded tensors (reshardable); the
    progress and every `control` object as JSON in train_state.json (keys: step, tokens_seen, then the control
    names, then world_size); every rank's CPU RNG state as one table. `fill` runs before a save (weights not yet
    filled from the seeded init are filled), `loaded` after a load (every weight came from the checkpoint).
    `nonfinite` says how many of the latest steps were non-finite (skipped); asked only when a save is due, as it
    may wait for the device, and it may raise to stop the run (the trainer's limit)."""
    model: torch.nn.Module
    optimizer: Any  # a DCP Stateful: state.OptimizerState or state.ZeroOneOptimizerState
    progress: Progress
    control: dict[str, JsonStateful]
    fill: Callable[[], Any] = lambda: None
    loaded: Callable[[], Any] = lambda: None
    nonfinite: Callable[[], int] = lambda: 0


class Checkpointer:
    def __init__(self, cfg: Config, layout: dict[str, int], run_dir: Path, rank: int, device: torch.device,
                 saved: Saved, phase: Callable[[str, str], Any] = lambda phase, detail: None,
                 progress: Callable[..., Any] = lambda nbytes, total=None: None,
                 attach: dict[str, Path] | None = None) -> None:
        """Collective: rank 0 takes the checkpoint directory's lock; the hosts of the provenance are gathered
        once here, not at every save. phase(name, detail) is told when a save or its wait begins (the trainer's
        heartbeat: the hang watchdog gives checkpoints the long limit); progress(nbytes, total=None) of the bytes
        a save or load moves, as they move (Heartbeat.advance: a slow save or resume that progresses is no hang)."""
        self.cfg, self.run_dir, self.rank, self.device, self.saved = cfg.checkpoint, Path(run_dir), rank, device, saved
        self.phase, self.progress = phase, progress
        self.resume, self.total_steps = cfg.train.resume, cfg.train.steps
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.mgr = CheckpointManager(self.cfg, self.run_dir, rank, progress=progress)
        self.mgr.attach = dict(attach or {})  # {name: source}: files rank 0 copies into every checkpoint
        self.provenance = ckpt_state.provenance(to_dict(cfg), layout, cfg.parallel.zero_stage, rank)
        self.loaded_step: int | None = None
        self.deferred = False  # a periodic or requested save waits for the first finite step

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, kind, value, tb) -> None:
        try:
            if kind is None:
                self._wait()  # commit the save in flight; not on an error path, where a rank may be gone
        finally:
            self.mgr.close()

    # -- what is saved ------------------------------------------------------------------------------------------
    def _tensors(self, saved_world: int | None = None) -> dict[str, Any]:
        """DCP's part: for a save, the live RNG table (collective); for a load, a table of the saved world's shape."""
        rng = ckpt_state.rng_table(self.world) if saved_world is None else torch.zeros(
            saved_world, torch.get_rng_state().numel(), dtype=torch.uint8)
        return {"model": ckpt_state.ModelState(self.saved.model), "optimizer": self.saved.optimizer, "rng": rng}

    def _control(self) -> dict[str, Any]:
        return (self.saved.progress.state_dict() | {k: v.state_dict() for k, v in self.saved.control.items()}
                | {"world_size": self.world})

    # -- saving -----------------------------------------------------------------------------------------------
    def _save(self, step: int, asynchronous: bool = False) -> None:
        self.saved.fill()
        prov = self.provenance | {"saved_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
        self.mgr.save(step, self._tensors(), self._control(), prov, asynchronous=asynchronous)

    def _wait(self) -> None:
        """Finishes the background save in flight, if any: a periodic or requested one, so one that finds the file
        system full or the quota spent is skipped with a warning (the manager has abandoned it)."""
        try:
            self.mgr.wait()
        except NoSpace as e:
            log.warning("periodic checkpoint skipped: %s", e)

    def local_requests(self) -> tuple[bool, bool]:
        """This rank's (save_now, writing): whether SAVE_NOW appeared (rank 0 looks, and removes it) and whether its
        background save is still writing. Every rank's are combined by the caller's agreement (or _requests)."""
        marker = self.run_dir / SAVE_NOW
        asked = self.rank == 0 and marker.exists()
        if asked:
            marker.unlink()
        return asked, self.mgr.unfinished()

    def _requests(self) -> tuple[bool, bool]:
        """(save_now, writing) of any rank, agreed now. Collective: one all-reduce, on the device (NCCL on GPUs),
        read at once (the host waits for the device)."""
        t = torch.tensor([float(f) for f in self.local_requests()], device=self.device)
        if dist.is_initialized():
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        save_now, writing = t.tolist()
        return save_now > 0, writing > 0

    def maybe_save(self, step: int, force: bool = False, final: bool = False,
                   requests: tuple[bool, bool] | None = None) -> bool:
        """Called by every rank after every step (collective); True when it saved. requests: (save_now, writing)
        as every rank agreed on them (the trainer's StepAgreement, a step late: the background save's commit and
        a SAVE_NOW wait one step more); None: agreed here (one all-reduce the host waits for).
        force (a preemption): waits for the save in flight, then saves now, synchronously.
        final (the end of training): the same, if checkpoint.at_end and the run stepped since its start.
        Otherwise: commits a background save once every rank has written it; saves every checkpoint.every_steps
        (not the last step, which is final's) and when SAVE_NOW appeared, in the background with
        checkpoint.async_save; a periodic save that finds no space (a full disk or a spent quota, before or
        while it writes) is skipped with a warning (earlier checkpoints stay), while a forced or final one raises
        NoSpace. Non-finite steps (the module docstring): a periodic or requested save waits for the first finite
        step; a forced or final one is not made when no step since the start was finite."""
        if force or final:
            self.phase("checkpoint", f"save of step {step}")
            self._wait()
            if final and not (self.cfg.at_end and step > (self.loaded_step or 0)):
                return False
            streak = self.saved.nonfinite()
            since_start = step - (self.loaded_step or 0)
            if streak and streak >= since_start:
                log.warning("no checkpoint of step %d: every step since the start (%d to %d) was non-finite, nothing "
                            "was trained", step, step - since_start + 1, step)
                return False
            if streak:
                log.warning("checkpoint of step %d holds the weights of step %d: its last %d steps were non-finite "
                            "(skipped)", step, step - streak, streak)
            self._save(step)
            return True
        save_now, writing = self._requests() if requests is None else requests
        if self.mgr.pending is not None and not writing:
            self.phase("checkpoint", "commit of a background save")
            self._wait()  # every rank's background write is done: commit now, not at the next save
        every = self.cfg.every_steps
        if not (((every and step % every == 0) or self.deferred) and step < self.total_steps or save_now):
            return False
        streak = self.saved.nonfinite()
        if streak:
            if not self.deferred:
                log.warning("checkpoint of step %d waits for the first finite step: the last %d steps were "
                            "non-finite (skipped)", step, streak)
            self.deferred = True
            return False
        self.deferred = False
        self.phase("checkpoint", f"save of step {step}")
        self._wait()  # the previous one first, so that its failure is not taken for this one's
        try:
            self._save(step, asynchronous=self.cfg.async_save)
        except NoSpace as e:
            log.warning("periodic checkpoint skipped: %s", e)
            return False
        return True

    # -- loading ----------------------------------------------------------------------------------------------
    def load(self) -> int | None:
        """Resumes per train.resume; returns the step resumed from, None for a fresh start. Collective.
        'auto': the newest committed checkpoint of this run (none: a fresh start); 'none': a fresh start, refused
        when this run's directory holds committed checkpoints (a fresh start would overwrite and prune them); a
        path: that checkpoint (step_NNNNNNNN), or the newest committed one of a checkpoints directory or of another
        run's directory (e.g. after a crash, in a new job). Nothing reaches live state before it is all checked."""
        r = self.resume
        root = self.mgr.root
        if r == "none":
            if committed(root):
                raise ValueError(f"train.resume = 'none' but {root} holds committed checkpoints (steps "
                                 f"{', '.join(str(s) for s, _ in committed(root))}); resume from them "
                                 f"(train.resume = 'auto'), or give the fresh run another checkpoint.dir")
            return None
        source = self.mgr
        if r != "auto" and (Path(r) / MARKER).is_file():
            extra, state = self.mgr.load(Path(r), self._make)
        else:
            if r != "auto":
                other = Path(r) / "checkpoints" if (Path(r) / "checkpoints").is_dir() else Path(r)
                if not committed(other):
                    raise ValueError(f"train.resume = {r!r}: no committed checkpoint there")
                source = CheckpointManager(dataclasses.replace(self.cfg, dir=str(other)), self.run_dir, self.rank,
                                           writer=False, progress=self.progress)
            found = source.load_latest(self._make)
            if found is None:
                if r != "auto":
                    raise ValueError(f"train.resume = {r!r}: no checkpoint there loads cleanly")
                return None
            _, extra, state = found
        self._restore(extra, state, source.root)
        return self.loaded_step

    def _make(self, extra: dict) -> dict[str, Any]:
        """The state a load fills, once the checkpoint's train state is checked against the live one's shape (a
        bad train state is a corrupt checkpoint)."""
        ckpt_state.check_train_state(extra, self._control())
        return self._tensors(saved_world=extra["world_size"])

    def _restore(self, extra: dict, state: dict, source: Path) -> None:
        self.saved.loaded()
        self.saved.progress.load_state_dict(extra)
        for name, obj in self.saved.control.items():
            obj.load_state_dict(extra[name])
        same_rng = ckpt_state.restore_rng(state["rng"], self.rank)
        self.loaded_step = extra["step"]
        log.info("resumed from step %d (%s world %d -> %d%s)", extra["step"], source, extra["world_size"],
                 self.world, "" if same_rng else "; RNG of new ranks left as seeded")
