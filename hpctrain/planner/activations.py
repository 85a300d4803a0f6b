"""Activation memory: the bytes autograd keeps from a micro-batch's forward for its backward, for hpctrain's block
(hpctrain.model.transformer: RMSNorm keeping its input, rotary q/k, scaled_dot_product_attention with a flash
kernel, SwiGLU keeping gate and up), per token and per block, by precision mode. Counted from the tensors autograd
saves in our own model (distinct storages, the parameters left out; benchmarks/activation_memory.py) and written
here as tensor counts, so they scale to any size. Every activation is kept in the compute dtype (e bytes: 4 in
fp32, 2 in bf16/fp16; the residual stream too), and per block and token the block keeps:

    width h (dim)        4: the block's input and the residual after attention (the norms' inputs), the two norms'
                            outputs (the projections' input)
    q (heads x hd)       2: the rotated queries, the attention's output
    kv (kv heads x hd)   2: the rotated keys, the values
    f (ffn)              3: gate, up, and the MLP's product (the down projection's input); GeLU (model.mlp):
                            2, GeLU's input and output
    + 4 bytes per head (the attention kernel's log-sum-exp) and 8 bytes (the norms' 1/rms, fp32)

The h-wide tensors and the 1/rms split over tp with sequence parallel (the projections' input is kept as its
sequence shard and gathered again in backward: parallel.tensor.SequenceGather) and stay whole without it; q, kv,
heads and f split over tp. Modes: "autocast" is mixed precision by torch.autocast (ZeRO 0-1: fp32 weights,
low-precision matmuls, one low-precision copy of each weight cached per forward and kept for backward: the place of
Megatron's bf16 weights beside its fp32 master copy); "fsdp" is FSDP2's MixedPrecisionPolicy (ZeRO 2-3: the
weights themselves are low precision in forward). Full activation checkpointing keeps only each block's input, plus
one block's full set while it is recomputed in backward; "every" checkpoints every k-th block. The partial modes
(hpctrain.parallel.recompute: "selective", "op") keep, per block and token, the block's input (h), the outputs of
the matmuls they keep (q, k, v, gate and up: their widths; the o and down projections': h, whole under tp, as a
matmul's output is before its reduction), the attention kernel's output (q) and log-sum-exp, and under tp the
reductions' results (h, a sequence shard with sequence parallel); "op" keeps the 1st, 3rd, 5th and 7th matmul of
the block's seven (q, v, gate, down), "selective" all seven. A GeLU block has six matmuls (no gate): "selective"
keeps q, k, v, up and o, down; "op" the 1st, 3rd and 5th (q, v, up). With fused projections
(model.fused_projections) a block has four matmuls, q/k/v, o, gate/up (GeLU: up), down: "selective" keeps the same
outputs as without, "op" the 1st and 3rd (q, k, v, gate, up; GeLU: q, k, v, up); the fused matmuls keep their
weights, not autocast's copies (only o's and down's, and GeLU's up, are copied). The activations are the same.

Outside the blocks, per micro-batch: the token ids (int64), the final norm's input and 1/rms, the output
projection's input (whole: gathered under sequence parallel), and the logits' log-softmax in fp32 (tokens x vocab
/ tp).
"""
from __future__ import annotations

from dataclasses import dataclass

from hpctrain.model.dims import ModelDims
from hpctrain.parallel.recompute import PARTIAL, recomputed_blocks

# per mode: bytes per element of an activation, bytes per weight of autocast's low-precision copy
MODES = {"fp32": (4, 0), "autocast": (2, 2), "fsdp": (2, 0)}
H, Q, KV, PER_HEAD, ONE = 4, 2, 2, 4, 8  # tensors of each width kept per block and token (above); bytes
F = {"swiglu": 3, "gelu": 2}  # ffn-wide tensors kept, by model.mlp


def block_weights(dims: ModelDims, copied: bool = False) -> int:
    """Elements of one block's matmul weights; `copied`: of those autocast copies to low precision and keeps for
    backward, all but the fused projections' (model.fused_projections: FusedLinear keeps the weights themselves)."""
    hd = dims.head_dim
    if copied and dims.fused_projections:  # o, down, and GeLU's up (nothing to fuse it with)
        return dims.n_heads * hd * dims.dim + (2 if dims.mlp == "gelu" else 1) * dims.dim * dims.ffn_dim
    return 2 * dims.n_heads * hd * dims.dim + 2 * dims.n_kv_heads * hd * dims.dim + dims.mlp_matrices * dims.dim \
        * dims.ffn_dim


@dataclass(frozen=True)
class ActivationModel:
    mode: str  # "fp32", "autocast" or "fsdp" (mode_of)
    tp: int = 1
    sequence_parallel: bool = False

    def block_bytes(self, dims: ModelDims, tokens: int) -> float:
        """Bytes one block keeps for backward from `tokens` tokens (a micro-batch's sequence x batch)."""
        e, per_weight = MODES[self.mode]
        hd, tp = dims.head_dim, self.tp
        seq_split = tp if self.sequence_parallel else 1
        per_token = (H * e * dims.dim + ONE) / seq_split + (
            Q * e * dims.n_heads * hd + KV * e * dims.n_kv_heads * hd + PER_HEAD * dims.n_heads
            + F[dims.mlp] * e * dims.ffn_dim) / tp
        return tokens * per_token + per_weight * block_weights(dims, copied=True) / tp

    def partial_block_bytes(self, dims: ModelDims, tokens: int, ac: str) -> float:
        """Bytes one block keeps under train.ac = "selective" or "op" (module docstring)."""
        e = MODES[self.mode][0]
        hd, tp = dims.head_dim, self.tp
        seq_split = tp if self.sequence_parallel else 1
        q, kv, f = dims.n_heads * hd / tp, dims.n_kv_heads * hd / tp, dims.ffn_dim / tp
        gelu = dims.mlp == "gelu"
        if ac == "selective":
            mm = q + 2 * kv + (1 if gelu else 2) * f + 2 * dims.dim
        elif dims.fused_projections:  # the odd-numbered of qkv, o, gate/up (GeLU: up), down: qkv and gate/up
            mm = q + 2 * kv + (1 if gelu else 2) * f
        else:  # the odd-numbered matmuls: q, v, gate, down (SwiGLU); q, v, up (GeLU)
            mm = q + kv + f + (0 if gelu else dims.dim)
        reductions = 2 * dims.dim / seq_split if tp > 1 else 0.0
        return tokens * (e * (dims.dim / seq_split + mm + q + reductions) + PER_HEAD * dims.n_heads / tp)

    def weight_copy_bytes(self, dims: ModelDims, blocks: int, head: bool = False) -> float:
        """Autocast's low-precision copies of the weights of `blocks` blocks (and the output projection's with the
        head), part of block_bytes and head_bytes: cached once per autocast region, however many micro-batches
        it runs (a pipeline schedule runs them all in one)."""
        per_weight = MODES[self.mode][1]
        if not per_weight:
            return 0.0
        return per_weight * (blocks * block_weights(dims, copied=True) + (dims.vocab_size * dims.dim if head else 0)) \
            / self.tp

    def input_bytes(self, dims: ModelDims, tokens: int) -> float:
        """What a checkpointed block keeps: its input (the residual stream, in the compute dtype)."""
        return tokens * MODES[self.mode][0] * dims.dim / (self.tp if self.sequence_parallel else 1)

    def head_bytes(self, dims: ModelDims, tokens: int, embedding: bool = True, head: bool = True) -> float:
        """Outside the blocks: token ids (with the embedding); with the head, the final norm's input and 1/rms, the
        output projection's input, the fp32 log-softmax of the logits (vocab / tp wide), and under autocast the
        output weight's low-precision copy."""
        out = 8.0 * tokens if embedding else 0.0
        if head:
            e, per_weight = MODES[self.mode]
            seq_split = self.tp if self.sequence_parallel else 1
            out += tokens * ((e * dims.dim + 4) / seq_split + e * dims.dim + 4 * dims.vocab_size / self.tp)
            out += per_weight * dims.vocab_size * dims.dim / self.tp
        return out

    @staticmethod
    def checkpointed(blocks: int, ac: str, ac_every: int = 1) -> int:
        """How many of `blocks` blocks are checkpointed (train.ac, train.ac_every): the blocks the model wrapper
        recomputes (hpctrain.parallel.recompute.recomputed_blocks); they keep only their input, or with the partial
        modes partial_block_bytes."""
        return len(recomputed_blocks(blocks, ac, ac_every))

    def micro_batch_bytes(self, dims: ModelDims, tokens: int, blocks: int, ac: str = "none", ac_every: int = 1,
                          embedding: bool = True, head: bool = True) -> float:
        """One micro-batch's activations on a rank holding `blocks` blocks, at the end of its forward."""
        kept = self.checkpointed(blocks, ac, ac_every)
        full = blocks - kept
        each = self.partial_block_bytes(dims, tokens, ac) if ac in PARTIAL else self.input_bytes(dims, tokens)
        return full * self.block_bytes(dims, tokens) + kept * each + self.head_bytes(dims, tokens, embedding, head)


def mode_of(precision: str, zero_stage: int, dp: int) -> str:
    """Which table applies: FSDP's mixed precision for ZeRO 2-3 with dp > 1, autocast for other low precisions."""
    if precision == "fp32":
        return "fp32"
    return "fsdp" if zero_stage in (2, 3) and dp > 1 else "autocast"
