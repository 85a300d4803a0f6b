"""Turns the single-device Transformer into the job's parallel model, one parallelism at a time in a fixed order
(torchtitan's), on the meta device first so no rank ever holds more than its shard:

    1. pipeline  (parallel/pipeline.py)    the rank keeps only its stages' blocks
    2. tensor    (parallel/tensor.py)      DTensor tp over the node-local mesh
       context   (parallel/context.py)     ring attention over the cp group (its rotary rows after 6.)
    3. recompute (parallel/recompute.py)   activation checkpointing of blocks
       compile   (compile_blocks)          torch.compile of each block (train.compile)
    4. data      (parallel/data.py)        FSDP2 for ZeRO-2/3
    5. materialise (parallel/materialize.py)  each rank allocates and fills only its shards (tiled seeded init)
    6. data      (parallel/data.py)        how gradients meet across dp: DDP, a coalesced all-reduce or FSDP's

    pm = build(cfg, mesh, device)        # pm.model, pm.dims, pm.sync(last_micro_step), pm.loss_parallel
    with pm.step_context(last_micro_step):  # the sync, loss parallel (and autocast when asked) of one micro-step

fill=False leaves the weights allocated but unfilled (a resume overwrites them): pm.fill() fills them, pm.loaded()
says a checkpoint did. With pp > 1, pm.parts are the stage modules the schedule runs and pm.plan says which stages
this rank runs.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from hpctrain.config import Config
from hpctrain.dtypes import torch_dtype
from hpctrain.model.transformer import ModelDims, Transformer
from hpctrain.parallel import context, data, pipeline, recompute, tensor
from hpctrain.parallel.materialize import materialize
from hpctrain.parallel.mesh import Layout
from hpctrain.parallel.plan import Plan, with_training
from hpctrain.parallel.stages import StagePlan


@dataclass
class ParallelModel:
    model: nn.Module
    dims: ModelDims
    loss_parallel: bool  # logits stay vocab-sharded; cross-entropy runs under torch's loss_parallel()
    sync: data.Sync  # sync(is_last_micro_step) -> context manager around forward+backward
    autocast_dtype: torch.dtype | None  # autocast for layouts without FSDP's mixed precision
    zero_stage: int
    parts: list[nn.Module] = field(default_factory=list)  # stage modules this rank runs (pp > 1)
    plan: StagePlan | None = None
    # fills the weights from the seeded init; None once filled, or when a checkpoint has filled them
    unfilled: Callable[[], None] | None = None
    device_type: str = "cpu"  # where the weights live: autocast's device type
    tied: pipeline.TiedEmbedding | None = None  # tied embeddings whose two copies live on two pipeline ranks
    float8_gather: bool = False  # FSDP gathers the blocks' weights in float8 (train.fp8_all_gather)

    def fill(self) -> bool:
        """Fills the weights from the seeded init unless done (or loaded) already; True if it filled now."""
        fill, self.unfilled = self.unfilled, None
        if fill is not None:
            fill()
        return fill is not None

    def loaded(self) -> None:
        """A checkpoint has written every parameter (before the first step): the seeded init is not needed."""
        self.unfilled = None

    def after_step(self) -> None:
        """The optimizer has changed the weights (every rank, after its step, skipped or not). With float8
        all-gathers: the next gathers' float8 scales, for every weight at once in one all-reduce of the FSDP mesh
        (torchao's precompute, as torchtitan runs it) instead of an all-reduce per weight in each gather. The same
        number either way: fp8 max / max|w| in float64."""
        if self.float8_gather:
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
            precompute_float8_dynamic_scale_for_fsdp(self.model)

    def step_context(self, last_micro_step: bool, autocast: bool = False) -> contextlib.ExitStack:
        """Around a forward and backward: the gradient sync of the last micro-step, loss parallel (its backward
        must run inside it too), and with `autocast` autocast for layouts without FSDP's mixed precision."""
        ctx = contextlib.ExitStack()
        if self.tied is not None and last_micro_step:  # entered first, so it runs after the dp reduction
            ctx.enter_context(_after(self.tied.sync))
        ctx.enter_context(self.sync(last_micro_step))
        if self.loss_parallel:
            from torch.distributed.tensor.parallel import loss_parallel
            ctx.enter_context(loss_parallel())
        if autocast:
            ctx.enter_context(self.autocast())
        return ctx

    def autocast(self):
        """Autocast to autocast_dtype on the model's device type, or nothing."""
        dt = self.autocast_dtype
        return torch.autocast(self.device_type, dtype=dt) if dt is not None else contextlib.nullcontext()


def build(cfg: Config, mesh, device: torch.device, fill: bool = True, plan: Plan | None = None) -> ParallelModel:
    """mesh: hpctrain.parallel.mesh.Mesh (or None for one process); plan: the trainer's plan (hpctrain.parallel.plan,
    with its training part), made here on the mesh's layout when not given."""
    if plan is None:
        bare = Plan(mesh.layout, tuple(mesh.node_of_rank)) if mesh else Plan(Layout(1, 1, 1), (0,))
        plan = with_training(bare, cfg)
    tp, dp, stages, dims = plan.layout.tp, plan.layout.dp, plan.stages, plan.dims
    assert dims is not None
    # -1: no data parallel wrapping; CPU offload is FSDP's, on one GPU too (its shards are the whole model)
    offload = cfg.parallel.offload == "all" and mesh is not None
    zero = cfg.parallel.zero_stage if dp > 1 or offload else -1
    loss_parallel = tp > 1 and cfg.parallel.loss_parallel
    low = torch_dtype(cfg.train.compute) if cfg.train.compute != "fp32" else None
    with torch.device("meta"):
        model = Transformer(dims)
    pp_rank = mesh.pp_rank if stages else 0
    if stages:
        pipeline.prune(model, stages, pp_rank)
    if cfg.train.precision == "fp8":
        to_float8(model, cfg.train.fp8_scaling, cfg.train.fp8_all_gather)
    if tp > 1:
        keys = list(model.layers)
        recomputed = [keys[i] for i in recompute.recomputed_blocks(len(keys), cfg.train.ac, cfg.train.ac_every)]
        tensor.apply_tp(model, mesh.sub("tp"), cfg.parallel.sequence_parallel, loss_parallel, recomputed)
    cp = plan.layout.cp
    if cp > 1:
        context.apply_cp(model, mesh.group("cp"), mesh.members("cp", mesh.rank))
    # compiled after recompute's wrapper (torch.compile's own recompute), except whole-block recompute under tp:
    # torch 2.13 cannot trace activation checkpointing of DTensor blocks (its saved tensors then include a
    # DeviceMesh), so there the compiled block is recomputed by the eager wrapper
    inside = cfg.train.compile and tp > 1 and cfg.train.ac in recompute.WHOLE
    if inside:
        compile_blocks(model, in_place=True)
    recompute.apply_ac(model, cfg.train.ac, cfg.train.ac_every)
    if cfg.train.compile and not inside:
        compile_blocks(model)
    parts = [pipeline.stage_module(model, stages, s) for s in stages.stages_of(pp_rank)] if stages else []
    if zero in (2, 3):
        data.apply_fsdp(model, mesh.sub("fsdp"), zero, low, torch_dtype(cfg.train.reduce_dtype), parts or None,
                        stages.pp if stages else 1, offload=offload, prefetch=cfg.parallel.fsdp_prefetch)
    unfilled = materialize(model, dims, cfg.train.seed, device, parts or None, fill,
                           torch.device("cpu") if offload else None)
    model, sync = data.gradient_sync(model, zero, stages is not None, tp, mesh.group("dp") if mesh else None, device,
                                     compress_bf16=low is not None and cfg.train.reduce_dtype == "bf16",
                                     offload=offload, bucket_mb=cfg.parallel.ddp_bucket_mb)
    if cp > 1:  # after DDP's construction, which broadcasts every buffer from dp rank 0 (its rotary rows)
        context.place_rotary([getattr(model, "module", model), *parts],
                             context.positions(cfg.data.seq_len, cp, mesh.cp_rank))
    autocast = None if zero in (2, 3) else low  # FSDP casts parameters itself; master weights stay fp32 in shards
    tied = pipeline.TiedEmbedding.build(model, stages, mesh) if stages else None
    return ParallelModel(model, dims, loss_parallel, sync, autocast, zero, parts, stages, unfilled, device.type, tied,
                         cfg.train.fp8_all_gather)


def to_float8(model: Transformer, scaling: str, all_gather: bool = False) -> None:
    """train.precision = "fp8": the blocks' linear layers become torchao's Float8Linear (their matmuls in float8 with
    rowwise or tensorwise scales, the weights and their gradients as before: checkpoints do not change); the output
    projection stays in bf16, as torchtitan keeps it. all_gather (train.fp8_all_gather, tensorwise): their weights
    become torchao's float8-gathering wrappers of the fp32 weights, which FSDP then gathers in float8 (the
    checkpoint writes the fp32 inside, h5file.plain). GPUs only (trainer.check_precision refused the rest)."""
    import dataclasses

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(scaling), enable_fsdp_float8_all_gather=all_gather)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda module, fqn: fqn.startswith("layers."))


def compile_blocks(model: Transformer, in_place: bool = False) -> None:
    """Regional compilation (torchtitan's): each block (with its recompute wrapper) becomes torch.compile's module,
    so FSDP's hooks, the pipeline's stages and the loss stay eager around compiled blocks. Identical blocks share
    one graph (torch inlines the modules and takes their parameters as inputs), so compilation does not grow with the
    depth. Graph breaks are allowed (fullgraph off): context parallel's ring exchanges its K/V between compiled
    pieces. The parameters' names gain "_orig_mod.", which checkpoints and the seeded init drop (clean_name).
    in_place: the block module compiles its own call (Module.compile: no wrapper, the names unchanged), for a block
    that a recompute wrapper then wraps (torch's state dicts drop "_orig_mod." only where it is outermost)."""
    # found here: with AOTAutograd's cache warm (a second run of the same tp + sequence-parallel layout), torch 2.13
    # trained with wrong gradients (the first step's norm 1-4% off the eager run's); the compiled graphs' own cache
    # (inductor's FX graph cache) stays on
    torch._functorch.config.enable_autograd_cache = False
    for key in list(model.layers):
        if in_place:
            model.layers[key].compile()
        else:
            model.layers[key] = torch.compile(model.layers[key])


@contextlib.contextmanager
def _after(fn: Callable[[], None]):
    """Runs fn when the block ends without an error (a collective: never while an exception unwinds)."""
    yield
    fn()
