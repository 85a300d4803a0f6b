"""Mutation tests for the layout-equivalence check: it must catch a wrong gradient scale, with clipping off.

AdamW is invariant to a constant factor on the gradients, so a dp reduction that sums instead of averaging or a
missing 1/grad_accum leaves losses (and nearly the weights) where they were; before the equivalence tests compared
the pre-clip gradient norm, such a bug showed only when it changed which steps gradient clipping touched. Here one
4-rank spawn (tp=2 x dp=2, grad_accum=2, train.grad_clip=0, 8 steps) trains the layout clean and with each
deliberate bug of tests/plugins/seams.py (gradient_mutation, patched into the ranks' Trainer); the comparison
tests/multiproc/parallel/test_train_equivalence.py uses (helpers.training.compare_runs) must pass the clean run and fail
every mutated one on the gradient norm, while a loss-only comparison passes the scale bugs (the blind spot
the norm check closes).
"""
from __future__ import annotations

import json

import pytest
import torch
from seams import MUTATIONS, check_mutation

from helpers.training import (
    LOSS_TOL,
    NORM_RTOL,
    WEIGHT_TOL,
    compare_losses,
    compare_runs,
    norm_errors,
    run_case,
    spawn_train_worker,
)

CLIP_OFF = ["train.grad_clip=0"]  # nothing clipped: the losses cannot see a gradient scale
LAYOUT = ["parallel.tp=2", "parallel.zero_stage=0", "train.micro_batch_size=2", "train.grad_accum=2"] + CLIP_OFF
CASES = [{"name": "clean", "overrides": LAYOUT}] + [{"name": m, "overrides": LAYOUT, "mutation": m} for m in MUTATIONS]
SCALE_BUGS = ["dp_sum", "no_accum_div"]  # both double every gradient in this layout (dp = grad_accum = 2)
# tp_double doubles the norm weights' gradients only: the norm is off by ~45-48% here


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("mutations")
    procs = spawn_train_worker(4, CASES, out)
    run_case(CLIP_OFF, out / "ref.pt")  # the single-process reference while the ranks run
    logs = [p.communicate(timeout=600)[0] for p in procs]
    errors = {}
    for f in out.glob("errors-rank*.json"):
        errors.update(json.loads(f.read_text()))
    assert not errors, f"{errors}\n" + "\n".join(log[-3000:] for log in logs)
    return {f.stem: torch.load(f) for f in out.glob("*.pt")}


def test_clean_layout_passes(runs) -> None:
    compare_runs(runs["clean"], runs["ref"], LOSS_TOL, WEIGHT_TOL, NORM_RTOL)


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_equivalence_check_catches_the_mutation(runs, mutation) -> None:
    # "grad norm": the failure must come from the norm check; with it removed from compare_runs this test fails
    with pytest.raises(AssertionError, match="grad norm"):
        compare_runs(runs[mutation], runs["ref"], LOSS_TOL, WEIGHT_TOL, NORM_RTOL)


@pytest.mark.parametrize("mutation", SCALE_BUGS)
def test_scale_bug_doubles_the_norm(runs, mutation) -> None:
    got, ref = runs[mutation], runs["ref"]
    assert all(abs(e - 1) < 1e-3 for e in norm_errors(got["grad_norms"], ref["grad_norms"])), got["grad_norms"]


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_loss_only_comparison_is_blind_to_the_mutation(runs, mutation) -> None:
    """Why the norm check exists: with clipping off AdamW undoes a gradient scale (seen: losses within 1.5e-6 and
    weights within 9e-5 of the reference for every mutation), so a loss-only comparison passes every bug."""
    compare_losses(runs[mutation], runs["ref"], LOSS_TOL)


def test_mutation_hook_refuses_what_it_cannot_do() -> None:
    check_mutation("dp_sum", dp=2, tp=2, pp=1, grad_accum=2)
    with pytest.raises(ValueError, match="not one of dp_sum, no_accum_div, tp_double"):
        check_mutation("dp_double", dp=2, tp=2, pp=1, grad_accum=2)
    for name, layout in [("dp_sum", {"dp": 1, "tp": 2, "pp": 1, "grad_accum": 2}),
                         ("no_accum_div", {"dp": 2, "tp": 2, "pp": 1, "grad_accum": 1}),
                         ("no_accum_div", {"dp": 1, "tp": 1, "pp": 2, "grad_accum": 4}),
                         ("tp_double", {"dp": 2, "tp": 1, "pp": 1, "grad_accum": 2})]:
        with pytest.raises(ValueError, match=f"{name} needs"):
            check_mutation(name, **layout)
