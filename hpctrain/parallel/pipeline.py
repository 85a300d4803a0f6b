"""Pipeline parallelism on torch.distributed.pipelining, for the stages parallel/stages.py plans (`StagePlan`,
pure): the stage modules (slices of the rank's model that keep the full model's parameter names, so
checkpoints reshard across pp sizes), the schedule, and per-rank compute timing for the bubble metric.

    prune(model, plan, pp_rank)                                     # the rank keeps only its blocks
    parts = [stage_module(model, plan, s) for s in plan.stages_of(pp_rank)]
    pipe = Pipeline(plan, parts, pp_rank, pp_group, device, microbatches, loss_fn)
    loss = pipe.forward_backward(batches, context, loss_scale)      # one step's mean loss, on every pp rank
    total = pipe.eval_loss(batches, context, loss_scale)            # forward only: the sum of their mean losses
    pipe.summary(grad_accum)                                        # idle share per pp rank (collective)
"""
from __future__ import annotations

import contextlib
import inspect
import time
from typing import Any, Callable

import torch
from torch import nn

from hpctrain.parallel.stages import SCHEDULES, StagePlan

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


class TiedEmbedding:
    """Tied embeddings under pipeline parallel, as Megatron ties them: the first stage's rank holds the embedding,
    the last stage's its own copy as the output projection, both filled with the embedding's values
    (model.transformer.weight_of). After each step's backward (and data parallel's reduction) the two gradients
    are summed over a group of the two ranks of each (dp, tp) coordinate, so both copies take the same step and
    stay equal. The copy is counted once in the gradient norm (`duplicate`: the output's, on its rank), and a
    checkpoint holds the optimizer state of both under the embedding's name (`aliases`), as one process's tied
    model saves it; the model state holds both names, as one process's does."""

    def __init__(self, model: nn.Module, group, holds_copy: bool) -> None:
        self.model, self.group = model, group
        self.duplicate = model.output.weight if holds_copy else None
        self.aliases = {"output.weight": "tok_embeddings.weight"} if holds_copy else {}

    @staticmethod
    def build(model: nn.Module, plan: StagePlan, mesh) -> "TiedEmbedding | None":
        """Collective over the world (the pairs' groups are made together); None where the model is untied or
        one rank runs both stages."""
        import torch.distributed as dist
        first, last = plan.rank_of(0), plan.rank_of(plan.last)
        if not model.dims.tie_embeddings or first == last:
            return None
        lay = mesh.layout
        pairs = [[lay.rank(first, d, t), lay.rank(last, d, t)] for d in range(lay.dp) for t in range(lay.tp)]
        group, _ = dist.new_subgroups_by_enumeration(pairs)
        if mesh.pp_rank not in (first, last):
            return None
        return TiedEmbedding(model, group, holds_copy=mesh.pp_rank == last)

    def sync(self) -> None:
        """Sums the two copies' gradients (the local shards: both are sharded alike over tp and dp)."""
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor
        p = self.duplicate if self.duplicate is not None else self.model.tok_embeddings.weight
        grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        dist.all_reduce(grad, group=self.group)


# -- running --------------------------------------------------------------------------------------------------------

def timed_stage_class():
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import stage as torch_stage
    make_buffer = torch_stage._make_tensor_from_meta  # torch's own, private

    class TimedStage(PipelineStage):
        """A PipelineStage that adds up the time its compute takes (forward, backward, weight gradients);
        what remains of a step is the bubble plus communication. CUDA events on a GPU. Only while `timing`:
        Pipeline.step turns it on for the steps it times.

        Its receive buffers live only while their micro-batch does: torch's stage allocates one buffer for the
        input activations and one for the gradients coming back for every micro-batch of the step, and keeps
        them all between steps (m x 2 activations of b s h: 98 GiB per GPU on the 1T GPT layout's 512
        micro-batches, where Megatron receives into fresh tensors). Here a buffer is allocated when its receive
        is posted and dropped when its micro-batch's backward is done (the input activations autograd still
        needs stay alive through autograd: they are the stage's first block's input, counted as activations)."""
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.busy_s, self._events, self.timing = 0.0, [], True

        def _unallocated(self, prepare, *args, **kwargs):
            """torch's preparation of the first step, its m receive buffers made on the meta device (no memory)
            and dropped: each is made when its receive is posted."""
            torch_stage._make_tensor_from_meta = lambda meta, device: make_buffer(meta, torch.device("meta"))
            try:
                return prepare(*args, **kwargs)
            finally:
                torch_stage._make_tensor_from_meta = make_buffer
                self.release_buffers()

        def _prepare_forward_infra(self, *args, **kwargs):
            return self._unallocated(super()._prepare_forward_infra, *args, **kwargs)

        def _prepare_backward_infra(self, *args, **kwargs):
            return self._unallocated(super()._prepare_backward_infra, *args, **kwargs)

        @staticmethod
        def _held(infos) -> list:
            return [i for i in infos if not i.is_root_arg and i.tensor_meta is not None]

        def get_fwd_recv_ops(self, fwd_chunk_id: int):
            for info in self._held(self.args_recv_info.get(fwd_chunk_id, ())):
                if info.buffer is None:
                    info.buffer = make_buffer(info.tensor_meta, self.device)
            return super().get_fwd_recv_ops(fwd_chunk_id)

        def get_bwd_recv_ops(self, bwd_chunk_id: int):
            if self.has_backward and not self.is_last:
                for info in self._held(self.grad_recv_info.get(bwd_chunk_id, ())):
                    if info.buffer is None:
                        info.buffer = make_buffer(info.tensor_meta, self.device)
            return super().get_bwd_recv_ops(bwd_chunk_id)

        def release_buffers(self, chunk: int | None = None) -> None:
            """Drops the receive buffers of micro-batch `chunk` (all when None)."""
            chunks = self.args_recv_info.keys() | self.grad_recv_info.keys() if chunk is None else [chunk]
            for c in chunks:
                for info in self._held((*self.args_recv_info.get(c, ()), *self.grad_recv_info.get(c, ()))):
                    info.buffer = None

        def held_buffers(self) -> int:
            """Receive buffers this stage holds now (after a step: none)."""
            infos = [i for d in (self.args_recv_info, self.grad_recv_info) for t in d.values() for i in t]
            return sum(1 for i in self._held(infos) if i.buffer is not None)

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

        def backward_one_chunk(self, bwd_chunk_id: int, *args, **kwargs):
            out = self._timed(super().backward_one_chunk, bwd_chunk_id, *args, **kwargs)
            self.release_buffers(bwd_chunk_id)
            return out

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
        # the last stage keeps no micro-batch's logits for a merged output nobody reads (all m of them until the
        # step ends: 15 GB of fp32 on a 530B layout's last stage); an older torch without the option keeps them
        self.no_outputs = {"return_outputs": False} if "return_outputs" in inspect.signature(
            self.schedule.step).parameters else {}
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
        kwargs |= self.no_outputs
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
        try:
            with context, self._forward_only():
                self.schedule.eval(*args, **kwargs)
        finally:
            for st in self.stages:
                st.release_buffers()
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
