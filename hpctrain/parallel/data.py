"""Data parallelism and ZeRO: FSDP2 sharding of parameters, gradients and optimizer state (ZeRO-2/3, applied on
the meta device before materialisation), and how gradients meet across dp (gradient_sync): DDP, one coalesced
all-reduce, FSDP's reduce-scatter, each only after the last micro-batch. ZeRO-1 shards only the optimizer state
(hpctrain.train.optim.ZeroOne, torch's ZeroRedundancyOptimizer over the local shards) over the averaged gradients."""
from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from hpctrain.model.transformer import Transformer

Sync = Callable[[bool], Any]  # sync(is_last_micro_step) -> context manager around a forward and backward


def no_sync(last: bool) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


def reshard_after_forward(zero_stage: int, pp: int) -> bool:
    """Whether FSDP frees the gathered parameters after each forward. ZeRO-3 does, except under pipeline parallel:
    a stage runs a forward per micro-batch, and torch's schedule keeps parameters gathered through the
    micro-batches' backwards (reshard after backward only at the last), so resharding after forward would gather
    them again for every micro-batch. Pipeline trainers turn it off: one all-gather per stage module per step, and
    the stage's parameters stay whole from its first forward to its last backward (ZeRO-2's parameter memory during
    the step; gradients and optimizer state stay sharded)."""
    return zero_stage == 3 and pp == 1


def apply_fsdp(model: Transformer, dp_mesh, zero_stage: int, param_dtype: torch.dtype | None,
               reduce_dtype: torch.dtype, roots: list[nn.Module] | None = None, pp: int = 1,
               offload: bool = False, prefetch: int = 1) -> None:
    """FSDP2 per block then the root(s): ZeRO-3 reshards parameters after forward (not under pp, see
    reshard_after_forward), ZeRO-2 keeps them. Under pipeline parallel each stage module is a root (it holds the
    embedding, norm and output of its stage). offload: the shards, their gradients and so the optimizer's state
    and step live in (pinned) host memory; FSDP copies a block's shards to the device before gathering them and
    its gradient shards back after the reduce-scatter (CPUOffloadPolicy; materialize then allocates on the host)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
    # forward inputs are not cast: a block's input is already in the compute dtype (the embedding's weights are),
    # and the rotary tables a block is handed stay fp32 (cast, every block kept a bf16 copy, and positions lost
    # precision: bf16 holds 3 digits of a cosine)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
    reshard = reshard_after_forward(zero_stage, pp)
    # pinned memory only where a device copies from it (pinning is a CUDA host allocation)
    policy = CPUOffloadPolicy(pin_memory=dp_mesh.device_type == "cuda") if offload else OffloadPolicy()
    blocks = list(model.layers.values())
    for block in blocks:
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp, offload_policy=policy)
    for root in roots or [model]:
        fully_shard(root, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp, offload_policy=policy)
    if prefetch > 1 and pp == 1:  # parallel.fsdp_prefetch: each block asks for the next k (forward) and the previous
        # k (backward); under pp the stages keep their parameters gathered through the step (reshard_after_forward)
        for i, block in enumerate(blocks):
            block.set_modules_to_forward_prefetch(blocks[i + 1:i + 1 + prefetch])
            block.set_modules_to_backward_prefetch(blocks[max(0, i - prefetch):i][::-1])


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


def no_forward_buffer_sync(ddp_class) -> dict[str, bool]:
    """DDP's keyword that stops it broadcasting buffers from dp rank 0 at every forward. The only buffers are the
    RoPE tables, computed alike on every rank: the default is a collective per micro-batch for nothing (and one that
    made dp rank 0 wait inside its forward for a slow peer). torch 2.13 names it forward_sync_buffers and warns on
    every rank of every job that broadcast_buffers is deprecated; older torch (the floor is 2.9) knows only
    broadcast_buffers. forward_sync_buffers=False still broadcasts them once at construction: identical values,
    once (context parallel gives each rank its own rows afterwards: parallel.compose)."""
    import inspect
    if "forward_sync_buffers" in inspect.signature(ddp_class.__init__).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


def gradient_sync(model: nn.Module, zero: int, pipelined: bool, tp: int, dp_group, device: torch.device,
                  compress_bf16: bool, offload: bool = False, bucket_mb: int = 25) -> tuple[nn.Module, Sync]:
    """The model the trainer runs and its sync(is_last_micro_step): gradients are reduced across dp once per step,
    after the last micro-batch (nanoGPT's no_sync trick). zero -1 means no data parallelism.
    - ZeRO-2/3 (FSDP2): FSDP reduce-scatters after the last micro-batch; under pp the schedule tells it when. With
      CPU offload every micro-batch's gradients are reduce-scattered and accumulate in the host's shards: held
      unsharded on the device until the step's end they would be the whole model's gradients per GPU.
    - ZeRO-0/1 with tensor parallel, or under pp: one coalesced all-reduce of the (local shards of the)
      gradients after the last micro-batch. DDP cannot hold DTensor parameters, and under pipeline parallel
      torch's DDP fails with several stages per rank (bucket rebuild assert in torch 2.13); in a pipeline the
      reduction waits for the last micro-batch anyway. ZeRO-1's optimizer then steps its shard of the averages.
    - otherwise ZeRO-0/1: DDP, gradients as views into its buckets (no second copy of every gradient), bf16
      compression of the all-reduce when asked (compress_bf16)."""
    if zero == -1 or (zero in (2, 3) and (pipelined or offload)):
        return model, no_sync
    if zero in (2, 3):
        @contextlib.contextmanager
        def fsdp_sync(last: bool):
            model.set_requires_gradient_sync(last)  # accumulate unreduced gradients until the last micro-step
            yield
        return model, fsdp_sync
    if (zero in (0, 1) and tp > 1) or pipelined:
        @contextlib.contextmanager
        def allreduce_after(last: bool):
            yield
            if last:
                allreduce_grads(model, dp_group)
        return model, allreduce_after
    from torch.nn.parallel import DistributedDataParallel as DDP
    ddp = DDP(model, process_group=dp_group, gradient_as_bucket_view=True, bucket_cap_mb=bucket_mb,
              **no_forward_buffer_sync(DDP),
              device_ids=[device.index] if device.type == "cuda" else None)
    if compress_bf16:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook
        ddp.register_comm_hook(dp_group, bf16_compress_hook)
    return ddp, lambda last: contextlib.nullcontext() if last else ddp.no_sync()
