"""Pure tier for how training measures itself: the datasheet peak a device name stands for (device names mocked: no
GPU here), the fallbacks and their labels, the GEMM probe's size, the TF32 decision, the peak-memory reset. What
training runs report in their metrics rows and summary: tests/multiproc/train/test_mfu_training.py.

    .venv/bin/python -m pytest tests/pure/train/test_mfu.py -q
"""
from __future__ import annotations

import pytest
import torch
from faults import record

from hpctrain.bench.gemm import probe_size
from hpctrain.config import TrainConfig
from hpctrain.train import metrics
from hpctrain.train.metrics import DATASHEET_TFLOPS, Peak, choose_peak, datasheet_part, matmul_dtype
from hpctrain.train.trainer import apply_tf32, tf32_setting

GEMM = {"tflops": 0.1, "n": 1024, "dtype": "float32"}


@pytest.mark.parametrize("name, part, bf16, tf32", [
    ("NVIDIA A100-SXM4-80GB", "NVIDIA A100 SXM", 312.0, 156.0),
    ("NVIDIA A100-SXM4-40GB", "NVIDIA A100 SXM", 312.0, 156.0),
    ("NVIDIA H100 80GB HBM3", "NVIDIA H100 SXM", 989.5, 494.5),
    ("NVIDIA H200", "NVIDIA H200", 989.5, 494.5),
    ("NVIDIA B200", "NVIDIA B200", 2250.0, 1100.0),
    ("AMD Instinct MI250X", "AMD Instinct MI250X", 191.5, None),
    ("AMD Instinct MI300X", "AMD Instinct MI300X", 1307.4, 653.7),
])
def test_recognised_devices_get_their_dense_datasheet_peak(name, part, bf16, tf32) -> None:
    assert datasheet_part(name) == part
    assert choose_peak(name, "bf16", 0.0, GEMM) == Peak(bf16, f"datasheet: {part} bf16 dense")
    got = choose_peak(name, "tf32", 0.0, GEMM)
    if tf32 is None:  # CDNA2 has no TF32: measured, and the label says why
        assert got == Peak(0.1, f"measured: float32 GEMM 1024^3 ({part} has no tf32 figure)")
    else:
        assert got.tflops == pytest.approx(tf32) and got.source.startswith("datasheet")


@pytest.mark.parametrize("name", ["NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H100 80GB HBM2e",
                                  "NVIDIA A100 80GB PCIe", "NVIDIA A100-PCIE-40GB", "NVIDIA H200 NVL", "NVIDIA GB200",
                                  "AMD Instinct MI250X/MI250", "Tesla V100-SXM2-32GB", ""])
def test_other_parts_fall_back_to_the_measured_gemm_labelled(name) -> None:
    """Lower-peak parts under similar names are not taken for the SXM ones; nor is ROCm's shared MI250X/MI250."""
    assert datasheet_part(name) is None
    assert choose_peak(name, "bf16", 0.0, GEMM) == Peak(
        0.1, f"measured: float32 GEMM 1024^3 ({name!r} is not in the datasheet table)")


def test_cpu_configured_and_nothing_known() -> None:
    assert choose_peak(None, "fp32", 0.0, GEMM) == Peak(0.1, "measured: float32 GEMM 1024^3 (a CPU)")
    # a configured peak wins everywhere, a recognised GPU included (a power-capped part, say)
    assert choose_peak("NVIDIA H100 80GB HBM3", "bf16", 700.0, GEMM) == Peak(700.0, "config: train.peak_tflops")
    assert choose_peak(None, "fp32", 0.0, None) == Peak(0.0, "none")
    assert choose_peak("NVIDIA A100-SXM4-80GB", "fp8", 0.0, GEMM).source.endswith("(NVIDIA A100 SXM has no fp8 figure)")


def test_fp8_runs_are_measured_against_the_peak_of_their_mix() -> None:
    """train.precision = "fp8" runs the blocks' linears in float8 and the rest in bf16: MFU's peak is the mix's
    (Llama 3.1 8B at 8192 tokens: 72% of the model FLOPs in the blocks' linears), not the fp8 figure, under which
    the same run would read about 40% lower."""
    from hpctrain.config import load_config
    from hpctrain.model.dims import ModelDims
    dims = ModelDims.from_config(load_config(None, [
        "model.vocab_size=128256", "model.dim=4096", "model.n_heads=32", "model.n_kv_heads=8", "model.ffn_dim=14336",
        "model.n_layers=32", "model.max_seq_len=8192"]).model)
    share = dims.float8_flops_per_token() / dims.flops_per_token(8192)
    assert share == pytest.approx(0.723, abs=1e-3)
    got = choose_peak("NVIDIA H100 80GB HBM3", "fp8", 0.0, GEMM, share)
    assert got.tflops == pytest.approx(1 / (share / 1979 + (1 - share) / 989.5))
    assert got.source == "datasheet: NVIDIA H100 SXM fp8 dense for the 72% of the FLOPs in float8 matmuls, bf16 " \
                         "dense for the rest"
    assert choose_peak("NVIDIA H100 80GB HBM3", "fp8", 0.0, GEMM).tflops == 1979  # all of them float8
    assert choose_peak("NVIDIA H100 80GB HBM3", "fp8", 700.0, GEMM, share).tflops == 700.0  # configured wins


def test_table_is_dense_and_consistent() -> None:
    """Tensor-core rates double from tf32 to bf16 to fp8 on every listed part (within the datasheets' rounding:
    B200's TF32 is given as 2.2 against BF16's 4.5): a figure "with sparsity" copied by mistake breaks the ratio."""
    for part, row in DATASHEET_TFLOPS.items():
        assert row["bf16"] == row["fp16"], part
        if "tf32" in row:
            assert row["bf16"] == pytest.approx(2 * row["tf32"], rel=0.05), part
        if "fp8" in row:
            assert row["fp8"] == pytest.approx(2 * row["bf16"], rel=0.05), part
        assert row.get("fp32", 0) < row.get("tf32", row["bf16"]), part
        assert set(row) <= {"fp32", "tf32", "bf16", "fp16", "fp8"}, part
    assert {p for _, p in metrics.DEVICE_NAMES} <= set(DATASHEET_TFLOPS)  # H100 PCIe: in the table, unmatched


def test_device_name_asks_cuda_for_gpus_only(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert metrics.device_name(torch.device("cuda", 0)) == "NVIDIA H100 80GB HBM3"
    assert metrics.device_name(torch.device("cpu")) is None


def test_matmul_dtype_and_probe_size() -> None:
    assert [matmul_dtype(p, True) for p in ("fp32", "bf16", "fp16")] == ["tf32", "bf16", "fp16"]
    assert matmul_dtype("fp32", False) == "fp32"
    assert probe_size("cuda", torch.bfloat16) == probe_size("cuda", torch.float32) == 8192
    assert probe_size("cpu", torch.float32) == 1024 and probe_size("cpu", torch.bfloat16) == 256


def test_probe_halves_its_size_on_a_full_gpu(monkeypatch) -> None:
    sizes = []

    def measure(dtype, n, device, **kw):
        sizes.append(n)
        if n > 2048:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return {"tflops": 500.0}
    monkeypatch.setattr(metrics, "measure_gemm", measure)
    assert metrics.gemm_probe(torch.device("cuda", 0), torch.bfloat16) == {"tflops": 500.0, "n": 2048,
                                                                           "dtype": "bfloat16"}
    assert sizes == [8192, 4096, 2048]


def test_tf32_is_decided_for_cuda_only(monkeypatch) -> None:
    assert TrainConfig().tf32 is True
    assert tf32_setting(True, "cuda") is True and tf32_setting(False, "cuda") is False
    assert tf32_setting(True, "cpu") is None and tf32_setting(False, "cpu") is None
    flags = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    try:
        assert apply_tf32(True, torch.device("cpu")) is False
        assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == flags  # left alone
        assert apply_tf32(True, torch.device("cuda", 0)) is True
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        assert apply_tf32(False, torch.device("cuda", 0)) is False
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags


def test_cuda_peak_memory_is_reset_with_its_baseline(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: calls.append(device))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 3e9)
    got = metrics.reset_peak_memory(torch.device("cuda", 1))
    assert calls == [torch.device("cuda", 1)]
    assert got["baseline_gb"] == 3.0 and "since the end of initialisation" in got["peak_mem"]


# --- what a training run reports (one process, in this one) -----------------------------------------------------









# --- issue 26: rates in the unit that fits, no division by a probe that read 0 -------------------------------

def test_rates_print_in_the_unit_that_fits() -> None:
    assert [metrics.flop_rate(x) for x in (989.5, 1.0, 0.08, 0.004, 0.0)] == [
        "989.5 TFLOP/s", "1.0 TFLOP/s", "80.0 GFLOP/s", "4.0 GFLOP/s", "0 FLOP/s"]
    line = metrics.describe_peak(choose_peak(None, "fp32", 0.0, {**GEMM, "tflops": 0.08}), {**GEMM, "tflops": 0.08},
                                 None)
    assert line == ("MFU against 80.0 GFLOP/s per rank (measured: float32 GEMM 1024^3 (a CPU)); measured float32 "
                    "GEMM 1024^3 on CPU: 80.0 GFLOP/s")
    h100 = metrics.describe_peak(choose_peak("NVIDIA H100 80GB HBM3", "bf16", 0.0, {**GEMM, "tflops": 735.0}),
                                 {**GEMM, "tflops": 735.0}, "NVIDIA H100 80GB HBM3")
    assert h100.startswith("MFU against 989.5 TFLOP/s per rank (datasheet") and h100.endswith(": 735.0 TFLOP/s")


@pytest.mark.faults
def test_a_probe_that_read_zero_divides_nothing(tmp_path) -> None:
    zero = {**GEMM, "tflops": 0.0}
    peak = choose_peak(None, "fp32", 0.0, zero)
    assert peak == Peak(0.0, "none: the GEMM probe read 0")
    assert "MFU against nothing (none: the GEMM probe read 0)" in metrics.describe_peak(peak, zero, None)
    log = metrics.TrainLog(tmp_path, 0, 10, torch.device("cpu"), flops_per_token=6e6, world=1, peak=peak, gemm=zero,
                           tokens_seen=0)
    log.step({"step": 1, "loss": 2.0, "lr": 1e-3, "grad_norm": 1.0}, tokens_seen=4096, log_step=True)
    assert log.last["mfu"] == 0.0 and log.last["mfu_gemm"] is None and log.last["tflops_per_rank"] > 0
    assert "mfu 0.0%" in log.log_file.progress(log.last) and "gemm" not in log.log_file.progress(log.last)
    log.close()
    record("the GEMM probe reads 0 FLOP/s (a CPU stalled under load while it ran)",
           "no division by it: MFU reads 0 against 'none: the GEMM probe read 0', no gemm ratio", tier="pure")
