"""Which blocks are recomputed (train.ac, train.ac_every) is decided once, by
hpctrain.parallel.recompute.recomputed_blocks: the model wrapper wraps exactly those blocks, and the planner's
memory (ActivationModel.checkpointed) and FLOPs (timing.recomputed_share) count exactly those.

    PATH=$PWD/.venv/bin:$PATH .venv/bin/python -m pytest -q tests/pure/parallel/test_recompute.py
"""
from __future__ import annotations

import pytest

from hpctrain.parallel.recompute import apply_ac, recomputed_blocks
from hpctrain.planner import timing
from hpctrain.planner.activations import ActivationModel

CASES = [(n, mode, k) for n in (1, 2, 5, 6, 7) for mode in ("none", "full", "every", "selective", "op")
         for k in (1, 2, 3)]


def test_the_rule() -> None:
    assert recomputed_blocks(6, "every", 2) == [0, 2, 4]
    assert recomputed_blocks(7, "every", 3) == [0, 3, 6]
    assert recomputed_blocks(4, "full", 3) == [0, 1, 2, 3]
    assert recomputed_blocks(4, "none", 1) == []
    assert recomputed_blocks(3, "selective", 2) == recomputed_blocks(3, "op", 2) == [0, 1, 2]
    with pytest.raises(ValueError, match=r"train.ac = 'some': expected one of none, full, every, selective, op"):
        recomputed_blocks(4, "some", 1)
    with pytest.raises(ValueError, match=r"train.ac_every = 0 must be >= 1"):
        recomputed_blocks(4, "every", 0)


@pytest.mark.parametrize("n,mode,k", CASES)
def test_wrapper_and_planner_follow_the_rule(n, mode, k) -> None:
    from hpctrain.model.transformer import ModelDims, Transformer
    model = Transformer(ModelDims(vocab_size=32, dim=16, n_layers=n, n_heads=2, n_kv_heads=2, ffn_dim=32,
                                  max_seq_len=8, tie_embeddings=False))
    apply_ac(model, mode, k)
    wrapped = [i for i, block in enumerate(model.layers.values()) if type(block).__name__ == "CheckpointWrapper"]
    assert wrapped == recomputed_blocks(n, mode, k)
    assert ActivationModel.checkpointed(n, mode, k) == len(wrapped)
    whole = 0 if mode in ("selective", "op") else len(wrapped)  # the partial modes run no block's whole forward
    assert timing.recomputed_share(n, mode, k) == whole / n
