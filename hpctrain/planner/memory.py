"""Model-state memory per GPU, as hpctrain builds the parallel model (hpctrain.parallel): the bytes of parameters,
gradients and AdamW state each rank holds, from the plan alone (no torch, no process group).

    states = model_states(plan, zero_stage, precision, rank_coords)    # {"params", "grads", "optimizer"} bytes
    worst = max_model_states(plan, zero_stage, precision)              # the rank that runs out first

What each rank holds (P: the parameters of its pipeline stages, each cut by tensor parallel; N: dp size):
- tensor parallel: q/k/v, gate/up and the output projection are split along dim 0, o/down along dim 1, the
  embedding along the vocabulary (dim 0); norms are whole on every rank.
- parameters are fp32 masters. zero 0-1 (DDP, ZeroRedundancyOptimizer) and dp = 1: the module's own P.
  zero 3 (FSDP2): a dim-0 shard, padded to ceil(rows / N) rows on every rank. zero 2, and zero 3 under pipeline
  parallel (parallel.data.reshard_after_forward): the gathered parameters (N padded shards) in the compute dtype
  (bf16/fp16 under mixed precision, else fp32) held from forward to the end of backward, beside the fp32 shard.
- gradients: fp32 like the masters: P for zero 0-1 (the vocab-parallel embedding writes its rows' gradient only:
  parallel.tensor.VocabShardEmbedding); the padded shard for zero 2-3 (FSDP reduce-scatters into it).
- AdamW (exp_avg, exp_avg_sq): twice the masters' local elements in fp32 (FSDP: the unpadded shard); ZeRO-1
  only for the parameters ZeroRedundancyOptimizer gives the rank: whole tensors, largest first, each to the rank
  with the fewest elements so far (its greedy partition, per parameter group: matrices, then 1-D parameters).
- HSDP (parallel.dp_replicate = R): FSDP's N is the shard group, dp / R; each replica holds the same shards.
Autocast's cached low-precision weight copies, activations and buffers are not model states (activations.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hpctrain.model.dims import ModelDims
    from hpctrain.parallel.plan import Plan

LOW = {"bf16": 2, "fp16": 2, "fp8": 2}  # compute dtype bytes under mixed precision (fp8: bf16 outside its matmuls)
COLWISE = ("attention.wq.weight", "attention.wk.weight", "attention.wv.weight", "feed_forward.w1.weight",
           "feed_forward.w3.weight", "output.weight", "tok_embeddings.weight")
ROWWISE = ("attention.wo.weight", "feed_forward.w2.weight")


@dataclass(frozen=True)
class Coords:
    pp: int = 0
    dp: int = 0


def tp_local(name: str, shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
    """The shape one tensor-parallel rank holds of a parameter (full shape `shape`)."""
    if tp == 1 or len(shape) == 1:
        return shape
    if name.endswith(COLWISE):
        return (shape[0] // tp, *shape[1:])
    if name.endswith(ROWWISE):
        return (shape[0], shape[1] // tp)
    raise ValueError(f"no tensor-parallel rule for {name}")


def stage_shapes(plan: Plan, pp_rank: int) -> dict[str, tuple[int, ...]]:
    """Full shapes of the parameters pipeline rank pp_rank holds (all of them without pipeline parallel)."""
    dims: ModelDims = plan.dims
    if plan.stages is None:
        return dims.param_shapes()
    mine = plan.stages.stages_of(pp_rank)
    return dims.param_shapes(plan.stages.blocks_of(pp_rank), embedding=0 in mine, head=plan.stages.last in mine)


def dim0_shard(shape: tuple[int, ...], n: int, rank: int, padded: bool) -> int:
    """Elements of FSDP2's dim-0 shard on dp rank `rank` of n: ceil(rows / n) rows (the padded storage every rank
    has), or the rows that rank really holds."""
    rest = math.prod(shape[1:])
    chunk = -(-shape[0] // n)
    rows = chunk if padded else max(0, min(chunk, shape[0] - rank * chunk))
    return rows * rest


def zero1_partition(shapes: dict[str, tuple[int, ...]], n: int) -> list[int]:
    """Elements of the parameters ZeroRedundancyOptimizer assigns to each of n ranks (its greedy rule)."""
    sizes = [0] * n
    groups = [[s for s in shapes.values() if len(s) >= 2], [s for s in shapes.values() if len(s) < 2]]
    for group in groups:
        for numel in sorted((math.prod(s) for s in group), reverse=True):  # stable: ties keep their order
            r = sizes.index(min(sizes))
            sizes[r] += numel
    return sizes


def fsdp_shards(plan: Plan, coords: Coords) -> tuple[int, int]:
    """Elements of the rank's FSDP shards: (padded, the rows it really holds). FSDP shards over the dp group, or
    under HSDP over its shard group (dp / dp_replicate neighbouring dp ranks)."""
    tp, n = plan.layout.tp, plan.layout.shard
    local = {k: tp_local(k, s, tp) for k, s in stage_shapes(plan, coords.pp).items()}
    return (sum(dim0_shard(s, n, coords.dp % n, padded=True) for s in local.values()),
            sum(dim0_shard(s, n, coords.dp % n, padded=False) for s in local.values()))


def host_states(plan: Plan, coords: Coords, zero_stage: int, offload: str) -> int:
    """Bytes in host memory on the rank at `coords` under parallel.offload: "all", its fp32 shards, their gradients
    and AdamW's two moments (fused AdamW steps them on the host: no temporary); "optimizer", the fp32 masters of what
    it steps (its shards under ZeRO-2/3, else its whole stage), the gradients' copy, the moments and foreach AdamW's
    temporary while it steps (HostAdamW: half the moments)."""
    if offload == "none":
        return 0
    n = plan.layout.dp
    if zero_stage in (2, 3) and (n > 1 or offload == "all"):
        padded, held = fsdp_shards(plan, coords)
    else:
        held = sum(math.prod(tp_local(k, s, plan.layout.tp)) for k, s in stage_shapes(plan, coords.pp).items())
        padded = held
    if offload == "all":
        return 4 * padded + 4 * padded + 8 * held
    return 4 * held + 4 * held + 8 * held + 4 * held


def model_states(plan: Plan, zero_stage: int, precision: str, coords: Coords, offload: str = "none"
                 ) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state on the rank at `coords` (every tp rank of a pp and dp
    coordinate holds the same amount: dimensions divide by tp), in device memory: with offload = "all" (FSDP's CPU
    offload) only the gathered low-precision parameters ZeRO-2 or a pipeline keeps, with "optimizer" no AdamW
    state; the rest is host_states."""
    tp, n = plan.layout.tp, plan.layout.dp
    zero = zero_stage if n > 1 or offload == "all" else -1
    shapes = stage_shapes(plan, coords.pp)
    local = {k: tp_local(k, s, tp) for k, s in shapes.items()}
    whole = sum(math.prod(s) for s in local.values())
    if zero in (-1, 0, 1):
        optimizer = 8 * (zero1_partition(local, n)[coords.dp] if zero == 1 else whole)
        return {"params": 4 * whole, "grads": 4 * whole, "optimizer": 0 if offload == "optimizer" else optimizer}
    padded, held = fsdp_shards(plan, coords)
    n = plan.layout.shard  # FSDP's shard group (dp, or dp / dp_replicate under HSDP)
    gathered = zero == 2 or plan.stages is not None  # parameters stay whole (padded rows too) through the step
    whole = LOW.get(precision, 4) * padded * n if gathered else 0
    if offload == "all":
        return {"params": whole, "grads": 0, "optimizer": 0}
    return {"params": 4 * padded + whole, "grads": 4 * padded, "optimizer": 0 if offload == "optimizer" else 8 * held}


def max_model_states(plan: Plan, zero_stage: int, precision: str, offload: str = "none") -> dict[str, int]:
    """Each component and the total on the rank that holds the most of it (they may be different ranks). Only the
    dp ranks that can hold the most are evaluated: rank 0 (FSDP's uneven shards give it the most rows), and under
    ZeRO-1 the rank its greedy placement gives the most."""
    n = plan.layout.dp
    ranks = {0}
    if zero_stage == 1 and n > 1:
        for p in range(plan.layout.pp):
            local = {k: tp_local(k, s, plan.layout.tp) for k, s in stage_shapes(plan, p).items()}
            sizes = zero1_partition(local, n)
            ranks.add(sizes.index(max(sizes)))
    every = [model_states(plan, zero_stage, precision, Coords(p, d), offload) for p in range(plan.layout.pp)
             for d in ranks]
    out = {k: max(s[k] for s in every) for k in ("params", "grads", "optimizer")}
    out["total"] = max(sum(s.values()) for s in every)
    return out
