"""Multi-process tier for float8 training (train.precision = "fp8"): the layouts fp8 composes with train on this CPU
and match one process training in fp8.

A CPU job's fp8 is refused (there are no float8 matmuls to gain from: config load and the trainer's device check
say so, tests/pure/train/test_fp8_refusals.py). torchao's float8 layers still run here, their scaled matmuls
emulated, so these cases lift the refusal (helpers.training.run_case's fp8: loaded in bf16, switched after the
config's checks, the trainer's device check patched for the case) and run the product's own fp8 path: the blocks'
linears become Float8Linear, then tensor parallel, FSDP (ZeRO-2/3), DDP, the pipeline, context parallel and
compiled blocks wrap them as on a GPU. With rowwise scales (the default) the data-parallel layouts scale as one
process does (FSDP gathers whole weights before the cast; activations are scaled per token), and every layout
matches one process training in fp8 within FP8_LOSS_TOL and bf16's gradient-norm tolerance. Checkpoints are
unchanged by fp8: the weights are the same fp32 tensors, under the same names, as a bf16 run's. The GPU's kernels
themselves (cuBLAS's float8 matmuls, inductor's Triton) only run in tests/device/.

    PATH=$PWD/.venv/bin:$PATH .venv/bin/python -m pytest -q tests/multiproc/parallel/test_train_fp8.py
"""
from __future__ import annotations

import json
from pathlib import Path

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
       # tensor parallel: torch's column- and row-parallel plans over the float8 layers (DTensor weights, their
       # activations gathered and reduced in bf16), with sequence parallel and op-level recompute
       {"name": "tp2", "overrides": BF16 + ["parallel.tp=2"], "fp8": "rowwise"},
       {"name": "tp2_sp_op", "overrides": BF16 + ["parallel.tp=2", "parallel.sequence_parallel=true", "train.ac=op"],
        "fp8": "rowwise"},
       {"name": "dp2_zero3_compiled", "overrides": DP2 + ["parallel.zero_stage=3", "train.compile=true"],
        "fp8": "rowwise"},
       {"name": "dp2_zero3_tensorwise", "overrides": DP2 + ["parallel.zero_stage=3"], "fp8": "tensorwise"},
       # FSDP gathering the blocks' weights in float8 (train.fp8_all_gather), its last step checkpointed
       {"name": "dp2_zero3_gather8", "overrides": DP2 + ["parallel.zero_stage=3", "checkpoint.every_steps=4",
                                                         "checkpoint.at_end=true"],
        "fp8": "tensorwise", "fp8_all_gather": True}]
# HSDP (2 replicas of 2 shards) gathering in float8 within each replica, the same 8 sequences a step
FOUR = [{"name": "hsdp_gather8", "overrides": BF16 + ["train.micro_batch_size=2", "parallel.zero_stage=3",
                                                      "parallel.dp_replicate=2"],
         "fp8": "tensorwise", "fp8_all_gather": True}]
ROWWISE = [c["name"] for c in TWO if c["fp8"] == "rowwise"]
TENSORWISE = [c["name"] for c in TWO if c["fp8"] == "tensorwise"]
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
    ended = running
    # the float8-gathering run resumed from its step-4 checkpoint (loaded into torchao's wrappers of the weights);
    # beside it, the 4-rank HSDP case
    running = spawn_train_worker(4, FOUR, out)
    step4 = next((out / "dp2_zero3_gather8-runs").glob("*/checkpoints/step_00000004"), None)
    if step4 is not None:
        resumed = [{**TWO[-1], "name": "dp2_zero3_gather8_resumed",
                    "overrides": TWO[-1]["overrides"] + [f"train.resume={step4}", "checkpoint.every_steps=0",
                                                         "checkpoint.at_end=false"]}]
        running += spawn_train_worker(2, resumed, out)
    logs += [p.communicate(timeout=600)[0] for p in running]
    errors = {}
    for f in out.glob("errors-rank*.json"):
        errors.update(json.loads(f.read_text()))
    failed = [p.returncode for p in ended + running if p.returncode]
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
    from hpctrain.model.transformer import clean_name  # DDP's, compile's and recompute's prefixes dropped
    for case in ROWWISE:
        names = {clean_name(n) for n in results[case]["float8"]}
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


def test_fsdp_gathers_float8_and_checkpoints_the_fp32_weights(results) -> None:
    """train.fp8_all_gather: every block linear's shard is torchao's float8-gathering weight (14 of them), the run
    stays within fp8's tolerance of the same layout gathering bf16 (the cast moves before the gather, with the
    same whole-tensor scale), and its checkpoint holds the fp32 values inside those wrappers: what it wrote, read
    back and assembled (every dataset's checksum checked), equals the run's own full weights."""
    from hpctrain.checkpoint import inspection
    got, plain = results["dp2_zero3_gather8"], results["dp2_zero3_tensorwise"]
    assert got["float8_gathered"] == 14 and plain["float8_gathered"] == 0
    assert got["losses"] != plain["losses"]
    compare_runs(got, plain, FP8_LOSS_TOL, None, BF16_NORM_RTOL)
    ckpts = sorted((Path(got["run_dir"]) / "checkpoints").glob("step_*"))
    assert [c.name for c in ckpts] == ["step_00000004", "step_00000008"], ckpts
    mt = inspection.model_tensors(ckpts[-1])
    with inspection.full_tensor_reader(mt) as read:
        stored = {fqn.removeprefix("model."): torch.from_numpy(read(fqn, tuple(tmd.size)).copy())
                  for fqn, tmd in mt.tensors}
    assert stored.keys() == got["weights"].keys()
    assert all(torch.equal(stored[k], got["weights"][k]) for k in stored)


def test_float8_gathers_scales_are_computed_after_each_step(results) -> None:
    """train.fp8_all_gather: after the optimizer step every float8-gathered weight holds the scale of its whole
    updated tensor for the next gather (one all-reduce for all of them, torchao's precompute), the same scale the
    gather would compute itself; the layout without float8 gathers holds none."""
    for case in ["dp2_zero3_gather8", "hsdp_gather8"]:
        scales = results[case]["float8_scales"]
        assert len(scales) == 14 and all(held == want for held, want in scales.values()), (case, scales)
    assert results["dp2_zero3_tensorwise"]["float8_scales"] == {}


def test_hsdp_gathers_float8_too(results) -> None:
    """parallel.dp_replicate = 2 over 4 ranks (ZeRO-3 inside each replica of 2) with float8 gathers trains what the
    2-rank ZeRO-3 float8-gathering run trains, within fp8's tolerance."""
    got = results["hsdp_gather8"]
    assert got["float8_gathered"] == 14 and set(got["fsdp_mesh"].values()) == {(2, 2)}, got["fsdp_mesh"]
    compare_runs(got, results["dp2_zero3_gather8"], FP8_LOSS_TOL, None, BF16_NORM_RTOL)


def test_float8_gathering_run_resumes_where_it_stopped(results) -> None:
    """Resumed from its step-4 checkpoint, the float8-gathering run trains steps 5-8 exactly as it did the first
    time: the fp32 weights and AdamW state went back into torchao's wrappers."""
    whole, resumed = results["dp2_zero3_gather8"], results["dp2_zero3_gather8_resumed"]
    assert resumed["losses"] == whole["losses"][4:] and resumed["grad_norms"] == whole["grad_norms"][4:]
    assert all(torch.equal(resumed["weights"][k], whole["weights"][k]) for k in whole["weights"])
    assert resumed["float8_gathered"] == 14


def test_checkpointed_weights_are_those_of_a_bf16_run(results) -> None:
    """What a checkpoint holds (the full weights) has the names, shapes and fp32 dtype of a bf16 run's, in every
    layout: an fp8 run's checkpoint reshards and resumes in bf16 as any other."""
    want = {k: (v.shape, v.dtype) for k, v in results["ref_bf16"]["weights"].items()}
    assert all(dtype == torch.float32 for _, dtype in want.values())
    for case in ["ref", *ROWWISE, *TENSORWISE]:
        got = {k: (v.shape, v.dtype) for k, v in results[case]["weights"].items()}
        assert got == want, case
