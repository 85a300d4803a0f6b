"""The pipeline's stages, pure (no torch: the login node's plan and dry run use it): which blocks each stage holds
and which pp rank runs it, checked against the layer count and the schedule's micro-batch needs.

    plan = StagePlan.build(cfg.parallel, cfg.model.n_layers)        # refuses bad layer counts up front
    plan.stages_of(pp_rank), plan.blocks_of(pp_rank), describe(plan, microbatches)

Stage s holds plan.layers[s] (global block indices); stage 0 also the embedding, the last stage the final norm
and the output projection. Stages go to pp ranks round robin (s % pp: rank r runs r, r + pp, ...), or in a V
for the ZBV schedule (rank r runs r and 2 pp - 1 - r). The stage modules and the schedule: parallel/pipeline.py.
"""
from __future__ import annotations

from dataclasses import dataclass

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
