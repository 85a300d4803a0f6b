"""Pure tier: train.precision = "fp8" is refused, naming the value and the reason, wherever float8 matmuls cannot
run: a CPU job (at config load, before anything starts), a GPU older than compute capability 8.9,
a machine without torchao. The float8 layers run on CPU with the refusal lifted in
tests/multiproc/parallel/test_train_fp8.py; their GPU kernels in tests/device/.

    .venv/bin/python -m pytest -q tests/pure/train/test_fp8_refusals.py
"""
from __future__ import annotations

import configparser
from pathlib import Path

import pytest
import torch

from helpers.refusals import refused
from hpctrain.config import load_config
from hpctrain.train.trainer import check_precision, float8_refusal

GPU = ["job.gpus_per_node=8", "job.tasks_per_node=8", "train.precision=fp8"]


def test_config_refuses_fp8_on_cpus() -> None:
    refused(load_config, None, ["train.precision=fp8"], fragments=["train.precision = 'fp8'",
                                                                    "job.gpus_per_node = 0", "bf16 or fp32"])
    assert load_config(None, GPU + ["parallel.tp=2"]).parallel.tp == 2  # torch's tp plans over the float8 layers
    refused(load_config, None, GPU + ["train.fp8_scaling=blockwise"], fragments=["train.fp8_scaling", "blockwise",
                                                                                  "rowwise"])
    cfg = load_config(None, GPU + ["train.fp8_scaling=tensorwise"])
    assert (cfg.train.precision, cfg.train.compute, cfg.train.fp8_scaling) == ("fp8", "bf16", "tensorwise")
    assert load_config(None, ["train.precision=bf16"]).train.compute == "bf16"


def test_float8_gathers_need_tensorwise_fp8_under_fsdp() -> None:
    """train.fp8_all_gather: torchao gathers float8 weights with one scale a tensor, and only FSDP gathers."""
    tw = GPU + ["train.fp8_scaling=tensorwise", "train.fp8_all_gather=true"]
    refused(load_config, None, GPU + ["train.fp8_all_gather=true"], fragments=[
        "train.fp8_all_gather = true", "fp8_scaling = 'rowwise'", "tensorwise"])
    refused(load_config, None, ["job.gpus_per_node=8", "job.tasks_per_node=8", "train.precision=bf16",
                                "train.fp8_all_gather=true"],
            fragments=["train.fp8_all_gather = true", "precision = 'bf16'"])
    refused(load_config, None, tw + ["parallel.zero_stage=1"], fragments=["train.fp8_all_gather = true",
                                                                         "parallel.zero_stage = 1", "2 or 3"])
    assert load_config(None, tw + ["parallel.zero_stage=3"]).train.fp8_all_gather


def test_the_device_check_names_what_is_missing() -> None:
    assert "capability 8.9" in float8_refusal("cpu", None, "cpu", True)
    a100 = float8_refusal("cuda", (8, 0), "NVIDIA A100-SXM4-80GB", True)
    assert "NVIDIA A100-SXM4-80GB" in a100 and "compute capability 8.0" in a100
    assert "hpctrain[fp8]" in float8_refusal("cuda", (9, 0), "NVIDIA H100 80GB HBM3", False)
    assert float8_refusal("cuda", (9, 0), "NVIDIA H100 80GB HBM3", True) == ""
    assert float8_refusal("cuda", (10, 0), "NVIDIA B200", True) == ""
    with pytest.raises(ValueError, match="train.precision = 'fp8' on a cpu device"):
        check_precision("fp8", torch.device("cpu"))
    check_precision("bf16", torch.device("cpu"))  # the others pass on a CPU


def test_the_extra_the_message_names_is_declared() -> None:
    """`pip install 'hpctrain[fp8]'` installs torchao: the extra sits in [options.extras_require] (it once sat under
    [tool:pytest], where pip never looks and pytest warned of an unknown option)."""
    cfg = configparser.ConfigParser()
    cfg.read(Path(__file__).resolve().parents[3] / "setup.cfg")
    extras = {k: v.split() for k, v in cfg["options.extras_require"].items()}
    assert any(r.startswith("torchao") for r in extras.get("fp8", [])), extras
    assert "fp8" not in cfg["tool:pytest"], dict(cfg["tool:pytest"])
