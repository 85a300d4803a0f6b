"""Pure tier for the planner's time model (hpctrain/planner/timing.py): the FLOPs formulas against ModelDims and the
Megatron papers' equations, the pipeline bubble, how each communication term scales, and the validation the issue
asks for: predicted TFLOP/s per GPU against every published run in tests/data/published_runs.json, within 15%.
Importing without torch: tests/multiproc/planner/test_planner_no_torch.py.

    # -s: the table
    PATH=$PWD/.venv/bin:$PATH .venv/bin/python -m pytest -q -s tests/pure/planner/test_planner_timing.py

Validation protocol. The one fitted constant, timing.EFFICIENCY, is the geometric mean of the efficiency each A100
row needs (CALIBRATION); the H100 rows never touch it and are reported separately (validation). Each row is compared
in the FLOPs it reports: hardware TFLOP/s (recomputation counted: Megatron eq. 3, BLOOM) against the model's
hardware TFLOP/s, model TFLOP/s (MFU basis) against its model TFLOP/s; rows giving only MFU (x 312) or tokens/s per
GPU (x model FLOPs per token) are turned into model TFLOP/s. Both sides then use the same formula, so a ratio is
the ratio of step times. What a row leaves null is filled by one rule for all: micro-batch 1, one virtual stage
(1F1B), 16-bit precision, recompute "none", sequence parallel off; per-row facts from the rows' notes are in FACTS.
Rows missing 15% after this honest model are listed, with the reason, in KNOWN_MISSES; no row is skipped.
"""
from __future__ import annotations

import dataclasses
import json
import math

import pytest

from helpers.launch import REPO
from hpctrain.model.dims import ModelDims
from hpctrain.planner import timing
from hpctrain.planner.hardware import profile
from hpctrain.planner.timing import Shape, bubble_fraction, estimate, flops_per_token, hardware_flops_per_token

RUNS = json.loads((REPO / "tests/data/published_runs.json").read_text())["runs"]
TOLERANCE = 0.15
A100_PEAK = 312.0

# What each row's notes state beyond its columns (not tuned: each entry cites the note it comes from).
FACTS = {
    # Megatron-LM 2021/2022 did not overlap the gradient all-reduce with backward (Korthikanti 530B note says so)
    "megatron-sc21-gpt-1.7b-dp32": {"dp_overlap": False},
    "megatron-sc21-gpt-18.4b-tp8-dp32": {"dp_overlap": False},
    "megatron-sc21-gpt-1t-tp8-pp64-dp6": {"dp_overlap": False},
    "korthikanti-22b-tp8": {"dp_overlap": False},
    "korthikanti-gpt3-175b-tp8-pp8": {"dp_overlap": False},
    "korthikanti-530b-tp8-pp35-dp8": {"dp_overlap": False},
    "bloom-176b-tp4-pp12-dp8": {"dp_overlap": False},  # Megatron-DeepSpeed, same reduction after backward
    # recompute not stated, but eq. 3 (the reported figure) counts a recompute forward: compare on that basis
    "megatron-sc21-gpt3-175b-zero3-dp384": {"recompute": "full"},
    "mpt-7b-fsdp-a100-40g-128": {"reduce_dtype": "bf16"},  # FSDP mixed precision 'PURE': bf16 reductions
    # Megatron-Core r0.8.0: --tp-comm-overlap, --overlap-grad-reduce, distributed optimizer (ZeRO-1-like)
    "megatron-core-gpt-7.1b-tp2-dp48": {"tp_overlap": True, "zero_stage": 1},
    "megatron-core-gpt-177b-tp8-pp6-dp48": {"tp_overlap": True, "zero_stage": 1},
    "megatron-core-gpt-462b-tp8-pp16-dp48": {"tp_overlap": True, "zero_stage": 1},
    "llama3-405b-tp8-pp16-dp64-8192gpu": {"zero_stage": 2},  # FSDP, parameters not resharded after forward
}
CALIBRATION = [r["id"] for r in RUNS if r["gpu"].startswith("a100")]
KNOWN_MISSES = {
    "megatron-sc21-gpt-1.7b-dp32": "+20%: hidden size 2304, the smallest; memory-bound kernels (unfused softmax over "
    "24 heads x 2048 keys, layer norms, GeLU, dropout) grow against GEMMs as 1/dim, which one constant cannot follow",
    "megatron-sc21-gpt3-175b-zero3-dp384": "+17%: DeepSpeed ZeRO-3's per-parameter gather/partition overheads are not "
    "modelled (its all-gathers are taken as hidden behind compute); recompute not stated (assumed full, as eq. 3)",
    "mpt-7b-fsdp-a100-40g-128": "-18%: flash attention, no tensor parallel, bf16 FSDP: HFU 0.67 is far above the "
    "Megatron-era rows that set the single efficiency constant",
    "llama3-405b-tp8-pp16-dp64-8192gpu": "-22%: virtual stages not given, so 1F1B is assumed: a (p-1)/m = 15/32 "
    "bubble; the paper ran an interleaved schedule (v >= 2 would bring the row within 15%)",
    "torchtitan-llama3.1-8b-fsdp128": "+51%: hosts with 96 GB HBM2e H100s at 500 W, whose peak the source says is "
    "below SXM (unknown); its op-level SAC policy (every second matmul's forward again) is counted as 'op'",
    "torchtitan-llama3-70b-fsdp32-tp8": "+16%: the same 500 W HBM2e H100 hosts, peak below the SXM figure used",
}


def shape_of(row) -> Shape:
    m = row["model"]
    return Shape(m["n_layers"], m["dim"], m["ffn_dim"], m["n_heads"], m["n_kv_heads"], m["vocab_size"],
                 "gelu" if m["activation"] == "gelu" else "swiglu", bool(m["tied_embeddings"]))


def predict(row, efficiency=None):
    """(predicted, published, kind) TFLOP/s per GPU for a row, in the FLOPs the row reports."""
    m, lay, b, rep = row["model"], row["layout"], row["batch"], row["reported"]
    v = lay["virtual_stages"] or 1
    zero = lay["zero_stage"] or (3 if lay["fsdp"] else 0)  # an FSDP row without a stage: full sharding
    kw = dict(seq_len=m["seq_len"], global_batch=b["global_batch_seqs"], micro_batch=b["micro_batch_seqs"] or 1,
              tp=lay["tp"], pp=lay["pp"], dp=lay["dp"], virtual_stages=v,
              schedule="interleaved_1f1b" if v > 1 else "1f1b", zero_stage=zero,
              sequence_parallel=bool(lay["sequence_parallel"]), recompute=row["recompute"] or "none",
              precision=row["precision"] or "bf16", efficiency=efficiency) | FACTS.get(row["id"], {})
    est = estimate(shape_of(row), profile(row["gpu"]), **kw)
    if rep["tflops_per_gpu"] is not None:
        hardware = rep["tflops_kind"] in ("hardware", "source-formula")  # source-formula here: eq. 3, recompute in
        return (est.hardware_tflops_per_gpu if hardware else est.model_tflops_per_gpu), rep["tflops_per_gpu"], \
            ("hardware" if hardware else "model")
    if rep["mfu"] is not None:
        assert row["gpu"].startswith("a100")
        return est.model_tflops_per_gpu, rep["mfu"] * A100_PEAK, "model (mfu)"
    per_token = flops_per_token(m["n_layers"], m["dim"], m["ffn_dim"], m["n_heads"], m["n_kv_heads"], m["vocab_size"],
                                m["seq_len"], shape_of(row).mlp)
    return est.model_tflops_per_gpu, rep["tokens_per_s_per_gpu"] * per_token / 1e12, "model (tokens/s)"


def needed_efficiency(row) -> float:
    lo, hi = 0.05, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        pred, pub, _ = predict(row, mid)
        lo, hi = (lo, mid) if pred > pub else (mid, hi)
    return (lo + hi) / 2


def test_efficiency_is_the_a100_calibration():
    assert len(CALIBRATION) == 9
    needed = [needed_efficiency(r) for r in RUNS if r["id"] in CALIBRATION]
    assert round(math.exp(sum(map(math.log, needed)) / len(needed)), 2) == timing.EFFICIENCY


def test_published_runs_within_15_percent():
    rows, misses = [], set()
    for row in RUNS:
        pred, pub, kind = predict(row)
        ratio = pred / pub
        ok = abs(ratio - 1) <= TOLERANCE
        misses |= set() if ok else {row["id"]}
        lay = row["layout"]
        rows.append((row, pred, pub, ratio, kind, ok, f"tp{lay['tp']} pp{lay['pp']} dp{lay['dp']}"))
    print(f"\n{'id':40} {'gpu':9} {'layout':15} {'kind':17} {'pred':>6} {'pub':>6} ratio  set")
    for row, pred, pub, ratio, kind, ok, lay in rows:
        group = "calibration" if row["id"] in CALIBRATION else "validation"
        flag = "" if ok else "  MISS (known)" if row["id"] in KNOWN_MISSES else "  MISS"
        print(f"{row['id']:40} {row['gpu']:9} {lay:15} {kind:17} {pred:6.1f} {pub:6.1f} {ratio:5.3f}  "
              f"{group}{flag}")
    for group in ("calibration", "validation"):
        errs = [abs(r[3] - 1) for r in rows if (r[0]["id"] in CALIBRATION) == (group == "calibration")]
        print(f"{group}: {sum(e <= TOLERANCE for e in errs)}/{len(errs)} within 15%, median |error| "
              f"{sorted(errs)[len(errs) // 2]:.1%}")
    assert misses == set(KNOWN_MISSES)  # a row that starts or stops missing must be looked at, not absorbed
    passed = [(r[0], r[6]) for r in rows if r[5]]
    assert len(passed) >= 8
    for gpu in ("a100", "h100"):
        mine = [r for r, _ in passed if r["gpu"].startswith(gpu)]
        assert any(r["layout"]["tp"] > 1 for r in mine) and any(r["layout"]["pp"] > 1 for r in mine)
        assert any(r["layout"]["dp"] > 1 for r in mine)


def test_model_flops_equal_model_dims():
    for tied in (False, True):
        dims = ModelDims(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                         max_seq_len=8192, tie_embeddings=tied)
        shape = Shape.of(dims)
        for s in (2048, 8192):
            want = dims.flops_per_token(s)
            assert flops_per_token(32, 4096, 14336, 32, 8, 128256, s) == pytest.approx(want, rel=1e-12)
            assert hardware_flops_per_token(shape, s, "none") == pytest.approx(want, rel=1e-12)


def test_gpt_flops_equal_megatron_equations():
    L, h, V, s = 96, 12288, 51200, 2048
    gpt = Shape(L, h, 4 * h, 96, 96, V, "gelu", True)
    model = 72 * L * h**2 * (1 + s / (6 * h) + V / (12 * L * h))  # Korthikanti eq. 7 per token (B s = 1)
    assert flops_per_token(L, h, 4 * h, 96, 96, V, s, "gelu") == pytest.approx(model, rel=1e-12)
    eq3 = 96 * L * h**2 * (1 + s / (6 * h) + V / (16 * L * h))  # Narayanan et al. eq. 3: full recompute
    assert hardware_flops_per_token(gpt, s, "full") == pytest.approx(eq3, rel=1e-12)
    selective = hardware_flops_per_token(gpt, s, "attention-core") - hardware_flops_per_token(gpt, s, "none")
    assert selective == pytest.approx(4 * L * h * s)  # QK^T and AV forward once more
    # hpctrain's ac = "every": blocks 0, k, 2k, ... of 96 -> 48 (k = 2) or 32 (k = 3) of them recomputed in full
    full_extra = eq3 - model
    for k, share in ((1, 1.0), (2, 0.5), (3, 1 / 3)):
        every = hardware_flops_per_token(gpt, s, "every", ac_every=k) - model
        assert every == pytest.approx(share * full_extra)


def test_fused_projections_recompute_o_and_down_under_op():
    """train.ac = "op" recomputes every other matmul: k, o and the MLP's second of separate projections, o and down
    of fused ones (model.fused_projections: q/k/v, o, gate/up, down); the plan's own estimate models fused ones'
    tensor-parallel traffic as Megatron's (one input gradient per fused matmul)."""
    import dataclasses

    from hpctrain.config import load_config
    from hpctrain.parallel import mesh
    from hpctrain.parallel.plan import make_plan
    from hpctrain.planner.report import time_estimate

    dims = ModelDims(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                     max_seq_len=8192, tie_embeddings=False)
    separate, fused = Shape.of(dims), Shape.of(dataclasses.replace(dims, fused_projections=True))
    assert fused.fused and not separate.fused
    none = hardware_flops_per_token(separate, 8192, "none")
    assert hardware_flops_per_token(fused, 8192, "none") == none
    assert hardware_flops_per_token(separate, 8192, "op") - none == pytest.approx(32 * 2 * 4096 * (1024 + 4096 + 14336))
    assert hardware_flops_per_token(fused, 8192, "op") - none == pytest.approx(32 * 2 * 4096 * (4096 + 14336))
    terms = {}
    for flag in ("false", "true"):
        cfg = load_config(None, ["model.dim=256", "model.n_heads=8", "model.n_layers=4", "parallel.tp=4",
                                 "job.tasks_per_node=4", f"model.fused_projections={flag}", "train.micro_batch_size=1"])
        plan = make_plan(cfg, mesh.block_placement(cfg.job.nodes, cfg.job.tasks_per_node), training=True)
        terms[flag] = time_estimate(cfg, plan, profile("h100-sxm")).terms["tp_comm_total_s"]
    # per block 2 forward + 5 (separate) or 2 (fused) backward all-reduces, and the 2 of the embedding and logits
    assert terms["true"] / terms["false"] == pytest.approx((4 * 4 + 2) / (4 * 7 + 2))


def test_bubble():
    assert bubble_fraction(1, 8) == 0.0
    assert bubble_fraction(4, 8) == pytest.approx(3 / 8)
    assert bubble_fraction(4, 8, 2, "interleaved_1f1b") == pytest.approx(3 / 16)
    assert bubble_fraction(4, 8, 2, "gpipe") == pytest.approx(3 / 8)
    assert bubble_fraction(8, 64, 3, "interleaved_1f1b") == pytest.approx(7 / 192)
    assert bubble_fraction(4, 8, 2, "zbv") == 0.0
    for p, m, v in ((4, 8, 1), (8, 32, 2), (16, 32, 4)):  # as a share of the step: StagePlan.bubble_theory's
        b = bubble_fraction(p, m, v, "interleaved_1f1b")
        assert b / (1 + b) == pytest.approx((p - 1) / (v * m + p - 1))


LLAMA = Shape(32, 4096, 14336, 32, 8, 128256)


def run(hw=None, **kw):
    args = dict(seq_len=4096, global_batch=64, micro_batch=1, tp=8, pp=2, dp=4, zero_stage=3) | kw
    return estimate(LLAMA, hw or profile("h100-sxm"), **args)


def test_communication_scaling():
    base = run()
    fast_intra = run(profile("h100-sxm", {"intra_node_gbps": 900}))
    fast_inter = run(profile("h100-sxm", {"inter_node_gbps": 100}))
    assert fast_intra.terms["tp_comm_total_s"] == pytest.approx(base.terms["tp_comm_total_s"] / 2)
    assert fast_inter.terms["dp_comm_total_s"] == pytest.approx(base.terms["dp_comm_total_s"] / 2)  # dp: 1 per node
    assert fast_inter.terms["p2p_s"] == pytest.approx(base.terms["p2p_s"] / 2)  # a stage fills 4 nodes
    assert fast_inter.terms["compute_s"] == base.terms["compute_s"]
    assert run(tp=1, dp=32).terms["tp_comm_total_s"] == 0.0
    assert run(dp=1, global_batch=16).terms["dp_comm_total_s"] == 0.0
    flat = run(pp=1, tp=8, dp=8)
    assert flat.terms["pp_bubble_s"] == 0.0 and flat.terms["p2p_s"] == 0.0
    # per micro-batch on a stage of 16 blocks: 4 all-reduces a block, +1 at the end it holds (embedding or logits)
    one = base.terms["tp_comm_total_s"] / (4 * 16 + 1)
    assert run(recompute="full").terms["tp_comm_total_s"] == pytest.approx(one * (6 * 16 + 1))
    assert run(recompute="every", ac_every=2).terms["tp_comm_total_s"] == pytest.approx(one * (5 * 16 + 1))
    assert run(recompute="attention-core").terms["tp_comm_total_s"] == base.terms["tp_comm_total_s"]
    # separate q, k, v, gate and up projections reduce 5 input gradients a block in backward, unless sequence
    # parallel gathers the block input once; without pipeline parallel both ends are on the one stage
    assert run(tp_projections="separate").terms["tp_comm_total_s"] == pytest.approx(one * (7 * 16 + 1))
    assert run(tp_projections="separate", sequence_parallel=True).terms == base.terms
    assert run(pp=1, dp=8).terms["tp_comm_total_s"] == pytest.approx(one * (4 * 32 + 2) / 2)  # and m halves
    # tp 2 x dp 4 fits one 8-GPU node: the dp group runs on NVLink and ignores the NIC
    inside = run(tp=2, dp=4, pp=1, global_batch=16)
    assert inside.basis["dp_link_gbps"] == 450
    assert run(profile("h100-sxm", {"inter_node_gbps": 1}), tp=2, dp=4, pp=1, global_batch=16).terms == inside.terms
    assert run(tp=2, dp=16, pp=1, global_batch=64).basis["dp_link_gbps"] == 4 * 50  # 4 ranks per node, 4 NICs


def test_fsdp_accumulating_whole_gradients_reduces_once():
    per_micro, once = run(accumulate_unsharded=False), run(accumulate_unsharded=True)
    m = per_micro.basis["microbatches"]
    gather, reduce = 2 * 2, 4  # bytes per parameter: bf16 all-gathers forward and backward, fp32 reduce-scatter
    assert once.terms["dp_comm_total_s"] == pytest.approx(
        per_micro.terms["dp_comm_total_s"] * (m * gather + reduce) / (m * (gather + reduce)))
    assert run(zero_stage=2, accumulate_unsharded=True).terms == run(zero_stage=2).terms  # ZeRO-3 only


def test_overlap_hides_at_most_the_compute():
    slow = profile("h100-sxm", {"inter_node_gbps": 0.5, "intra_node_gbps": 5})
    for kw in ({"zero_stage": 0}, {"zero_stage": 1}, {"zero_stage": 3}, {"tp_overlap": True}):
        est = run(slow, **kw)
        t = est.terms
        assert t["dp_comm_total_s"] - t["compute_s"] <= t["dp_comm_s"] <= t["dp_comm_total_s"]
        assert t["tp_comm_total_s"] - t["compute_s"] <= t["tp_comm_s"] <= t["tp_comm_total_s"]
        assert t["dp_comm_s"] > 0
        exposed = sum(v for k, v in t.items() if not k.endswith("_total_s"))
        assert est.step_time_s == pytest.approx(exposed)
    hidden, exposed = run(dp_overlap=True), run(dp_overlap=False)
    assert hidden.terms["dp_comm_s"] < exposed.terms["dp_comm_s"] == exposed.terms["dp_comm_total_s"]


def test_outputs_consistent():
    est = run(recompute="full")
    gpus = 8 * 2 * 4
    assert est.tokens_per_s == pytest.approx(64 * 4096 / est.step_time_s)
    assert est.model_tflops_per_gpu == pytest.approx(LLAMA_FLOPS * est.tokens_per_s / gpus / 1e12)
    assert est.mfu == pytest.approx(est.model_tflops_per_gpu / (1979 / 2))
    assert est.hfu > est.mfu and est.hfu <= timing.EFFICIENCY
    assert json.loads(json.dumps(est.to_json()))["terms"]["compute_s"] == est.terms["compute_s"]
    fp8, bf16 = run(precision="fp8"), run()
    # the FLOPs' part (the narrow matmuls' is memory's): the blocks' linears at twice bf16's peak, attention's core
    # and the output projection at bf16's
    blocks = 32 * timing.block_flops(LLAMA, 4096)  # pp 2: the stages' average, 16 blocks and half the head each
    linear = blocks * timing.block_linear_share(LLAMA, 4096)
    head = 6.0 * LLAMA.vocab * LLAMA.dim
    assert fp8.terms["compute_s"] - fp8.basis["gemm_memory_s"] == pytest.approx(
        (bf16.terms["compute_s"] - bf16.basis["gemm_memory_s"]) * (linear / 2 + blocks - linear + head)
        / (blocks + head))
    # MFU against the peak of the same mix (Hardware.float8_peak): fp8's FLOPs share the bf16 run's, in less time
    assert fp8.mfu == pytest.approx(fp8.model_tflops_per_gpu / profile("h100-sxm").float8_peak(
        6 * 32 * LLAMA.block_weights() / LLAMA_FLOPS))
    assert fp8.mfu < fp8.model_tflops_per_gpu / (1979 / 2)


def test_narrow_matmuls_run_at_the_memory_rate():
    """A block matmul whose bytes take longer at the GPU memory's bandwidth than its FLOPs at the achievable peak
    adds the difference: nil for Llama 3 8B's shapes on tp 1; on tp 8 its K and V projections (8 KV heads: one
    head of 128 columns a rank) over 1,024 tokens are memory-bound, and fusing q/k/v (one read of the input) costs
    less; a CPU profile (no hbm_gbps) models none."""
    wide = estimate(LLAMA, profile("h100-sxm"), seq_len=4096, global_batch=8, micro_batch=1, tp=1, dp=8)
    assert wide.basis["gemm_memory_s"] == 0.0
    narrow = estimate(LLAMA, profile("h100-sxm"), seq_len=1024, global_batch=8, micro_batch=1, tp=8, dp=1)
    assert narrow.basis["gemm_memory_s"] > 0
    gemms = timing.block_gemms(LLAMA, 1024, 8)
    assert (1024, 4096, 128) in gemms and sum(2 * m * k * n for m, k, n in gemms) * 3 == pytest.approx(
        6 * LLAMA.block_weights() / 8 * 1024)  # the block's matmul FLOPs, forward and backward, on one tp rank
    fused = estimate(dataclasses.replace(LLAMA, fused=True), profile("h100-sxm"), seq_len=1024, global_batch=8,
                     micro_batch=1, tp=8, dp=1)
    assert 0 <= fused.basis["gemm_memory_s"] < narrow.basis["gemm_memory_s"]
    cpu = profile("h100-sxm").with_overrides()  # the same figures without the memory's bandwidth
    no_hbm = estimate(LLAMA, dataclasses.replace(cpu, hbm_gbps=None), seq_len=1024, global_batch=8, micro_batch=1,
                      tp=8, dp=1)
    assert no_hbm.basis["gemm_memory_s"] == 0.0
    assert narrow.step_time_s - no_hbm.step_time_s == pytest.approx(narrow.basis["gemm_memory_s"], rel=1e-6)


LLAMA_FLOPS = flops_per_token(32, 4096, 14336, 32, 8, 128256, 4096)


def test_rejects_bad_input():
    with pytest.raises(ValueError, match="precision"):
        run(precision="int4")
    with pytest.raises(ValueError, match="not a multiple"):
        run(global_batch=6)
    with pytest.raises(ValueError, match="recompute"):
        run(recompute="sometimes")
    with pytest.raises(ValueError, match="efficiency"):
        run(efficiency=1.5)
    with pytest.raises(ValueError, match="fp8"):
        run(profile("a100-80g"), precision="fp8")




def test_float8_gathers_move_a_byte_a_block_weight():
    """train.fp8_all_gather: FSDP's gathers move the blocks' linear weights in 1 byte, the embeddings and the output
    projection in bf16's 2; the gradients' reduce-scatter is unchanged."""
    base = dict(seq_len=4096, global_batch=64, micro_batch=1, dp=64, zero_stage=3, precision="fp8",
                accumulate_unsharded=True)
    bf16_gather = estimate(LLAMA, profile("h100-sxm"), **base)
    fp8_gather = estimate(LLAMA, profile("h100-sxm"), **base, float8_gather=True)
    blocks = 32 * LLAMA.block_weights() / LLAMA.params()
    m = 1  # one micro-batch a step: gathered twice (forward, backward), reduced once in fp32
    assert fp8_gather.terms["dp_comm_total_s"] / bf16_gather.terms["dp_comm_total_s"] == pytest.approx(
        (2 * m * (2 - blocks) + 4) / (2 * m * 2 + 4))
    assert fp8_gather.terms["compute_s"] == bf16_gather.terms["compute_s"]
