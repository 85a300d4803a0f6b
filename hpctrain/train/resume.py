"""What a training run saves and where its weights start: the run's checkpointer over everything a checkpoint
holds (weights, optimizer, progress, schedule, loss scale, data position, and the tokenizer files it attaches), and
the start itself: the newest checkpoint per train.resume, else train.init_from's Hugging Face directory, else the
seeded init. Called by the trainer (hpctrain/train/trainer.py), which it is handed:

    with resume.checkpointer(trainer) as ckpt:   # collective: takes the run directory's lock
        resumed = resume.start(trainer, ckpt)    # the step resumed from, None for a fresh start
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import torch
import torch.distributed as dist

from hpctrain.checkpoint import state as ckpt_state
from hpctrain.checkpoint.checkpointer import Checkpointer, Saved
from hpctrain.config import hf as hfconfig
from hpctrain.hf import load as hf_import

log = logging.getLogger(__name__)


def checkpointer(trainer) -> Checkpointer:
    """The run's checkpointer over everything `trainer` (a Trainer) holds that a checkpoint keeps (collective:
    takes the directory lock). The heartbeat follows its phases and bytes (the watchdog's checkpoint limit)."""
    t = trainer
    # an optimizer that holds stand-ins of the parameters (ZeRO-1's shards, the host's masters) saves by their map
    stand_ins = hasattr(t.optimizer, "params_of")
    optimizer = (ckpt_state.ZeroOneOptimizerState if stand_ins else ckpt_state.OptimizerState)(
        t.pm.model, t.optimizer, t.pm.tied.aliases if t.pm.tied else None)  # pm.model: loads into unfilled weights
    saved = Saved(t.pm.model, optimizer, t.progress, {"scheduler": t.scheduler, "scaler": t.scaler, "data": t.loader},
                  fill=t.pm.fill, loaded=t.pm.loaded, nonfinite=lambda: t.nonfinite.check(t.step))
    attach, skipped = hf_import.tokenizer_files(hfconfig.hf_dir(t.cfg.train.init_from), t.cfg.data.files)
    if skipped and t.s.rank == 0:
        log.warning("tokenizer files not recorded in checkpoints: %s", ", ".join(skipped))
    return Checkpointer(t.cfg, dataclasses.asdict(t.plan.layout), t.s.run_dir, t.s.rank, t.device, saved,
                        phase=t.hb.enter, progress=t.hb.advance, attach=attach)


def start(trainer, ckpt: Checkpointer) -> int | None:
    """Fills `trainer`'s weights from where training starts: a checkpoint per train.resume, else train.init_from's
    Hugging Face directory, else the seeded init (before the peak memory is reset). Returns the step resumed from,
    None for a fresh start. init_from never overrides a resume: a requeued job goes on from its own checkpoint."""
    t = trainer
    t.hb.enter("checkpoint", "resume")
    resumed = ckpt.load()
    hf = hfconfig.hf_dir(t.cfg.train.init_from)
    if hf is not None and resumed is None:
        # each rank reads (and checks finite) only its own slices: a bad one stops every rank, not only its own
        stats = agree_on_failure(lambda: hf_import.load_hf(t.pm.model, t.pm.dims, hf), t.s.rank, t.device)
        t.pm.loaded()
        log.info("weights from Hugging Face directory %s: %d tensors from %d files, %.1f MB read by this rank",
                 hf, stats["tensors"], stats["files"], stats["bytes"] / 1e6)
    elif hf is not None:
        log.info("resumed from step %d: train.init_from = %r is not read", resumed, t.cfg.train.init_from)
    t.pm.fill()  # nothing loaded: the seeded init
    return resumed


def agree_on_failure(fn: Callable[[], Any], rank: int, device: torch.device) -> Any:
    """fn() on every rank, and when it raised on any rank, an error on every rank (collective): the lowest failing
    rank's message, broadcast, raised as a ValueError by ranks where fn() succeeded (a failing rank raises its own).
    For work whose outcome differs by rank, which would otherwise leave the others in the next collective."""
    error: Exception | None = None
    try:
        out = fn()
    except Exception as e:
        error = e
    if not dist.is_initialized():
        if error is not None:
            raise error
        return out
    world = dist.get_world_size()
    first = torch.tensor([float(world if error is None else rank)], device=device)
    dist.all_reduce(first, op=dist.ReduceOp.MIN)
    src = int(first.item())
    if src == world:
        return out
    box = [str(error) if rank == src else None]
    dist.broadcast_object_list(box, src=src)
    if error is not None:
        raise error
    raise ValueError(f"rank {src}: {box[0]}")
