"""Deliberate gradient-scale bugs, for tests only: tests/multiproc/test_grad_scale_mutations.py proves with them
that the layout-equivalence tests see a dp reduction that sums, a missing /grad_accum and a tp gradient counted twice.
HPCTRAIN_TEST_MUTATION names one; unset (always, outside those tests) the trainer is unchanged."""
from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

log = logging.getLogger("hpctrain")

# name -> (what the layout needs for the bug to act, the bug)
MUTATION_ENV = "HPCTRAIN_TEST_MUTATION"
MUTATIONS = {"dp_sum": ("dp > 1", "the dp reduction sums instead of averaging"),
             "no_accum_div": ("grad_accum > 1 and pp = 1", "the backward loss is not divided by grad_accum"),
             "tp_double": ("tp > 1", "gradients replicated over tp are all-reduced over tp a second time")}


def gradient_mutation(dp: int, tp: int, pp: int, grad_accum: int) -> str | None:
    """The test mutation named by HPCTRAIN_TEST_MUTATION, or None (unset: the normal trainer). Refuses unknown names,
    and a layout the bug would not touch (a mutation test that mutates nothing would pass for the wrong reason)."""
    name = os.environ.get(MUTATION_ENV, "")
    if not name:
        return None
    if name not in MUTATIONS:
        raise ValueError(f"{MUTATION_ENV}={name!r} is not one of {', '.join(MUTATIONS)}")
    acts = {"dp_sum": dp > 1, "no_accum_div": grad_accum > 1 and pp == 1, "tp_double": tp > 1}[name]
    if not acts:
        raise ValueError(f"{MUTATION_ENV}={name} needs {MUTATIONS[name][0]}; this layout has pp={pp} dp={dp} "
                         f"tp={tp} grad_accum={grad_accum}")
    log.warning("%s=%s: %s (a deliberate bug, for tests only)", MUTATION_ENV, name, MUTATIONS[name][1])
    return name


def mutate_reduced_grads(name: str, params, dp: int, tp_group) -> None:
    """After the real reductions: dp_sum turns the dp average into the sum (a DDP/FSDP divide factor of 1);
    tp_double sums the gradients that tensor parallel replicates (norm weights; those not sharded over tp) over tp
    again, as a redundant all-reduce of already complete gradients would."""
    with torch.no_grad():
        for p in params:
            if p.grad is None:
                continue
            local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            if name == "dp_sum":
                local.mul_(dp)
            elif not _sharded_over_tp(p.grad):
                dist.all_reduce(local, group=tp_group)


def _sharded_over_tp(t: torch.Tensor) -> bool:
    """Whether a (gradient) tensor is split over the tp mesh axis; plain tensors are whole on every tp rank."""
    if not isinstance(t, DTensor):
        return False
    names = t.device_mesh.mesh_dim_names or ()
    return "tp" in names and t.placements[names.index("tp")].is_shard()
