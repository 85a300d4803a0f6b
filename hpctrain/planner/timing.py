"""Time model of the planner: the step time, throughput, MFU and HFU of one parallel layout, from the model's shape
and a hardware profile, before any GPU time is spent. Pure: no torch (the planner runs on a login node).

    est = estimate(Shape.of(dims), profile("h100-sxm"), seq_len=8192, global_batch=512, micro_batch=1, tp=8, dp=32)
    est.step_time_s, est.tokens_per_s, est.mfu, est.terms    # terms: the seconds behind the step, for --json

FLOPs per token (a token of one sequence of length s; d = dim, L = layers, V = vocabulary):
- model FLOPs, the MFU basis (PaLM; = ModelDims.flops_per_token): 6 per weight of every matmul (forward 2, backward
  4: block projections and the output/logit layer; embedding lookups, norms, biases and position tables are not
  matmuls) + 12 L d s for attention scores and values (causal mask not discounted). A block's matmul weights are
  2 d (q + kv) + 3 d f for SwiGLU and 2 d (q + kv) + 2 d f for a 2-matrix GELU MLP.
- hardware FLOPs add what recomputation runs again: "full" one more forward of every block (2 per block weight +
  4 d s), "every" that on every k-th block (hpctrain's train.ac_every), "selective" no matmul (hpctrain's: norms,
  rotary and SwiGLU again), "op" the forward of every other matmul (k, o and the MLP's second: hpctrain's
  train.ac = "op"; with fused projections o and down), "attention-core" the attention core's forward only (4 d s
  per layer; Megatron's selective recompute, for published runs); the logit layer is never recomputed.
  For a GPT block this reproduces Narayanan et al. 2021 eq. 3 (96 L d^2 + 16 L d s + 6 V d per token).
Times per optimizer step, on the busiest GPU (m = global_batch / (dp b) micro-batches of b sequences):
- compute = the stage's hardware FLOPs / (EFFICIENCY x dense peak of the precision's matmul dtype). The stage runs
  max(ceil(L / (p v)) v blocks, (L blocks + head) / p): whole layers, the head balanced as BLOOM and Llama 3 did.
- narrow GEMMs: a block's matmul of T = b s / cp tokens (sequence parallel gathers them) by k by n (n or k the tp
  shard) moves e (T k + k n + T n) bytes (e: the activations' bytes); where those take longer at the profile's GPU
  memory bandwidth (Hardware.hbm_gbps, datasheet) than its 2 T k n FLOPs at the achievable peak, the matmul runs at
  the memory's rate: the difference, for forward, both backward matmuls and a recomputed forward, is added to the
  compute (basis["gemm_memory_s"] says how much). Nil for every published run here (their shards are hundreds of
  columns wide over thousands of tokens); it is what makes a small model or a narrow tp shard run below the
  large-GEMM rate.
- bubble = compute x (p - 1) / (v m) for GPipe, 1F1B and interleaved (= StagePlan.bubble_theory's idle share
  (p-1)/(vm+p-1) of the step, reimplemented: parallel/pipeline imports torch); 0 for zero-bubble schedules.
- tensor parallel, per block and micro-batch: 2 all-reduces forward + 2 backward (+2 per recomputed block) of
  b s d activation bytes, ring cost 2 (t-1)/t x size / link; sequence parallel swaps each for an all-gather plus
  a reduce-scatter, the same volume. Backward's 2 assume fused projections (tp_projections="fused": Megatron's
  one QKV and one gate/up matrix, and hpctrain's with model.fused_projections); with "separate" ones (hpctrain's
  default DTensor plan: wq, wk, wv, w1, w3 each a ColwiseParallel module) each projection's input gradient is
  all-reduced on its own, 5 per block, unless sequence parallel gathers the block's input once. Plus per
  micro-batch the embedding's forward all-reduce and the logit layer's backward one (one of them on a pipeline
  stage). The link is NVLink while tp fits in a node.
  Exposed unless tp_overlap (then only what exceeds the compute is).
- data parallel, on the stage's parameters P (params / (t p)), N = dp: DDP 2 (N-1)/N P g once per step (g: grad
  reduce bytes, fp32 by default as hpctrain's train.reduce_dtype); ZeRO-1/2 a reduce-scatter of grads plus an
  all-gather of 16-bit params (hpctrain's ZeRO-1, zero1_broadcast: an all-reduce of grads and a broadcast of the
  fp32 params, (N-1)/N P (2 g + 4)); ZeRO-3/FSDP per micro-batch an all-gather forward, again backward, and a reduce-
  scatter (once per step with accumulate_unsharded, as hpctrain accumulates whole gradients). Layout (hpctrain's
  and Megatron's): tp innermost in a node, then dp, then pp. A dp group with k = gpus_per_node / t ranks per node
  that spans nodes runs at min(NVLink, k x NIC) (its k ranks use k NICs; NCCL runs one ring per NIC), else on
  NVLink.
  HSDP (dp_replicate R): FSDP's traffic in the shard group of N / R ranks, plus each rank's gradient shard
  (P / (N / R)) all-reduced over its R replicas once per step (2 (R-1)/R of it), on a NIC once the dp group spans
  nodes (the replicas of a node's shard groups share its NICs).
  With dp_overlap the collectives hide behind compute (ZeRO-0-2: one micro-batch's, ZeRO-3: every micro-batch's)
  except the last block's share (a bucket cannot start before its gradients exist), or under DDP its last
  bucket's all-reduce (ddp_bucket_mb).
- pipeline point-to-point: per micro-batch and virtual stage one send forward and one backward of b s d / t bytes
  (Megatron's scatter-gather, or sequence parallel shards), on the NIC when a stage fills a node.
- context parallel (cp): each rank computes its share of every sequence (s / cp tokens, the causal work balanced),
  the data replicas are dp and the gradient group dp x cp; per block and micro-batch the ring sends the K/V shard
  cp - 1 hops forward (hidden behind the attention blocks' compute where it is shorter) and again in backward with
  the fp32 K/V gradients, which take one more hop home (not overlapped: hpctrain's RingAttention waits for them);
  on NVLink while cp x tp fits in a node, else on a NIC.
- CPU offload "all" (FSDP's CPUOffloadPolicy): per step each rank's fp32 shards travel to the GPU for every gather
  (2 per micro-batch under ZeRO-3, once under ZeRO-2) and its gradient shards back after every micro-batch's
  reduce-scatter, over the GPU's host link (Hardware.host_link_gbps, PCIe); hidden behind the compute where it is
  shorter, except one block's share. "optimizer": the step's fp32 gradients down, the host's step and the
  parameters up, pipelined over HOST_BUCKET_BYTES buckets (a bucket's three stages, then the slowest stage per
  further bucket), exposed. The optimizer's step on the host, exposed, where the host memory's bandwidth per node
  is given (Hardware.host_memory_gbps: HOST_ADAMW_BYTES per parameter of the node's ranks); without it, not
  modelled.
- host: host_step_s + (host_block_s + host_token_s x b s / cp x d / t) x blocks x m, the host's own work where it
  does not overlap the compute (0 on GPUs; a CPU calibration's Hardware.host_*_s): per step, per block and
  micro-batch, and (tensor parallel's, Hardware.host_tp_token_s) per token and unit of the rank's width.
Links run at the profile's figures: datasheet ceilings unless `hpctrain bench` measured them, so communication is
optimistic on datasheet profiles. Not modelled: the optimizer step (apart from a CPU's host terms), data loading,
collectives slowing concurrent GEMMs, kernel launch gaps, stragglers, network congestion. fp8 runs the blocks'
linears at the fp8 peak and the rest (attention's scores and values, the output projection) at bf16's, as
torchao's Float8Linear on the blocks does (Hardware.float8_peak: MFU's peak too), and communicates in bf16, but
for FSDP's gathers of the blocks' weights under train.fp8_all_gather (float8_gather: a byte a weight).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from hpctrain.config.sections import HOST_BUCKET_BYTES
from hpctrain.parallel.recompute import recomputed_blocks
from hpctrain.planner.hardware import Hardware

# EFFICIENCY: the achievable share of the dense peak in a training step's compute, i.e. the GEMMs plus the memory-
# bound kernels between them (norms, activations, softmax, dropout, optimizer): the hardware FLOP/s a run would
# reach with its communication hidden. One constant for every GPU, calibrated on the A100 rows of
# tests/data/published_runs.json (the geometric mean of the efficiency each row needs under this model; the test
# re-derives it) and validated on the H100 rows, which did not influence it. It is lower than what one large GEMM
# reaches because the step's other kernels are memory-bound. Not validated on AMD parts or on CPU (whose "peak" is
# already a measured GEMM rate: a calibration measures its own, Hardware.efficiency).
EFFICIENCY = 0.54
MATMUL_DTYPE = {"bf16": "bf16", "fp16": "fp16", "fp32": "fp32", "fp8": "fp8"}  # precision -> dtype of its GEMMs
ACT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 2}  # activations and gathered parameters (fp8: bf16 comm)
REDUCE_BYTES = {"fp32": 4, "bf16": 2}
HOST_ADAMW_BYTES = 32  # host memory traffic of one parameter's AdamW step: fp32 master r+w, grad r, moments r+w
# hpctrain's train.ac modes ("every": blocks 0, k, 2k, ...), and Megatron's selective recompute of published runs
RECOMPUTE = ("none", "full", "every", "selective", "op", "attention-core")
ZERO_BUBBLE = ("interleaved_zero_bubble", "zbv")
TP_PROJECTIONS = ("fused", "separate")  # see "tensor parallel" in the module docstring


@dataclass(frozen=True)
class Shape:
    """What the time model needs of a model; `of` takes it from a ModelDims (SwiGLU)."""
    n_layers: int
    dim: int
    ffn_dim: int
    n_heads: int
    n_kv_heads: int
    vocab: int
    mlp: str = "swiglu"  # "swiglu" (3 matrices) | "gelu" (2 matrices)
    tied: bool = False
    fused: bool = False  # q/k/v and gate/up as one matmul each (hpctrain's model.fused_projections)

    @staticmethod
    def of(dims) -> Shape:
        return Shape(dims.n_layers, dims.dim, dims.ffn_dim, dims.n_heads, dims.n_kv_heads, dims.vocab_size,
                     dims.mlp, dims.tie_embeddings, dims.fused_projections)

    def block_weights(self) -> int:
        """Weights of one block's matmuls."""
        if self.mlp not in ("swiglu", "gelu"):
            raise ValueError(f"mlp = {self.mlp!r}: expected 'swiglu' or 'gelu'")
        head_dim = self.dim // self.n_heads
        q, kv = self.n_heads * head_dim, self.n_kv_heads * head_dim
        return 2 * self.dim * (q + kv) + (3 if self.mlp == "swiglu" else 2) * self.dim * self.ffn_dim

    def params(self) -> int:
        """Parameters to synchronise (norms and biases left out: under 0.1%)."""
        return self.n_layers * self.block_weights() + self.vocab * self.dim * (1 if self.tied else 2)


def flops_per_token(n_layers: int, dim: int, ffn_dim: int, n_heads: int, n_kv_heads: int, vocab: int, seq_len: int,
                    mlp: str = "swiglu") -> float:
    """Model FLOPs per trained token (the MFU basis): 6 x matmul weights + 12 L d s."""
    shape = Shape(n_layers, dim, ffn_dim, n_heads, n_kv_heads, vocab, mlp)
    return 6.0 * (n_layers * shape.block_weights() + vocab * dim) + 12.0 * n_layers * dim * seq_len


def block_linear_share(shape: Shape, seq_len: int) -> float:
    """The share of a block's FLOPs in its linear layers (the rest: attention's scores and values)."""
    linear = 6.0 * shape.block_weights()
    return linear / (linear + 12.0 * shape.dim * seq_len)


def recomputed_share(n_layers: int, recompute: str, ac_every: int = 2) -> float:
    """Share of the blocks whose whole forward runs twice: those hpctrain.parallel.recompute.recomputed_blocks names
    (all for "full", ceil(L / k) of L for "every", k = ac_every), over L."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute = {recompute!r}: expected one of {', '.join(RECOMPUTE)}")
    if ac_every < 1:
        raise ValueError(f"ac_every = {ac_every} must be >= 1")
    whole = recompute if recompute in ("full", "every") else "none"  # the others recompute no whole block
    return len(recomputed_blocks(n_layers, whole, ac_every)) / n_layers


def block_flops(shape: Shape, seq_len: int, recompute: str = "none", ac_every: int = 2) -> float:
    """FLOPs per token of one (average) block, recomputation included: hardware FLOPs; "none" gives model FLOPs."""
    attn = 4.0 * shape.dim * seq_len  # forward of QK^T and AV
    full = recomputed_share(shape.n_layers, recompute, ac_every)
    extra = full * (2.0 * shape.block_weights() + attn)
    if recompute == "attention-core":
        extra = attn
    elif recompute == "op":  # the 2nd, 4th and 6th of the block's matmuls: k, o, and up (SwiGLU) or down (GELU);
        head_dim = shape.dim // shape.n_heads  # fused projections (4 matmuls): the 2nd and 4th, o and down
        kv = 0 if shape.fused else shape.n_kv_heads * head_dim
        extra = 2.0 * shape.dim * (kv + shape.n_heads * head_dim + shape.ffn_dim)
    return 6.0 * shape.block_weights() + 3 * attn + extra


def hardware_flops_per_token(shape: Shape, seq_len: int, recompute: str = "none", ac_every: int = 2) -> float:
    return shape.n_layers * block_flops(shape, seq_len, recompute, ac_every) + 6.0 * shape.vocab * shape.dim


def block_gemms(shape: Shape, tokens: float, tp: int) -> list[tuple[float, float, float]]:
    """One block's forward matmuls on a tp rank, as (m, k, n): q, k, v (or one fused q/k/v), o, the MLP's up/gate
    (or one fused) and down; the tp shard is n for column-parallel ones, k for row-parallel ones."""
    head_dim = shape.dim // shape.n_heads
    q, kv, d, f = shape.n_heads * head_dim, shape.n_kv_heads * head_dim, shape.dim, shape.ffn_dim
    up = 2 if shape.mlp == "swiglu" else 1
    if shape.fused:
        column = [(tokens, d, (q + 2 * kv) / tp), (tokens, d, up * f / tp)]
    else:
        column = [(tokens, d, q / tp), (tokens, d, kv / tp), (tokens, d, kv / tp)] + [(tokens, d, f / tp)] * up
    return column + [(tokens, q / tp, d), (tokens, f / tp, d)]


def narrow_gemm_s(shape: Shape, tokens: float, tp: int, peak_flops: float, hbm_bytes_per_s: float,
                  element_bytes: int) -> float:
    """Seconds one block's forward matmuls take beyond their FLOPs at peak_flops because their bytes take longer
    at hbm_bytes_per_s (the roofline's memory side), summed; 0 for matmuls wide enough to be compute-bound."""
    return sum(max(0.0, element_bytes * (m * k + k * n + m * n) / hbm_bytes_per_s - 2.0 * m * k * n / peak_flops)
               for m, k, n in block_gemms(shape, tokens, tp))


def bubble_fraction(pp: int, microbatches: int, virtual: int = 1, schedule: str = "1f1b") -> float:
    """Pipeline idle time over busy time, (p - 1) / (v m) (GPipe: v = 1); StagePlan.bubble_theory gives the same
    bubble as a share of the whole step, (p-1)/(vm+p-1). Zero-bubble schedules: 0 (their ideal)."""
    if pp <= 1 or schedule in ZERO_BUBBLE:
        return 0.0
    return (pp - 1) / ((1 if schedule == "gpipe" else virtual) * microbatches)


def ring(n: int) -> float:
    """Bytes each rank moves per byte of a ring all-gather or reduce-scatter of n ranks ((n-1)/n); all-reduce: 2x."""
    return (n - 1) / n


@dataclass(frozen=True)
class TimeEstimate:
    step_time_s: float
    tokens_per_s: float  # whole job
    model_tflops_per_gpu: float
    hardware_tflops_per_gpu: float
    mfu: float
    hfu: float
    terms: dict[str, float]  # seconds per step: exposed parts (summing to step_time_s) and comm totals
    basis: dict[str, float]  # what the terms came from: micro-batches, blocks on the busiest stage, efficiency, links

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def estimate(shape: Shape, hw: Hardware, *, seq_len: int, global_batch: int, micro_batch: int, tp: int = 1,
             pp: int = 1, dp: int = 1, virtual_stages: int = 1, schedule: str = "1f1b", zero_stage: int = 0,
             sequence_parallel: bool = False, recompute: str = "none", ac_every: int = 2, precision: str = "bf16",
             reduce_dtype: str = "fp32", tp_overlap: bool = False, dp_overlap: bool = True,
             tp_projections: str = "fused", efficiency: float | None = None, host_block_s: float = 0.0,
             host_step_s: float = 0.0, host_token_s: float = 0.0, accumulate_unsharded: bool = False,
             zero1_broadcast: bool = False, cp: int = 1, offload: str = "none", dp_replicate: int = 1,
             ddp_bucket_mb: float | None = None, float8_gather: bool = False) -> TimeEstimate:
    """Step time of one layout (see the module docstring). `efficiency` replaces EFFICIENCY (e.g. a measured one).
    host_block_s, host_token_s and host_step_s: host work that does not overlap the compute (a CPU's, see
    Hardware.host_*_s), per block and micro-batch on the busiest stage, per token and unit of width besides, and per
    step. accumulate_unsharded: ZeRO-3 accumulates whole
    gradients over the micro-batches and reduce-scatters once per step (hpctrain's FSDP without pipeline parallel).
    zero1_broadcast: ZeRO-1 all-reduces the gradients and broadcasts the updated fp32 parameters from their owners
    (hpctrain's ZeroOne, torch's ZeroRedundancyOptimizer) instead of Megatron's reduce-scatter and all-gather.
    cp: context parallel (dp counts the data replicas; gradients are reduced over dp x cp). offload: "all", FSDP's
    CPU offload (ZeRO-2/3 shards in host memory, gradients reduce-scattered every micro-batch); "optimizer", AdamW
    on the host (gradients down and parameters up once per step). dp_replicate: HSDP's replicas (ZeRO-2/3): FSDP's
    traffic in a shard group of dp x cp / dp_replicate ranks, and the gradient shards all-reduced across the
    replicas. ddp_bucket_mb: DDP's bucket (zero_stage 0/1 reducing through DDP): the last bucket's all-reduce
    cannot start before backward ends, so at least its time stays exposed; None: the last block's share.
    float8_gather (train.fp8_all_gather): FSDP gathers the blocks' linear weights in float8, 1 byte each."""
    if precision not in MATMUL_DTYPE:
        raise ValueError(f"precision = {precision!r}: expected one of {', '.join(MATMUL_DTYPE)}")
    if tp_projections not in TP_PROJECTIONS:
        raise ValueError(f"tp_projections = {tp_projections!r}: expected one of {', '.join(TP_PROJECTIONS)}")
    if reduce_dtype not in REDUCE_BYTES:
        raise ValueError(f"reduce_dtype = {reduce_dtype!r}: expected fp32 or bf16")
    if min(seq_len, global_batch, micro_batch, tp, pp, dp, cp, virtual_stages) < 1 or zero_stage not in (0, 1, 2, 3):
        raise ValueError("seq_len, batches, tp, pp, dp, cp and virtual_stages must be >= 1, zero_stage 0-3")
    if dp_replicate < 1 or (dp * cp) % dp_replicate or (dp_replicate > 1 and zero_stage not in (2, 3)):
        raise ValueError(f"dp_replicate = {dp_replicate} must divide dp x cp = {dp * cp}, with zero_stage 2 or 3")
    if global_batch % (dp * micro_batch):
        raise ValueError(f"global batch {global_batch} is not a multiple of dp x micro batch = {dp * micro_batch}")
    eff = EFFICIENCY if efficiency is None else efficiency
    if not 0 < eff <= 1:
        raise ValueError(f"efficiency = {eff} must be in (0, 1]")
    peak = hw.peak(MATMUL_DTYPE[precision]) * 1e12 * eff
    m = global_batch // (dp * micro_batch)
    v = virtual_stages if pp > 1 else 1
    tokens = global_batch * seq_len / (dp * cp)  # per pipeline replica (a cp rank: its share of the sequences)
    act, gpn = ACT_BYTES[precision], hw.gpus_per_node
    if max(tp, pp, dp, cp) > 1 and None in (hw.intra_node_gbps, hw.inter_node_gbps):
        raise ValueError(f"{hw.name}: the link bandwidths are unknown, and tp={tp} pp={pp} dp={dp} communicates: "
                         "calibrate with `hpctrain plan --calibrate --bench bench.jsonl` (an `hpctrain bench "
                         "all_reduce` run on the machine) or give --hw intra_node_gbps=... inter_node_gbps=...")
    intra, inter = (hw.intra_node_gbps or 0) * 1e9, (hw.inter_node_gbps or 0) * 1e9

    blocks = math.ceil(shape.n_layers / (pp * v)) * v  # on the busiest stage
    head = 6.0 * shape.vocab * shape.dim

    block = block_flops(shape, seq_len, recompute, ac_every)
    bf16_peak = peak
    if precision == "fp8":  # the blocks' linears in float8, attention's core and the output projection in bf16
        bf16_peak = hw.peak("bf16") * 1e12 * eff
        block_peak = hw.float8_peak(block_linear_share(shape, seq_len)) * 1e12 * eff
        compute = max(blocks * block / block_peak, (shape.n_layers * block / block_peak + head / bf16_peak) / pp) \
            * tokens / tp
    else:
        compute = max(blocks * block, (shape.n_layers * block + head) / pp) * tokens / tp / peak
    narrow = 0.0
    if hw.hbm_gbps is not None:  # forward, two backward matmuls per forward one, and recomputed forwards
        passes = 3 + recomputed_share(shape.n_layers, recompute, ac_every)
        narrow = passes * blocks * m * narrow_gemm_s(shape, micro_batch * seq_len / cp, tp, peak, hw.hbm_gbps * 1e9,
                                                     ACT_BYTES[precision])
    compute += narrow
    bubble = bubble_fraction(pp, m, v, schedule) * compute

    micro_bytes = micro_batch * seq_len / cp * shape.dim * act  # one micro-batch's activations, b s d (/ cp)
    tp_link = intra if tp <= gpn else inter
    backward = 5 if tp_projections == "separate" and not sequence_parallel else 2
    n_coll = 2 + backward + 2 * recomputed_share(shape.n_layers, recompute, ac_every)
    ends = 2 if pp == 1 else 1  # the embedding's forward all-reduce, the logit layer's backward one
    tp_comm = (n_coll * blocks + ends) * 2 * ring(tp) * micro_bytes * m / tp_link if tp > 1 else 0.0
    tp_exposed = max(0.0, tp_comm - compute) if tp_overlap else tp_comm

    ring_comm = ring_exposed = 0.0
    if cp > 1:  # per block and micro-batch: cp - 1 hops of the K/V shard forward, again in backward with the
        # fp32 K/V gradients, which take one more hop home; the forward hops hide behind the attention blocks
        kv_bytes = 2 * micro_batch * seq_len / cp * shape.n_kv_heads * (shape.dim // shape.n_heads) / tp
        cp_link = intra if cp * tp <= gpn else inter
        fwd = (cp - 1) * kv_bytes * act / cp_link
        bwd = ((cp - 1) * kv_bytes * act + cp * kv_bytes * 4) / cp_link
        repeats = 1 + recomputed_share(shape.n_layers, recompute, ac_every)
        attention = 4.0 * shape.dim * seq_len * micro_batch * seq_len / cp / tp / bf16_peak  # a block's attention
        ring_comm = blocks * m * (repeats * fwd + bwd)
        ring_exposed = blocks * m * (repeats * max(0.0, fwd - attention) + bwd)

    per_node = max(1, gpn // tp)  # dp ranks of one group per node
    whole_dp = dp * cp  # gradients: over the data replicas and their cp ranks
    dp = whole_dp // dp_replicate  # ZeRO's shards: over that group, or HSDP's shard group within it
    dp_link = intra if dp <= per_node else min(intra, per_node * inter)
    p_rank = shape.params() / (tp * pp)
    reduce_b = REDUCE_BYTES[reduce_dtype]
    gather = act  # bytes an FSDP gather moves per parameter; float8_gather: the blocks' linears in 1 byte
    if float8_gather:
        gather = act - (act - 1) * shape.n_layers * shape.block_weights() / shape.params()
    replicate_comm = 0.0
    if dp_replicate > 1:  # each rank's gradient shard all-reduced over the replicas (one rank per replica): per
        # step, or per micro-batch where offload reduces every micro-batch; the replicas of a node's shard groups
        # share its NICs (k of a replica group's ranks per node)
        k = max(1, per_node // dp)
        rep_link = intra if whole_dp <= per_node else min(intra, k * inter)
        replicate_comm = (m if offload == "all" else 1) * 2 * ring(dp_replicate) * p_rank / dp * reduce_b / rep_link
    if dp == 1:
        dp_comm = replicate_comm
    elif zero_stage == 0:
        dp_comm = 2 * ring(dp) * p_rank * reduce_b / dp_link
    elif zero_stage == 1 and zero1_broadcast:
        dp_comm = ring(dp) * p_rank * (2 * reduce_b + 4) / dp_link
    elif zero_stage in (1, 2):
        dp_comm = ring(dp) * p_rank * ((m if offload == "all" else 1) * reduce_b + gather) / dp_link
    else:
        once = accumulate_unsharded and offload != "all"
        dp_comm = ring(dp) * p_rank * (2 * m * gather + (1 if once else m) * reduce_b) / dp_link
    if dp > 1:
        dp_comm += replicate_comm
    hideable = compute if zero_stage == 3 else compute / m
    tail = dp_comm / blocks  # the last gradients' share cannot overlap the backward that makes them
    if ddp_bucket_mb is not None and zero_stage in (0, 1) and dp > 1:  # DDP: its last bucket's all-reduce
        tail = 2 * ring(dp) * min(ddp_bucket_mb * 2**20, p_rank * reduce_b) / dp_link
    dp_exposed = max(tail, dp_comm - hideable) if dp_overlap else dp_comm

    p2p = 0.0
    if pp > 1:
        p2p_link = inter if tp * dp >= gpn else intra
        p2p = 2 * m * v * micro_bytes / tp / p2p_link

    offload_comm = offload_exposed = 0.0
    if offload != "none":
        if offload == "all" and zero_stage not in (2, 3):
            raise ValueError(f"offload = 'all' needs FSDP's shards: zero_stage 2 or 3 (got {zero_stage})")
        if hw.host_link_gbps is None:
            raise ValueError(f"{hw.name}: the GPU-host link bandwidth is unknown and offload moves data over it: "
                             f"give --hw host_link_gbps=... (PCIe, per direction, GB/s)")
        link = hw.host_link_gbps * 1e9
        shard = p_rank / dp if zero_stage in (2, 3) else p_rank
        if offload == "all":  # fp32 shards to the GPU for each gather, gradient shards back after each reduce-scatter
            gathers = 2 * m if zero_stage == 3 else 1
            offload_comm = shard * (4 * gathers + reduce_b * m) / link
            offload_exposed = max(offload_comm / blocks, offload_comm - compute)
        host_step = 0.0
        if hw.host_memory_gbps is not None:  # the host's AdamW step, after backward: every rank of the node streams
            # its share's masters (read, write), gradients (read) and two moments (read, write): 32 bytes a parameter
            host_step = gpn * shard * HOST_ADAMW_BYTES / (hw.host_memory_gbps * 1e9)
        if offload == "all":
            offload_exposed += host_step
            offload_comm += host_step
        else:  # the step's gradients down, the host's step and the parameters up, between backward and the next
            # forward: a three-stage pipeline over buckets (HostAdamW), exposed in full: one bucket's down + step +
            # up, then the slowest stage for every further bucket
            down = shard * 4 / link
            buckets = max(1, math.ceil(shard * 4 / HOST_BUCKET_BYTES))
            offload_comm = 2 * down + host_step
            offload_exposed = (2 * down + host_step) / buckets + (buckets - 1) * max(down, host_step) / buckets

    host = host_step_s + (host_block_s + host_token_s * micro_batch * seq_len / cp * shape.dim / tp) * blocks * m
    step = compute + bubble + tp_exposed + dp_exposed + p2p + ring_exposed + offload_exposed + host
    model_flops = flops_per_token(shape.n_layers, shape.dim, shape.ffn_dim, shape.n_heads, shape.n_kv_heads,
                                  shape.vocab, seq_len, shape.mlp)
    hw_flops = hardware_flops_per_token(shape, seq_len, recompute, ac_every)
    gpus = tp * pp * whole_dp
    job_tokens = global_batch * seq_len / step
    model_tflops = model_flops * job_tokens / gpus / 1e12
    hw_tflops = hw_flops * job_tokens / gpus / 1e12
    dense = hw.peak(MATMUL_DTYPE[precision]) if precision != "fp8" else hw.float8_peak(
        6.0 * shape.n_layers * shape.block_weights() / model_flops)
    terms = {"compute_s": compute, "pp_bubble_s": bubble, "tp_comm_s": tp_exposed, "tp_comm_total_s": tp_comm,
             "dp_comm_s": dp_exposed, "dp_comm_total_s": dp_comm, "dp_replicate_comm_total_s": replicate_comm,
             "p2p_s": p2p, "cp_comm_s": ring_exposed,
             "cp_comm_total_s": ring_comm, "offload_s": offload_exposed, "offload_total_s": offload_comm,
             "host_s": host}
    basis = {"microbatches": m, "blocks_on_busiest_stage": blocks, "efficiency": eff,
             "gemm_memory_s": narrow, "tp_link_gbps": tp_link / 1e9,
             "dp_link_gbps": dp_link / 1e9}
    return TimeEstimate(step, job_tokens, model_tflops, hw_tflops, model_tflops / dense, hw_tflops / dense, terms,
                        basis)
