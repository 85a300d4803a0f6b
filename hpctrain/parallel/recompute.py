"""Activation recomputation (activation checkpointing): which blocks keep only their input in forward and run their
forward again in backward. `recomputed_blocks` is the one rule; the model wrapper here applies it and the planner
(hpctrain/planner/activations.py for memory, planner/timing.py for FLOPs) counts with it. Pure at import (no torch):
the planner imports it.

    recomputed_blocks(6, "every", 2)      # [0, 2, 4]: train.ac = "every", train.ac_every = 2
    apply_ac(model, cfg.train.ac, cfg.train.ac_every)
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hpctrain.model.transformer import Transformer

MODES = ("none", "full", "every")  # train.ac


def recomputed_blocks(n_blocks: int, mode: str, every: int) -> list[int]:
    """Indices (0-based, among the n_blocks a model or pipeline stage holds) of the blocks that are recomputed:
    all for "full", 0, k, 2k, ... for "every" (k = every), none for "none"."""
    if mode not in MODES:
        raise ValueError(f"train.ac = {mode!r}: expected one of {', '.join(MODES)}")
    if every < 1:
        raise ValueError(f"train.ac_every = {every} must be >= 1")
    if mode == "none":
        return []
    return list(range(0, n_blocks, 1 if mode == "full" else every))


def apply_ac(model: Transformer, mode: str, every: int) -> None:
    """Recompute block activations in backward: the blocks recomputed_blocks names."""
    chosen = recomputed_blocks(len(model.layers), mode, every)
    if not chosen:
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    keys = list(model.layers)
    for i in chosen:
        model.layers[keys[i]] = checkpoint_wrapper(model.layers[keys[i]], preserve_rng_state=False)
