"""Initialisation that scales, in this process: any slice of a parameter's init equals the same slice of its full
value; a slice draws only the tiles it touches; that a resume never runs the init, a fresh run does and a Trainer
stepped by hand fills on first use is tests/multiproc/model/test_init_scale_training.py's. The shards of real gloo
layouts are
tests/multiproc/model/test_init_scale_shards.py's.

    .venv/bin/python -m pytest tests/pure/model/test_init_scale.py -q
"""
from __future__ import annotations

import math

import pytest
import torch

from helpers.training import counting_tiles, touched
from hpctrain.config import ModelConfig
from hpctrain.model.transformer import INIT_TILE, ModelDims, init_slice, init_value

DIMS = ModelDims.from_config(ModelConfig(n_layers=4))
TR, TC = INIT_TILE

SLICES = [  # (shape, offset, local shape): tile multiples, ragged edges, 1-D, 3-D, empty boxes, one element
    ((64, 2048), (16, 1024), (16, 1024)),
    ((50, 3000), (5, 1000), (37, 1999)),
    ((1003, 17), (998, 0), (5, 17)),
    ((5000,), (1500,), (2100,)),
    ((7,), (0,), (7,)),
    ((5, 7, 300), (1, 2, 17), (3, 4, 200)),
    ((40, 6, 700), (0, 3, 0), (40, 1, 700)),
    ((33, 2050), (33, 0), (0, 2050)),
    ((33, 2050), (3, 2050), (20, 0)),
    ((), (), ()),
]


@pytest.mark.parametrize("shape,offset,local_shape", SLICES)
def test_any_slice_is_the_slice_of_the_full_tensor(shape, offset, local_shape) -> None:
    name = "layers.3.feed_forward.w2.weight"
    full = init_value(name, shape, DIMS, seed=7)
    box = tuple(slice(o, o + n) for o, n in zip(offset, local_shape))
    part = init_slice(name, shape, DIMS, 7, offset, local_shape)
    assert part.shape == full[box].shape and torch.equal(part, full[box])
    out = torch.full(tuple(local_shape) + (3,), float("nan"))[..., 1]  # a strided target is written through
    init_slice(name, shape, DIMS, 7, offset, local_shape, out=out)
    assert torch.equal(out, full[box])


def test_init_statistics_and_norms() -> None:
    w = init_value("layers.0.attention.wq.weight", (1000, 3000), DIMS, seed=0)
    assert abs(w.std().item() - 0.02) < 2e-4 and abs(w.mean().item()) < 1e-4
    wo = init_value("layers.0.attention.wo.weight", (1000, 3000), DIMS, seed=0)
    assert abs(wo.std().item() - 0.02 / math.sqrt(2 * DIMS.n_layers)) < 1e-4
    assert torch.equal(init_slice("layers.2.ffn_norm.weight", (4096,), DIMS, 0, (100,), (50,)), torch.ones(50))
    # tiles are independent draws, not one stream restarted: neighbouring tiles differ
    assert not torch.equal(w[:TR, :TC], w[:TR, TC:2 * TC]) and not torch.equal(w[:TR, :TC], w[TR:2 * TR, :TC])


def test_a_slice_draws_only_the_tiles_it_touches(monkeypatch) -> None:
    drawn = counting_tiles(monkeypatch)
    cases = [((8192, 8192), (64, 0), (64, 8192)), ((8192, 3584 * 8), (512, 3584), (512, 3584)),
             ((1002 * 16, 8192), (1002 * 5, 0), (1002, 8192)), ((8192,), (1024,), (2048,))]
    for i, (shape, offset, local_shape) in enumerate(cases):
        init_slice(f"p{i}.weight", shape, DIMS, 0, offset, local_shape)
        assert drawn[f"p{i}.weight"] == touched(shape, offset, local_shape) < math.prod(shape)
        assert drawn[f"p{i}.weight"] <= 1.3 * math.prod(local_shape)









