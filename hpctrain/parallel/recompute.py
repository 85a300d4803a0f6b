"""Activation recomputation (activation checkpointing): which blocks run (part of) their forward again in backward,
and what they keep. `recomputed_blocks` is the one rule for which blocks; the model wrapper here applies it and the
planner (hpctrain/planner/activations.py for memory, planner/timing.py for FLOPs) counts with it. Pure at import (no
torch): the planner imports it.

    recomputed_blocks(6, "every", 2)      # [0, 2, 4]: train.ac = "every", train.ac_every = 2
    apply_ac(model, cfg.train.ac, cfg.train.ac_every)

train.ac:
    none        nothing recomputed
    full        every block keeps only its input and runs its whole forward again in backward
    every       the same for blocks 0, k, 2k, ... (k = train.ac_every)
    selective   every block keeps its matmuls' and its attention kernel's outputs and the reduce-scatters' (or
                all-reduces') results, and recomputes the rest in backward: norms, rotary, SwiGLU, casts, residual
                adds, sequence-parallel gathers (Korthikanti et al.'s selective recomputation, for a block whose
                attention core is one fused kernel: what is cheap to compute and heavy to keep is recomputed)
    op          as selective, but only every other matmul's output is kept (the 1st, 3rd, ... of each block's
                forward), the others computed again too: less memory for more compute (torchtitan's op-level policy)
Both partial modes go through torch's selective activation checkpointing (SAC_POLICIES: the policy per op).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hpctrain.model.transformer import Transformer

MODES = ("none", "full", "every", "selective", "op")  # train.ac
PARTIAL = ("selective", "op")  # modes that keep more than a block's input
WHOLE = ("full", "every")  # modes that recompute whole blocks (every block, or every k-th)


def recomputed_blocks(n_blocks: int, mode: str, every: int) -> list[int]:
    """Indices (0-based, among the n_blocks a model or pipeline stage holds) of the blocks that are recomputed (in
    whole or in part): all for "full", "selective" and "op", 0, k, 2k, ... for "every" (k = every), none for
    "none"."""
    if mode not in MODES:
        raise ValueError(f"train.ac = {mode!r}: expected one of {', '.join(MODES)}")
    if every < 1:
        raise ValueError(f"train.ac_every = {every} must be >= 1")
    if mode == "none":
        return []
    return list(range(0, n_blocks, every if mode == "every" else 1))


def apply_ac(model: Transformer, mode: str, every: int) -> None:
    """Recompute block activations in backward: the blocks recomputed_blocks names, wholly or (selective, op) by
    the op policy of sac_policy."""
    chosen = recomputed_blocks(len(model.layers), mode, every)
    if not chosen:
        return
    import functools

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    keys = list(model.layers)
    for i in chosen:
        extra = {"context_fn": functools.partial(sac_contexts, mode)} if mode in PARTIAL else {}
        model.layers[keys[i]] = checkpoint_wrapper(model.layers[keys[i]], preserve_rng_state=False, **extra)


def sac_contexts(mode: str):
    """The forward and recompute contexts of one checkpointed call under `mode`'s policy (a fresh matmul count)."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts
    return create_selective_checkpoint_contexts(sac_policy(mode))


def _kept_ops() -> tuple[set, set]:
    """(matmuls, other ops whose outputs the partial modes keep): the attention kernels and the collectives whose
    results would cost communication again."""
    import torch
    aten, c10d = torch.ops.aten, torch.ops._c10d_functional
    matmuls = {aten.mm.default, aten.addmm.default, aten.bmm.default}
    kept = {getattr(aten, name).default for name in (
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu") if hasattr(aten, name)}
    kept |= {c10d.reduce_scatter_tensor.default, c10d.all_reduce.default}
    return matmuls, kept


def sac_policy(mode: str):
    """The op policy of train.ac = "selective" or "op" (module docstring). The matmul count restarts in each
    checkpointed call and runs separately in its recompute, so both passes keep the same matmuls."""
    from torch.utils.checkpoint import CheckpointPolicy
    matmuls, kept = _kept_ops()
    count = {False: 0, True: 0}

    def policy(ctx, func, *args, **kwargs):
        if func in matmuls:
            count[ctx.is_recompute] += 1
            keep = mode == "selective" or count[ctx.is_recompute] % 2 == 1
        else:
            keep = func in kept
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE
    return policy
