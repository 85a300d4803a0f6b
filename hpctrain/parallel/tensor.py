"""Tensor parallelism (Megatron's split, on DTensor): column-parallel q/k/v and gate/up, row-parallel o/down, a
vocab-parallel embedding and output, optionally sequence-parallel norms; on the node-local tp mesh."""
from __future__ import annotations

from typing import Any

from torch.distributed.tensor import Replicate, Shard

from hpctrain.model.transformer import Transformer


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
