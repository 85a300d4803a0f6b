"""From the meta device to real memory: each rank allocates only its shards and fills them from the tiled seeded
init (hpctrain.model.transformer.init_slice), so every layout starts from the same full weights."""
from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from hpctrain.model.transformer import ModelDims, clean_name, init_slice, weight_of


def shard_box(p: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(global offset, local shape) of this rank's piece of a parameter: a DTensor's local shard (FSDP's uneven
    dim-0 chunks, tensor parallel's Shard(0)/Shard(1), both on a 2-D mesh), or the whole of a plain tensor."""
    if isinstance(p, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
        local_shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        return tuple(offset), tuple(local_shape)
    return (0,) * p.ndim, tuple(p.shape)


def init_weights(model: nn.Module, dims: ModelDims, seed: int) -> None:
    """Fills each parameter's local shard with its slice of the layout-independent init: every rank draws only the
    tiles its shards touch (no full tensor of a sharded parameter) and writes them on the parameter's device."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            offset, shape = shard_box(p)
            assert tuple(local.shape) == shape, (name, tuple(local.shape), shape)
            init_slice(weight_of(clean_name(name), dims), p.shape, dims, seed, offset, shape, out=local)


def retie(model: nn.Module) -> None:
    """to_empty gives every module its own new parameter, so a tied output projection comes back as a second
    matrix, initialised and trained on its own: point it at the embedding's again (the same local shard under
    tensor parallel, where both are vocabulary-sharded Shard(0)). A pipeline rank that holds only one of the two
    keeps its own copy, synchronised by parallel.pipeline.TiedEmbedding."""
    emb, out = getattr(model, "tok_embeddings", None), getattr(model, "output", None)
    if model.dims.tie_embeddings and emb is not None and out is not None and out.weight is not emb.weight:
        out.weight = emb.weight


def materialize(model: nn.Module, dims: ModelDims, seed: int, device: torch.device,
                parts: list[nn.Module] | None = None, fill: bool = True,
                param_device: torch.device | None = None) -> Callable[[], None] | None:
    """Allocates the (sharded) parameters on `device` (param_device: on the host under FSDP's CPU offload; the
    buffers stay on `device`) and fills them (init_weights), or with fill=False leaves them unfilled and returns the
    function that fills them (a resume overwrites them anyway). With pipeline stages, each stage module (an FSDP
    root) allocates what it holds; together they cover the model."""
    for part in parts or [model]:
        part.to_empty(device=param_device or device)
        retie(part)
    for m in [model, *(parts or [])]:
        m.init_buffers(device)
    if fill:
        init_weights(model, dims, seed)
        return None
    return functools.partial(init_weights, model, dims, seed)
