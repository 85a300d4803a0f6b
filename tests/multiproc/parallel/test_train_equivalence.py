"""Multi-process tier for training: every layout trains the same model as one process.

Same seed, same data, 8 steps of a tiny Llama on gloo: per-step losses, per-step pre-clip gradient norms and final
full weights of each layout must match the single-process reference within fp32 tolerance (reduction order
differs across layouts). The gradient norm is the check that sees gradient scale: AdamW is invariant to a constant
factor on the gradients, so a dp reduction that sums instead of averaging, or a missing 1/grad_accum, leaves losses
and weights alone unless clipping happens to engage (tests/multiproc/parallel/test_grad_scale_mutations.py proves it).
bf16
is held to stated looser tolerances; fp16 must skip exactly the step whose gradients were made infinite.
Pipeline layouts (GPipe, 1F1B, interleaved, ZBV zero bubble, with tp and with dp/ZeRO) are held to the same
tolerances; their weights are gathered from every stage.
"""
from __future__ import annotations

import json
import math

import pytest
import torch

from helpers.layouts import FOUR, FOUR_LAYERS, FUSED, TWO
from helpers.training import (
    BF16_LOSS_TOL,
    BF16_NORM_RTOL,
    LOSS_TOL,
    NORM_RTOL,
    WEIGHT_TOL,
    compare_runs,
    norm_errors,
    run_case,
    spawn_train_worker,
)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    return _results(tmp_path_factory.mktemp("train"))


def _results(out) -> dict[str, dict]:
    # both spawns run while this process computes the references (6 processes on 2 cores, ~1 min)
    running = {2: spawn_train_worker(2, TWO, out)}
    run_case([], out / "ref.pt")
    run_case(["train.micro_batch_size=2", "train.grad_accum=4"], out / "accum4.pt")
    run_case(["train.ac=full"], out / "ac_full.pt")
    run_case(["train.ac=selective"], out / "ac_selective.pt")
    run_case(["train.ac=op"], out / "ac_op.pt")
    run_case(FOUR_LAYERS, out / "ref4.pt")
    run_case(["model.tie_embeddings=true"], out / "ref_tied.pt")
    run_case(["model.mlp=gelu"], out / "ref_gelu.pt")
    run_case([FUSED], out / "ref_fused.pt")
    run_case(["parallel.zero_stage=3", "parallel.offload=all"], out / "ref_offload.pt")  # one process: FSDP of 1
    logs = [p.communicate(timeout=600)[0] for p in running[2]]
    running[4] = spawn_train_worker(4, FOUR, out)
    logs += [p.communicate(timeout=600)[0] for p in running[4]]
    errors = {}
    for f in out.glob("errors-rank*.json"):
        errors.update(json.loads(f.read_text()))
    failed = [p.returncode for procs in running.values() for p in procs if p.returncode]
    assert not errors and not failed, f"{errors} {failed}\n" + "\n".join(log[-3000:] for log in logs)
    return {f.stem: torch.load(f) for f in out.glob("*.pt")}


@pytest.mark.parametrize("case", ["tp2", "tp2_sp", "dp2_zero0", "dp2_zero1", "dp2_zero2", "dp2_zero3",
                                  "tp2dp2_zero3", "tp2dp2_zero0", "tp2dp2_zero1_sp", "tp2dp2_zero2_ac",
                                  "dp4_zero1_accum2", "accum4", "ac_full"])
def test_layout_matches_single_process(results, case) -> None:
    compare_runs(results[case], results["ref"], LOSS_TOL, WEIGHT_TOL, NORM_RTOL)


@pytest.mark.parametrize("case, twin", [("ac_selective", "ref"), ("ac_op", "ref"), ("tp2_sp_selective", "tp2_sp"),
                                        ("tp2_sp_op", "tp2_sp"), ("dp2_zero3_op", "dp2_zero3"),
                                        ("pp2_1f1b_selective", "pp2_1f1b"), ("tp2_sp_fused_op", "tp2_sp_fused")])
def test_partial_recompute_changes_nothing(results, case, twin) -> None:
    """train.ac = "selective" and "op" compute again in backward what they did not keep: the same values, so the
    same run bit for bit as without recomputation, in one process and under tp with sequence parallel, ZeRO-3 and
    a pipeline."""
    got, ref = results[case], results[twin]
    assert got["losses"] == ref["losses"] and got["grad_norms"] == ref["grad_norms"], (got["losses"], ref["losses"])
    assert got["weights"].keys() == ref["weights"].keys()
    assert all(torch.equal(got["weights"][k], ref["weights"][k]) for k in ref["weights"])


def test_gelu_mlp_matches_single_process(results) -> None:
    assert "layers.0.feed_forward.w3.weight" not in results["ref_gelu"]["weights"]
    assert not torch.equal(results["ref_gelu"]["weights"]["output.weight"], results["ref"]["weights"]["output.weight"])
    compare_runs(results["tp2_sp_gelu"], results["ref_gelu"], LOSS_TOL, WEIGHT_TOL, NORM_RTOL)


@pytest.mark.parametrize("case", ["ref_fused", "tp2_fused", "tp2_sp_fused", "pp2tp2_fused", "tp2dp2_zero1_sp_fused"])
def test_fused_projections_match_single_process(results, case) -> None:
    """model.fused_projections trains the same model as separate projections (the one-process reference has
    them): one process, tp with and without sequence parallel, a pipeline, ZeRO-1; the weights keep their names."""
    compare_runs(results[case], results["ref"], LOSS_TOL, WEIGHT_TOL, NORM_RTOL)
    # 2 per block (q/k/v, gate/up), on every rank's blocks: the flag took effect, sharded over tp where there is tp
    blocks = 1 if case.startswith("pp2") else 2
    assert results[case]["fused"] == {"FusedProjection" if case == "ref_fused" else "ShardFusedProjection":
                                      2 * blocks}, results[case]["fused"]
    assert results["ref"]["fused"] == {} and results["tp2_sp"]["fused"] == {}


@pytest.mark.parametrize("case", ["cp2", "cp4_selective", "cp2tp2_sp", "cp2dp2_zero3", "cp2pp2"])
def test_context_parallel_matches_single_process(results, case) -> None:
    """parallel.cp: every sequence split over the cp ranks (ring attention, global rotary positions, the loss a mean
    over the whole sequences) trains what one process trains, alone and with tp + sequence parallel, dp ZeRO-3, a
    pipeline and selective recompute."""
    compare_runs(results[case], results["ref"], LOSS_TOL, WEIGHT_TOL, NORM_RTOL)


def test_overlap_settings_train_the_same_model(results) -> None:
    """parallel.fsdp_prefetch = 2 (every block asks for the next two in forward; 4 blocks: the last has none left)
    and parallel.ddp_bucket_mb = 2 (DDP's bucket cap) change when communication runs, not what is computed."""
    compare_runs(results["dp2_zero3_prefetch2"], results["ref4"], LOSS_TOL, WEIGHT_TOL, NORM_RTOL)
    assert results["dp2_zero3_prefetch2"]["prefetch"] == {"layers.0": 2, "layers.1": 2, "layers.2": 1,
                                                          "layers.3": 0}, results["dp2_zero3_prefetch2"]["prefetch"]
    assert set(results["dp2_zero3"]["prefetch"].values()) == {0}
    compare_runs(results["dp2_zero0_bucket2"], results["ref"], LOSS_TOL, WEIGHT_TOL, NORM_RTOL)
    assert results["dp2_zero0_bucket2"]["ddp_bucket_bytes"] == 2 * 2**20
    assert results["dp2_zero0"]["ddp_bucket_bytes"] == 25 * 2**20


@pytest.mark.parametrize("case", ["dp4_zero3_hsdp2", "dp4_zero2_hsdp2_accum2"])
def test_hsdp_matches_single_process(results, case) -> None:
    """parallel.dp_replicate = 2 on dp 4: every FSDP module shards over a (2 replicas, 2 shards) mesh and trains
    what one process trains (and so what plain ZeRO-2/3 over dp 4 trains)."""
    compare_runs(results[case], results["ref"], LOSS_TOL, WEIGHT_TOL, NORM_RTOL)
    assert results[case]["fsdp_mesh"] and set(results[case]["fsdp_mesh"].values()) == {(2, 2)}
    assert set(results["dp2_zero3"]["fsdp_mesh"].values()) == {(2,)}


@pytest.mark.parametrize("case", ["ref_offload", "dp2_zero3_offload", "tp2dp2_zero2_offload", "pp2dp2_zero2_offload"])
def test_cpu_offload_trains_the_same_model(results, case) -> None:
    """parallel.offload = "all": every FSDP module keeps its shards in host memory (CPUOffloadPolicy), one process
    (FSDP over one rank), ZeRO-3 over dp, ZeRO-2 with tp and under a pipeline; on a CPU the host is the device, so
    each is the plain run (the GPU proof: tests/device/)."""
    compare_runs(results[case], results["ref"], LOSS_TOL, WEIGHT_TOL, NORM_RTOL)
    assert results[case]["offload"] and all(results[case]["offload"].values()), results[case]["offload"]
    assert results["dp2_zero3"]["offload"] and not any(results["dp2_zero3"]["offload"].values())


@pytest.mark.parametrize("case", ["dp2_zero0_host_adamw", "tp2dp2_zero3_host_adamw"])
def test_optimizer_offload_trains_the_same_model(results, case) -> None:
    """parallel.offload = "optimizer": AdamW steps fp32 masters in host memory and copies them back into the
    parameters (DDP, and tp2 x dp2 ZeRO-3's DTensor shards): the same run."""
    compare_runs(results[case], results["ref"], LOSS_TOL, WEIGHT_TOL, NORM_RTOL)
    assert results[case]["host_optimizer"] and not results["dp2_zero0"]["host_optimizer"]


def test_tied_embeddings_stay_one_matrix(results) -> None:
    """model.tie_embeddings: the output projection is the embedding, in one process and under tp2 x dp2 ZeRO-3
    (materialising on the device once gave each its own copy, trained apart); under pipeline parallel the last
    stage's copy stays equal to the embedding (pp2, with tp2, with dp2 ZeRO-3), and each run is one process's."""
    for name in ("ref_tied", "tp2dp2_zero3_tied", "pp2_tied", "pp2tp2_tied", "pp2dp2_zero3_tied"):
        w = results[name]["weights"]
        assert torch.equal(w["output.weight"], w["tok_embeddings.weight"]), name
    for name in ("tp2dp2_zero3_tied", "pp2_tied", "pp2tp2_tied", "pp2dp2_zero3_tied"):
        compare_runs(results[name], results["ref_tied"], LOSS_TOL, WEIGHT_TOL, NORM_RTOL)
    assert results["ref_tied"]["losses"][-1] != results["ref"]["losses"][-1]  # tying changed what was trained


@pytest.mark.parametrize("case", ["pp2_gpipe", "pp2_1f1b", "pp2tp2", "pp2dp2_zero0", "pp2dp2_zero3"])
def test_pipeline_matches_single_process(results, case) -> None:
    compare_runs(results[case], results["ref"], LOSS_TOL, WEIGHT_TOL, NORM_RTOL)
    # the last stage keeps no micro-batch's logits past its backward (no merged output asked of the schedule), and
    # no stage keeps a receive buffer between steps (torch's stage kept one per micro-batch for inputs and grads)
    assert results[case]["outputs_kept"] == 0 and results[case]["recv_buffers"] == 0


@pytest.mark.parametrize("case", ["pp2v2_interleaved_1f1b", "pp2v2_zbv", "pp4_gpipe", "pp2v2dp2_interleaved_zero1_ac",
                                  "pp2v2dp2_zbv_zero2"])
def test_pipeline_four_stages_match_single_process(results, case) -> None:
    compare_runs(results[case], results["ref4"], LOSS_TOL, WEIGHT_TOL, NORM_RTOL)
    assert results[case]["recv_buffers"] == 0


def test_pipeline_zero3_gathers_parameters_once_per_step(results) -> None:
    """Under pp, ZeRO-3's FSDP modules do not reshard after forward (parallel.data.reshard_after_forward): each gathers
    its parameters once in a step of 4 micro-batches. Plain dp ZeRO-3 still reshards its blocks after forward and
    gathers them again for backward."""
    pp = results["pp2dp2_zero3"]
    assert pp["fsdp"] and not any(pp["fsdp"].values()), pp["fsdp"]
    assert pp["gathers"] == len(pp["fsdp"])
    dp = results["dp2_zero3"]
    blocks = {k: v for k, v in dp["fsdp"].items() if k.startswith("layers.")}
    assert blocks and all(blocks.values()), dp["fsdp"]
    assert dp["gathers"] >= len(dp["fsdp"]) + len(blocks)


def test_reference_learns(results) -> None:
    losses = results["ref"]["losses"]
    assert losses[-1] < losses[0] - 0.1  # a test that compares equal nothings would pass; this one would not


@pytest.mark.parametrize("case", ["dp2_zero3_bf16", "pp2_bf16"])
def test_bf16_within_looser_tolerance(results, case) -> None:
    compare_runs(results[case], results["ref"], BF16_LOSS_TOL, None, BF16_NORM_RTOL)
    assert results[case]["losses"] != results["ref"]["losses"]  # it really ran in bf16


def test_fp16_skips_the_poisoned_step(results) -> None:
    r = results["dp2_fp16_inf"]
    assert r["skipped"] == [False, False, True, False, False, False, False, False]
    assert r["scales"][2] == r["scales"][1] / 2  # the scale halves on overflow
    assert all(torch.isfinite(w).all() for w in r["weights"].values())
    # before the poisoned step it is the reference run in fp16; afterwards it has lost one update but learns on
    assert max(abs(a - b) for a, b in zip(r["losses"][:3], results["ref"]["losses"][:3])) <= BF16_LOSS_TOL
    assert r["losses"][-1] < r["losses"][3] - 0.05
    # the norm too: the reference's in fp16 before the poisoned step, inf on it (never reaching the weights)
    assert max(norm_errors(r["grad_norms"][:2], results["ref"]["grad_norms"][:2])) <= BF16_NORM_RTOL
    assert r["grad_norms"][2] == float("inf") and all(math.isfinite(n) for n in r["grad_norms"][3:])
