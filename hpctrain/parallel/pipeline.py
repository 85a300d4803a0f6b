"""Pipeline parallelism on torch.distributed.pipelining: which blocks each stage holds and which pp rank runs it
(pure, `StagePlan`), the stage modules (slices of the rank's model that keep the full model's parameter names, so
checkpoints reshard across pp sizes), the schedule, and per-rank compute timing for the bubble metric.

    plan = StagePlan.build(cfg.parallel, cfg.model.n_layers)        # refuses bad layer counts up front
    prune(model, plan, pp_rank)                                     # the rank keeps only its blocks
    parts = [stage_module(model, plan, s) for s in plan.stages_of(pp_rank)]
    pipe = Pipeline(plan, parts, pp_rank, pp_group, device, microbatches, loss_fn)
    loss = pipe.forward_backward(batches, context, loss_scale)      # one step's mean loss, on every pp rank
    total = pipe.eval_loss(batches, context, loss_scale)            # forward only: the sum of their mean losses
    pipe.summary(grad_accum)                                        # idle share per pp rank (collective)

Stage s holds plan.layers[s] (global block indices); stage 0 also the embedding, the last stage the final norm
and the output projection. Stages go to pp ranks round robin (s % pp: rank r runs r, r + pp, ...), or in a V
for the ZBV schedule (rank r runs r and 2 pp - 1 - r).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

# config name -> (torch schedule class name, runs several stages per rank)
SCHEDULES = {
    "gpipe": ("ScheduleGPipe", False),
    "1f1b": ("Schedule1F1B", False),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", True),
    "looped_bfs": ("ScheduleLoopedBFS", True),
    "interleaved_zero_bubble": ("ScheduleInterleavedZeroBubble", True),
    "zbv": ("ScheduleZBVZeroBubble", True),
}


def balanced_layers(n_layers: int, num_stages: int) -> list[int]:
    """Blocks per stage as even as possible; the first stages take the remainder, since the last one also runs
    the output projection and the loss."""
    base, extra = divmod(n_layers, num_stages)
    return [base + (1 if s < extra else 0) for s in range(num_stages)]


@dataclass(frozen=True)
class StagePlan:
    pp: int
    virtual: int  # stages per pp rank
    schedule: str
    layers: tuple[tuple[int, ...], ...]  # global block indices of each stage

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual

    @property
    def last(self) -> int:
        return self.num_stages - 1

    def rank_of(self, stage: int) -> int:
        if self.schedule == "zbv":  # V: down the ranks, then back up
            return stage if stage < self.pp else 2 * self.pp - 1 - stage
        return stage % self.pp

    def stages_of(self, pp_rank: int) -> list[int]:
        return [s for s in range(self.num_stages) if self.rank_of(s) == pp_rank]

    def blocks_of(self, pp_rank: int) -> list[int]:
        return sorted(b for s in self.stages_of(pp_rank) for b in self.layers[s])

    @property
    def zero_bubble(self) -> bool:
        """Schedules that split backward into input- and weight-gradient passes."""
        return self.schedule in ("interleaved_zero_bubble", "zbv")

    def bubble_theory(self, microbatches: int) -> float | None:
        """Idle share of a step with equal stages and free communication: (p - 1) / (v m + p - 1) for GPipe and
        1F1B (v = 1) and the interleaved schedules; None for zero-bubble ones, whose bubble depends on the ratio
        of forward, input-gradient and weight-gradient times."""
        if self.zero_bubble:
            return None
        p, v = self.pp, self.virtual
        return (p - 1) / (v * microbatches + p - 1)

    def check_microbatches(self, m: int) -> None:
        """What torch's schedules need of the micro-batch count (train.grad_accum), checked before launch."""
        if self.schedule == "1f1b" and m < self.pp:
            raise ValueError(f"train.grad_accum = {m} micro-batches: 1F1B needs at least pp = {self.pp}")
        if self.schedule in ("interleaved_1f1b", "interleaved_zero_bubble"):
            rounds = max(1, m // self.pp)
            if m % rounds:
                raise ValueError(f"train.grad_accum = {m} micro-batches: {self.schedule} needs a multiple of "
                                 f"{rounds} (max(1, m // pp)); use a multiple of pp = {self.pp}")

    @staticmethod
    def build(parallel, n_layers: int) -> "StagePlan":
        """From [parallel] (pp, pp_schedule, pp_virtual_stages, pp_layers) and model.n_layers."""
        pp, v = parallel.pp, parallel.pp_virtual_stages
        stages = pp * v
        if parallel.pp_layers:
            counts = list(parallel.pp_layers)
            if sum(counts) != n_layers:
                raise ValueError(f"parallel.pp_layers = {counts} sums to {sum(counts)}; model.n_layers = {n_layers}")
        else:
            if n_layers < stages:
                raise ValueError(f"model.n_layers = {n_layers} cannot fill pp ({pp}) x pp_virtual_stages ({v}) = "
                                 f"{stages} pipeline stages with a block each")
            counts = balanced_layers(n_layers, stages)
        # A stage with no block is refused, the first (embedding only) and the last (norm and output only) too: its
        # rank idles through the step (pp_layers = [0, 2] on 1f1b here: rank 0 idle 0.992 of the step)
        empty = [s for s, n in enumerate(counts) if n == 0]
        if empty:
            fix = (f"e.g. {balanced_layers(n_layers, stages)}" if n_layers >= stages else
                   f"model.n_layers = {n_layers} cannot fill {stages} stages")
            raise ValueError(f"parallel.pp_layers = {counts}: stage(s) {empty} of {stages} would hold no block; every "
                             f"stage needs at least one ({fix})")
        layers, start = [], 0
        for n in counts:
            layers.append(tuple(range(start, start + n)))
            start += n
        return StagePlan(pp, v, parallel.pp_schedule, tuple(layers))


def describe(plan: StagePlan, microbatches: int) -> str:
    """What the dry run shows: the schedule, and the blocks of each pp rank's stages."""
    def span(blocks) -> str:
        return f"{blocks[0]}-{blocks[-1]}" if len(blocks) > 1 else (str(blocks[0]) if blocks else "none")
    lines = [f"pipeline: {plan.schedule}, {plan.num_stages} stages over pp={plan.pp} ranks, {microbatches} "
             f"micro-batches per step"
             + (f", bubble (p-1)/(vm+p-1) = {plan.bubble_theory(microbatches):.3f}"
                if plan.bubble_theory(microbatches) is not None else "")]
    for r in range(plan.pp):
        parts = []
        for s in plan.stages_of(r):
            extra = (["embedding"] if s == 0 else []) + (["norm, output"] if s == plan.last else [])
            parts.append(f"stage {s} blocks {span(plan.layers[s])}" + (f" + {', '.join(extra)}" if extra else ""))
        lines.append(f"  pp rank {r}: " + "; ".join(parts))
    return "\n".join(lines)


# -- stage modules ------------------------------------------------------------------------------------------------

def prune(model: nn.Module, plan: StagePlan, pp_rank: int) -> None:
    """Drops what this pp rank does not run: other stages' blocks, the embedding unless it runs stage 0, the
    final norm and output unless it runs the last stage. Block names (global indices) stay."""
    stages = plan.stages_of(pp_rank)
    keep = {str(b) for b in plan.blocks_of(pp_rank)}
    for key in [k for k in model.layers if k not in keep]:
        del model.layers[key]
    if 0 not in stages:
        model.tok_embeddings = None
    if plan.last not in stages:
        model.norm, model.output = None, None


def stage_module(model: nn.Module, plan: StagePlan, stage: int) -> nn.Module:
    """A module that runs one stage with the rank's own (already parallelised) submodules, under their full-model
    names: the same class as the model, so its forward skips what is None."""
    part = type(model).__new__(type(model))
    nn.Module.__init__(part)
    part.dims = model.dims
    part.tok_embeddings = model.tok_embeddings if stage == 0 else None
    part.layers = nn.ModuleDict({str(b): model.layers[str(b)] for b in plan.layers[stage]})
    last = stage == plan.last
    part.norm, part.output = (model.norm, model.output) if last else (None, None)
    part.register_buffer("rope_cos", torch.empty(0), persistent=False)
    part.register_buffer("rope_sin", torch.empty(0), persistent=False)
    return part


# -- running --------------------------------------------------------------------------------------------------------

def timed_stage_class():
    from torch.distributed.pipelining import PipelineStage

    class TimedStage(PipelineStage):
        """A PipelineStage that adds up the time its compute takes (forward, backward, weight gradients);
        what remains of a step is the bubble plus communication. CUDA events on a GPU. Only while `timing`:
        Pipeline.step turns it on for the steps it times."""
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.busy_s, self._events, self.timing = 0.0, [], True

        def _timed(self, fn, *args, **kwargs):
            if not self.timing:
                return fn(*args, **kwargs)
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = fn(*args, **kwargs)
                end.record()
                self._events.append((start, end))
                return out
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.busy_s += time.perf_counter() - t0

        def forward_one_chunk(self, *args, **kwargs):
            return self._timed(super().forward_one_chunk, *args, **kwargs)

        def backward_one_chunk(self, *args, **kwargs):
            return self._timed(super().backward_one_chunk, *args, **kwargs)

        def backward_weight_one_chunk(self, *args, **kwargs):
            return self._timed(super().backward_weight_one_chunk, *args, **kwargs)

        def take_busy(self) -> float:
            """Compute seconds since the last call (synchronises the device)."""
            if self._events:
                self._events[-1][1].synchronize()
                self.busy_s += sum(s.elapsed_time(e) for s, e in self._events) / 1e3
                self._events = []
            busy, self.busy_s = self.busy_s, 0.0
            return busy

    return TimedStage


class Pipeline:
    """This rank's stages and the schedule that drives them. `step(x, y)` runs one pipelined forward and
    backward over `microbatches` equal slices of the batch (gradients averaged over them); it returns the
    per-micro-batch losses on the rank that runs the last stage, None elsewhere. `timing()` gives the compute
    and wall seconds of the timed steps since the last call; `step(x, y, timed=False)` leaves a step out of it and
    does without the barriers and device synchronisation that timing takes. The first step is never timed: it
    infers the activation shapes across stages."""

    def __init__(self, plan: StagePlan, parts: list[nn.Module], pp_rank: int, group, device: torch.device,
                 microbatches: int, loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]) -> None:
        import torch.distributed.pipelining as pipelining
        plan.check_microbatches(microbatches)
        timed = timed_stage_class()
        self.plan, self.device, self.group, self.pp_rank = plan, device, group, pp_rank
        self.stage_ids = plan.stages_of(pp_rank)
        self.stages = [timed(part, s, plan.num_stages, device, group=group)
                       for part, s in zip(parts, self.stage_ids)]
        cls_name, multi = SCHEDULES[plan.schedule]
        cls = getattr(pipelining, cls_name)
        self.schedule = cls(self.stages if multi else self.stages[0], n_microbatches=microbatches,
                            loss_fn=loss_fn, scale_grads=True)
        self.first, self.last = 0 in self.stage_ids, plan.last in self.stage_ids
        self.busy_s = self.wall_s = 0.0
        self.steps = 0
        self.shapes_known = False  # the first step infers shapes across stages: never timed (not the bubble)
        self.eval_order: dict[int, list] | None = None  # see _forward_only

    def step(self, x: torch.Tensor, y: torch.Tensor, timed: bool = True) -> list[torch.Tensor] | None:
        import torch.distributed as dist
        losses: list[torch.Tensor] = []
        args = (x,) if self.first else ()
        kwargs: dict[str, Any] = {"target": y, "losses": losses} if self.last else {}
        timed, self.shapes_known = timed and self.shapes_known, True
        for st in self.stages:
            st.timing = timed
        if not timed:
            self.schedule.step(*args, **kwargs)
            return losses if self.last else None
        # The step is timed between barriers of the pp group, the same window on every stage: the last stage
        # finishes its own work before the first stage's final backward, and that wait belongs to its bubble.
        # (The ranks meet right after anyway, in the gradient-norm all-reduce.)
        dist.barrier(group=self.group)
        t0 = time.perf_counter()
        self.schedule.step(*args, **kwargs)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)
        self.wall_s += time.perf_counter() - t0
        self.busy_s += sum(st.take_busy() for st in self.stages)
        self.steps += 1
        return losses if self.last else None

    def forward_backward(self, batches: list[tuple[torch.Tensor, torch.Tensor]], context, loss_scale: float,
                         timed: bool = False) -> torch.Tensor:
        """One step's forward and backward: the (x, y) micro-batches (every stage reads them, so every rank's
        loader stays at the same position) through the schedule under `context` (gradient sync, loss parallel,
        autocast); returns the mean unscaled loss on every pp rank. Timing the schedule (for the bubble)
        synchronises the pp group and the device: `timed` on log steps only."""
        import torch.distributed as dist
        # copied part by part: a concatenation on the host would leave the loader's pinned memory
        x, y = (torch.cat([b.to(self.device, non_blocking=True) for b in parts]) for parts in zip(*batches))
        loss = torch.zeros((), device=self.device)
        with context:
            losses = self.step(x, y, timed=timed)
        if losses is not None:
            total = sum((t.full_tensor() if hasattr(t, "full_tensor") else t).detach().float() for t in losses)
            loss = total / (len(batches) * loss_scale)
        dist.all_reduce(loss, group=self.group)  # only the last stage's ranks add a non-zero loss
        return loss

    def eval_loss(self, batches: list[tuple[torch.Tensor, torch.Tensor]], context, loss_scale: float) -> torch.Tensor:
        """Forward only (the schedule's eval) over as many (x, y) micro-batches as a step takes, under `context`
        (loss parallel, autocast): the sum of their mean unscaled losses, on every pp rank. Never timed."""
        import torch.distributed as dist
        x, y = (torch.cat([b.to(self.device) for b in parts]) for parts in zip(*batches))
        losses: list[torch.Tensor] = []
        args = (x,) if self.first else ()
        kwargs: dict[str, Any] = {"target": y, "losses": losses} if self.last else {}
        for st in self.stages:
            st.timing = False
        with context, self._forward_only():
            self.schedule.eval(*args, **kwargs)
        total = torch.zeros((), device=self.device)
        if self.last:
            total = sum((t.full_tensor() if hasattr(t, "full_tensor") else t).detach().float() for t in losses)
            total = total / loss_scale
        dist.all_reduce(total, group=self.group)  # only the last stage's ranks add a non-zero loss
        return total

    @contextlib.contextmanager
    def _forward_only(self):
        """Around schedule.eval(): a multi-stage schedule runs its training order with the forward actions and their
        sends and receives only. torch 2.13's eval() of these schedules still runs the backward actions (as
        no-ops), and ZBV's two adjacent stages on one rank fail there ("can't steal_bwd_input if this stage doesn't
        have backward"). Dropping actions keeps every rank's forwards in the order training runs them, so no new
        wait can arise. gpipe and 1f1b: eval() runs forwards only already."""
        sched = self.schedule
        train_order = getattr(sched, "pipeline_order_with_comms", None)
        if train_order is None:
            yield
            return
        if self.eval_order is None:
            from torch.distributed.pipelining.schedules import FORWARD, RECV_F, RESHARD, SEND_F, UNSHARD
            keep = (FORWARD, SEND_F, RECV_F, UNSHARD, RESHARD)
            self.eval_order = {r: [a for a in ops if a.computation_type in keep] for r, ops in train_order.items()}
        sched.pipeline_order_with_comms = self.eval_order
        try:
            yield
        finally:
            sched.pipeline_order_with_comms = train_order

    def summary(self, microbatches: int) -> dict[str, Any]:
        """Per pp rank: mean step time (schedule only, the timed steps since the last timing() call), compute time,
        and the idle share 1 - compute / step next to the schedule's theory, with a one-line digest ("line").
        Collective over the whole world: every rank calls it."""
        import torch.distributed as dist
        plan, t = self.plan, self.timing()
        mine = (self.pp_rank, t["steps"], t["wall_s"], t["busy_s"])
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        ranks = []
        for r in range(plan.pp):
            rows = [e for e in every if e[0] == r and e[1] > 0]  # averaged over the rank's dp and tp peers
            steps = sum(e[1] for e in rows)
            wall, busy = (sum(e[2] for e in rows) / steps, sum(e[3] for e in rows) / steps) if steps else (0, 0)
            ranks.append({"pp_rank": r, "stages": plan.stages_of(r), "blocks": plan.blocks_of(r), "step_s": wall,
                          "compute_s": busy, "idle_fraction": 1 - busy / wall if wall else None})
        idle = [x["idle_fraction"] for x in ranks if x["idle_fraction"] is not None]
        theory = plan.bubble_theory(microbatches)
        out = {"schedule": plan.schedule, "pp": plan.pp, "virtual_stages": plan.virtual, "microbatches": microbatches,
               "stage_layers": [list(x) for x in plan.layers], "bubble_theory": theory,
               "idle_fraction_mean": sum(idle) / len(idle) if idle else None, "per_pp_rank": ranks}
        out["line"] = (f"{plan.schedule} p={plan.pp} v={plan.virtual} m={microbatches}: idle "
                       + ", ".join(f"rank {x['pp_rank']} {x['idle_fraction']:.3f} of {x['step_s'] * 1e3:.1f} ms"
                                   for x in ranks if x["idle_fraction"] is not None)
                       + (f" (theory {theory:.3f})" if theory is not None else ""))
        return out

    def timing(self) -> dict[str, float]:
        """{'steps', 'wall_s', 'busy_s'} accumulated since the last call, then reset."""
        out = {"steps": self.steps, "wall_s": self.wall_s, "busy_s": self.busy_s}
        self.busy_s = self.wall_s = 0.0
        self.steps = 0
        return out
