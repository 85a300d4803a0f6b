"""Training metrics on rank 0: JSON lines in the run directory, a one-line progress display, TensorBoard
when it is installed. Throughput is tokens/s, TFLOP/s per rank and MFU against a peak (configured, or the
GEMM probe's measured rate); memory is CUDA's peak allocation on GPUs, the process's peak RSS on CPUs.
"""
from __future__ import annotations

import json
import resource
import time
from pathlib import Path
from typing import Any

import torch


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def measured_peak_tflops(device: torch.device, dtype: torch.dtype) -> float:
    """A short GEMM probe (~0.3 s): the peak MFU is measured against when none is configured."""
    from hpctrain.bench.gemm import measure_gemm
    n = 4096 if device.type == "cuda" else 512
    return measure_gemm(dtype, n, device, min_time_s=0.3)["tflops"]


class MetricsLog:
    def __init__(self, run_dir: Path, enabled: bool, total_steps: int, tensorboard: bool = True) -> None:
        self.enabled = enabled
        self.total = total_steps
        self.path = run_dir / "metrics.jsonl"
        self.tb = None
        self.t0 = time.time()
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
        """One line per logged step: a bar, loss, throughput, time left."""
        done = row["step"] / max(1, self.total)
        bar = "#" * int(20 * done) + "." * (20 - int(20 * done))
        eta = (time.time() - self.t0) / max(done, 1e-9) * (1 - done)
        return (f"[{bar}] step {row['step']}/{self.total} loss {row['loss']:.4f} lr {row['lr']:.2e} "
                f"gnorm {row['grad_norm']:.3f} {row['tokens_per_s']:.0f} tok/s mfu {row['mfu']:.1%} "
                f"eta {eta:.0f}s")

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
