"""Peak memory of one rank during a train step: the most bytes of live tensors at any moment of forward, backward,
gradient sync, clipping and optimizer step, model states included, from the plan alone (no torch). What
`hpctrain plan` calls memory per GPU before its margin (report.MARGIN, for the allocator's fragmentation).

    each, once = stage_activations(cfg, plan, pp_rank)  # bytes per micro-batch in flight, and held just once
    n = in_flight(schedule, pp, v, m, pp_rank)          # micro-batches whose activations it holds at once
    out = peak(cfg, plan, states, pp_rank)              # {"peak", "activations", "phase"}; states: memory.py's

The step's moments, each a candidate; the peak is the largest (every term seen in the live tensors of real ranks,
tests/multiproc/planner/test_planner_memory.py):
- "backward": the backward that starts with the most micro-batches in flight. Always the fp32 masters and AdamW
  state. The gradients that already exist: DDP's buckets all step (under no_sync a second, unbucketed set for
  the micro-batches before the last); otherwise those of an earlier micro-batch's backward (grad_accum > 1;
  under pipeline parallel when the rank holds fewer in flight than its micro-batches), for FSDP still unsharded
  (fp32, or bf16 with train.reduce_dtype = "bf16" under mixed precision, not measured here: reduce-scattered
  after the last one).
  The parameters FSDP keeps gathered (ZeRO-2, ZeRO-3 under pipeline parallel); under plain ZeRO-3 the root's
  (embedding, norm, output) and two blocks' (the one in backward, the one prefetched). The activations of the
  micro-batches in flight (stage_activations x in_flight, autocast's weight copies once; + one block recomputed
  under checkpointing). Then on the rank with the loss three logits-sized fp32 buffers (the logits the trainer
  or the pipeline's last stage holds, their log-softmax's gradient and their gradient), or, where no gradient
  existed yet, the first block's gradients if larger.
- "sync": where gradients are all-reduced as one flat copy after the last backward (ZeRO-0/1 with tensor parallel
  or under pipeline parallel: parallel.data.allreduce_grads): masters, AdamW state, gradients, the copy.
- "optimizer": fused AdamW's step (train.optim.build_optimizer): masters, gradients and AdamW state; its kernel
  keeps no temporary (foreach AdamW's held the square root of exp_avg_sq, half the AdamW state, beside them).
Under pipeline parallel every moment also has the schedule's receive buffers: one for input activations (all stages
but the first) and one for the gradients coming back (all but the last); hpctrain's stages make each when its
receive is posted and drop it after its micro-batch's backward (parallel.pipeline: torch kept one of each per
micro-batch of the step), and a micro-batch in flight holds its input as its first block's input (activations). The last
stage keeps no micro-batch's logits past its backward: the trainer asks the schedule for no merged output
(parallel.pipeline.Pipeline; torch older than that option keeps them all, m logits more on the last stage).

Micro-batches in flight on pipeline rank r (measured on torch 2.13's schedules, in units of the rank's whole
set of blocks): 1 without pipeline parallel; GPipe m; 1F1B min(m, pp - r); interleaved 1F1B (warm-up + 1)
chunks of 1/v of the blocks, warm-up = (v - 1) x m / max(1, m // pp) + 2 (pp - 1 - r), at most m v chunks.
Other schedules (looped BFS, zero bubble) use the interleaved count: not measured.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from hpctrain.planner.activations import ActivationModel, block_weights, mode_of
from hpctrain.planner.memory import LOW, Coords, fsdp_shards

if TYPE_CHECKING:
    from hpctrain.config import Config
    from hpctrain.parallel.plan import Plan



def in_flight(schedule: str, pp: int, virtual: int, microbatches: int, pp_rank: int = 0) -> float:
    """Micro-batches whose activations pipeline rank pp_rank holds at once, in units of all its blocks."""
    m = microbatches
    if pp == 1:
        return 1
    if schedule == "gpipe":
        return m
    if virtual == 1:
        return min(m, pp - pp_rank)
    per_round = m // max(1, m // pp)
    warmup = min((virtual - 1) * per_round + 2 * (pp - 1 - pp_rank), m * virtual)
    return min(warmup + 1, m * virtual) / virtual


def stage_activations(cfg: Config, plan: Plan, pp_rank: int) -> tuple[float, float]:
    """(each micro-batch's activations, what the rank holds once however many are in flight) on pipeline rank
    pp_rank (all of them without pipeline parallel). Once: autocast's weight copies; under pipeline parallel two
    residual-stream widths on the last stage. Each micro-batch: the blocks, embedding and head, and on every
    stage but the first the received input (a residual-stream width)."""
    p, t, lay = cfg.parallel, cfg.train, plan.layout
    model = ActivationModel(mode_of(t.precision, p.zero_stage, lay.dp), lay.tp, p.sequence_parallel)
    tokens = plan.micro_batch * cfg.data.seq_len // plan.layout.cp  # a cp rank holds its share of each sequence
    if plan.stages is None:
        n = plan.dims.n_layers
        kept = n - model.checkpointed(n, t.ac, t.ac_every)
        weights = model.weight_copy_bytes(plan.dims, kept, head=True)
        return model.micro_batch_bytes(plan.dims, tokens, n, t.ac, t.ac_every) - weights, weights
    each = once = 0.0
    for s in plan.stages.stages_of(pp_rank):
        first, last, n = s == 0, s == plan.stages.last, len(plan.stages.layers[s])
        weights = model.weight_copy_bytes(plan.dims, n - model.checkpointed(n, t.ac, t.ac_every), head=last)
        each += model.micro_batch_bytes(plan.dims, tokens, n, t.ac, t.ac_every, embedding=first, head=last) - weights
        each += (0 if first else 1) * model.input_bytes(plan.dims, tokens)
        once += weights + (2 if last else 0) * model.input_bytes(plan.dims, tokens)
    return each, once


def peak(cfg: Config, plan: Plan, states: dict[str, int], pp_rank: int = 0) -> dict[str, float]:
    """The peak live bytes of the rank at pipeline rank pp_rank holding `states` (memory.model_states): "peak",
    the moment it happens at ("phase"), every moment's bytes ("moments") and the activations in flight at the
    backward ("activations")."""
    p, t, lay, dims = cfg.parallel, cfg.train, plan.layout, plan.dims
    offload = p.offload == "all"  # FSDP's shards, gradients and AdamW state in host memory (memory.host_states)
    # (offload = "optimizer": `states` holds no AdamW state; the rest stays on the device)
    zero = p.zero_stage if lay.dp > 1 or offload else -1
    fsdp = zero in (2, 3)
    masters = states["grads"] if fsdp else states["params"]
    gathered = states["params"] - masters
    grads, opt = states["grads"], states["optimizer"]
    # the fp32 shard size, for the unsharded gradients FSDP accumulates on the device over micro-batches
    shard = 4 * fsdp_shards(plan, Coords(pp_rank, 0))[0] if offload else masters
    tokens = plan.micro_batch * cfg.data.seq_len // plan.layout.cp  # a cp rank holds its share of each sequence
    model = ActivationModel(mode_of(t.precision, p.zero_stage, lay.dp), lay.tp, p.sequence_parallel)
    m = t.grad_accum
    head = plan.stages is None or plan.stages.last in plan.stages.stages_of(pp_rank)
    each, once = stage_activations(cfg, plan, pp_rank)
    n = in_flight(p.pp_schedule, lay.pp, p.pp_virtual_stages, m, pp_rank)
    acts = each * n + once
    if t.ac != "none":
        acts += model.block_bytes(dims, tokens)
    logits = 4.0 * tokens * dims.vocab_size / lay.tp
    buffers = 0.0
    if plan.stages is not None:
        stages = plan.stages.stages_of(pp_rank)
        width = model.input_bytes(dims, tokens)
        buffers = width * sum((s != 0) + (s != plan.stages.last) for s in stages)
    ddp = zero in (0, 1) and lay.tp == 1 and plan.stages is None
    # an earlier micro-batch's gradients; FSDP's unsharded, in train.reduce_dtype under mixed precision
    low_reduce = t.reduce_dtype == "bf16" and t.precision in LOW
    accumulated = shard * lay.shard * (0.5 if low_reduce else 1) if fsdp else grads  # HSDP: its shard group
    if offload and plan.stages is None:  # reduce-scattered every micro-batch into the host's shards
        accumulated = 0
    if ddp:
        early = grads * (2 if m > 1 else 1)
    elif plan.stages is None:
        early = accumulated if m > 1 else 0
    else:
        early = accumulated if n < m else 0
    block = block_weights(dims) / lay.tp + 2 * dims.dim  # one block's local elements
    if fsdp and zero == 3 and plan.stages is None:
        root = (2 * dims.vocab_size * dims.dim / lay.tp + dims.dim)
        # the running block and the ones gathered ahead of it (parallel.fsdp_prefetch: the next one by default)
        gathered = LOW.get(t.precision, 4) * ((1 + p.fsdp_prefetch) * block + root)
    # then the loss's buffers, or, a little later, the first block's gradients beside the same activations
    later = 3 * logits if head else 0.0
    if not early:
        later = max(later, 4 * block)
    moments = {
        "backward": masters + opt + gathered + early + acts + later + buffers,
        "optimizer": masters + grads + opt + buffers,
    }
    if zero in (0, 1) and (lay.tp > 1 or plan.stages is not None):
        moments["sync"] = masters + opt + 2 * grads + buffers
    phase = max(moments, key=moments.get)
    return {"peak": moments[phase], "activations": acts, "phase": phase, "moments": moments}
