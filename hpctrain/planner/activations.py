"""Activation memory: the bytes autograd keeps from a micro-batch's forward for its backward, for hpctrain's block
(hpctrain.model.transformer: RMSNorm, rotary q/k, scaled_dot_product_attention with a flash kernel, SwiGLU), per
token and per block, by precision mode. Counted from the tensors autograd saves in our own model (distinct storages, the
parameters left out) and written here as tensor counts, so they scale to any size:

                     per block and token, as tensors of width ...              per block, independent of tokens
    mode             h (dim)            q (heads*hd) kv   heads  f (ffn)  1
    fp32             6 fp32             2 fp32       2    1 fp32 3 fp32   2 fp32
    autocast (bf16)  4 fp32 + 5 bf16    2 bf16       2    1 fp32 3 bf16   2 fp32   a bf16 copy of every weight
    fsdp (bf16)      2 fp32 + 4 bf16    2 bf16       2    1 fp32 3 bf16   2 fp32
"autocast" is mixed precision by torch.autocast (ZeRO 0-1: fp32 weights, low-precision matmuls, one low-precision
copy of each weight cached per forward and kept for backward); "fsdp" is FSDP2's MixedPrecisionPolicy (ZeRO 2-3:
the weights themselves are low precision in forward). Residual stream and norm inputs ("h") stay full under tensor
parallel unless sequence parallel shards them along the sequence; the attention and MLP inner widths (q, kv,
heads, f) split over tp. Full activation checkpointing keeps only each block's input, plus one block's full set
while it is recomputed in backward; "every" checkpoints every k-th block.

Outside the blocks, per micro-batch: the token ids (int64), the final norm and the output projection's input (as a
block's norm), and the logits' log-softmax in fp32 (tokens x vocab / tp), plus the low-precision logits under
autocast.
"""
from __future__ import annotations

from dataclasses import dataclass

from hpctrain.model.dims import ModelDims
from hpctrain.parallel.recompute import recomputed_blocks

# bytes per token per block: (h_sharded_by_sp, h_always_full, q, kv, heads, f, one) and per-weight bytes
MODES = {
    "fp32": ((4 + 4 + 4 + 4, 4 + 4), 4 + 4, 4 + 4, 4, 4 + 4 + 4, 4 + 4, 0),
    "autocast": ((4 + 4 + 4 + 4, 2 * 5), 2 + 2, 2 + 2, 4, 2 * 3, 4 + 4, 2),
    "fsdp": ((4 + 4, 2 * 4), 2 + 2, 2 + 2, 4, 2 * 3, 4 + 4, 0),
}

# outside the blocks, bytes per token per dim: the final norm's saved tensors, the output projection's input
HEAD = {"fp32": (4 + 4, 4), "autocast": (4 + 4, 2), "fsdp": (4 + 2, 2)}


@dataclass(frozen=True)
class ActivationModel:
    mode: str  # "fp32", "autocast" or "fsdp" (mode_of)
    tp: int = 1
    sequence_parallel: bool = False

    def block_bytes(self, dims: ModelDims, tokens: int) -> float:
        """Bytes one block keeps for backward from `tokens` tokens (a micro-batch's sequence x batch)."""
        (h_seq, h_full), q, kv, heads, f, one, per_weight = MODES[self.mode]
        hd, tp = dims.head_dim, self.tp
        seq_split = tp if self.sequence_parallel else 1
        per_token = (h_seq * dims.dim + one) / seq_split + h_full * dims.dim + (
            q * dims.n_heads * hd + kv * dims.n_kv_heads * hd + heads * dims.n_heads + f * dims.ffn_dim) / tp
        weights = 2 * dims.n_heads * hd * dims.dim + 2 * dims.n_kv_heads * hd * dims.dim + 3 * dims.dim * dims.ffn_dim
        return tokens * per_token + per_weight * weights / tp

    def weight_copy_bytes(self, dims: ModelDims, blocks: int, head: bool = False) -> float:
        """Autocast's low-precision copies of the weights of `blocks` blocks (and the output projection's with the
        head), part of block_bytes and head_bytes: cached once per autocast region, however many micro-batches
        it runs (a pipeline schedule runs them all in one)."""
        if self.mode != "autocast":
            return 0.0
        per_weight = MODES[self.mode][-1]
        weights = (2 * dims.n_heads * dims.head_dim * dims.dim + 2 * dims.n_kv_heads * dims.head_dim * dims.dim
                   + 3 * dims.dim * dims.ffn_dim)
        return per_weight * (blocks * weights + (dims.vocab_size * dims.dim if head else 0)) / self.tp

    def input_bytes(self, dims: ModelDims, tokens: int) -> float:
        """What a checkpointed block keeps: its input (the residual stream, fp32 unless FSDP casts it)."""
        width = 2 if self.mode == "fsdp" else 4
        return tokens * width * dims.dim / (self.tp if self.sequence_parallel else 1)

    def head_bytes(self, dims: ModelDims, tokens: int, embedding: bool = True, head: bool = True) -> float:
        """Outside the blocks: token ids (with the embedding); with the head, the final norm, the output
        projection's input, the fp32 log-softmax of the logits (vocab / tp wide), and under autocast the output
        weight's low-precision copy."""
        out = 8.0 * tokens if embedding else 0.0
        if head:
            norm, proj_in = HEAD[self.mode]
            seq_split = self.tp if self.sequence_parallel else 1
            out += tokens * ((norm * dims.dim + 4) / seq_split + proj_in * dims.dim + 4 * dims.vocab_size / self.tp)
            if self.mode == "autocast":
                out += 2 * dims.vocab_size * dims.dim / self.tp
        return out

    @staticmethod
    def checkpointed(blocks: int, ac: str, ac_every: int = 1) -> int:
        """How many of `blocks` blocks keep only their input (train.ac, train.ac_every): the blocks the model
        wrapper recomputes (hpctrain.parallel.recompute.recomputed_blocks)."""
        return len(recomputed_blocks(blocks, ac, ac_every))

    def micro_batch_bytes(self, dims: ModelDims, tokens: int, blocks: int, ac: str = "none", ac_every: int = 1,
                          embedding: bool = True, head: bool = True) -> float:
        """One micro-batch's activations on a rank holding `blocks` blocks, at the end of its forward."""
        kept = self.checkpointed(blocks, ac, ac_every)
        full = blocks - kept
        return (full * self.block_bytes(dims, tokens) + kept * self.input_bytes(dims, tokens)
                + self.head_bytes(dims, tokens, embedding, head))


def mode_of(precision: str, zero_stage: int, dp: int) -> str:
    """Which table applies: FSDP's mixed precision for ZeRO 2-3 with dp > 1, autocast for other low precisions."""
    if precision == "fp32":
        return "fp32"
    return "fsdp" if zero_stage in (2, 3) and dp > 1 else "autocast"
