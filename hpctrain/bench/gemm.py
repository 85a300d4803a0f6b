"""GEMM probe: the device's measured matmul rate per dtype, the peak that MFU can be measured against. A leaf
(torch only) below both of its users: the trainer's MFU (hpctrain.train.metrics) and `hpctrain bench gemm`.

    tflops = measure_gemm(torch.float32, n=2048, device=torch.device("cpu"))
"""
from __future__ import annotations

import time

import torch


def measure_gemm(dtype: torch.dtype, n: int, device: torch.device, iters: int = 0, min_time_s: float = 0.5,
                 warmup: int = 2) -> dict[str, float]:
    """Times C = A @ B for n x n matrices; iterations grow until the loop lasts min_time_s (or iters given)."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)

    def loop(k: int) -> float:
        sync(device)
        t0 = time.perf_counter()
        for _ in range(k):
            torch.mm(a, b)
        sync(device)
        return time.perf_counter() - t0

    loop(warmup)
    k = iters or 1
    elapsed = loop(k)
    while not iters and elapsed < min_time_s:
        k = max(k * 2, int(k * min_time_s / max(elapsed, 1e-6) * 1.2))
        elapsed = loop(k)
    flops = 2.0 * n**3 * k
    return {"n": n, "iters": k, "time_s": elapsed, "tflops": flops / elapsed / 1e12}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def probe_size(device_type: str, dtype: torch.dtype) -> int:
    """Large enough to approach a GPU's peak (8192^3 is ~1 ms in bf16 on an H100); bounded on CPUs, where bf16 and
    fp16 matmuls run ~70x slower than fp32 without AVX512-BF16."""
    if device_type == "cuda":
        return 8192
    return 1024 if dtype == torch.float32 else 256
