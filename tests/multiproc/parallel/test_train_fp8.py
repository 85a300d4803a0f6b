"""Multi-process tier for float8 training (train.precision = "fp8"): the layouts fp8 composes with train on this CPU
and match one process training in fp8.

A CPU job's fp8 is refused (there are no float8 matmuls to gain from: config load and the trainer's device check
say so, tests/pure/train/test_fp8_refusals.py). torchao's float8 layers still run here, their scaled matmuls
emulated, so these cases lift the refusal (helpers.training.run_case's fp8: loaded in bf16, switched after the
config's checks, the trainer's device check patched for the case) and run the product's own fp8 path: the blocks'
linears become Float8Linear, then FSDP (ZeRO-2/3), DDP, the pipeline, context parallel and compiled blocks wrap
them as on a GPU. With rowwise scales (the default) every row and column scale is computed where it is on one
process (FSDP gathers whole weights before the cast; activations are scaled per token), so a layout matches one
process training in fp8 within bf16's tolerances. Checkpoints are unchanged by fp8: the weights are the same fp32
tensors, under the same names, as a bf16 run's. The GPU's kernels themselves (cuBLAS's float8 matmuls, inductor's
Triton) only run in tests/device/.

    PATH=$PWD/.venv/bin:$PATH .venv/bin/python -m pytest -q tests/multiproc/parallel/test_train_fp8.py
"""
from __future__ import annotations

import json

import pytest
import torch

from helpers.layouts import PP
from helpers.training import BF16_NORM_RTOL, TINY, compare_runs, run_case, spawn_train_worker

pytest.importorskip("torchao", reason="make install adds torchao beside the pinned torch (TORCHAO_SPEC)")

BF16 = ["train.precision=bf16"]
DP2 = BF16 + ["train.micro_batch_size=4"]
TWO = [{"name": "dp2_zero3", "overrides": DP2 + ["parallel.zero_stage=3"], "fp8": "rowwise"},
       {"name": "dp2_zero0", "overrides": DP2 + ["parallel.zero_stage=0"], "fp8": "rowwise"},
       {"name": "pp2_1f1b", "overrides": BF16 + PP + ["parallel.pp_schedule=1f1b"], "fp8": "rowwise"},
       {"name": "cp2", "overrides": BF16 + ["parallel.cp=2"], "fp8": "rowwise"},
       {"name": "dp2_zero3_compiled", "overrides": DP2 + ["parallel.zero_stage=3", "train.compile=true"],
        "fp8": "rowwise"},
       {"name": "dp2_zero3_tensorwise", "overrides": DP2 + ["parallel.zero_stage=3"], "fp8": "tensorwise"}]
ROWWISE = [c["name"] for c in TWO if c["fp8"] == "rowwise"]
# per-step losses of 8 steps: seen within 9e-4 of one process (fp8 or bf16) in every case; the gradient norms are
# held to bf16's BF16_NORM_RTOL (seen within 4.4e-3)
FP8_LOSS_TOL = 5e-3


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("fp8")
    running = spawn_train_worker(2, TWO, out)
    run_case(BF16, out / "ref.pt", fp8="rowwise")  # one process, the same 8 sequences a step
    run_case(BF16, out / "ref_bf16.pt")
    logs = [p.communicate(timeout=600)[0] for p in running]
    errors = {}
    for f in out.glob("errors-rank*.json"):
        errors.update(json.loads(f.read_text()))
    failed = [p.returncode for p in running if p.returncode]
    assert not errors and not failed, f"{errors} {failed}\n" + "\n".join(log[-3000:] for log in logs)
    return {f.stem: torch.load(f, weights_only=True) for f in out.glob("*.pt")}


def block_linears() -> set[str]:
    from hpctrain.config import load_config
    from hpctrain.model.dims import ModelDims
    from hpctrain.model.transformer import Transformer
    with torch.device("meta"):
        model = Transformer(ModelDims.from_config(load_config(None, TINY).model))
    return {name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def test_the_blocks_linears_are_float8_and_the_output_is_not(results) -> None:
    linears = block_linears()
    assert "output" in linears and len(linears) == 1 + 2 * 7  # wq wk wv wo w1 w2 w3 in each of 2 blocks
    assert results["ref"]["float8"] == sorted(linears - {"output"})
    assert results["ref_bf16"]["float8"] == []
    for case in ROWWISE:  # DDP's names start with module., compiled blocks' gain _orig_mod.
        names = {n.removeprefix("module.").replace("_orig_mod.", "") for n in results[case]["float8"]}
        # rank 0 holds the pipeline's first block only
        assert names == {n for n in linears - {"output"} if case != "pp2_1f1b" or n.startswith("layers.0.")}, case


def test_fp8_really_ran_and_stays_near_bf16(results) -> None:
    fp8, bf16 = results["ref"], results["ref_bf16"]
    assert fp8["losses"] != bf16["losses"]  # one process both: only the matmuls differ
    compare_runs(fp8, bf16, FP8_LOSS_TOL, None, BF16_NORM_RTOL)


@pytest.mark.parametrize("case", ROWWISE)
def test_layout_matches_one_process_in_fp8(results, case) -> None:
    compare_runs(results[case], results["ref"], FP8_LOSS_TOL, None, BF16_NORM_RTOL)


def test_tensorwise_scales_train_too(results) -> None:
    got = results["dp2_zero3_tensorwise"]
    assert got["losses"] != results["dp2_zero3"]["losses"]  # the same layout: the recipe reached torchao
    compare_runs(got, results["ref_bf16"], FP8_LOSS_TOL, None, BF16_NORM_RTOL)


def test_checkpointed_weights_are_those_of_a_bf16_run(results) -> None:
    """What a checkpoint holds (the full weights) has the names, shapes and fp32 dtype of a bf16 run's, in every
    layout: an fp8 run's checkpoint reshards and resumes in bf16 as any other."""
    want = {k: (v.shape, v.dtype) for k, v in results["ref_bf16"]["weights"].items()}
    assert all(dtype == torch.float32 for _, dtype in want.values())
    for case in ["ref", *ROWWISE, "dp2_zero3_tensorwise"]:
        got = {k: (v.shape, v.dtype) for k, v in results[case]["weights"].items()}
        assert got == want, case
