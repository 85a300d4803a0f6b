"""Multi-process tier for compiled blocks (train.compile = true): every block of every rank runs as torch.compile's
module (inductor on CPU) and the run trains what the eager single process trains, within fp32 tolerance, as each
eager layout of test_train_equivalence.py does.

    PATH=$PWD/.venv/bin:$PATH .venv/bin/python -m pytest -q tests/multiproc/parallel/test_train_equivalence_compiled.py
    # every layout of the equivalence suite, compiled (about half an hour here; not in `make test`):
    HPCTRAIN_COMPILE_EVERY_LAYOUT=1 PATH=$PWD/.venv/bin:$PATH .venv/bin/python -m pytest -q \
        tests/multiproc/parallel/test_train_equivalence_compiled.py

A compile costs tens of seconds on this machine's two cores, so `make test` runs one layout per kind of block graph:
FSDP, tp with sequence parallel (again in new processes on a warm cache: torch 2.13's AOTAutograd cache trained
this layout with wrong gradients, parallel/compose.py's compile_blocks turns it off), context parallel, tp x FSDP
with every-other-block recompute (the block compiled inside the recompute wrapper), selective recompute under
tp x ZeRO-1. HPCTRAIN_COMPILE_EVERY_LAYOUT=1 runs every layout of helpers/layouts.py compiled instead, each
against its one-process reference (bf16 at bf16's tolerance; fp16 must skip the step its gradients were poisoned
in), but the zero-bubble pipelines, which train.compile refuses. Its own module and fixture: beside the eager
suite's, pytest-xdist runs the two at once.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from helpers.layouts import COMPILE, FOUR, TWO, reference_of
from helpers.training import (
    BF16_LOSS_TOL,
    BF16_NORM_RTOL,
    LOSS_TOL,
    NORM_RTOL,
    WEIGHT_TOL,
    compare_runs,
    run_case,
    spawn_train_worker,
)

EVERY = os.environ.get("HPCTRAIN_COMPILE_EVERY_LAYOUT") == "1"


def compiled(cases: list[dict]) -> list[dict]:
    return [c | {"name": f"{c['name']}_compiled", "overrides": c["overrides"] + [COMPILE]} for c in cases]


SP = ["parallel.tp=2", "parallel.sequence_parallel=true"]
ZERO_BUBBLE = ("parallel.pp_schedule=zbv", "parallel.pp_schedule=interleaved_zero_bubble")


def compilable(cases: list[dict]) -> list[dict]:
    """Every layout but the zero-bubble pipelines, which a compiled block cannot run (torch's schedule splits
    each block's backward): train.compile refuses them at config load (tests/pure/config/test_config.py)."""
    return [c for c in cases if not any(o in ZERO_BUBBLE for o in c["overrides"])]


if EVERY:
    TWO_C, FOUR_C = compiled(compilable(TWO)), compiled(compilable(FOUR))
else:
    TWO_C = compiled([{"name": "dp2_zero3", "overrides": ["parallel.zero_stage=3", "train.micro_batch_size=4"]},
                      {"name": "tp2_sp", "overrides": SP}, {"name": "cp2", "overrides": ["parallel.cp=2"]}])
    FOUR_C = compiled([{"name": "tp2dp2_zero2_ac", "overrides": ["parallel.tp=2", "parallel.zero_stage=2",
                                                                "train.micro_batch_size=4", "train.ac=every"]},
                       {"name": "tp2dp2_zero1_selective", "overrides": ["parallel.tp=2", "parallel.zero_stage=1",
                                                                       "train.micro_batch_size=4",
                                                                       "train.ac=selective"]}])
# tp2 with sequence parallel again, in new processes that find its graphs in the cache the first run filled
AGAIN = [{"name": "tp2_sp_compiled_warm", "overrides": SP + [COMPILE]}]
CASES = {c["name"]: c for c in [*TWO_C, *FOUR_C, *AGAIN]}
REFERENCES = {"ref": [], "ref4": ["model.n_layers=4"], "ref_tied": ["model.tie_embeddings=true"],
              "ref_gelu": ["model.mlp=gelu"]}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("compiled")
    with pytest.MonkeyPatch.context() as mp:  # every compiling process of this fixture: one cache, cold at first
        mp.setenv("TORCHINDUCTOR_CACHE_DIR", str(out / "inductor"))
        running = {2: spawn_train_worker(2, TWO_C, out)}
        for name in sorted({reference_of(c["overrides"]) for c in CASES.values()}):  # eager, beside the workers
            run_case(REFERENCES[name], out / f"{name}.pt")
        logs = [p.communicate(timeout=3600)[0] for p in running[2]]
        running[4] = spawn_train_worker(4, FOUR_C, out)
        logs += [p.communicate(timeout=3600)[0] for p in running[4]]
        # alone, and in a directory of its own: every worker writes errors-rank<R>.json
        (out / "warm").mkdir()
        running[-2] = spawn_train_worker(2, AGAIN, out / "warm")
        logs += [p.communicate(timeout=600)[0] for p in running[-2]]
    errors = {}
    for f in [*out.glob("errors-rank*.json"), *out.glob("warm/errors-rank*.json")]:
        errors.update(json.loads(f.read_text()))
    failed = [p.returncode for procs in running.values() for p in procs if p.returncode]
    assert not errors and not failed, f"{errors} {failed}\n" + "\n".join(log[-3000:] for log in logs)
    return {f.stem: torch.load(f) for f in [*out.glob("*.pt"), *out.glob("warm/*.pt")]}


@pytest.mark.parametrize("case", sorted(CASES))
def test_compiled_layout_matches_eager_single_process(results, case) -> None:
    overrides = CASES[case]["overrides"]
    got, ref = results[case], results[reference_of(overrides)]
    assert got["compiled"] > 0 and ref["compiled"] == 0, (got["compiled"], ref["compiled"])
    if not EVERY:  # 2 blocks, no pipeline: every block of the rank compiled
        assert got["compiled"] == 2, got["compiled"]
    if "train.precision=bf16" in overrides:
        compare_runs(got, ref, BF16_LOSS_TOL, None, BF16_NORM_RTOL)
    elif CASES[case].get("inject_inf_step"):  # fp16: the poisoned step skipped, the rest learns
        assert got["skipped"] == [False, False, True, False, False, False, False, False], got["skipped"]
        assert got["losses"][-1] < got["losses"][3] - 0.05
    else:
        compare_runs(got, ref, LOSS_TOL, WEIGHT_TOL, NORM_RTOL)
