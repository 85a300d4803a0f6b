"""The trainer: the only module that wires session, model, parallelism, data, optimizer and metrics. Launch it
any way you like:

    hpctrain train CONFIG                      # one process
    mpiexec -n 4 hpctrain train CONFIG         # MPI gives identity
    srun --mpi=pmi2 hpctrain train CONFIG      # same inside Slurm
    torchrun --nproc-per-node 4 -m hpctrain.cli train CONFIG
    hpctrain submit CONFIG                     # through submitit (passes --run-dir)

Rank 0 writes metrics.jsonl and summary.json into the run directory. Non-finite steps are skipped (nothing reaches
the weights); train.max_nonfinite_steps of them in a row, or every step of a run, stop it with NonFiniteSteps (exit
status 1), and no checkpoint is made of them (checkpoint/checkpointer.py says which saves wait or are not made).
"""
from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hpctrain.checkpoint.checkpointer import Progress
from hpctrain.config import Config, load_config
from hpctrain.data import loader as data
from hpctrain.hang import stragglers
from hpctrain.hang.heartbeat import Heartbeat
from hpctrain.job import session
from hpctrain.parallel import compose, context, pipeline
from hpctrain.parallel.plan import with_training
from hpctrain.train import agreement, evaluate, metrics, optim, resume, summary

log = logging.getLogger(__name__)


def check_precision(precision: str, device: torch.device) -> None:
    if device.type == "cuda" and precision == "bf16" and not torch.cuda.is_bf16_supported():
        raise ValueError(f"train.precision = 'bf16' but {torch.cuda.get_device_name(device)} has no bf16; "
                         f"use fp16 (with loss scaling) or fp32")
    if precision == "fp8":
        import importlib.util
        cuda = device.type == "cuda"
        why = float8_refusal(device.type, torch.cuda.get_device_capability(device) if cuda else None,
                             torch.cuda.get_device_name(device) if cuda else device.type,
                             importlib.util.find_spec("torchao") is not None)
        if why:
            raise ValueError(why)


def float8_refusal(device_type: str, capability: tuple[int, int] | None, name: str, have_torchao: bool) -> str:
    """Why train.precision = 'fp8' cannot run here ('' when it can): float8 matmuls need CUDA compute capability
    8.9 or newer (Ada, Hopper, Blackwell) and torchao's float8 layers."""
    if device_type != "cuda" or capability is None:
        return (f"train.precision = 'fp8' on a {name} device: float8 matmuls need an NVIDIA GPU of compute "
                f"capability 8.9 or newer (H100, H200, B200); train in bf16 or fp32")
    if tuple(capability) < (8, 9):
        return (f"train.precision = 'fp8' on {name} (compute capability {capability[0]}.{capability[1]}): float8 "
                f"matmuls need 8.9 or newer (H100, H200, B200); train in bf16")
    if not have_torchao:
        return ("train.precision = 'fp8' needs torchao's float8 layers: pip install 'hpctrain[fp8]' (or torchao "
                "matching this torch)")
    return ""


def tf32_setting(enabled: bool, device_type: str) -> bool | None:
    """What to set torch's TF32 flags to: train.tf32 on CUDA, both ways (cuDNN's flag defaults to on); None on
    other devices, whose flags are left alone (torch's fp32 matmul precision also steers oneDNN on CPUs)."""
    return enabled if device_type == "cuda" else None


def apply_tf32(enabled: bool, device: torch.device) -> bool:
    """Sets the process's TF32 flags for this device; True when fp32 matmuls then run on TF32 tensor cores."""
    setting = tf32_setting(enabled, device.type)
    if setting is not None:
        torch.backends.cuda.matmul.allow_tf32 = setting
        torch.backends.cudnn.allow_tf32 = setting
    return bool(setting)


class NonFiniteSteps(RuntimeError):
    """Training stopped: train.max_nonfinite_steps consecutive steps were non-finite, or every step of the run."""


class NonFiniteStreak:
    """How many of the latest steps were non-finite (skipped), against train.max_nonfinite_steps. Counted where
    a step's "skipped" lives: on the host when the host decided the skip, on the device when the fused optimizer
    did (optim.step_or_skip), so counting never waits for the device. Reading a count on the device waits
    for it: the trainer reads it only where the host reads the device anyway (log steps, saves, the end)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.count: int | torch.Tensor = 0

    def add(self, skipped: bool | torch.Tensor) -> None:
        if isinstance(skipped, torch.Tensor):
            self.count = (self.count + 1) * skipped  # on the device: a finite step sets it back to 0
        else:
            self.count = self.count + 1 if skipped else 0

    def on_host(self) -> bool:
        return not isinstance(self.count, torch.Tensor)

    def check_where_read(self, step: int, logged: bool) -> None:
        """check(step) where the count costs no wait for the device: it is on the host, or the log step read it."""
        if logged or self.on_host():
            self.check(step)

    def check(self, step: int) -> int:
        """The count after `step`; NonFiniteSteps when it has reached the limit. Same on every rank: a step is
        skipped on the global gradient norm (or the loss scaler's world-wide overflow check)."""
        n = int(self.count)
        if n >= self.limit:
            raise NonFiniteSteps(
                f"training stopped at step {step}: its last {n} steps ({step - n + 1} to {step}) were non-finite "
                f"(loss or gradients nan or inf, each step skipped), train.max_nonfinite_steps = {self.limit}; no "
                f"checkpoint of them was made. Look for nan or inf in the starting weights or the data, or a "
                f"train.lr too large, then resume from the newest checkpoint")
        return n

    def check_trained(self, start: int, step: int) -> None:
        """At the end of training from `start` to `step`: a run whose every step was non-finite trained nothing,
        whatever the limit."""
        streak = self.check(step)
        if step > start and streak >= step - start:
            raise NonFiniteSteps(f"training ended at step {step} with nothing trained: every step of this run "
                                 f"({start + 1} to {step}) was non-finite (loss or gradients nan or inf, each "
                                 f"skipped); no checkpoint of them was made. Look for nan or inf in the starting "
                                 f"weights or the data")


class Trainer:
    """Builds one rank's training (parallel model, optimizer, schedule, loss scaler, data) from the config and the
    session, and steps it: train_step() is one optimizer step; fit() runs the loop with checkpoints and metrics."""

    def __init__(self, cfg: Config, s: session.Session) -> None:
        self.cfg, self.s, self.device = cfg, s, s.device
        check_precision(cfg.train.precision, self.device)
        self.tf32 = apply_tf32(cfg.train.tf32, self.device)
        self.plan = with_training(s.plan, cfg)  # the session's layout; this config's model, stages and batches
        layout = self.plan.layout
        self.micro_batch, self.global_batch = self.plan.micro_batch, self.plan.global_batch
        torch.manual_seed(cfg.train.seed)
        # weights allocated, not filled: a resume overwrites them; train_step, save and .model fill them otherwise
        self.pm = compose.build(cfg, s.mesh, self.device, fill=False, plan=self.plan)
        self.params = [p for p in self.pm.model.parameters() if p.requires_grad]
        copy = self.pm.tied.duplicate if self.pm.tied else None  # a tied embedding's second copy: counted once
        self.norm_params = [p for p in self.params if p is not copy]
        self.dp_group = s.mesh.group("dp")
        self.pp_group = s.mesh.group("pp") if layout.pp > 1 else None
        self.lr = optim.effective_lr(cfg.train, self.global_batch)
        zero_group = self.dp_group if self.pm.zero_stage == 1 else None  # ZeRO-1 shards the optimizer state on dp
        self.optimizer = optim.build_optimizer(self.pm.model, cfg.train, self.lr, zero_group,
                                               host=cfg.parallel.offload == "optimizer")
        self.scheduler = optim.build_schedule(self.optimizer, cfg.train, self.lr, cfg.train.steps)
        self.scaler = optim.LossScaler(cfg.train.precision == "fp16", cfg.train.loss_scale)
        # files no record describes: scanned once, by one rank, before any rank opens them
        data.check_ids_at_start(cfg, dist.group.WORLD, s.run_dir, s.heartbeat)
        self.loader = data.train_loader(cfg, self.pm.dims.true_vocab_size, self.micro_batch, s.mesh.data_rank,
                                        layout.data, pin_memory=self.device.type == "cuda")
        if layout.cp > 1:  # the cp ranks of a replica read the same sequences, each keeping its share
            self.loader = context.ShardedLoader(self.loader, context.positions(cfg.data.seq_len, layout.cp,
                                                                               s.mesh.cp_rank))
        self.evaluator = (evaluate.Evaluator(cfg, self.pm.dims.true_vocab_size, s.mesh, self.micro_batch, self.device)
                          if cfg.train.eval_every else None)
        self.progress = Progress()
        self.nonfinite = NonFiniteStreak(cfg.train.max_nonfinite_steps)
        self.sync_steps = True  # train_step reads its metrics to the host every step; fit() only on log steps
        self.pipe = pipeline.Pipeline(self.pm.plan, self.pm.parts, s.mesh.pp_rank, self.pp_group, self.device,
                                      cfg.train.grad_accum, self._pipeline_loss) if self.pm.plan else None
        # where this rank is (hang forensics) and how long it computed and waited (the straggler report)
        self.hb = s.heartbeat if s.heartbeat is not None else Heartbeat(None, s.rank)
        self.stragglers = stragglers.Reporter(self.hb, self.device, s.hosts, layout, cfg.train.straggler_margin)
        if layout.dp > 1 and self.pipe is None:
            self.stragglers.mark_gradient_reduction(self.pm.model)
        summary.log_model(self)

    step = property(lambda self: self.progress.step, doc="optimizer steps taken (a resume restores them)")
    tokens_seen = property(lambda self: self.progress.tokens_seen, doc="training tokens of every step taken")

    @property
    def model(self) -> torch.nn.Module:
        """The parallel model, its weights filled from the seeded init on first use unless a checkpoint filled them."""
        self.pm.fill()
        return self.pm.model

    def _pipeline_loss(self, logits, y: torch.Tensor) -> torch.Tensor:
        """The last stage's loss of one micro-batch; the schedule averages gradients over micro-batches."""
        return self.scaler.scale_loss(F.cross_entropy(logits.flatten(0, 1).float(), y.flatten()))

    def _forward_backward(self) -> torch.Tensor:
        """grad_accum micro-batches through the (unpipelined) model; returns their mean loss. Gradients are reduced
        across dp only after the last micro-batch (nanoGPT's no_sync trick)."""
        accum = self.cfg.train.grad_accum
        loss_sum = torch.zeros((), device=self.device)
        for k in range(accum):
            self.hb.enter("data")
            x, y = (b.to(self.device, non_blocking=True) for b in self.loader.next_batch())
            self.stragglers.last_micro_batch = k == accum - 1
            with self.pm.step_context(k == accum - 1):
                self.hb.enter("forward", f"micro-batch {k + 1}/{accum}")
                with self.pm.autocast():
                    logits = self.model(x)
                mean = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
                loss = mean / accum
                self.hb.enter("backward", f"micro-batch {k + 1}/{accum}")
                self.scaler.scale_loss(loss).backward()
            loss_sum += (loss.full_tensor() if hasattr(loss, "full_tensor") else loss).detach()
        self.stragglers.last_micro_batch = False
        return loss_sum

    def log_step(self, step: int) -> bool:
        """Whether `step` is logged: every train.log_every steps, the first and the last."""
        return step % self.cfg.train.log_every == 0 or step in (1, self.cfg.train.steps)

    def train_step(self, sync: bool | None = None) -> dict[str, Any]:
        """One optimizer step over grad_accum micro-batches; returns this step's metrics (dp-averaged loss). Without
        sync nothing here waits for the device (but optim.step_or_skip's finiteness read where the optimizer cannot
        skip on the device): "loss" (float64, the dp mean) and "grad_norm" stay device tensors (metrics.host_values
        reads them), the pipeline's step is not timed. By default a step syncs when sync_steps is set (callers that
        step by hand get host values) or when it is a log step: fit() clears sync_steps for its loop."""
        t = self.cfg.train
        if sync is None:
            sync = self.sync_steps or self.log_step(self.step + 1)
        self.hb.begin_step(self.step + 1)
        self.pm.fill()  # never train on unfilled memory (the pipeline's stages do not go through self.model)
        self.optimizer.zero_grad(set_to_none=True)
        if self.pipe is None:
            loss_sum = self._forward_backward()
        else:
            self.hb.enter("data")
            batches = [self.loader.next_batch() for _ in range(t.grad_accum)]  # every stage reads: same position
            self.hb.enter("forward", f"pipeline schedule, forward and backward of {t.grad_accum} micro-batches")
            loss_sum = self.pipe.forward_backward(batches, self.pm.step_context(True, autocast=True), self.scaler.scale,
                                                  timed=sync)
        self.hb.enter("optimizer", "unscale and finiteness")
        finite = self.scaler.unscale_and_check(self.params, self.device)  # fp16: reads the overflow flag (a sync)
        self.hb.enter("collective", "gradient norm over the shards")
        norm = optim.grad_norm(self.norm_params, self.pp_group) if finite else torch.full((), float("inf"))
        self.hb.enter("optimizer")
        if t.grad_clip > 0 and finite:  # a non-finite norm only touches the gradients of a step that is skipped
            optim.clip_grads(self.params, t.grad_clip, norm)
        skipped = optim.step_or_skip(self.optimizer, norm, finite, self.scaler.enabled)
        self.pm.after_step()
        self.nonfinite.add(skipped)
        self.scaler.update(skipped)
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        self.progress.step += 1
        self.progress.tokens_seen += self.global_batch * self.cfg.data.seq_len
        self.hb.enter("collective", "all_reduce of the loss on dp")
        dist.all_reduce(loss_sum, group=self.dp_group)  # on the device: no host sync
        # in float64, read or not: the same number as loss_sum.item() / dp
        row = {"step": self.step, "loss": loss_sum.double() / self.s.mesh.layout.dp, "grad_norm": norm, "lr": lr,
               "skipped": skipped, "loss_scale": self.scaler.scale}
        return metrics.host_values(row) if sync else row

    def evaluate(self) -> dict[str, Any]:
        """Validation loss at the current step (every rank; collective): {"step", "val_loss", "val_tokens",
        "eval_s"}. Needs train.eval_every (the validation split is opened when the trainer is built)."""
        if self.evaluator is None:
            raise ValueError("train.eval_every = 0: no validation split was opened")
        self.pm.fill()
        loss = functools.partial(evaluate.forward_loss, self.pm, self.pipe, self.scaler.scale, self.device)
        return self.evaluator.run(self.step, loss, self.cfg.train.grad_accum if self.pipe else 1)

    def fit(self, on_step: Callable[[dict[str, Any]], Any] | None = None) -> dict[str, Any]:
        """Trains from where train.resume says to train.steps, checkpointing per the checkpoint config; a preemption
        (any rank's signal) ends it early with a committed checkpoint and a requeue. Returns the run's summary
        (summary.of_run). Waits for its own saves. on_step(row) sees every step's row as train_step returns it,
        before the step's checkpoint decision. The heartbeat follows every phase, for the session's watchdog."""
        t = self.cfg.train
        try:
            with resume.checkpointer(self) as ckpt:
                resumed = resume.start(self, ckpt)  # the weights: a checkpoint, train.init_from or the seeded init
                tlog = metrics.begin_train_log(t, self.s.run_dir, self.s.rank, self.device, self.tf32, self.pm.dims,
                                               self.cfg.data.seq_len, self.tokens_seen)
                self.hb.begin_training(self.step)  # the first step compiles, allocates, sets up NCCL: the long limit
                self.hb.take_times()  # the straggler report counts training steps only
                self.hb.enter("collective", "preemption poll on the world")
                preempted = self.s.preempt.poll(self.device)  # a signal during start-up or the resume stops here
                self.sync_steps = False  # the host reads the device on log steps only
                start, committed = self.step, None
                agree = agreement.StepAgreement(self.device, self.hb, lambda: (  # read a step late
                    self.s.preempt.received is not None, *ckpt.local_requests()))
                while self.step < t.steps and not preempted:
                    row = self.train_step()
                    logged = self.log_step(self.step)
                    tlog.step(row, self.tokens_seen, logged, self.stragglers.report() if logged else None)
                    if on_step is not None:
                        on_step(row)
                    self.nonfinite.check_where_read(self.step, logged)
                    flags = agree.receive()  # sent after the previous step: waits for the stream up to there only
                    preempted = flags.preempt
                    if self.evaluator is not None and not preempted and self.evaluator.due(self.step, t.steps):
                        self.hb.enter("eval")
                        tlog.eval(self.evaluate())
                    if ckpt.maybe_save(self.step, force=preempted, requests=flags.requests) and preempted:
                        committed = self.step
                    if not preempted:
                        agree.send(self.step)
                if agree.finish().preempt:  # a signal during the last step: its flags, read now
                    preempted, committed = True, self.step if ckpt.maybe_save(self.step, force=True) else committed
                tlog.close()
                if not preempted:
                    self.nonfinite.check_trained(start, self.step)
                    ckpt.maybe_save(self.step, final=True)
        finally:
            self.loader.close()  # the read-ahead thread; it rewinds to the consumed batches, so stepping on is fine
            self.sync_steps = True
        return summary.of_run(self, tlog, resumed, preempted, committed)


def run(cfg: Config, run_dir: str | Path | None = None) -> dict[str, Any]:
    with session.start(cfg, run_dir, resumes=True) as s:  # resumes: a hung job is requeued without its bad nodes
        if cfg.job.preflight:
            from hpctrain.doctor import measure as doctor
            if not doctor.preflight(s):
                return s.summary  # a node failed: Slurm runs the job again without it, this attempt trains nothing
        if cfg.train.steps:
            s.summary["train"] = Trainer(cfg, s).fit()
    return s.summary


def main(config_path: str | Path | None, run_dir: str | Path | None = None, overrides: Sequence[str] = ()):
    """Entry point of each rank (CLI and submitit): returns the summary."""
    return run(load_config(config_path, overrides), run_dir)
