"""A Llama-style decoder on one device: RMSNorm, rotary embeddings, SwiGLU MLP (or GPT's GeLU one), grouped-query
attention through scaled_dot_product_attention (FlashAttention on GPUs; K/V heads passed grouped with enable_gqa
where the kernel reads them so), optional tied embeddings, optionally q/k/v and gate/up each as one matmul. No
distributed code here: hpctrain.parallel applies tensor parallel, checkpointing and sharding to this unmodified
module.

    model = Transformer(ModelDims.from_config(cfg.model, tp=2))   # on the meta device for big models
    model.init_buffers(); p.copy_(init_value(name, p.shape, dims, seed))  # layout-independent weights
    init_slice(name, p.shape, dims, seed, offset, local_shape, out=shard)  # any slice of them, tile by tile
    logits = model(tokens)                                         # (B, T) -> (B, T, padded_vocab)
"""
from __future__ import annotations

import functools
import hashlib
import itertools
import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from hpctrain.model.dims import ModelDims

__all__ = ["ModelDims", "Transformer", "clean_name", "init_slice", "init_value", "weight_of"]


class _RMSNorm(torch.autograd.Function):
    """RMSNorm keeping only its input and the per-token 1/rms for backward (autograd would also keep the normalised
    tensor, one more activation of the model's width), and giving its output in `out_dtype` (autocast's compute
    dtype: the matmuls that read it then share one copy instead of each casting its own). The forward's values are
    the module's before this function, bit for bit; the backward is the closed form of the same function."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None) -> torch.Tensor:
        xf = x.float()  # normalise in fp32 even under bf16: the mean of squares loses precision in low precision
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        y = (xf * rstd).type_as(x) * weight
        return y if out_dtype is None else y.to(out_dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        n = x.float() * rstd  # the normalised input, again
        g = grad.float()
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = (g * n.type_as(x).float()).sum(tuple(range(g.dim() - 1))).to(weight.dtype)
        gn = g * weight.float()
        grad_x = rstd * (gn - n * (gn * n).mean(-1, keepdim=True))
        return grad_x.to(x.dtype), grad_w, None, None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device = x.device.type
        out_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        return _RMSNorm.apply(x, self.weight, self.eps, out_dtype)


def rope_tables(head_dim: int, seq_len: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (seq_len, head_dim // 2)."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates the two halves of each head: x (B, T, H, D), cos/sin (T, D/2)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).type_as(x)


@functools.cache
def sdpa_has_gqa() -> bool:
    """Whether this torch's scaled_dot_product_attention takes enable_gqa (added in torch 2.5)."""
    q, kv = torch.zeros(1, 2, 1, 2), torch.zeros(1, 1, 1, 2)
    try:
        F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
    except TypeError:
        return False
    return True


def native_gqa(device_type: str, dtype: torch.dtype, rocm: bool, has_gqa: bool) -> bool:
    """Whether SDPA gets the grouped K/V heads as they are (enable_gqa) rather than repeated to every query head.
    Only kernels that read grouped heads make that a gain: the CPU flash kernel, and on CUDA the flash kernel
    (fp16/bf16, not on ROCm). The memory-efficient kernel, the one CUDA runs fp32 in, rejects grouped heads and
    torch would fall back to the math kernel, which materialises the (B, H, T, T) scores: repeat there."""
    if not has_gqa:
        return False
    return device_type == "cpu" or (device_type == "cuda" and not rocm and dtype in (torch.float16, torch.bfloat16))


class FusedLinear(torch.autograd.Function):
    """x @ cat(weights).T as one matmul, split back into one output per weight (views of one result). Keeps x and
    the weights as they are (parameters: nothing copied), never their concatenation or its low-precision cast: the
    backward concatenates them again, for as long as it runs. Under autocast the matmul runs in autocast's dtype,
    as nn.Linear's would; the weights' gradients come back in their own dtype."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, *weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        ctx.dtype, ctx.sizes = dtype, [w.shape[0] for w in weights]
        ctx.save_for_backward(x, *weights)
        with torch.autocast(device, enabled=False):
            y = F.linear(x.to(dtype), torch.cat([w.to(dtype) for w in weights]))
        return tuple(y.split(ctx.sizes, dim=-1))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        x, *weights = ctx.saved_tensors
        g = torch.cat(grads, dim=-1).to(ctx.dtype)  # (..., sum of the outputs' widths)
        xd = x.to(ctx.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = (g @ torch.cat([w.to(ctx.dtype) for w in weights])).to(x.dtype)
        flat = g.reshape(-1, g.shape[-1]).t().mm(xd.reshape(-1, xd.shape[-1]))  # (outputs, inputs)
        grad_ws = [part.to(w.dtype) if ctx.needs_input_grad[i + 1] else None
                   for i, (part, w) in enumerate(zip(flat.split(ctx.sizes), weights))]
        return grad_x, *grad_ws


class FusedProjection(nn.Module):
    """Bias-free nn.Linear modules that read the same input, run as one matmul (model.fused_projections: Megatron's
    fused QKV and gate/up shapes, one larger GEMM where there were two or three). It holds no parameter of its own:
    the weights stay the member modules' (names, init, checkpoints and Hugging Face export as without it)."""

    def __init__(self, *members: nn.Linear) -> None:
        super().__init__()
        self.members = tuple(members)  # a tuple, so not registered as submodules a second time

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return FusedLinear.apply(x, *(m.weight for m in self.members))


class AttentionCore(nn.Module):
    """Causal attention of q (B, H, T, hd) over k, v (B, H_kv, T, hd) through scaled_dot_product_attention; a
    module of its own (no parameters) so context parallelism can run its ring attention in its place
    (hpctrain.parallel.context)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        gqa = k.shape[1] != q.shape[1]  # grouped-query attention: each kv head serves n_heads / n_kv_heads
        native = gqa and native_gqa(q.device.type, q.dtype, torch.version.hip is not None, sdpa_has_gqa())
        if gqa and not native:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, **({"enable_gqa": True} if native else {}))


class Attention(nn.Module):
    def __init__(self, d: ModelDims) -> None:
        super().__init__()
        self.head_dim = d.head_dim
        self.wq = nn.Linear(d.dim, d.n_heads * d.head_dim, bias=False)
        self.wk = nn.Linear(d.dim, d.n_kv_heads * d.head_dim, bias=False)
        self.wv = nn.Linear(d.dim, d.n_kv_heads * d.head_dim, bias=False)
        self.wo = nn.Linear(d.n_heads * d.head_dim, d.dim, bias=False)
        self.qkv = FusedProjection(self.wq, self.wk, self.wv) if d.fused_projections else None
        self.core = AttentionCore()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        if self.qkv is not None:
            q, k, v = self.qkv(x)
            v = v.contiguous()  # its own storage: attention keeps v, which would keep all of q, k, v alive
        else:
            q, k, v = self.wq(x), self.wk(x), self.wv(x)
        # -1 heads: under tensor parallel each rank holds n_heads / tp of them
        q, k, v = (t.view(B, T, -1, self.head_dim) for t in (q, k, v))
        q, k = apply_rope(q, cos[:T], sin[:T]), apply_rope(k, cos[:T], sin[:T])
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, head_dim), k and v (B, H_kv, T, head_dim)
        y = self.core(q, k, v)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class SwiGLU(torch.autograd.Function):
    """silu(gate) * up keeping only gate and up for backward, where silu(gate) is computed again: autograd would
    also keep silu's output (one more activation of the ffn width per token). The gradients are autograd's own, bit
    for bit: the same kernels (mul's backward, silu_backward) on the same values in the same order."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = ctx.saved_tensors
        return torch.ops.aten.silu_backward(grad * up, gate), grad * F.silu(gate)


class FeedForward(nn.Module):
    """SwiGLU (Llama: w2(silu(w1 x) * w3 x)) or, with mlp = "gelu", GPT's two matrices (w2(gelu(w1 x)), tanh GeLU;
    autograd keeps GeLU's input and output, as Megatron's GPT does)."""

    def __init__(self, d: ModelDims) -> None:
        super().__init__()
        self.w1 = nn.Linear(d.dim, d.ffn_dim, bias=False)  # gate (SwiGLU), up (GeLU)
        self.w3 = nn.Linear(d.dim, d.ffn_dim, bias=False) if d.mlp == "swiglu" else None  # up
        self.w2 = nn.Linear(d.ffn_dim, d.dim, bias=False)  # down
        self.gate_up = FusedProjection(self.w1, self.w3) if d.fused_projections and self.w3 is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is None:
            return self.w2(F.gelu(self.w1(x), approximate="tanh"))
        gate, up = self.gate_up(x) if self.gate_up is not None else (self.w1(x), self.w3(x))
        return self.w2(SwiGLU.apply(gate, up))


class Block(nn.Module):
    def __init__(self, d: ModelDims) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(d.dim, d.norm_eps)
        self.attention = Attention(d)
        self.ffn_norm = RMSNorm(d.dim, d.norm_eps)
        self.feed_forward = FeedForward(d)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, d: ModelDims) -> None:
        super().__init__()
        self.dims = d
        self.tok_embeddings = nn.Embedding(d.vocab_size, d.dim)
        # a dict keyed by the global block index, so names stay the same when pipeline stages drop blocks
        self.layers = nn.ModuleDict({str(i): Block(d) for i in range(d.n_layers)})
        self.norm = RMSNorm(d.dim, d.norm_eps)
        self.output = nn.Linear(d.dim, d.vocab_size, bias=False)
        if d.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)

    def init_buffers(self, device: torch.device | str | None = None) -> None:
        cos, sin = rope_tables(self.dims.head_dim, self.dims.max_seq_len, self.dims.rope_theta, device)
        self.rope_cos, self.rope_sin = cos, sin

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        device = x.device.type
        if torch.is_autocast_enabled(device):  # the residual stream in the compute dtype, as every activation
            x = x.to(torch.get_autocast_dtype(device))
        for block in self.layers.values():
            x = block(x, self.rope_cos, self.rope_sin)
        x = self.norm(x) if self.norm is not None else x
        return self.output(x) if self.output is not None else x


def clean_name(name: str) -> str:
    """A parameter's name in this plain model: drops the prefixes that wrappers add (activation checkpointing,
    torch.compile, DDP), so the seeded init and the checkpoint keys see the same names in every layout."""
    for junk in ("_checkpoint_wrapped_module.", "_orig_mod."):
        name = name.replace(junk, "")
    return name.removeprefix("module.")


def weight_of(name: str, dims: ModelDims) -> str:
    """The weight a parameter holds: with tied embeddings the output projection is the embedding (a pipeline's
    last stage holds it as output.weight without the embedding module beside it), initialised and loaded as it."""
    return "tok_embeddings.weight" if dims.tie_embeddings and name == "output.weight" else name


INIT_TILE = (16, 1024)  # (rows, columns) of the 2-D view that one generator fills: 64 KiB of fp32


def init_std(name: str, dims: ModelDims) -> float | None:
    """The normal init's std of a parameter, from its name; None for the norm weights, which start at ones."""
    if name.endswith("norm.weight"):
        return None
    if name.endswith(("wo.weight", "w2.weight")):  # residual projections: scaled so depth does not blow up
        return 0.02 / math.sqrt(2 * dims.n_layers)
    return 0.02


def init_tile(name: str, seed: int, rows: int, cols: int, r: int, c: int) -> torch.Tensor:
    """Tile (r, c) of the (rows, cols) view of a parameter, unscaled N(0, 1), from its own CPU generator (CUDA
    generators give other numbers). The seed hashes (seed, name, r, c) with blake2b: stable across processes.
    torch's CPU generator keeps only 32 bits of a seed, so some tiles repeat others: about 2,000 pairs among the
    70B model's 4.3M tiles (0.1%), harmless for an init."""
    key = hashlib.blake2b(f"{seed}/{name}/{r}/{c}".encode(), digest_size=8).digest()
    g = torch.Generator().manual_seed(int.from_bytes(key, "little"))
    tr, tc = INIT_TILE
    return torch.randn(min(tr, rows - r * tr), min(tc, cols - c * tc), generator=g)


def init_slice(name: str, shape: Sequence[int], dims: ModelDims, seed: int, offset: Sequence[int],
               local_shape: Sequence[int], out: torch.Tensor | None = None) -> torch.Tensor:
    """The box [offset, offset + local_shape) of a parameter's initial value, written into `out` (any device;
    a new CPU tensor when None). Layout-independent: the parameter, viewed as (shape[0], prod(shape[1:])) (1-D:
    one row), is cut into INIT_TILE tiles each drawn from its own generator, and only the tiles the box touches
    are drawn, one band of tile rows at a time (host memory: one band of the box, not the parameter)."""
    out = torch.empty(tuple(local_shape)) if out is None else out
    std = init_std(name, dims)
    if std is None or out.numel() == 0:
        return out.fill_(1.0)
    if len(shape) < 2:  # a 1-D (or 0-D) parameter is one row
        shape, offset, local_shape = (1, *shape), (0, *offset), (1, *local_shape)
    rows, cols = shape[0], math.prod(shape[1:])
    runs = column_runs(shape[1:], offset[1:], local_shape[1:])
    target = out if out.is_contiguous() else torch.empty_like(out)
    flat = target.view(local_shape[0], -1)  # (local rows, local columns)
    tr, tc = INIT_TILE
    r0, r1 = offset[0], offset[0] + local_shape[0]
    for r in range(r0 // tr, (r1 - 1) // tr + 1):
        lo, hi = max(r0, r * tr), min(r1, (r + 1) * tr)
        band = torch.empty(hi - lo, flat.shape[1])
        tiles: dict[int, torch.Tensor] = {}  # this band's tiles, each drawn once
        for start, end, at in runs:
            for c in range(start // tc, (end - 1) // tc + 1):
                if c not in tiles:
                    tiles[c] = init_tile(name, seed, rows, cols, r, c)[lo - r * tr:hi - r * tr]
                a, b = max(start, c * tc), min(end, (c + 1) * tc)
                band[:, at + a - start:at + b - start] = tiles[c][:, a - c * tc:b - c * tc]
        flat[lo - r0:hi - r0].copy_(band.mul_(std))
    if target is not out:
        out.copy_(target)
    return out


def column_runs(shape: Sequence[int], offset: Sequence[int], local_shape: Sequence[int]) -> list[tuple[int, int, int]]:
    """A box of a row-major tensor of `shape` as runs of flat indices: (start, end, position in the box's flat
    order). One run when the box spans whole trailing dims (2-D views: always); adjacent runs are merged."""
    if not shape:
        return [(0, 1, 0)]
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    runs: list[tuple[int, int, int]] = []
    at = 0
    for idx in itertools.product(*(range(o, o + n) for o, n in zip(offset[:-1], local_shape[:-1]))):
        start = sum(i * st for i, st in zip(idx, strides)) + offset[-1]
        end = start + local_shape[-1]
        if runs and runs[-1][1] == start:
            runs[-1] = (runs[-1][0], end, runs[-1][2])
        elif end > start:
            runs.append((start, end, at))
        at += end - start
    return runs


def init_value(name: str, shape: Sequence[int], dims: ModelDims, seed: int) -> torch.Tensor:
    """The full, unsharded initial value of one parameter, from its name alone: layout-independent (the
    single-process reference; sharded parameters take their slice with init_slice)."""
    return init_slice(name, shape, dims, seed, (0,) * len(shape), tuple(shape))
