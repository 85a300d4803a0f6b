"""Optimizer pieces: AdamW without decay on 1-D parameters, the learning rate (linear batch scaling when asked),
warmup + cosine schedule, gradient clipping on the true global norm across tensor-parallel and FSDP shards and
pipeline stages, and a dynamic loss scaler for fp16.

    lr = effective_lr(cfg.train, global_batch)             # train.lr, scaled when train.scale_lr_with_batch is set
    opt = build_optimizer(model, cfg.train, lr, zero_group)  # ZeRO-1 (ZeroOne) when zero_group is given
    sched = build_schedule(opt, cfg.train, lr, cfg.train.steps)  # LambdaLR, stepped once per train step
    norm = grad_norm(params, pp_group); clip_grads(params, t.grad_clip, norm)   # the same norm on every rank
    skipped = step_or_skip(opt, norm, finite, loss_scaled=False)  # a non-finite step never reaches the weights
    scaler = LossScaler(enabled=precision == "fp16", init_scale=t.loss_scale)

Tested through training: tests/multiproc/parallel/test_train_equivalence.py (grad norms against a one-process reference,
the
skipped non-finite step) and tests/multiproc/parallel/test_grad_scale_mutations.py.
"""
from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

from hpctrain.config import TrainConfig
from hpctrain.config.sections import HOST_BUCKET_BYTES


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only: norms, biases and other 1-D parameters are left alone."""
    decay, keep = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else keep).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": keep, "weight_decay": 0.0}]


class ZeroOne(ZeroRedundancyOptimizer):
    """ZeRO-1 over dp, for plain and tensor-parallel parameters (Megatron's distributed optimizer): each dp rank
    keeps the AdamW state of its share of the parameters, steps that share and broadcasts it to the other dp ranks.

    torch's ZeroRedundancyOptimizer partitions and broadcasts plain tensors; a tp parameter is a DTensor, so it is
    handed the parameter's local shard (the storage the DTensor wraps: an update in place is the parameter's
    update), and step() points each shard's .grad at the local part of the parameter's gradient, redistributed to
    the parameter's placements first (a no-op unless the gradient is partial). Shards have the same sizes on every
    tp rank, so every tp rank of a dp group partitions alike and the broadcasts pair up. params_of maps each
    tensor the optimizer holds to the model's parameter (itself when plain): the checkpoint saves the state under
    the parameter's name, as a DTensor like the parameter's."""

    def __init__(self, groups: list[dict], process_group, **kwargs) -> None:
        self.params_of: dict[torch.Tensor, torch.Tensor] = {}
        shards = [[self._shard(p) for p in g["params"]] for g in groups]
        super().__init__(shards[0], optimizer_class=torch.optim.AdamW, process_group=process_group,
                         weight_decay=groups[0]["weight_decay"], fused=True, **kwargs)
        for g, held in zip(groups[1:], shards[1:]):
            self.add_param_group({"params": held, "weight_decay": g["weight_decay"]})

    def _shard(self, p: torch.Tensor) -> torch.Tensor:
        if isinstance(p, DTensor):
            with torch.no_grad():
                shard = p.to_local()  # no autograd: the local tensor itself, the parameter's storage
        else:
            shard = p
        self.params_of[shard] = p
        return shard

    def step(self, closure=None):
        for shard, p in self.params_of.items():
            if shard is not p:
                g = p.grad
                shard.grad = None if g is None else g.redistribute(p.device_mesh, p.placements).to_local()
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for shard, p in self.params_of.items():
            if shard is not p and p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()


class HostAdamW(torch.optim.AdamW):
    """parallel.offload = "optimizer" (ZeRO-Offload's split): the parameters and their gradients stay on the
    device, AdamW's state and an fp32 master copy of each (local shard of a) parameter live in host memory (pinned
    on GPUs), and the step runs on the host's cores. params_of maps each master to its parameter (the checkpoint
    saves the state under the parameter's name, as a DTensor like the parameter's: state.ZeroOneOptimizerState).
    The masters are copied from the parameters before the first step and after a checkpoint's load
    (reload_masters): the weights are filled, or loaded, after the optimizer is built.

    The step is a pipeline over buckets of about bucket_bytes of masters (ZeRO-Offload's overlap): on a GPU every
    bucket's gradients are queued for download on one side stream, the host steps bucket i as soon as its own
    download has landed (an event, not a device-wide sync) while bucket i+1 is still coming down and bucket i-1's
    new weights go up on a second side stream; the device's compute stream waits for the uploads, the host does
    not, so the next step's first kernels are queued while the last bucket is still in flight. What is left
    exposed is the first bucket's download and the last one's upload. The gradients are final only after the
    step's reductions, clipping and (fp16) unscaling, so nothing goes down before step() is called. On the CPU
    device the same buckets run in order, with plain copies."""

    def __init__(self, groups: list[dict], pin: bool, bucket_bytes: int = HOST_BUCKET_BYTES, **kwargs) -> None:
        self.params_of: dict[torch.Tensor, torch.Tensor] = {}
        self.pin, self.stale = pin, True
        host = [{"params": [self._master(p) for p in g["params"]], "weight_decay": g["weight_decay"]}
                for g in groups]
        super().__init__(host, foreach=True, **kwargs)
        self.buckets = self._bucket(bucket_bytes)
        self._streams = None

    optim = property(lambda self: self, doc="the optimizer holding the masters (as ZeroOne's .optim)")

    def _master(self, p: torch.Tensor) -> torch.Tensor:
        local = self._weights(p)
        master = torch.empty(local.shape, dtype=torch.float32, device="cpu", pin_memory=self.pin)
        self.params_of[master] = p
        return master

    def _bucket(self, bucket_bytes: int) -> list[list[list[torch.Tensor]]]:
        """Consecutive masters of about bucket_bytes each: bucket[g] is the list of group g's masters in it."""
        buckets, size = [], bucket_bytes
        for gi, group in enumerate(self.param_groups):
            for m in group["params"]:
                if size >= bucket_bytes:
                    buckets.append([[] for _ in self.param_groups])
                    size = 0
                buckets[-1][gi].append(m)
                size += m.numel() * m.element_size()
        return buckets

    def reload_masters(self) -> None:
        """The masters are copied from the parameters before the next step."""
        self.stale = True

    @staticmethod
    def _weights(p: torch.Tensor) -> torch.Tensor:
        """The parameter's local storage (under no_grad: the tensor the DTensor wraps, written in place)."""
        return p.to_local() if isinstance(p, DTensor) else p

    @staticmethod
    def _grad(p: torch.Tensor) -> torch.Tensor:
        """The local part of the parameter's gradient, in the parameter's placements (partial under some plans)."""
        g = p.grad
        return g.redistribute(p.device_mesh, p.placements).to_local() if isinstance(g, DTensor) else g

    def _step_bucket(self, bucket: list[list[torch.Tensor]]) -> None:
        """torch's AdamW over this bucket's masters only (its state is kept per tensor, so a step in parts is the
        step); the groups' full lists are put back even if it raises."""
        whole = [g["params"] for g in self.param_groups]
        try:
            for g, part in zip(self.param_groups, bucket):
                g["params"] = part
            super().step()
        finally:
            for g, params in zip(self.param_groups, whole):
                g["params"] = params

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            self._pipelined_step()
        return loss

    def _pipelined_step(self) -> None:
        pairs = list(self.params_of.items())
        if not pairs:
            return
        device = next(iter(self.params_of.values())).device
        if self.stale:
            for master, p in pairs:
                master.copy_(self._weights(p))
            self.stale = False
        grads = {}
        for master, p in pairs:  # on the compute stream: a partial gradient's reduction is compute-stream work
            if p.grad is None:
                master.grad = None
                continue
            grads[master] = self._grad(p)
            if master.grad is None:
                master.grad = torch.empty(master.shape, dtype=torch.float32, device="cpu", pin_memory=self.pin)
        if device.type != "cuda":
            for bucket in self.buckets:
                for m in (m for part in bucket for m in part if m in grads):
                    m.grad.copy_(grads[m])
                self._step_bucket(bucket)
                for m in (m for part in bucket for m in part):
                    self._weights(self.params_of[m]).copy_(m)
            return
        if self._streams is None:
            self._streams = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        down, up = self._streams
        compute = torch.cuda.current_stream(device)
        down.wait_stream(compute)  # the gradients are final on the compute stream
        landed = []
        with torch.cuda.stream(down):
            for bucket in self.buckets:
                for m in (m for part in bucket for m in part if m in grads):
                    m.grad.copy_(grads[m], non_blocking=True)
                landed.append(torch.cuda.Event())
                landed[-1].record(down)
        up.wait_stream(compute)
        for bucket, event in zip(self.buckets, landed):
            event.synchronize()  # this bucket's gradients are on the host; the next ones are still coming
            self._step_bucket(bucket)
            with torch.cuda.stream(up):
                for m in (m for part in bucket for m in part):
                    self._weights(self.params_of[m]).copy_(m, non_blocking=True)
        compute.wait_stream(up)  # the next forward reads the new weights; the host goes on
        # the gradients read on the side stream were reached from the compute stream: their memory is not reused
        # before the downloads are done (every event was waited for above)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for p in self.params_of.values():
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()


def build_optimizer(model: nn.Module, t: TrainConfig, lr: float, zero_group=None,
                    host: bool = False) -> torch.optim.Optimizer:
    """AdamW over the model's parameters: ZeRO-1's (ZeroOne) when zero_group is given, on the host (HostAdamW)
    with host (parallel.offload = "optimizer")."""
    kwargs = {"lr": lr, "betas": (t.beta1, t.beta2), "eps": 1e-8}
    groups = param_groups(model, t.weight_decay)
    if zero_group is not None:  # ZeRO-1: each dp rank keeps the AdamW state of its share of parameters
        return ZeroOne(groups, zero_group, **kwargs)
    if host:
        pin = any(p.device.type == "cuda" for g in groups for p in g["params"])
        return HostAdamW(groups, pin, **kwargs)
    # fused: one kernel per dtype and device that takes DTensor shards (FSDP, TP) as plain tensors and takes
    # found_inf, so step_or_skip skips a non-finite step on the device, without the host reading the norm
    return torch.optim.AdamW(groups, fused=True, **kwargs)


def step_or_skip(optimizer: torch.optim.Optimizer, norm: torch.Tensor, finite: bool,
                 loss_scaled: bool) -> bool | torch.Tensor:
    """torchtitan's rule: never let a non-finite gradient reach the weights. Steps `optimizer` unless the gradients'
    norm is non-finite (or `finite` is False); returns whether the step was skipped.

    An optimizer that takes found_inf (build_optimizer's fused AdamW, and ZeRO-1's, whose inner AdamW is fused)
    decides on the device: its kernel leaves weights, moments and step counts alone, and "skipped" stays a device
    tensor. The others (the host's AdamW of parallel.offload = "optimizer", whose step waits for the gradients
    anyway) cannot, so the host reads the norm's finiteness. With fp16 (`loss_scaled`) the scaler has read its
    overflow flag already (finite)."""
    inner = getattr(optimizer, "optim", optimizer)  # ZeroOne steps its inner AdamW
    if finite and getattr(inner, "_step_supports_amp_scaling", False) and not loss_scaled:
        found_inf = (~torch.isfinite(norm)).float()
        inner.found_inf = found_inf
        optimizer.step()
        return found_inf.bool()
    skipped = not (finite and bool(torch.isfinite(norm)))  # the documented host sync
    if not skipped:
        optimizer.step()
    return skipped


def lr_at(step: int, base_lr: float, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup over `warmup` steps, then cosine down to base_lr * min_ratio at `total`."""
    if warmup and step < warmup:
        return base_lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return base_lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def build_schedule(opt: torch.optim.Optimizer, t: TrainConfig, base_lr: float, total: int):
    fn = lambda step: lr_at(step, base_lr, t.warmup_steps, total, t.min_lr_ratio) / base_lr  # noqa: E731
    return torch.optim.lr_scheduler.LambdaLR(opt, fn)


def effective_lr(t: TrainConfig, global_batch: int) -> float:
    """Linear scaling rule when train.scale_lr_with_batch names the batch that train.lr was tuned for."""
    return t.lr * global_batch / t.scale_lr_with_batch if t.scale_lr_with_batch else t.lr


def _groups(params: Iterable[nn.Parameter]) -> list[list[nn.Parameter]]:
    """Parameters with gradients, grouped so each group's gradients share one mesh and placement (or are plain
    tensors): foreach kernels cannot mix DTensors of different meshes (FSDP+TP gives 1-D and 2-D ones)."""
    groups: dict[tuple, list[nn.Parameter]] = {}
    for p in params:
        if p.grad is not None:
            g = p.grad
            key = (id(g.device_mesh), tuple(g.placements)) if isinstance(g, DTensor) else ("plain",)
            groups.setdefault(key, []).append(p)
    return list(groups.values())


def grad_norm(params: Iterable[nn.Parameter], pp_group=None) -> torch.Tensor:
    """The L2 norm of all gradients as if the model were on one device.

    Sharded (DTensor) gradients reduce their partial norms over their mesh; plain gradients are whole on
    every rank (DDP has all-reduced them; tensor parallel replicates what it does not shard). Pipeline stages
    hold disjoint parameters: their squared norms add up over pp_group."""
    params = list(params)
    total = None  # starts from the first group's norm, on its device: no host scalar copied in every step
    for group in _groups(params):
        n = torch.nn.utils.get_total_norm([p.grad for p in group], 2.0, foreach=True)
        n = (n.full_tensor() if isinstance(n, DTensor) else n).float() ** 2
        total = n if total is None else total + n
    if total is None:
        # No gradient on this rank: its zero joins the pp all-reduce on the device its peers' norms are on (the
        # parameters'). A host zero would go to the gloo half of a "cpu:gloo,cuda:nccl" group while the peers
        # wait in NCCL: a hang. Every pp rank holds a block (StagePlan.build), so params is not empty there.
        total = torch.zeros((), device=params[0].device if params else None)
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    return total.sqrt()


def clip_grads(params: list[nn.Parameter], max_norm: float, norm: torch.Tensor) -> None:
    """Scales the gradients so that their norm (grad_norm's) is at most max_norm, on the device: no host sync.
    Call it only for a finite norm (an inf one zeroes the gradients, a nan one poisons them)."""
    for group in _groups(params):
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm, foreach=True)


class LossScaler:
    """Dynamic loss scaling for fp16: scale the loss up, skip steps whose gradients overflow and halve the
    scale, double it after `growth_interval` clean steps. Works for any sharding: the overflow check is one
    all-reduce over the world."""

    def __init__(self, enabled: bool, init_scale: float, growth_interval: int = 200) -> None:
        self.enabled = enabled
        self.scale = init_scale if enabled else 1.0
        self.growth_interval = growth_interval
        self.good_steps = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.enabled else loss

    def unscale_and_check(self, params: list[nn.Parameter], device: torch.device) -> bool:
        """Divides gradients by the scale; True when every rank's gradients are finite."""
        if not self.enabled:
            return True
        bad = torch.zeros(1, device=device)
        with torch.no_grad():
            for p in params:
                if p.grad is None:
                    continue
                g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                g.mul_(1.0 / self.scale)
                bad += (~torch.isfinite(g)).any().float()
        if dist.is_initialized():
            dist.all_reduce(bad)
        return bad.item() == 0

    def update(self, skipped: bool | torch.Tensor) -> None:
        """After a step: the scale doubles after growth_interval clean steps and halves on a skipped one. Disabled,
        `skipped` is not read (it may be a device tensor, the fused optimizer's own skip: reading it waits)."""
        if not self.enabled:
            return
        if not skipped:
            self.good_steps += 1
            if self.good_steps % self.growth_interval == 0:
                self.scale *= 2.0
        else:
            self.scale /= 2.0
            self.good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, d: dict) -> None:
        self.scale, self.good_steps = d["scale"], d["good_steps"]
