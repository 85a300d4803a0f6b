"""Training metrics on rank 0: JSON lines in the run directory, a one-line progress display, TensorBoard
when it is installed. Throughput is tokens/s, TFLOP/s per rank and MFU; memory is CUDA's peak allocation since the
end of initialisation on GPUs, the process's peak RSS on CPUs (since process start: it cannot be reset).

MFU is against the vendor's dense datasheet peak when the GPU is recognised (DATASHEET_TFLOPS, matched on
torch.cuda.get_device_name), so it compares with published figures; on CPUs and unknown devices against
train.peak_tflops or the GEMM probe's measured rate, and every row says which (`peak_source`). The measured GEMM
rate is reported beside it (`mfu_gemm`): no kernel reaches the datasheet figure, a bare GEMM included.

    gemm = gemm_probe(device, torch.bfloat16)                        # {"tflops", "n", "dtype"}
    peak = choose_peak(device_name(device), matmul_dtype("bf16", tf32=True), configured=0.0, gemm=gemm)
    log.info("%s", describe_peak(peak, gemm, device_name(device)))   # rates in the unit that fits (GFLOP/s on CPUs)
"""
from __future__ import annotations

import json
import logging
import re
import resource
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hpctrain.bench.gemm import measure_gemm, probe_size
from hpctrain.config import TrainConfig
from hpctrain.dtypes import torch_dtype
from hpctrain.hang.stragglers import describe
from hpctrain.model.dims import ModelDims
from hpctrain.planner.hardware import DATASHEET_TFLOPS, float8_mix

log = logging.getLogger(__name__)

# torch.cuda.get_device_name -> DATASHEET_TFLOPS key; the first match wins. Parts with lower peaks under a similar
# name are not matched on purpose (A100 PCIe, H100 PCIe / NVL / "80GB HBM2e", H200 NVL, GB200), nor is ROCm's
# "MI250X/MI250", shared by two parts 6% apart: they fall back, labelled. (The table's H100 PCIe row is for the
# planner's h100-pcie profile; its device names stay unmatched, as the other lower-peak parts.)
DEVICE_NAMES: tuple[tuple[str, str], ...] = (
    (r"A100-SXM", "NVIDIA A100 SXM"),  # "NVIDIA A100-SXM4-80GB"
    (r"H100 80GB HBM3\b|H100 SXM", "NVIDIA H100 SXM"),  # the SXM5 part reports "NVIDIA H100 80GB HBM3"
    (r"\bH200\b(?!\s*NVL)", "NVIDIA H200"),
    (r"\bB200\b", "NVIDIA B200"),
    (r"MI250X(?!/)", "AMD Instinct MI250X"),
    (r"MI300X", "AMD Instinct MI300X"),
)


def device_name(device: torch.device) -> str | None:
    """The accelerator's marketing name, None on CPUs."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else None


def datasheet_part(name: str | None) -> str | None:
    """The DATASHEET_TFLOPS key a device name stands for, or None when it is not one of them."""
    for pattern, part in DEVICE_NAMES:
        if name and re.search(pattern, name):
            return part
    return None


def matmul_dtype(precision: str, tf32: bool) -> str:
    """The DATASHEET_TFLOPS column a train.precision runs its matmuls in (fp32 ones on TF32 cores when enabled)."""
    return "tf32" if precision == "fp32" and tf32 else precision


@dataclass(frozen=True)
class Peak:
    tflops: float  # per rank; 0.0 when nothing is known, a probe that read 0 included (MFU then reads 0)
    source: str  # what the figure is, for every row and the summary


def choose_peak(name: str | None, dtype: str, configured: float, gemm: dict[str, Any] | None,
                float8_share: float = 1.0) -> Peak:
    """The peak MFU is measured against: train.peak_tflops when set, else the datasheet figure of a recognised
    device, else the measured GEMM rate. fp8: float8_share of the FLOPs run at the fp8 figure, the rest at bf16's
    (float8_mix: the blocks' linears are float8, attention's core and the output projection bf16)."""
    part = datasheet_part(name)
    if configured:
        return Peak(configured, "config: train.peak_tflops")
    if part and dtype == "fp8" and float8_share < 1 and {"fp8", "bf16"} <= set(DATASHEET_TFLOPS[part]):
        table = DATASHEET_TFLOPS[part]
        return Peak(float8_mix(table["fp8"], table["bf16"], float8_share),
                    f"datasheet: {part} fp8 dense for the {float8_share:.0%} of the FLOPs in float8 matmuls, bf16 "
                    f"dense for the rest")
    if part and dtype in DATASHEET_TFLOPS[part]:
        return Peak(DATASHEET_TFLOPS[part][dtype], f"datasheet: {part} {dtype} dense")
    if gemm and gemm["tflops"] > 0:
        why = (f"{part} has no {dtype} figure" if part else
               "a CPU" if name is None else f"{name!r} is not in the datasheet table")
        return Peak(gemm["tflops"], f"measured: {gemm['dtype']} GEMM {gemm['n']}^3 ({why})")
    return Peak(0.0, "none: the GEMM probe read 0" if gemm else "none")


def flop_rate(tflops: float) -> str:
    """A rate given in TFLOP/s, in the unit that fits: a CPU's 0.08 TFLOP/s is "80.0 GFLOP/s", not "0.1 TFLOP/s"
    (or "0.0" under load, which hid a probe that read 4 GFLOP/s against a 75 GFLOP/s step: MFU 1875%)."""
    for scale, unit in ((1.0, "TFLOP/s"), (1e-3, "GFLOP/s"), (1e-6, "MFLOP/s")):
        if tflops >= scale:
            return f"{tflops / scale:.1f} {unit}"
    return f"{tflops * 1e12:.0f} FLOP/s"


def describe_peak(peak: Peak, gemm: dict[str, Any], name: str | None) -> str:
    """The line a run logs once before its first step: what MFU is against, and the probe's measured rate."""
    against = f"{flop_rate(peak.tflops)} per rank ({peak.source})" if peak.tflops else f"nothing ({peak.source})"
    return (f"MFU against {against}; measured {gemm['dtype']} GEMM {gemm['n']}^3 on {name or 'CPU'}: "
            f"{flop_rate(gemm['tflops'])}")


def mfu_peak(device: torch.device, precision: str, tf32: bool, configured: float,
             float8_share: float = 1.0) -> tuple[Peak, dict[str, Any]]:
    """A training run's peak, which MFU is against (choose_peak; `configured`: train.peak_tflops; float8_share: the
    share of an fp8 run's model FLOPs in float8 matmuls), and the GEMM probe's measured rate reported beside it;
    logs them in one line (describe_peak)."""
    gemm = gemm_probe(device, torch_dtype("bf16" if precision == "fp8" else precision))
    name = device_name(device)
    peak = choose_peak(name, matmul_dtype(precision, tf32), configured, gemm, float8_share)
    log.info("%s", describe_peak(peak, gemm, name))
    return peak, gemm


def gemm_probe(device: torch.device, dtype: torch.dtype, min_time_s: float = 0.25) -> dict[str, Any]:
    """The measured matmul rate at probe_size, reported beside MFU. Run before the first step: its buffers (three
    n x n matrices, 0.8 GB in fp32 at 8192) are given back to the device, and the peak-memory reset comes after it.
    A GPU too full for them is probed at half the size, down to 1024, rather than ending the job."""
    n = probe_size(device.type, dtype)
    while True:
        try:
            r = measure_gemm(dtype, n, device, min_time_s=min_time_s)
            break
        except torch.cuda.OutOfMemoryError:
            if n <= 1024:
                raise
            n //= 2
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return {"tflops": r["tflops"], "n": n, "dtype": str(dtype).removeprefix("torch.")}


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA: the peak allocation since reset_peak_memory. CPU: the process's peak RSS since it started."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def reset_peak_memory(device: torch.device) -> dict[str, Any]:
    """Called once initialisation is over (model, optimizer, probe, resume), so the peak is training's own. CUDA
    resets its counter; a process's peak RSS cannot be reset, so on CPUs the baseline is reported beside it."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return {"peak_mem": "cuda max_memory_allocated since the end of initialisation",
                "baseline_gb": torch.cuda.memory_allocated(device) / 1e9}
    return {"peak_mem": "process peak RSS since start, initialisation included (it cannot be reset); "
                        "baseline_gb is the peak when initialisation ended",
            "baseline_gb": peak_memory_bytes(device) / 1e9}


class MetricsLog:
    def __init__(self, run_dir: Path, enabled: bool, total_steps: int, tensorboard: bool = True) -> None:
        self.enabled = enabled
        self.total = total_steps
        self.path = run_dir / "metrics.jsonl"
        self.tb = None
        self.t0 = time.time()
        self.val_loss: float | None = None  # the latest validation loss, shown on the progress lines after it
        if enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(str(run_dir / "tensorboard"))
            except ImportError:  # tensorboard is optional
                self.tb = None

    def log(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self.tb is not None:
            for k, v in row.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.tb.add_scalar(f"train/{k}", v, row["step"])

    def progress(self, row: dict[str, Any]) -> str:
        """One line per logged step: a bar, loss, throughput, MFU (and against the measured GEMM), time left."""
        done = row["step"] / max(1, self.total)
        bar = "#" * int(20 * done) + "." * (20 - int(20 * done))
        eta = (time.time() - self.t0) / max(done, 1e-9) * (1 - done)
        gemm = f" (gemm {row['mfu_gemm']:.1%})" if row.get("mfu_gemm") is not None else ""
        val = f" val {self.val_loss:.4f}" if self.val_loss is not None else ""
        slow = describe({"slow": row.get("stragglers", [])})
        return (f"[{bar}] step {row['step']}/{self.total} loss {row['loss']:.4f}{val} lr {row['lr']:.2e} "
                f"gnorm {row['grad_norm']:.3f} {row['tokens_per_s']:.0f} tok/s mfu {row['mfu']:.1%}{gemm} "
                f"eta {eta:.0f}s" + (f" | {slow}" if slow else ""))

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def start_profiler(steps: list[int] | tuple[int, ...], run_dir: Path, rank: int, device: torch.device):
    """train.profile_steps = [first, last]: a torch.profiler trace of those steps in RUN_DIR/profile/ (TensorBoard
    format, one worker per rank); None when not asked for. Call .step() after every step and .stop() at the end."""
    if not steps:
        return None
    first, last = steps
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    prof = torch.profiler.profile(
        activities=activities,
        schedule=torch.profiler.schedule(wait=max(0, first - 1), warmup=1 if first else 0,
                                         active=last - first + 1, repeat=1),
        on_trace_ready=torch.profiler.tensorboard_trace_handler(str(run_dir / "profile"), worker_name=f"rank{rank}"))
    prof.start()
    return prof


class TrainLog:
    """What a training loop reports, fed once per step: every step's loss (device values read in one transfer on
    log steps, so the host never waits for the device in between), and on log steps a row for metrics.jsonl and
    TensorBoard with throughput, TFLOP/s per rank and MFU of the steps since the previous log step, plus the
    progress line on rank 0. Also steps the profiler (train.profile_steps)."""

    def __init__(self, run_dir: Path, rank: int, total_steps: int, device: torch.device, flops_per_token: float,
                 world: int, peak: Peak, gemm: dict[str, Any], tokens_seen: int, profile_steps=(),
                 memory: dict[str, Any] | None = None) -> None:
        self.log_file = MetricsLog(run_dir, rank == 0, total_steps)
        self.rank0, self.device, self.flops_per_token, self.world = rank == 0, device, flops_per_token, world
        self.peak, self.gemm = peak, gemm
        self.memory = memory or {}  # what peak_mem_gb counts from (reset_peak_memory), for the run's summary
        self.losses: list[float] = []
        self.pending: list[Any] = []  # losses of the steps since the last log step (device tensors or floats)
        self.last: dict[str, Any] = {}
        self.tick, self.tokens_at_tick = time.time(), tokens_seen
        self.profiler = start_profiler(profile_steps, run_dir, rank, device)

    def step(self, row: dict[str, Any], tokens_seen: int, log_step: bool,
             ranks: dict[str, Any] | None = None) -> None:
        """ranks: on log steps, the straggler report of the steps since the previous one (stragglers.py): every
        rank's compute and wait seconds, and the slow ones, go into the row and the progress line."""
        self.pending.append(row["loss"])
        if self.profiler is not None:
            self.profiler.step()
        if not log_step:
            return
        self._read_losses()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        tps = (tokens_seen - self.tokens_at_tick) / (time.time() - self.tick)
        tflops = tps * self.flops_per_token / self.world / 1e12
        row = host_values(row) | dict(
            tokens_per_s=tps, tflops_per_rank=tflops, mfu=tflops / self.peak.tflops if self.peak.tflops else 0.0,
            mfu_gemm=tflops / self.gemm["tflops"] if self.gemm["tflops"] > 0 else None, peak_source=self.peak.source,
            peak_mem_gb=peak_memory_bytes(self.device) / 1e9, tokens_seen=tokens_seen,
            time_s=time.time() - self.log_file.t0)
        if ranks is not None:
            row.update(rank_compute_s=ranks["compute_s"], rank_wait_s=ranks["wait_s"], stragglers=ranks["slow"])
        self.log_file.log(row)
        if self.rank0:
            log.info("%s", self.log_file.progress(row))
        self.tick, self.tokens_at_tick = time.time(), tokens_seen
        self.last = row

    def eval(self, row: dict[str, Any]) -> None:
        """An evaluation's row ({"step", "val_loss", "val_tokens", "eval_s"}): its own line in metrics.jsonl and
        on rank 0's log; its time is left out of the throughput of the steps around it."""
        self.log_file.val_loss = row["val_loss"]
        self.log_file.log(row)
        if self.rank0:
            log.info("eval step %d: val loss %.4f (%d tokens, %.2f s)", row["step"], row["val_loss"],
                     row["val_tokens"], row["eval_s"])
        self.tick += row["eval_s"]

    def _read_losses(self) -> None:
        tensors = [v for v in self.pending if isinstance(v, torch.Tensor)]
        read = iter(torch.stack(tensors).tolist() if tensors else [])
        self.losses += [next(read) if isinstance(v, torch.Tensor) else v for v in self.pending]
        self.pending = []

    def close(self) -> list[float]:
        """Ends the profiler and the files; returns every step's loss (a preemption stops between log steps)."""
        self._read_losses()
        if self.profiler is not None:
            self.profiler.stop()
        self.log_file.close()
        return self.losses


def begin_train_log(t: TrainConfig, run_dir: Path, rank: int, device: torch.device, tf32: bool, dims: ModelDims,
                    seq_len: int, tokens_seen: int) -> TrainLog:
    """A training loop's log, begun once initialisation is over (model, optimizer, resume): the GEMM probe and the
    peak MFU is against (mfu_peak: for fp8, the share of the model FLOPs in the blocks' float8 linears), then the
    reset of the peak memory, so the peak is training's own."""
    flops_per_token = dims.flops_per_token(seq_len)
    peak, gemm = mfu_peak(device, t.precision, tf32, t.peak_tflops,
                          dims.float8_flops_per_token() / flops_per_token if t.precision == "fp8" else 1.0)
    memory = reset_peak_memory(device)
    return TrainLog(run_dir, rank, t.steps, device, flops_per_token, dist.get_world_size(), peak, gemm, tokens_seen,
                    t.profile_steps, memory)


def host_values(row: dict[str, Any]) -> dict[str, Any]:
    """A step's row with its device scalars read into Python numbers: a host sync."""
    return {k: v.item() if isinstance(v, torch.Tensor) else v for k, v in row.items()}
