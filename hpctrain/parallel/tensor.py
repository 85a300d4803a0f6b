"""Tensor parallelism (Megatron's split, on DTensor): column-parallel q/k/v and gate/up, row-parallel o/down, a
vocab-parallel embedding and output, optionally sequence-parallel norms; on the node-local tp mesh.

With sequence parallel each block gathers its norms' sequence-sharded outputs before the column-parallel
projections. The projections' backward needs that gathered input; as Megatron does, a block that is not recomputed
keeps it as the shard it was gathered from and gathers it again in backward (SequenceGather: saved-tensor hooks
around the attention and MLP), so nothing of the model's width is kept whole across the step.
"""
from __future__ import annotations

from typing import Any, Collection

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from hpctrain.model.transformer import FusedLinear, FusedProjection, Transformer


def tp_plan(block_prefix: str, sequence_parallel: bool, mlp: str = "swiglu", fused: bool = False) -> dict[str, Any]:
    """Column-parallel q/k/v and gate/up (GeLU: up), row-parallel o/down; norms sequence-parallel when asked (the
    gathers before attention and MLP: SequenceGather). Fused projections (model.fused_projections): q/k/v and
    gate/up column-parallel as one matmul each (fused_colwise)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel
    seq = Shard(1) if sequence_parallel else Replicate()
    p = block_prefix
    plan: dict[str, Any] = {f"{p}.attention.wo": RowwiseParallel(output_layouts=seq),
                            f"{p}.feed_forward.w2": RowwiseParallel(output_layouts=seq)}
    if fused:
        plan[f"{p}.attention.qkv"] = fused_colwise()
    else:
        plan.update({f"{p}.attention.{w}": ColwiseParallel() for w in ("wq", "wk", "wv")})
    if fused and mlp == "swiglu":
        plan[f"{p}.feed_forward.gate_up"] = fused_colwise()
    else:
        plan.update({f"{p}.feed_forward.{w}": ColwiseParallel() for w in ("w1", "w3")[:2 if mlp == "swiglu" else 1]})
    if sequence_parallel:
        plan[f"{block_prefix}.attention_norm"] = SequenceParallel()
        plan[f"{block_prefix}.ffn_norm"] = SequenceParallel()
    return plan


class VocabShardEmbedding(torch.nn.Embedding):
    """The tp rank's rows of the vocabulary, looked up as Megatron's vocab-parallel embedding does: token ids
    outside the rank's rows give zeros, and one all-reduce (a reduce-scatter over the sequence with sequence
    parallel) sums the ranks' partial outputs. The backward writes the gradient of the rank's rows only, in
    place: torch's DTensor embedding (RowwiseParallel) computes the weight's gradient as a partial sum over the
    whole table and reduce-scatters it, every micro-batch (a vocabulary x width fp32 buffer on every rank and a
    collective of its size). The weight stays the DTensor parameter, Shard(0) over tp (checkpoints, FSDP and tied
    output weights see what they saw). Apply with VocabParallel, never by hand."""

    output_layout: Any = None  # Replicate() or, with sequence parallel, Shard(1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import Partial
        w = self.weight  # under FSDP: its gathered tp shard
        local = w.to_local()
        rows = local.shape[0]
        ids = tokens - w.device_mesh.get_local_rank() * rows
        outside = (ids < 0) | (ids >= rows)
        out = torch.nn.functional.embedding(ids.masked_fill(outside, 0), local).masked_fill(outside.unsqueeze(-1), 0)
        summed = DTensor.from_local(out, w.device_mesh, [Partial()], run_check=False)
        return summed.redistribute(w.device_mesh, [self.output_layout]).to_local()


def vocab_parallel(output_layout):
    """A ParallelStyle for the embedding (a parallelize_module plan entry): its weight sharded by rows over tp,
    looked up by VocabShardEmbedding."""
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.parallel import ParallelStyle

    class VocabParallel(ParallelStyle):
        def _apply(self, module: torch.nn.Module, device_mesh) -> torch.nn.Module:
            if type(module) is not torch.nn.Embedding:
                raise TypeError(f"vocab_parallel shards an nn.Embedding, not {type(module).__name__}")
            module.weight = torch.nn.Parameter(distribute_tensor(module.weight, device_mesh, [Shard(0)]))
            module.__class__ = VocabShardEmbedding
            module.output_layout = output_layout
            return module

    return VocabParallel()


class ShardFusedProjection(FusedProjection):
    """A FusedProjection over column-parallel weights (each member's Shard(0) over tp): this rank's rows of every
    member in one local matmul, the outputs this rank's heads (or ffn columns) as ColwiseParallel's local outputs.
    The input is replicated over tp (with sequence parallel: SequenceGather's gathered DTensor); its gradient, a
    partial sum on each rank, is all-reduced (reduce-scattered with sequence parallel) once for the fused matmul.
    Apply with fused_colwise, never by hand."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        from torch.distributed.tensor import Partial
        weights = [m.weight for m in self.members]  # under FSDP: the gathered tp shards
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, weights[0].device_mesh, [Replicate()], run_check=False)
        x = x.redistribute(placements=[Replicate()]).to_local(grad_placements=[Partial()])
        return FusedLinear.apply(x, *(w.to_local() for w in weights))


def fused_colwise():
    """A ParallelStyle for a FusedProjection (a parallelize_module plan entry): each member's weight sharded by
    rows over tp, as ColwiseParallel shards it (checkpoints, FSDP and HF export see the same DTensors)."""
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.parallel import ParallelStyle

    class FusedColwise(ParallelStyle):
        def _apply(self, module: torch.nn.Module, device_mesh) -> torch.nn.Module:
            if type(module) is not FusedProjection:
                raise TypeError(f"fused_colwise shards a FusedProjection, not {type(module).__name__}")
            for m in module.members:
                m.weight = torch.nn.Parameter(distribute_tensor(m.weight, device_mesh, [Shard(0)]))
            module.__class__ = ShardFusedProjection
            return module

    return FusedColwise()


class SequenceGather:
    """The input gather of a sequence-parallel attention or MLP (a forward pre-hook: the norm's output, sharded
    along the sequence, gathered whole; its backward reduce-scatters the gradient), and, with keep_shard, saved-tensor
    hooks over the module's forward that keep what autograd saves of the gathered tensor (the column-parallel
    projections' input) as the shard, gathered again once in backward for all the projections that read it. Hooks
    already in force outside (a memory count, an offload to host memory) still see every tensor: ours hand them
    what they keep, the shard in place of the gathered input."""

    def __init__(self, module: torch.nn.Module, keep_shard: bool) -> None:
        self.keep_shard, self.hooks = keep_shard, None
        module.register_forward_pre_hook(self.gather)
        if keep_shard:
            module.register_forward_hook(self.done, always_call=True)

    def gather(self, module: torch.nn.Module, args: tuple) -> tuple:
        shard, *rest = args
        full = shard.redistribute(placements=[Replicate()])
        if self.keep_shard and torch.is_grad_enabled():
            top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)  # torch's own, private
            outer = top(False) if top is not None else None
            holder = _Regather(shard.detach(), full._local_tensor.untyped_storage().data_ptr(), outer)
            self.hooks = torch.autograd.graph.saved_tensors_hooks(holder.pack, holder.unpack)
            self.hooks.__enter__()
        return (full, *rest)

    def done(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        if self.hooks is not None:
            hooks, self.hooks = self.hooks, None
            hooks.__exit__(None, None, None)


class _Outer:
    """A saved tensor as the hooks outside packed it, with their unpack."""
    __slots__ = ("packed", "unpack")

    def __init__(self, hooks: tuple, t: torch.Tensor) -> None:
        self.packed, self.unpack = hooks[0](t), hooks[1]

    def get(self) -> torch.Tensor:
        return self.unpack(self.packed)


class _Regather:
    """One forward's gathered input: what autograd saves of it (views of its storage) is kept as a view description
    beside the shard; the first unpack in backward gathers the shard again, the last lets the gathered copy go.
    Other saved tensors pass through the outer hooks (if any) unchanged."""

    def __init__(self, shard: DTensor, storage: int, outer: tuple | None) -> None:
        self.storage, self.outer, self.full, self.packed, self.unpacked = storage, outer, None, 0, 0
        self.shard = shard if outer is None else _Outer(outer, shard)

    def pack(self, t: torch.Tensor) -> Any:
        local = t._local_tensor if isinstance(t, DTensor) else t  # plain: a fused projection's local input
        if local.untyped_storage().data_ptr() != self.storage:
            return t if self.outer is None else _Outer(self.outer, t)
        self.packed += 1
        spec = t._spec if isinstance(t, DTensor) else None
        return (spec, local.shape, local.stride(), local.storage_offset(), t.shape, t.stride())

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, _Outer):
            return packed.get()
        if not isinstance(packed, tuple):
            return packed
        spec, shape, stride, offset, gshape, gstride = packed
        if self.full is None:
            shard = self.shard.get() if isinstance(self.shard, _Outer) else self.shard
            self.full = shard.redistribute(placements=[Replicate()])._local_tensor
        local = self.full.as_strided(shape, stride, offset)
        self.unpacked += 1
        if self.unpacked == self.packed:
            self.full = None
        if spec is None:
            return local
        return DTensor.from_local(local, spec.mesh, spec.placements, run_check=False, shape=gshape, stride=gstride)


def apply_tp(model: Transformer, tp_mesh, sequence_parallel: bool, loss_parallel: bool,
             recomputed: Collection[str] = ()) -> None:
    """Vocab-parallel embedding and output, and the per-block plan, on the node-local tp mesh. `recomputed`: the
    keys of the blocks activation checkpointing will recompute (they keep only their input; the others keep the
    sequence-sharded inputs of their projections: SequenceGather)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, SequenceParallel, parallelize_module
    seq = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, Any] = {}
    if model.tok_embeddings is not None:  # a pipeline stage may lack the embedding or the output
        plan["tok_embeddings"] = vocab_parallel(seq)
    if model.output is not None:
        plan["output"] = ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                         use_local_output=not loss_parallel)
    if sequence_parallel and model.norm is not None:
        plan["norm"] = SequenceParallel()
    for i in model.layers:
        plan.update(tp_plan(f"layers.{i}", sequence_parallel, model.dims.mlp, model.dims.fused_projections))
    parallelize_module(model, tp_mesh, plan)
    if sequence_parallel:
        for key, block in model.layers.items():
            SequenceGather(block.attention, keep_shard=key not in recomputed)
            SequenceGather(block.feed_forward, keep_shard=key not in recomputed)
    if model.dims.tie_embeddings and model.output is not None and model.tok_embeddings is not None:
        # both vocab-sharded as Shard(0): one parameter (a pipeline's last stage alone keeps its own copy)
        model.output.weight = model.tok_embeddings.weight
