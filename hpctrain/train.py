"""The trainer: the only module that wires session, model, parallelism, data, optimizer and metrics. Launch it
any way you like:

    hpctrain train CONFIG                      # one process
    mpiexec -n 4 hpctrain train CONFIG         # MPI gives identity
    srun --mpi=pmi2 hpctrain train CONFIG      # same inside Slurm
    torchrun --nproc-per-node 4 -m hpctrain.cli train CONFIG
    hpctrain submit CONFIG                     # through submitit (passes --run-dir)

Rank 0 writes metrics.jsonl and summary.json into the run directory.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hpctrain import data, metrics, mutations, optim, parallelize, pipeline, preempt, session
from hpctrain.checkpoint import state as ckpt_state
from hpctrain.checkpoint.manager import MARKER, CheckpointManager, NoSpace, committed
from hpctrain.config import Config, load_config, to_dict
from hpctrain.plan import with_training
from hpctrain.watchdog import Watchdog

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

def host_values(row: dict[str, Any]) -> dict[str, Any]:
    """A step's row with its device scalars read into Python numbers: a host sync."""
    return {k: v.item() if isinstance(v, torch.Tensor) else v for k, v in row.items()}


class Trainer:
    def __init__(self, cfg: Config, s: session.Session) -> None:
        self.cfg, self.s, self.device = cfg, s, s.device
        check_precision(cfg.train.precision, self.device)
        self.tf32 = apply_tf32(cfg.train.tf32, self.device)
        self.plan = with_training(s.plan, cfg)  # the session's layout; this config's model, stages and batches
        layout = self.plan.layout
        self.dp_rank = s.mesh.dp_rank
        self.micro_batch, self.global_batch = self.plan.micro_batch, self.plan.global_batch
        torch.manual_seed(cfg.train.seed)
        # weights allocated, not filled: a resume overwrites them; train_step, save and .model fill them otherwise
        self.pm = parallelize.build(cfg, s.mesh, self.device, fill=False, plan=self.plan)
        self.params = [p for p in self.pm.model.parameters() if p.requires_grad]
        self.lr = optim.effective_lr(cfg.train, self.global_batch)
        zero_group = s.mesh.group("dp") if self.pm.zero_stage == 1 else None
        self.optimizer = optim.build_optimizer(self.pm.model, cfg.train, self.lr, zero_group)
        self.scheduler = optim.build_schedule(self.optimizer, cfg.train, self.lr, cfg.train.steps)
        self.scaler = optim.LossScaler(cfg.train.precision == "fp16", cfg.train.loss_scale)
        source = data.open_source(cfg.data, self.pm.dims.true_vocab_size, seed=cfg.train.seed)
        loader = data.TokenLoader(source, cfg.data.seq_len, self.micro_batch, self.dp_rank, layout.dp, cfg.train.seed)
        self.loader = (data.PrefetchLoader(loader, cfg.train.prefetch, pin_memory=self.device.type == "cuda")
                       if cfg.train.prefetch else loader)
        self.step = 0
        self.tokens_seen = 0
        self.sync_steps = True  # train_step reads its metrics to the host every step; fit() only on log steps
        self.dp_group = s.mesh.group("dp")
        self.pp_group = s.mesh.group("pp") if layout.pp > 1 else None
        self.pipe = None
        if self.pm.plan is not None:
            self.pipe = pipeline.Pipeline(self.pm.plan, self.pm.parts, s.mesh.pp_rank, self.pp_group,
                                          self.device, cfg.train.grad_accum, self._pipeline_loss)
        self.flops_per_token = self.pm.dims.flops_per_token(cfg.data.seq_len)
        # None except in tests/test_grad_scale_mutations.py
        self.mutation = mutations.gradient_mutation(layout.dp, layout.tp, layout.pp, cfg.train.grad_accum)
        log.info("model %.2fM parameters (vocab %d, padded %d), zero %d, precision %s, ac %s, global batch %d "
                 "(micro %d x accum %d x dp %d), lr %.3g", self.pm.dims.num_params() / 1e6,
                 self.pm.dims.true_vocab_size, self.pm.dims.vocab_size, cfg.parallel.zero_stage,
                 cfg.train.precision, cfg.train.ac, self.global_batch, self.micro_batch, cfg.train.grad_accum,
                 layout.dp, self.lr)

    @property
    def model(self) -> torch.nn.Module:
        """The parallel model, its weights filled from the seeded init on first use unless a checkpoint filled them."""
        self.pm.fill()
        return self.pm.model

    def _autocast(self):
        dt = self.pm.autocast_dtype
        return torch.autocast(self.device.type, dtype=dt) if dt is not None else contextlib.nullcontext()

    def _loss_ctx(self):
        if self.pm.loss_parallel:
            from torch.distributed.tensor.parallel import loss_parallel
            return loss_parallel()  # backward of the sharded cross-entropy must run inside it too
        return contextlib.nullcontext()

    def _pipeline_loss(self, logits, y: torch.Tensor) -> torch.Tensor:
        """The last stage's loss of one micro-batch; the schedule averages gradients over micro-batches."""
        return self.scaler.scale_loss(F.cross_entropy(logits.flatten(0, 1).float(), y.flatten()))

    def _pipeline_forward_backward(self, timed: bool) -> torch.Tensor:
        """All grad_accum micro-batches through the pipeline; returns the mean loss on every pp rank. Timing the
        schedule (for the bubble) synchronises the pp group and the device: `timed` on log steps only."""
        accum = self.cfg.train.grad_accum
        batches = [self.loader.next_batch() for _ in range(accum)]  # every stage reads: same position
        # copied part by part: a concatenation on the host would leave the loader's pinned memory
        x, y = (torch.cat([b.to(self.device, non_blocking=True) for b in parts]) for parts in zip(*batches))
        loss = torch.zeros((), device=self.device)
        with self.pm.sync(True), self._loss_ctx(), self._autocast():
            losses = self.pipe.step(x, y, timed=timed)
        if losses is not None:
            total = sum((t.full_tensor() if hasattr(t, "full_tensor") else t).detach().float() for t in losses)
            loss = total / (accum * self.scaler.scale)
        dist.all_reduce(loss, group=self.pp_group)  # only the last stage's ranks add a non-zero loss
        return loss

    def log_step(self, step: int) -> bool:
        """Whether `step` is logged: every train.log_every steps, the first and the last."""
        return step % self.cfg.train.log_every == 0 or step in (1, self.cfg.train.steps)

    def train_step(self, sync: bool | None = None) -> dict[str, Any]:
        """One optimizer step over grad_accum micro-batches; returns this step's metrics (dp-averaged loss).

        Without sync nothing here waits for the device, so the host runs ahead: "loss" (float64, the dp mean)
        and "grad_norm" stay device tensors (host_values reads them), and the pipeline's step is not timed. The
        one exception is the non-finite check when the optimizer cannot skip on the device (_optimizer_step).
        By default a step syncs when sync_steps is set (callers that step by hand get host values) or when it is
        a log step: fit() clears sync_steps for its loop."""
        t = self.cfg.train
        if sync is None:
            sync = self.sync_steps or self.log_step(self.step + 1)
        accum = t.grad_accum
        self.pm.fill()  # never train on unfilled memory (the pipeline's stages do not go through self.model)
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=self.device)
        for k in range(accum if self.pipe is None else 0):
            x, y = (b.to(self.device, non_blocking=True) for b in self.loader.next_batch())
            # gradients are reduced across dp only after the last micro-batch (nanoGPT's no_sync trick)
            with self.pm.sync(k == accum - 1), self._loss_ctx():
                with self._autocast():
                    logits = self.model(x)
                mean = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
                loss = mean / accum
                self.scaler.scale_loss(mean if self.mutation == "no_accum_div" else loss).backward()
            loss_sum += (loss.full_tensor() if hasattr(loss, "full_tensor") else loss).detach()
        if self.pipe is not None:
            loss_sum = self._pipeline_forward_backward(timed=sync)
        if self.mutation in ("dp_sum", "tp_double"):
            mutations.mutate_reduced_grads(self.mutation, self.params, self.s.mesh.layout.dp,
                                           self.s.mesh.group("tp"))
        finite = self.scaler.unscale_and_check(self.params, self.device)  # fp16: reads the overflow flag (a sync)
        norm = optim.grad_norm(self.params, self.pp_group) if finite else torch.full((), float("inf"))
        if t.grad_clip > 0 and finite:  # a non-finite norm only touches the gradients of a step that is skipped
            optim.clip_grads(self.params, t.grad_clip, norm)
        skipped = self._optimizer_step(norm, finite)
        if self.scaler.enabled:
            self.scaler.update(not skipped)
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        self.step += 1
        self.tokens_seen += self.global_batch * self.cfg.data.seq_len
        dist.all_reduce(loss_sum, group=self.dp_group)  # on the device: no host sync
        # in float64, read or not: the same number as loss_sum.item() / dp
        row = {"step": self.step, "loss": loss_sum.double() / self.s.mesh.layout.dp, "grad_norm": norm, "lr": lr,
               "skipped": skipped, "loss_scale": self.scaler.scale}
        return host_values(row) if sync else row

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

    # -- checkpoints ----------------------------------------------------------------------------------------
    def _state(self, saved_world: int | None = None) -> dict[str, Any]:
        world = dist.get_world_size()
        rng = ckpt_state.rng_table(world) if saved_world is None else torch.zeros(
            saved_world, torch.get_rng_state().numel(), dtype=torch.uint8)
        model = self.pm.model  # not self.model: a resume loads into the unfilled weights
        optimizer = (ckpt_state.ZeroOneOptimizerState(model, self.optimizer) if self.pm.zero_stage == 1
                     else ckpt_state.OptimizerState(model, self.optimizer))
        return {"model": ckpt_state.ModelState(model), "optimizer": optimizer, "rng": rng}

    def _extra(self) -> dict[str, Any]:
        return {"step": self.step, "tokens_seen": self.tokens_seen, "scheduler": self.scheduler.state_dict(),
                "scaler": self.scaler.state_dict(), "data": self.loader.state_dict(),
                "world_size": dist.get_world_size()}

    def save(self, mgr: CheckpointManager, asynchronous: bool = False) -> None:
        layout = dataclasses.asdict(self.plan.layout)  # {"pp": ., "dp": ., "tp": .}
        prov = ckpt_state.provenance(to_dict(self.cfg), layout, self.cfg.parallel.zero_stage)
        self.pm.fill()
        mgr.save(self.step, self._state(), self._extra(), prov, asynchronous=asynchronous)

    def resume(self, mgr: CheckpointManager) -> int | None:
        """train.resume: 'auto' takes the newest committed checkpoint of this run; a path names one checkpoint
        (step_NNNNNNNN), or a checkpoints directory or another run's directory, whose newest committed one is
        taken (e.g. after a crash, in a new job)."""
        r = self.cfg.train.resume
        if r == "none":
            if committed(mgr.root):  # a fresh start here would overwrite and prune them: never silently
                raise ValueError(f"train.resume = 'none' but {mgr.root} holds committed checkpoints (steps "
                                 f"{', '.join(str(s) for s, _ in committed(mgr.root))}); resume from them "
                                 f"(train.resume = 'auto'), or give the fresh run another checkpoint.dir")
            return None

        def make(extra: dict) -> dict:  # checked before anything is loaded: a bad train state is a corrupt one
            ckpt_state.check_train_state(extra, self._extra())
            return self._state(saved_world=extra["world_size"])
        source = mgr
        if r != "auto" and (Path(r) / MARKER).is_file():
            extra, state = mgr.load(Path(r), make)
            step = extra["step"]
        else:
            if r != "auto":
                root = Path(r) / "checkpoints" if (Path(r) / "checkpoints").is_dir() else Path(r)
                if not committed(root):
                    raise ValueError(f"train.resume = {r!r}: no committed checkpoint there")
                source = CheckpointManager(dataclasses.replace(self.cfg.checkpoint, dir=str(root)),
                                           self.s.run_dir, self.s.rank, writer=False)
            found = source.load_latest(make)
            if found is None:
                if r != "auto":
                    raise ValueError(f"train.resume = {r!r}: no checkpoint there loads cleanly")
                return None
            step, extra, state = found
        self.pm.loaded()  # every parameter came from the checkpoint: no seeded init
        self.step, self.tokens_seen = extra["step"], extra["tokens_seen"]
        self.scheduler.load_state_dict(extra["scheduler"])
        self.scaler.load_state_dict(extra["scaler"])
        self.loader.load_state_dict(extra["data"])
        same_rng = ckpt_state.restore_rng(state["rng"], self.s.rank)
        log.info("resumed from step %d (%s world %d -> %d%s)", step, source.root, extra["world_size"],
                 dist.get_world_size(), "" if same_rng else "; RNG of new ranks left as seeded")
        return step

    def mfu_peak(self) -> tuple[metrics.Peak, dict[str, Any]]:
        """The peak MFU is against (metrics.choose_peak) and the GEMM probe's measured rate, reported beside it."""
        t = self.cfg.train
        gemm = metrics.gemm_probe(self.device, parallelize.DTYPES[t.precision])
        name = metrics.device_name(self.device)
        peak = metrics.choose_peak(name, metrics.matmul_dtype(t.precision, self.tf32), t.peak_tflops, gemm)
        log.info("MFU against %.1f TFLOP/s per rank (%s); measured %s GEMM %d^3 on %s: %.1f TFLOP/s", peak.tflops,
                 peak.source, gemm["dtype"], gemm["n"], name or "CPU", gemm["tflops"])
        return peak, gemm

    def fit(self) -> dict[str, Any]:
        t = self.cfg.train
        mlog = metrics.MetricsLog(self.s.run_dir, self.s.rank == 0, t.steps)
        mgr = CheckpointManager(self.cfg.checkpoint, self.s.run_dir, self.s.rank)
        self.dog = None
        try:
            return self._fit(mgr, mlog)  # waits for its own saves
        finally:
            if self.dog is not None:
                self.dog.stop()
            mgr.close()  # the directory lock
            self.loader.close()  # the read-ahead thread; it rewinds to the consumed batches, so stepping on is fine
            self.sync_steps = True

    def _fit(self, mgr: CheckpointManager, mlog: metrics.MetricsLog) -> dict[str, Any]:
        t = self.cfg.train
        rank0 = self.s.rank == 0
        world = dist.get_world_size()
        flag = self.s.preempt  # installed at process start, so a signal during start-up or the resume is kept
        resumed = self.resume(mgr)
        self.pm.fill()  # nothing loaded: the seeded init, before the peak memory is reset
        peak, gemm = self.mfu_peak()
        memory = metrics.reset_peak_memory(self.device)  # initialisation is over: the peak from here is training's
        profiler = metrics.start_profiler(self.cfg.train.profile_steps, self.s.run_dir, self.s.rank, self.device)
        last: dict[str, Any] = {}
        losses: list[float] = []
        pending: list[torch.Tensor] = []  # device losses of the steps since the last log step
        steps_run = 0
        tick, tokens_at_tick = time.time(), self.tokens_seen
        every = self.cfg.checkpoint.every_steps
        # a signal during start-up or the resume: stop before training; what was resumed is already on disk
        preempted = flag.poll(self.device)[0]
        self.sync_steps = False  # the host reads the device on log steps only
        self.dog = Watchdog(self.cfg.parallel.timeout_s + 60)  # a hang no collective timeout ends ends the job
        while self.step < t.steps and not preempted:
            row = self.train_step()
            self.dog.beat()
            log_step = self.log_step(self.step)
            pending.append(row["loss"])
            if log_step:
                losses += self._read_losses(pending)
                pending = []
            steps_run += 1
            if self.pipe is not None and steps_run == 1:
                self.pipe.timing()  # the first step infers shapes across stages: not part of the bubble
            if profiler is not None:
                profiler.step()
            stop, save_now, writing = flag.poll(self.device, self._save_requested(), mgr.unfinished())
            if mgr.pending is not None and not writing:
                mgr.wait()  # every rank's background write is done: commit now, not at the next save
            if stop:
                mgr.wait()
                self.save(mgr)
                preempted = True
                break
            if (every and self.step % every == 0 and self.step < t.steps) or save_now:
                try:
                    self.save(mgr, asynchronous=self.cfg.checkpoint.async_save)
                except NoSpace as e:  # a periodic save may wait for space; the final and preemption ones may not
                    log.warning("periodic checkpoint skipped: %s", e)
                self.dog.beat()
            if log_step:
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                dt = time.time() - tick
                tps = (self.tokens_seen - tokens_at_tick) / dt
                tflops = tps * self.flops_per_token / world / 1e12
                row.update(tokens_per_s=tps, tflops_per_rank=tflops,
                           mfu=tflops / peak.tflops if peak.tflops else 0.0, mfu_gemm=tflops / gemm["tflops"],
                           peak_source=peak.source, peak_mem_gb=metrics.peak_memory_bytes(self.device) / 1e9,
                           tokens_seen=self.tokens_seen, time_s=time.time() - mlog.t0)
                mlog.log(row)
                if rank0:
                    log.info("%s", mlog.progress(row))
                tick, tokens_at_tick = time.time(), self.tokens_seen
                last = row
        self.dog.stop()  # the final save's collectives have their own timeout, and it may take long
        losses += self._read_losses(pending)  # a preemption stops between log steps
        if profiler is not None:
            profiler.stop()
        mgr.wait()
        if not preempted and self.cfg.checkpoint.at_end and self.step > (resumed or 0):
            self.save(mgr)
        mlog.close()
        out = {"steps": self.step, "first_loss": losses[0] if losses else None, "final": last,
               "peak_tflops": peak.tflops, "peak_source": peak.source, "gemm": gemm, "tf32": self.tf32,
               "memory": memory, "tokens_seen": self.tokens_seen, "resumed_from": resumed, "preempted": preempted,
               "losses": losses}
        if self.pipe is not None:
            out["pipeline"] = self.pipeline_summary()
            if rank0:
                log.info("pipeline %s", out["pipeline"]["line"])
        if preempted and self.s.rank == 0:
            out["requeue"] = preempt.requeue()
            log.info("preempted at step %d: checkpoint committed, %s", self.step, out["requeue"])
        return out

    @staticmethod
    def _read_losses(values: list) -> list[float]:
        """Per-step losses as floats: device tensors read in one transfer, floats (a synced step's) kept."""
        tensors = [v for v in values if isinstance(v, torch.Tensor)]
        read = iter(torch.stack(tensors).tolist() if tensors else [])
        return [next(read) if isinstance(v, torch.Tensor) else v for v in values]

    def pipeline_summary(self) -> dict[str, Any]:
        """Per pp rank: mean step time (schedule only, first step excluded), compute time, and the idle share
        1 - compute / step next to the schedule's theory. Collective: every rank calls it."""
        plan, t = self.pm.plan, self.pipe.timing()
        mine = (self.s.mesh.pp_rank, t["steps"], t["wall_s"], t["busy_s"])
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
        m = self.cfg.train.grad_accum
        theory = plan.bubble_theory(m)
        out = {"schedule": plan.schedule, "pp": plan.pp, "virtual_stages": plan.virtual, "microbatches": m,
               "stage_layers": [list(x) for x in plan.layers], "bubble_theory": theory,
               "idle_fraction_mean": sum(idle) / len(idle) if idle else None, "per_pp_rank": ranks}
        out["line"] = (f"{plan.schedule} p={plan.pp} v={plan.virtual} m={m}: idle "
                       + ", ".join(f"rank {x['pp_rank']} {x['idle_fraction']:.3f} of {x['step_s'] * 1e3:.1f} ms"
                                   for x in ranks if x["idle_fraction"] is not None)
                       + (f" (theory {theory:.3f})" if theory is not None else ""))
        return out

    def _save_requested(self) -> bool:
        """On demand: `touch <run dir>/SAVE_NOW`; rank 0 looks (PreemptionFlag.poll tells everyone)."""
        marker = self.s.run_dir / "SAVE_NOW"
        if self.s.rank == 0 and marker.exists():
            marker.unlink()
            return True
        return False


def run(cfg: Config, run_dir: str | Path | None = None) -> dict[str, Any]:
    with session.start(cfg, run_dir) as s:
        if cfg.train.steps:
            s.summary["train"] = Trainer(cfg, s).fit()
    return s.summary


def main(config_path: str | Path | None, run_dir: str | Path | None = None, overrides: Sequence[str] = ()):
    """Entry point of each rank (CLI and submitit): returns the summary."""
    return run(load_config(config_path, overrides), run_dir)
