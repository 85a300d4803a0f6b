"""Turns the single-device Transformer into the job's parallel model, in torchtitan's fixed order: tensor
parallel, activation checkpointing, then data parallel (DDP, ZeRO-1 optimizer sharding, or FSDP2 for ZeRO-2/3),
on the meta device first so no rank ever holds more than its shard; then each rank fills only its own shards, on
its device, from the tiled seeded init (hpctrain.model.init_slice), so every layout starts from the same full
weights (the trainer skips this when a checkpoint loads: build(..., fill=False), pm.fill()).

    pm = build(cfg, mesh, device)        # pm.model, pm.dims, pm.sync(last_micro_step), pm.loss_parallel

With pp > 1 the rank's model holds only its stages' blocks (hpctrain.pipeline), pm.parts are the stage modules
the schedule runs (DDP- or FSDP-wrapped), and pm.plan says which stages this rank runs.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from hpctrain import pipeline
from hpctrain.config import Config
from hpctrain.mesh import Layout
from hpctrain.model import ModelDims, Transformer, clean_name, init_slice
from hpctrain.plan import Plan, with_training

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class ParallelModel:
    model: nn.Module
    dims: ModelDims
    loss_parallel: bool  # logits stay vocab-sharded; cross-entropy runs under torch's loss_parallel()
    sync: Callable[[bool], Any]  # sync(is_last_micro_step) -> context manager around forward+backward
    autocast_dtype: torch.dtype | None  # autocast for layouts without FSDP's mixed precision
    zero_stage: int
    parts: list[nn.Module] = field(default_factory=list)  # stage modules this rank runs (pp > 1)
    plan: pipeline.StagePlan | None = None
    # fills the weights from the seeded init; None once filled, or when a checkpoint has filled them
    unfilled: Callable[[], None] | None = None

    def fill(self) -> bool:
        """Fills the weights from the seeded init unless done (or loaded) already; True if it filled now."""
        fill, self.unfilled = self.unfilled, None
        if fill is not None:
            fill()
        return fill is not None

    def loaded(self) -> None:
        """A checkpoint has written every parameter: the seeded init is not needed."""
        self.unfilled = None


def tp_plan(block_prefix: str, sequence_parallel: bool) -> dict[str, Any]:
    """Column-parallel q/k/v and gate/up, row-parallel o/down; norms sequence-parallel when asked."""
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel
    seq = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, Any] = {
        f"{block_prefix}.attention.wq": ColwiseParallel(),
        f"{block_prefix}.attention.wk": ColwiseParallel(),
        f"{block_prefix}.attention.wv": ColwiseParallel(),
        f"{block_prefix}.attention.wo": RowwiseParallel(output_layouts=seq),
        f"{block_prefix}.feed_forward.w1": ColwiseParallel(),
        f"{block_prefix}.feed_forward.w3": ColwiseParallel(),
        f"{block_prefix}.feed_forward.w2": RowwiseParallel(output_layouts=seq),
    }
    if sequence_parallel:
        plan[f"{block_prefix}.attention_norm"] = SequenceParallel()
        plan[f"{block_prefix}.ffn_norm"] = SequenceParallel()
        plan[f"{block_prefix}.attention"] = PrepareModuleInput(
            input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None))
        plan[f"{block_prefix}.feed_forward"] = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return plan


def apply_tp(model: Transformer, tp_mesh, sequence_parallel: bool, loss_parallel: bool) -> None:
    """Vocab-parallel embedding and output, and the per-block plan, on the node-local tp mesh."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module
    seq = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, Any] = {}
    if model.tok_embeddings is not None:  # a pipeline stage may lack the embedding or the output
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if model.output is not None:
        plan["output"] = ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                         use_local_output=not loss_parallel)
    if sequence_parallel and model.norm is not None:
        plan["norm"] = SequenceParallel()
    for i in model.layers:
        plan.update(tp_plan(f"layers.{i}", sequence_parallel))
    parallelize_module(model, tp_mesh, plan)
    if model.dims.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight  # both vocab-sharded as Shard(0): one parameter


def apply_ac(model: Transformer, mode: str, every: int) -> None:
    """Recompute block activations in backward: all blocks ('full') or every k-th ('every')."""
    if mode == "none":
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    for i, key in enumerate(list(model.layers)):
        if mode == "full" or i % every == 0:
            model.layers[key] = checkpoint_wrapper(model.layers[key], preserve_rng_state=False)


def reshard_after_forward(zero_stage: int, pp: int) -> bool:
    """Whether FSDP frees the gathered parameters after each forward. ZeRO-3 does, except under pipeline parallel:
    a stage runs a forward per micro-batch, and torch's schedule keeps parameters gathered through the
    micro-batches' backwards (reshard after backward only at the last), so resharding after forward would gather
    them again for every micro-batch. Pipeline trainers turn it off: one all-gather per stage module per step, and
    the stage's parameters stay whole from its first forward to its last backward (ZeRO-2's parameter memory during
    the step; gradients and optimizer state stay sharded)."""
    return zero_stage == 3 and pp == 1


def apply_fsdp(model: Transformer, dp_mesh, zero_stage: int, param_dtype: torch.dtype | None,
               reduce_dtype: torch.dtype, roots: list[nn.Module] | None = None, pp: int = 1) -> None:
    """FSDP2 per block then the root(s): ZeRO-3 reshards parameters after forward (not under pp, see
    reshard_after_forward), ZeRO-2 keeps them. Under pipeline parallel each stage module is a root (it holds the
    embedding, norm and output of its stage)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    reshard = reshard_after_forward(zero_stage, pp)
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp)
    for root in roots or [model]:
        fully_shard(root, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp)


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
            init_slice(clean_name(name), p.shape, dims, seed, offset, shape, out=local)


def materialize(model: nn.Module, dims: ModelDims, seed: int, device: torch.device,
                parts: list[nn.Module] | None = None, fill: bool = True) -> Callable[[], None] | None:
    """Allocates the (sharded) parameters on `device` and fills them (init_weights), or with fill=False leaves them
    unfilled and returns the function that fills them (a resume overwrites them anyway). With pipeline stages,
    each stage module (an FSDP root) allocates what it holds; together they cover the model."""
    for part in parts or [model]:
        part.to_empty(device=device)
    for m in [model, *(parts or [])]:
        m.init_buffers(device)
    if fill:
        init_weights(model, dims, seed)
        return None
    return functools.partial(init_weights, model, dims, seed)


def allreduce_grads(model: nn.Module, group) -> None:
    """Averages every gradient (the local shard of a DTensor one) over `group` in one flat all-reduce."""
    import torch.distributed as dist
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
             for p in model.parameters() if p.grad is not None]
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    flat /= dist.get_world_size(group)
    for g, avg in zip(grads, _unflatten_dense_tensors(flat, grads)):
        g.copy_(avg)


def build(cfg: Config, mesh, device: torch.device, fill: bool = True, plan: Plan | None = None) -> ParallelModel:
    """mesh: hpctrain.mesh.Mesh (or None for one process); plan: the trainer's plan (hpctrain.plan, with its
    training part), made here on the mesh's layout when not given. fill=False leaves the weights allocated but
    unfilled: pm.fill() fills them (the trainer, unless a checkpoint loads; pm.loaded() says one did)."""
    if plan is None:
        bare = Plan(mesh.layout, tuple(mesh.node_of_rank)) if mesh else Plan(Layout(1, 1, 1), (0,))
        plan = with_training(bare, cfg)
    tp, dp = plan.layout.tp, plan.layout.dp
    dims = plan.dims
    assert dims is not None
    stages = plan.stages
    zero = cfg.parallel.zero_stage if dp > 1 else -1  # -1: no data parallel wrapping
    loss_parallel = tp > 1 and cfg.parallel.loss_parallel
    with torch.device("meta"):
        model = Transformer(dims)
    pp_rank = mesh.pp_rank if stages else 0
    if stages:
        pipeline.prune(model, stages, pp_rank)
    if tp > 1:
        apply_tp(model, mesh.device_mesh["tp"], cfg.parallel.sequence_parallel, loss_parallel)
    apply_ac(model, cfg.train.ac, cfg.train.ac_every)
    parts = [pipeline.stage_module(model, stages, s) for s in stages.stages_of(pp_rank)] if stages else []
    low = DTYPES[cfg.train.precision] if cfg.train.precision != "fp32" else None
    autocast = low
    if zero in (2, 3):
        apply_fsdp(model, mesh.device_mesh["dp"], zero, low, DTYPES[cfg.train.reduce_dtype], parts or None,
                   stages.pp if stages else 1)
        autocast = None  # FSDP casts parameters itself; master weights stay fp32 in the shards
    unfilled = materialize(model, dims, cfg.train.seed, device, parts or None, fill)
    sync: Callable[[bool], Any] = lambda last: contextlib.nullcontext()  # noqa: E731
    if stages and zero in (2, 3):
        pass  # the schedule tells FSDP when the last micro-batch's backward runs
    elif zero == 0 and tp > 1 or stages and zero in (0, 1):
        # One coalesced all-reduce of the (local shards of the) gradients over dp after the last micro-batch:
        # DDP cannot hold DTensor parameters, and under pipeline parallel torch's DDP fails with several
        # stages per rank (bucket rebuild assert in torch 2.13); in a pipeline the reduction waits for the last
        # micro-batch anyway. ZeRO-1's optimizer then steps its shard of the averaged gradients.
        group = mesh.group("dp")

        @contextlib.contextmanager
        def sync(last: bool):
            yield
            if last:
                allreduce_grads(model, group)
    elif zero in (0, 1):
        from torch.nn.parallel import DistributedDataParallel as DDP
        # gradients as views into DDP's buckets: no second copy of every gradient (4 bytes/param in fp32)
        model = DDP(model, process_group=mesh.group("dp"), gradient_as_bucket_view=True,
                    device_ids=[device.index] if device.type == "cuda" else None)
        if low is not None and cfg.train.reduce_dtype == "bf16":
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook
            model.register_comm_hook(mesh.group("dp"), bf16_compress_hook)
        ddp = model
        sync = lambda last: contextlib.nullcontext() if last else ddp.no_sync()  # noqa: E731
    elif zero in (2, 3):
        fsdp = model

        @contextlib.contextmanager
        def sync(last: bool):
            # accumulate unreduced gradients locally until the last micro-step, then reduce-scatter once
            fsdp.set_requires_gradient_sync(last)
            yield
    return ParallelModel(model, dims, loss_parallel, sync, autocast, zero, parts, stages, unfilled)
