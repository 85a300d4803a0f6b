"""The model's dimensions, and what follows from them without building it: parameter count, the shape of every
parameter (by its name in hpctrain.model.transformer.Transformer), training FLOPs per token. Pure: no torch, so the
login node plans (hpctrain.parallel.plan, hpctrain.planner) without importing it; hpctrain.model.transformer builds
the module from them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from hpctrain.config import ModelConfig


@dataclass(frozen=True)
class ModelDims:
    vocab_size: int  # padded: a multiple of pad_to (and of tp) so the vocabulary shards evenly
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    max_seq_len: int
    tie_embeddings: bool
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    true_vocab_size: int = 0  # before padding
    mlp: str = "swiglu"  # "swiglu" (w1 gate, w3 up, w2 down) or "gelu" (w1 up, w2 down)
    fused_projections: bool = False  # q/k/v (and SwiGLU's gate/up) computed as one matmul; the same parameters

    @staticmethod
    def from_config(m: ModelConfig, tp: int = 1, pad_to: int = 64) -> "ModelDims":
        """Pads the vocabulary to a multiple of lcm(pad_to, tp): the same padded size for every tp dividing
        pad_to, so layouts stay comparable. Heads and FFN width must divide by tp (ValueError otherwise)."""
        kv = m.n_kv_heads or m.n_heads
        ffn = m.ffn_dim or (4 * m.dim if m.mlp == "gelu" else 64 * math.ceil(8 * m.dim / 3 / 64))
        for name, value in (("model.n_heads", m.n_heads), ("model.n_kv_heads", kv), ("model ffn_dim", ffn)):
            if value % tp:
                raise ValueError(f"{name} = {value} is not divisible by parallel.tp = {tp}")
        multiple = math.lcm(pad_to, tp)
        vocab = multiple * math.ceil(m.vocab_size / multiple)
        return ModelDims(vocab, m.dim, m.n_layers, m.n_heads, kv, ffn, m.max_seq_len, m.tie_embeddings,
                         rope_theta=m.rope_theta, norm_eps=m.norm_eps, true_vocab_size=m.vocab_size, mlp=m.mlp,
                         fused_projections=m.fused_projections)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def mlp_matrices(self) -> int:
        """The MLP's weight matrices: 3 for SwiGLU, 2 for GeLU."""
        return 3 if self.mlp == "swiglu" else 2

    def num_params(self, embeddings: bool = True) -> int:
        d, h = self.dim, self.head_dim
        attn = d * (self.n_heads * h) * 2 + d * (self.n_kv_heads * h) * 2
        block = attn + self.mlp_matrices * d * self.ffn_dim + 2 * d
        emb = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        return self.n_layers * block + d + (emb if embeddings else 0)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 per weight in matmuls (forward 2, backward 4) plus attention scores and
        values, 12 * layers * dim * seq_len (PaLM's accounting, causal mask not discounted)."""
        matmul_params = self.num_params(embeddings=False) - (2 * self.n_layers + 1) * self.dim
        matmul_params += self.vocab_size * self.dim  # the output projection is a matmul; the lookup is not
        return 6.0 * matmul_params + 12.0 * self.n_layers * self.dim * seq_len

    def float8_flops_per_token(self) -> float:
        """Of flops_per_token, those of the blocks' linear layers: what train.precision = "fp8" runs in float8."""
        return 6.0 * sum(math.prod(shape) for i in range(self.n_layers)
                         for shape in self.block_shapes(i).values() if len(shape) == 2)

    def block_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        """Every parameter of block `layer`, by its name in the Transformer, with its full (unsharded) shape."""
        d, h, f = self.dim, self.head_dim, self.ffn_dim
        p = f"layers.{layer}."
        q, kv = self.n_heads * h, self.n_kv_heads * h
        out = {p + "attention_norm.weight": (d,), p + "attention.wq.weight": (q, d),
               p + "attention.wk.weight": (kv, d), p + "attention.wv.weight": (kv, d),
               p + "attention.wo.weight": (d, q), p + "ffn_norm.weight": (d,),
               p + "feed_forward.w1.weight": (f, d), p + "feed_forward.w3.weight": (f, d),
               p + "feed_forward.w2.weight": (d, f)}
        if self.mlp == "gelu":
            del out[p + "feed_forward.w3.weight"]
        return out

    def param_shapes(self, layers=None, embedding: bool = True, head: bool = True) -> dict[str, tuple[int, ...]]:
        """Full shapes of the parameters a model (or a pipeline stage) holds: the blocks `layers` (all by default),
        the embedding, and the head (final norm and output projection; tied to the embedding when asked)."""
        out: dict[str, tuple[int, ...]] = {}
        if embedding:
            out["tok_embeddings.weight"] = (self.vocab_size, self.dim)
        for i in range(self.n_layers) if layers is None else layers:
            out.update(self.block_shapes(i))
        if head:
            out["norm.weight"] = (self.dim,)
            if not (self.tie_embeddings and embedding):
                out["output.weight"] = (self.vocab_size, self.dim)
        return out
