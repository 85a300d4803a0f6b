"""What a training checkpoint holds, as DCP Stateful objects plus JSON: the model and optimizer through
torch.distributed.checkpoint.state_dict (sharded, so DCP can reshard them into another layout), every rank's
RNG state, and the small control state (step, tokens, schedule, loss scale, data position) as JSON.
"""
from __future__ import annotations

import math
import os
import platform
import socket
import subprocess
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from hpctrain.model.transformer import clean_name


class ModelState(Stateful):
    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        set_model_state_dict(self.model, sd)


# Flat keys ("state.<fqn>.exp_avg", "param_groups.<fqn>.lr"): every entry belongs to one parameter, so a pipeline
# stage saves and loads only its own parameters' entries and checkpoints reshard across pp sizes.
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def renamed(sd: dict[str, Any], aliases: dict[str, str]) -> dict[str, Any]:
    """Flat optimizer keys with each parameter name of `aliases` replaced by its alias ("state.<name>.<key>",
    "param_groups.<name>.<key>")."""
    if not aliases:
        return sd
    out = {}
    for key, value in sd.items():
        kind, _, rest = key.partition(".")
        for name, alias in aliases.items():
            if rest.startswith(name + "."):
                key = f"{kind}.{alias}{rest[len(name):]}"
        out[key] = value
    return out


class OptimizerState(Stateful):
    """aliases: parameter name -> the name its entries are saved under (a pipeline's tied output projection holds
    the embedding's state, saved as the embedding's: parallel.pipeline.TiedEmbedding)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 aliases: dict[str, str] | None = None) -> None:
        self.model, self.optimizer, self.aliases = model, optimizer, aliases or {}

    def state_dict(self) -> dict[str, Any]:
        return renamed(get_optimizer_state_dict(self.model, self.optimizer, options=FLAT), self.aliases)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        back = {alias: name for name, alias in self.aliases.items()}
        set_optimizer_state_dict(self.model, self.optimizer, renamed(sd, back), options=FLAT)


class ZeroOneOptimizerState(Stateful):
    """ZeRO-1 (hpctrain.train.optim.ZeroOne), and the host's AdamW of parallel.offload = "optimizer" (HostAdamW,
    whose masters stand in for the parameters as ZeRO-1's shards do): each rank saves the AdamW state of the
    parameters it owns, under the
    same flat keys get_optimizer_state_dict gives a whole optimizer ("state.<fqn>.<key>",
    "param_groups.<fqn>.<key>"), so a checkpoint moves between ZeRO-1 and every other layout. The optimizer holds
    the local shards of tensor-parallel parameters (zero.params_of maps each to its parameter): their moments are
    saved as DTensors with the parameter's mesh and placements, as a plain optimizer's are."""

    def __init__(self, model: torch.nn.Module, zero, aliases: dict[str, str] | None = None) -> None:
        self.zero = zero
        aliases = aliases or {}
        names = {p: clean_name(n) for n, p in model.named_parameters()}
        self.names = {held: aliases.get(names[p], names[p]) for held, p in zero.params_of.items()}

    def _owned(self) -> list[torch.Tensor]:
        return [p for g in self.zero.optim.param_groups for p in g["params"]]

    def _as_saved(self, held: torch.Tensor, value: Any) -> Any:
        p = self.zero.params_of[held]
        if isinstance(p, DTensor) and isinstance(value, torch.Tensor) and value.shape == held.shape:
            return DTensor.from_local(value, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                      stride=p.stride())
        return value

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for p in self._owned():
            st = self.zero.optim.state.get(p)
            if not st:  # before the first step: zeros of the right shapes, so a load has places to fill
                st = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
                self.zero.optim.state[p] = st
            out.update({f"state.{self.names[p]}.{k}": self._as_saved(p, v) for k, v in st.items()})
        for g in self.zero.param_groups:  # every rank holds every group's hyperparameters
            for p in g["params"]:
                out.update({f"param_groups.{self.names[p]}.{k}": v for k, v in g.items() if k != "params"})
        return out

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        reload = getattr(self.zero, "reload_masters", None)  # the host's masters: copied again from the weights
        if reload is not None:
            reload()
        for p in self._owned():
            prefix = f"state.{self.names[p]}."
            self.zero.optim.state[p] = {k[len(prefix):]: v.to_local() if isinstance(v, DTensor) else v
                                        for k, v in sd.items() if k.startswith(prefix)}
        for g in self.zero.param_groups:
            prefix = f"param_groups.{self.names[g['params'][0]]}."
            g.update({k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)})


def rng_table(world: int) -> torch.Tensor:
    """Every rank's CPU RNG state as one (world, n) uint8 tensor, the same on all ranks (saved once)."""
    mine = torch.get_rng_state()
    table = torch.zeros(world, mine.numel(), dtype=torch.uint8)
    table[dist.get_rank() if dist.is_initialized() else 0] = mine
    if dist.is_initialized():
        dist.all_reduce(table)  # gloo has no uint8 max; exactly one rank fills each row, so a sum is exact
    return table


def rng_table_bytes(world: int) -> int:
    """Bytes of rng_table(world): what a load allocates for a checkpoint saved by `world` ranks."""
    return world * torch.get_rng_state().numel()


def restore_rng(table: torch.Tensor, rank: int) -> bool:
    """This rank's saved RNG state when the saved world had this rank; False otherwise (left as seeded)."""
    if rank >= table.shape[0]:
        return False
    torch.set_rng_state(table[rank].clone())
    return True


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def provenance(config: dict, layout: dict, zero_stage: int, rank: int = 0) -> dict[str, Any]:
    """Where a run's checkpoints come from: enough to reproduce or audit them. Made once per run (collective: the
    hosts are gathered from every rank); the git commit is read on rank 0 only, which writes the markers. Each
    save adds its "saved_at"."""
    hosts: list[Any] = [socket.gethostname()]
    if dist.is_initialized():
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, os.environ.get("SLURMD_NODENAME") or socket.gethostname())
        hosts = sorted(set(every))
    return {
        "config": config, "layout": layout | {"zero_stage": zero_stage},
        "world_size": dist.get_world_size() if dist.is_initialized() else 1, "hosts": hosts,
        "slurm_job_id": os.environ.get("SLURM_JOB_ID", ""), "git_commit": git_commit() if rank == 0 else "",
        "torch": torch.__version__, "python": platform.python_version(),
    }


def _like(value: Any, template: Any, where: str) -> None:
    """value has template's structure: the same dict keys, lists of the template's element types, finite numbers."""
    if isinstance(template, dict):
        if not isinstance(value, dict) or set(value) != set(template):
            have = sorted(value) if isinstance(value, dict) else type(value).__name__
            raise ValueError(f"{where}: {have}, expected the keys {sorted(template)}")
        for k in template:
            _like(value[k], template[k], f"{where}.{k}")
    elif isinstance(template, (list, tuple)):
        if not isinstance(value, list):
            raise ValueError(f"{where}: {type(value).__name__}, expected a list")
        kinds = {type(t) for t in template}
        for i, v in enumerate(value):
            if kinds and type(v) not in kinds | ({float} if int in kinds else set()):
                raise ValueError(f"{where}[{i}] = {v!r}")
    elif isinstance(template, bool) or template is None or isinstance(template, str):
        if type(value) is not type(template):
            raise ValueError(f"{where} = {value!r}, expected a {type(template).__name__}")
    elif isinstance(template, (int, float)):
        if type(value) not in (int, float) or (type(template) is int and type(value) is not int) or not math.isfinite(
                value):
            raise ValueError(f"{where} = {value!r}, expected a finite {type(template).__name__}")


def check_train_state(extra: Any, template: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's train_state.json checked against the live trainer's own (template): the same keys all the
    way down, values of the same types, counts that make sense. ValueError names the field."""
    _like(extra, template, "train_state")
    for key in ("step", "tokens_seen"):
        if extra[key] < 0:
            raise ValueError(f"train_state.{key} = {extra[key]} is negative")
    if not 1 <= extra["world_size"] <= 1 << 20:
        raise ValueError(f"train_state.world_size = {extra['world_size']}")
    return extra
