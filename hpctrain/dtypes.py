"""The one table of dtype names: the config's (fp32, bf16, fp16), nccl-tests' (-d float, half, bfloat16, ...) and
torch's own spellings, all resolved to one torch dtype."""
from __future__ import annotations

import torch

TORCH: dict[str, torch.dtype] = {
    "float": torch.float32, "double": torch.float64, "half": torch.float16, "bfloat16": torch.bfloat16,
    "int32": torch.int32, "int64": torch.int64, "int8": torch.int8, "uint8": torch.uint8}
ALIASES: dict[str, str] = {
    "float32": "float", "fp32": "float", "float64": "double", "fp64": "double", "float16": "half", "fp16": "half",
    "bf16": "bfloat16", "int": "int32", "long": "int64"}


def canonical(name: str) -> str:
    """nccl-tests' name of a dtype name ('fp32' -> 'float'); unknown names come back unchanged."""
    return ALIASES.get(name, name)


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of any name above; KeyError names the unknown one."""
    try:
        return TORCH[canonical(name)]
    except KeyError:
        raise KeyError(f"unknown dtype {name!r}; valid: {', '.join([*TORCH, *ALIASES])}") from None
