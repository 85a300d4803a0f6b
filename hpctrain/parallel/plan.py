"""The job's plan: every layout decision, made once by one function (`make_plan`) on the login node (submit, dry
run, topo) and on every rank (session start; the trainer adds the training part), from the config and where
the ranks are:

    p = make_plan(cfg, mesh.block_placement(nodes, tasks_per_node))  # raises ValueError on what cannot run
    p.layout, p.dims, p.stages, p.micro_batch, p.global_batch, p.notes

Pure: checks and arithmetic, no process group. The layout and topology check always; the model dimensions, the
pipeline's stages and the batch plan when the job trains (train.steps > 0, or training=True; `with_training` adds
them to a plan made without), imported only then.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from hpctrain.parallel import mesh

if TYPE_CHECKING:
    from hpctrain.config import Config
    from hpctrain.model.dims import ModelDims
    from hpctrain.parallel.stages import StagePlan


@dataclass(frozen=True)
class Plan:
    layout: mesh.Layout
    node_of_rank: tuple[int, ...]  # node index of each rank, the placement the topology was checked on
    dims: ModelDims | None = None  # training part: None when the plan was made without training
    stages: StagePlan | None = None  # the pipeline's stages when pp > 1
    micro_batch: int = 0  # sequences per rank per micro-step
    global_batch: int = 0  # sequences per optimizer step
    notes: tuple[str, ...] = ()  # to show before launch (the vocabulary padding, the pipeline's stages)

    @property
    def training(self) -> bool:
        return self.dims is not None


def make_plan(cfg: Config, node_of_rank: Sequence[int], training: bool | None = None) -> Plan:
    """The plan of cfg on ranks placed on nodes node_of_rank (len = world size); each check runs here once.
    training=None: with the training part when cfg.train.steps > 0 (the login node); a session makes the layout
    part (training=False) and its trainer adds the rest (with_training), for the config it trains."""
    p = cfg.parallel
    layout = mesh.resolve_layout(p.pp, p.dp, p.tp, len(node_of_rank), p.cp, p.dp_replicate)
    mesh.check_topology(layout, node_of_rank)
    plan = Plan(layout, tuple(node_of_rank))
    return with_training(plan, cfg) if (bool(cfg.train.steps) if training is None else training) else plan


def with_training(plan: Plan, cfg: Config) -> Plan:
    """plan (its layout checked) with the model dimensions, pipeline stages and batch plan of cfg on it."""
    from hpctrain.model.dims import ModelDims
    from hpctrain.parallel import stages as pipeline_stages

    tp, dp = plan.layout.tp, plan.layout.dp
    stages = _check_supported(cfg, dp)
    dims = ModelDims.from_config(cfg.model, tp)
    micro, global_batch = _batch_plan(cfg, plan.layout.data)
    notes = [pipeline_stages.describe(stages, cfg.train.grad_accum)] if stages else []
    if stages and cfg.parallel.zero_stage == 3 and dp > 1:
        notes.append(f"parallel.zero_stage = 3 with parallel.pp = {stages.pp}: each stage's parameters are gathered "
                     f"once per step, not for each of the {cfg.train.grad_accum} micro-batches, and stay whole until "
                     f"its last backward (ZeRO-2's parameter memory during the step)")
    if dims.vocab_size != dims.true_vocab_size:
        notes.append(f"model.vocab_size = {dims.true_vocab_size} padded to {dims.vocab_size} (a multiple of "
                     f"lcm(64, tp={tp})) so the vocabulary shards evenly")
    return dataclasses.replace(plan, dims=dims, stages=stages, micro_batch=micro, global_batch=global_batch,
                               notes=tuple(notes))


def _check_supported(cfg: Config, dp: int) -> StagePlan | None:
    """Refuses what does not compose; returns the pipeline's stage plan when pp > 1."""
    from hpctrain.parallel.stages import StagePlan

    z, pp = cfg.parallel.zero_stage, cfg.parallel.pp
    stages = None
    if pp > 1:
        stages = StagePlan.build(cfg.parallel, cfg.model.n_layers)
        if cfg.model.tie_embeddings and stages.rank_of(stages.last) == stages.rank_of(0):
            raise ValueError(f"model.tie_embeddings = true with parallel.pp_schedule = {stages.schedule!r}: its "
                             f"first and last stages run on the same rank as two modules, and a parameter shared "
                             f"between them is not supported; untie them or use 1f1b or interleaved_1f1b")
        stages.check_microbatches(cfg.train.grad_accum)
        if stages.zero_bubble and z == 3 and dp > 1:
            # measured: losses leave the single-process reference from the second step on (torch 2.13)
            raise ValueError(f"parallel.pp_schedule = {stages.schedule!r} with parallel.zero_stage = 3 trains "
                             f"wrongly: the deferred weight-gradient pass does not compose with parameters resharded "
                             f"after forward; use zero_stage 2 (the same memory for gradients and optimizer state) "
                             f"or a schedule without zero bubble (1f1b, interleaved_1f1b)")
    return stages


def _batch_plan(cfg: Config, dp: int) -> tuple[int, int]:
    """(micro_batch_size, global_batch_size) over dp data-parallel replicas (the ranks of a cp group read the same
    sequences); a global batch that does not split evenly is refused."""
    t = cfg.train
    if t.global_batch_size:
        if t.global_batch_size % (dp * t.grad_accum):
            raise ValueError(f"train.global_batch_size = {t.global_batch_size} is not divisible by dp({dp}) x "
                             f"train.grad_accum({t.grad_accum}) = {dp * t.grad_accum}")
        return t.global_batch_size // (dp * t.grad_accum), t.global_batch_size
    return t.micro_batch_size, t.micro_batch_size * t.grad_accum * dp
