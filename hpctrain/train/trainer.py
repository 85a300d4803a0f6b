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

import contextlib
import dataclasses
import functools
import logging
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hpctrain.checkpoint import state as ckpt_state
from hpctrain.checkpoint.checkpointer import Checkpointer, Progress, Saved
from hpctrain.config import Config, load_config
from hpctrain.config import hf as hfconfig
from hpctrain.data import loader as data
from hpctrain.dtypes import torch_dtype
from hpctrain.hang import stragglers
from hpctrain.hang.heartbeat import Heartbeat
from hpctrain.hf import load as hf_import
from hpctrain.job import preempt, session
from hpctrain.job import requeue as hangrequeue
from hpctrain.parallel import compose, pipeline
from hpctrain.parallel.plan import with_training
from hpctrain.train import evaluate, metrics, optim

log = logging.getLogger(__name__)


def check_precision(precision: str, device: torch.device) -> None:
    if device.type == "cuda" and precision == "bf16" and not torch.cuda.is_bf16_supported():
        raise ValueError(f"train.precision = 'bf16' but {torch.cuda.get_device_name(device)} has no bf16; "
                         f"use fp16 (with loss scaling) or fp32")


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
    did (Trainer._optimizer_step), so counting never waits for the device. Reading a count on the device waits
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


def agree_on_failure(fn: Callable[[], Any], rank: int, device: torch.device) -> Any:
    """fn() on every rank, and when it raised on any rank, an error on every rank (collective): the lowest failing
    rank's message, broadcast, raised as a ValueError by ranks where fn() succeeded (a failing rank raises its own).
    For work whose outcome differs by rank, which would otherwise leave the others in the next collective."""
    error: Exception | None = None
    try:
        out = fn()
    except Exception as e:
        error = e
    if not dist.is_initialized():
        if error is not None:
            raise error
        return out
    world = dist.get_world_size()
    first = torch.tensor([float(world if error is None else rank)], device=device)
    dist.all_reduce(first, op=dist.ReduceOp.MIN)
    src = int(first.item())
    if src == world:
        return out
    box = [str(error) if rank == src else None]
    dist.broadcast_object_list(box, src=src)
    if error is not None:
        raise error
    raise ValueError(f"rank {src}: {box[0]}")


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
        self.lr = optim.effective_lr(cfg.train, self.global_batch)
        zero_group = s.mesh.group("dp") if self.pm.zero_stage == 1 else None
        self.optimizer = optim.build_optimizer(self.pm.model, cfg.train, self.lr, zero_group)
        self.scheduler = optim.build_schedule(self.optimizer, cfg.train, self.lr, cfg.train.steps)
        self.scaler = optim.LossScaler(cfg.train.precision == "fp16", cfg.train.loss_scale)
        # files no record describes: scanned once, by one rank, before any rank opens them
        data.check_ids_at_start(cfg, dist.group.WORLD, s.run_dir, s.heartbeat)
        sources = data.open_sources(cfg.data, self.pm.dims.true_vocab_size, seed=cfg.train.seed)
        loader = data.make_loader(cfg.data, sources, self.micro_batch, s.mesh.dp_rank, layout.dp, cfg.train.seed)
        self.loader = (data.PrefetchLoader(loader, cfg.train.prefetch, pin_memory=self.device.type == "cuda")
                       if cfg.train.prefetch else loader)
        self.evaluator = (evaluate.Evaluator(cfg, self.pm.dims.true_vocab_size, s.mesh.dp_rank, layout.dp,
                                             self.micro_batch, s.mesh.group("dp"), self.device)
                          if cfg.train.eval_every else None)
        self.progress = Progress()
        self.nonfinite = NonFiniteStreak(cfg.train.max_nonfinite_steps)
        self.sync_steps = True  # train_step reads its metrics to the host every step; fit() only on log steps
        self.dp_group = s.mesh.group("dp")
        self.pp_group = s.mesh.group("pp") if layout.pp > 1 else None
        self.pipe = None
        if self.pm.plan is not None:
            self.pipe = pipeline.Pipeline(self.pm.plan, self.pm.parts, s.mesh.pp_rank, self.pp_group,
                                          self.device, cfg.train.grad_accum, self._pipeline_loss)
        # where this rank is (hang forensics) and how long it computed and waited (the straggler report)
        self.hb = s.heartbeat if s.heartbeat is not None else Heartbeat(None, s.rank)
        if self.device.type == "cuda":
            self.hb.device_clock = stragglers.CudaClock()
        self.stragglers = stragglers.Tally()
        self._reduction_armed = False
        if layout.dp > 1 and self.pipe is None:
            self._mark_gradient_reduction()
        log.info("model %.2fM parameters (vocab %d, padded %d), zero %d, precision %s, ac %s, global batch %d "
                 "(micro %d x accum %d x dp %d), lr %.3g", self.pm.dims.num_params() / 1e6,
                 self.pm.dims.true_vocab_size, self.pm.dims.vocab_size, cfg.parallel.zero_stage,
                 cfg.train.precision, cfg.train.ac, self.global_batch, self.micro_batch, cfg.train.grad_accum,
                 layout.dp, self.lr)

    @property
    def step(self) -> int:
        return self.progress.step

    @property
    def tokens_seen(self) -> int:
        return self.progress.tokens_seen

    @property
    def model(self) -> torch.nn.Module:
        """The parallel model, its weights filled from the seeded init on first use unless a checkpoint filled them."""
        self.pm.fill()
        return self.pm.model

    # -- one step -----------------------------------------------------------------------------------------------
    def _context(self, last_micro_step: bool, autocast: bool = False) -> contextlib.ExitStack:
        """Around a forward and backward: the gradient sync of the last micro-step, loss parallel (its backward
        must run inside it too), and with `autocast` autocast for layouts without FSDP's mixed precision."""
        ctx = contextlib.ExitStack()
        ctx.enter_context(self.pm.sync(last_micro_step))
        if self.pm.loss_parallel:
            from torch.distributed.tensor.parallel import loss_parallel
            ctx.enter_context(loss_parallel())
        if autocast:
            ctx.enter_context(self._autocast())
        return ctx

    def _autocast(self):
        dt = self.pm.autocast_dtype
        return torch.autocast(self.device.type, dtype=dt) if dt is not None else contextlib.nullcontext()

    def _pipeline_loss(self, logits, y: torch.Tensor) -> torch.Tensor:
        """The last stage's loss of one micro-batch; the schedule averages gradients over micro-batches."""
        return self.scaler.scale_loss(F.cross_entropy(logits.flatten(0, 1).float(), y.flatten()))

    def _mark_gradient_reduction(self) -> None:
        """On the last micro-batch, the backward reaching the embedding's output ends this rank's backward compute:
        what follows is the gradient reduction across dp (DDP's or FSDP's last buckets, or the coalesced
        all-reduce), waiting for the slowest dp peer. The heartbeat counts it as wait, not compute."""
        embedding = next((m for name, m in self.pm.model.named_modules() if name.endswith("tok_embeddings")), None)
        if embedding is None:
            return

        def on_forward(module, inputs, out) -> None:
            if self._reduction_armed and out.requires_grad:
                out.register_hook(lambda grad: self.hb.enter("collective", "gradient reduction on dp"))
        embedding.register_forward_hook(on_forward)

    def _forward_backward(self) -> torch.Tensor:
        """grad_accum micro-batches through the (unpipelined) model; returns their mean loss. Gradients are reduced
        across dp only after the last micro-batch (nanoGPT's no_sync trick)."""
        accum = self.cfg.train.grad_accum
        loss_sum = torch.zeros((), device=self.device)
        for k in range(accum):
            self.hb.enter("data")
            x, y = (b.to(self.device, non_blocking=True) for b in self.loader.next_batch())
            self._reduction_armed = k == accum - 1
            with self._context(k == accum - 1):
                self.hb.enter("forward", f"micro-batch {k + 1}/{accum}")
                with self._autocast():
                    logits = self.model(x)
                mean = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
                loss = mean / accum
                self.hb.enter("backward", f"micro-batch {k + 1}/{accum}")
                self.scaler.scale_loss(loss).backward()
            loss_sum += (loss.full_tensor() if hasattr(loss, "full_tensor") else loss).detach()
        self._reduction_armed = False
        return loss_sum

    def log_step(self, step: int) -> bool:
        """Whether `step` is logged: every train.log_every steps, the first and the last."""
        return step % self.cfg.train.log_every == 0 or step in (1, self.cfg.train.steps)

    def train_step(self, sync: bool | None = None) -> dict[str, Any]:
        """One optimizer step over grad_accum micro-batches; returns this step's metrics (dp-averaged loss).

        Without sync nothing here waits for the device, so the host runs ahead: "loss" (float64, the dp mean)
        and "grad_norm" stay device tensors (metrics.host_values reads them), and the pipeline's step is not
        timed. The one exception is the non-finite check when the optimizer cannot skip on the device
        (_optimizer_step). By default a step syncs when sync_steps is set (callers that step by hand get host
        values) or when it is a log step: fit() clears sync_steps for its loop."""
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
            loss_sum = self.pipe.forward_backward(batches, self._context(True, autocast=True), self.scaler.scale,
                                                  timed=sync)
        self.hb.enter("optimizer", "unscale and finiteness")
        finite = self.scaler.unscale_and_check(self.params, self.device)  # fp16: reads the overflow flag (a sync)
        self.hb.enter("collective", "gradient norm over the shards")
        norm = optim.grad_norm(self.params, self.pp_group) if finite else torch.full((), float("inf"))
        self.hb.enter("optimizer")
        if t.grad_clip > 0 and finite:  # a non-finite norm only touches the gradients of a step that is skipped
            optim.clip_grads(self.params, t.grad_clip, norm)
        skipped = self._optimizer_step(norm, finite)
        self.nonfinite.add(skipped)
        if self.scaler.enabled:
            self.scaler.update(not skipped)
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

    def _optimizer_step(self, norm: torch.Tensor, finite: bool) -> bool | torch.Tensor:
        """torchtitan's rule: never let a non-finite gradient reach the weights. Returns whether the step was skipped.

        An optimizer that takes found_inf (fused AdamW) decides on the device: its kernel leaves weights, moments
        and step counts alone, and "skipped" stays a device tensor. The others (foreach AdamW, ZeRO-1's wrapper)
        cannot skip on the device, so the host reads the norm's finiteness: one host sync per step, which
        optim.build_optimizer building fused AdamW on CUDA would remove. With fp16 the scaler has read its overflow
        flag already (finite)."""
        if finite and getattr(self.optimizer, "_step_supports_amp_scaling", False) and not self.scaler.enabled:
            found_inf = (~torch.isfinite(norm)).float()
            self.optimizer.found_inf = found_inf
            self.optimizer.step()
            return found_inf.bool()
        skipped = not (finite and bool(torch.isfinite(norm)))  # the documented host sync
        if not skipped:
            self.optimizer.step()
        return skipped

    def _eval_loss(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """The sum of the mean losses of `batches` (forward only), as training computes its loss."""
        if self.pipe is not None:
            return self.pipe.eval_loss(batches, self._context(True, autocast=True), self.scaler.scale)
        total = torch.zeros((), device=self.device)
        for x, y in batches:
            x, y = x.to(self.device), y.to(self.device)
            with self._context(True, autocast=True):
                loss = F.cross_entropy(self.model(x).flatten(0, 1).float(), y.flatten())
            total += (loss.full_tensor() if hasattr(loss, "full_tensor") else loss).detach()
        return total

    def evaluate(self) -> dict[str, Any]:
        """Validation loss at the current step (every rank; collective): {"step", "val_loss", "val_tokens",
        "eval_s"}. Needs train.eval_every (the validation split is opened when the trainer is built)."""
        if self.evaluator is None:
            raise ValueError("train.eval_every = 0: no validation split was opened")
        self.pm.fill()
        return self.evaluator.run(self.step, self._eval_loss, self.cfg.train.grad_accum if self.pipe else 1)

    # -- the loop -------------------------------------------------------------------------------------------
    def checkpointer(self) -> Checkpointer:
        """This run's checkpointer over everything a checkpoint holds (collective: takes the directory lock)."""
        optimizer = (ckpt_state.ZeroOneOptimizerState if self.pm.zero_stage == 1 else ckpt_state.OptimizerState)(
            self.pm.model, self.optimizer)  # pm.model, not .model: a resume loads into the unfilled weights
        saved = Saved(self.pm.model, optimizer, self.progress,
                      {"scheduler": self.scheduler, "scaler": self.scaler, "data": self.loader},
                      fill=self.pm.fill, loaded=self.pm.loaded, nonfinite=lambda: self.nonfinite.check(self.step))
        attach, skipped = hf_import.tokenizer_files(hfconfig.hf_dir(self.cfg.train.init_from), self.cfg.data.files)
        if skipped and self.s.rank == 0:
            log.warning("tokenizer files not recorded in checkpoints: %s", ", ".join(skipped))
        return Checkpointer(self.cfg, dataclasses.asdict(self.plan.layout), self.s.run_dir, self.s.rank,
                            self.device, saved, phase=self.hb.enter, progress=self.hb.advance, attach=attach)

    def start(self, ckpt: Checkpointer) -> int | None:
        """The weights training starts from: a checkpoint per train.resume, else train.init_from's Hugging Face
        directory, else the seeded init (before the peak memory is reset). Returns the step resumed from, None
        for a fresh start. init_from never overrides a resume: a requeued job goes on from its own checkpoint."""
        self.hb.enter("checkpoint", "resume")
        resumed = ckpt.load()
        hf = hfconfig.hf_dir(self.cfg.train.init_from)
        if hf is not None and resumed is None:
            # each rank reads (and checks finite) only its own slices: a bad one stops every rank, not only its own
            stats = agree_on_failure(lambda: hf_import.load_hf(self.pm.model, self.pm.dims, hf), self.s.rank,
                                     self.device)
            self.pm.loaded()
            log.info("weights from Hugging Face directory %s: %d tensors from %d files, %.1f MB read by this rank",
                     hf, stats["tensors"], stats["files"], stats["bytes"] / 1e6)
        elif hf is not None:
            log.info("resumed from step %d: train.init_from = %r is not read", resumed, self.cfg.train.init_from)
        self.pm.fill()  # nothing loaded: the seeded init
        return resumed

    def mfu_peak(self) -> tuple[metrics.Peak, dict[str, Any]]:
        """The peak MFU is against (metrics.choose_peak) and the GEMM probe's measured rate, reported beside it."""
        t = self.cfg.train
        gemm = metrics.gemm_probe(self.device, torch_dtype(t.precision))
        name = metrics.device_name(self.device)
        peak = metrics.choose_peak(name, metrics.matmul_dtype(t.precision, self.tf32), t.peak_tflops, gemm)
        log.info("%s", metrics.describe_peak(peak, gemm, name))
        return peak, gemm

    def fit(self, on_step: Callable[[dict[str, Any]], Any] | None = None) -> dict[str, Any]:
        """Trains from where train.resume says to train.steps, checkpointing per the checkpoint config; a
        preemption (any rank's signal) ends it early with a committed checkpoint and a requeue. Returns the
        run's summary. Waits for its own saves. on_step(row) sees every step's row as train_step returns it
        (device values except on log steps), before the step's checkpoint decision. The heartbeat follows every
        phase, so the session's watchdog ends a hung job with every live rank's stacks."""
        try:
            with self.checkpointer() as ckpt:
                resumed = self.start(ckpt)
                peak, gemm = self.mfu_peak()
                memory = metrics.reset_peak_memory(self.device)  # initialisation is over: training's peak from here
                tlog = metrics.TrainLog(self.s.run_dir, self.s.rank, self.cfg.train.steps, self.device,
                                        self.pm.dims.flops_per_token(self.cfg.data.seq_len), dist.get_world_size(),
                                        peak, gemm, self.tokens_seen, self.cfg.train.profile_steps)
                if self.s.watchdog is not None:  # the first step compiles, allocates, sets up NCCL: the long limit
                    self.s.watchdog.long_until(self.step + 1)
                self.hb.begin_step(self.step)
                self.hb.take_times()  # the straggler report counts training steps only
                # the flag was installed at process start: a signal during start-up or the resume stops here
                self.hb.enter("collective", "preemption poll on the world")
                preempted = self.s.preempt.poll(self.device)
                self.sync_steps = False  # the host reads the device on log steps only
                start, committed = self.step, None
                while self.step < self.cfg.train.steps and not preempted:
                    row = self.train_step()
                    logged = self.log_step(self.step)
                    tlog.step(row, self.tokens_seen, logged, self._rank_times() if logged else None)
                    if on_step is not None:
                        on_step(row)
                    if logged or self.nonfinite.on_host():  # no wait for the device: it was read for the log
                        self.nonfinite.check(self.step)
                    self.hb.enter("collective", "preemption poll on the world")
                    preempted = self.s.preempt.poll(self.device)
                    ev = self.evaluator
                    if ev is not None and not preempted and ev.due(self.step, self.cfg.train.steps):
                        self.hb.enter("eval")
                        tlog.eval(self.evaluate())
                    self.hb.enter("collective", "checkpoint requests on the world")
                    if ckpt.maybe_save(self.step, force=preempted) and preempted:
                        committed = self.step
                losses = tlog.close()
                if not preempted:
                    self._check_trained(start)
                    ckpt.maybe_save(self.step, final=True)
        finally:
            self.loader.close()  # the read-ahead thread; it rewinds to the consumed batches, so stepping on is fine
            self.sync_steps = True
        return self._summary(resumed, preempted, committed, losses, tlog.last, peak, gemm, memory)

    def _check_trained(self, start: int) -> None:
        """At the end of training: a run whose every step was non-finite trained nothing, whatever the limit."""
        streak = self.nonfinite.check(self.step)
        if self.step > start and streak >= self.step - start:
            raise NonFiniteSteps(f"training ended at step {self.step} with nothing trained: every step of this run "
                                 f"({start + 1} to {self.step}) was non-finite (loss or gradients nan or inf, each "
                                 f"skipped); no checkpoint of them was made. Look for nan or inf in the starting "
                                 f"weights or the data")

    def _rank_times(self) -> dict[str, Any]:
        """The straggler report of the steps since the previous log step (collective: every rank, log steps)."""
        self.hb.enter("collective", "straggler report on the world")
        times = stragglers.gather_times(self.hb, self.device)
        layout = self.s.mesh.layout
        stage = [layout.coords(r)["pp"] for r in range(layout.world_size)]
        report = stragglers.find_stragglers(times, self.s.hosts or ["?"] * len(times), stage,
                                            self.cfg.train.straggler_margin)
        self.stragglers.add(report)
        return report

    def _summary(self, resumed, preempted, committed, losses, last, peak, gemm, memory) -> dict[str, Any]:
        out = {"steps": self.step, "first_loss": losses[0] if losses else None, "final": last,
               "peak_tflops": peak.tflops, "peak_source": peak.source, "gemm": gemm, "tf32": self.tf32,
               "memory": memory, "tokens_seen": self.tokens_seen, "resumed_from": resumed, "preempted": preempted,
               "losses": losses, "stragglers": self.stragglers.summary()}
        if self.evaluator is not None:
            out["val_losses"] = self.evaluator.done
            out["val_loss"] = self.evaluator.done[-1][1] if self.evaluator.done else None
        if self.pipe is not None:
            out["pipeline"] = self.pipe.summary(self.cfg.train.grad_accum)
            if self.s.rank == 0:
                log.info("pipeline %s", out["pipeline"]["line"])
        if preempted:
            out["preempt_checkpoint"] = committed  # the step this attempt committed on the way out, or None
        if preempted and self.s.rank == 0:
            out["requeue"] = preempt.requeue()
            log.info("preempted at step %d: %s; %s", self.step, self._preempt_saved(resumed, committed),
                     out["requeue"])
        return out

    def _preempt_saved(self, resumed: int | None, committed: int | None) -> str:
        """What a preemption left behind, as the log says it: the checkpoint it committed, or why none."""
        if committed is not None:
            return f"checkpoint of step {committed} committed"
        if self.step == (resumed or 0):
            return ("no checkpoint written: nothing was trained" if resumed is None else
                    f"no checkpoint written: nothing trained since the resume, step {resumed}'s checkpoint stays "
                    f"the newest")
        return ("no checkpoint written: every step of this attempt was non-finite (nothing trained)"
                + ("" if resumed is None else f", step {resumed}'s checkpoint stays the newest"))


def run(cfg: Config, run_dir: str | Path | None = None) -> dict[str, Any]:
    with session.start(cfg, run_dir) as s:
        if s.watchdog is not None and cfg.job.hang_requeues:  # a hung training job goes on without its bad nodes
            s.watchdog.on_end = functools.partial(hangrequeue.after_hang, s.run_dir, cfg.job.hang_requeues,
                                                  s.ident.num_nodes)
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
