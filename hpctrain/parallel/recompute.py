"""Activation recomputation (activation checkpointing): blocks whose activations are recomputed in backward."""
from __future__ import annotations

from hpctrain.model.transformer import Transformer


def apply_ac(model: Transformer, mode: str, every: int) -> None:
    """Recompute block activations in backward: all blocks ('full') or every k-th ('every')."""
    if mode == "none":
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    for i, key in enumerate(list(model.layers)):
        if mode == "full" or i % every == 0:
            model.layers[key] = checkpoint_wrapper(model.layers[key], preserve_rng_state=False)
