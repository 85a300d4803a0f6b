"""Context parallelism (parallel.cp): every sequence split over the cp ranks of a data replica, attention computed
by ring attention, so no rank holds a whole sequence's activations or its attention.

    pos = positions(seq_len, cp, cp_rank)      # this rank's token indices of every sequence
    apply_cp(model, group, ranks)              # each block's attention core runs the ring over the cp group
    place_rotary([model, *parts], pos)         # rotary positions are the global ones
    loader = ShardedLoader(loader, pos)        # every cp rank reads the same sequences and keeps its columns

Load balance: a sequence is cut into 2 cp chunks and cp rank r holds chunks r and 2 cp - 1 - r, an early and a late
one, so under the causal mask every rank computes the same number of query x key blocks (Megatron's and torch's
layout). Loss: each rank's cross-entropy is the mean over its tokens, all ranks holding as many; the dp group
counts the cp ranks (parallel.mesh), so its average of losses and of gradients is the mean over whole sequences.
Parameters are the same on every cp rank and nothing here holds state: a checkpoint written at one cp resumes at
another.

Ring attention (RingAttention) is our own, in plain torch, where torch 2.13 has context_parallel: torch's swaps
scaled_dot_product_attention under DTensor dispatch and runs its ring only for the CUDA flash, efficient and cuDNN
kernels, so the CPU's flash kernel, which the multi-process tests run on gloo, is not served (its handler raises
"CP only supports flash attention and memory efficient attention"); and it needs the model to call SDPA on
DTensors inside its context manager. Ours calls the attention kernels that return the log-sum-exp (the CPU flash
kernel; on CUDA the flash kernel, bf16/fp16) block by block: the K/V shard of every rank travels around the ring,
one hop per step, sent while the local blocks compute; partial outputs merge by the online softmax (running
log-sum-exp). The backward runs the kernels' own backward per block with the merged output and log-sum-exp (the
gradient of each block is then the whole attention's restricted to it), the K/V gradients travelling with their
K/V and a last hop taking them home. GQA: the CPU kernel reads grouped K/V heads; on CUDA they are repeated for
the kernel and their gradients summed back.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn

from hpctrain.model.transformer import AttentionCore


def positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """The token indices cp rank `rank` holds of a sequence of seq_len: chunks rank and 2 cp - 1 - rank of 2 cp."""
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2 x cp = {2 * cp}")
    c = seq_len // (2 * cp)
    early, late = rank * c, (2 * cp - 1 - rank) * c
    return torch.cat([torch.arange(early, early + c), torch.arange(late, late + c)])


def chunk_indices(cp: int, rank: int) -> tuple[int, int]:
    """The global chunk indices (of 2 cp) rank `rank` holds: its early and its late one."""
    return rank, 2 * cp - 1 - rank


def _block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """One query block against one key/value block: (output, log-sum-exp (B, H, Tq) fp32, what the kernel's backward
    needs besides)."""
    if q.device.type == "cuda":
        rep = q.shape[1] // k.shape[1]
        k, v = (k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)) if rep > 1 else (k, v)
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal)
        return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
    return out, lse, None


def _block_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, causal: bool, extra: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's backward of one block, with the whole attention's output and log-sum-exp."""
    if q.device.type == "cuda":
        rep = q.shape[1] // k.shape[1]
        kr, vr = (k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)) if rep > 1 else (k, v)
        cum_q, cum_k, max_q, max_k, seed, offset = extra
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad, q, kr, vr, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset)
        if rep > 1:
            dk, dv = (t.unflatten(1, (k.shape[1], rep)).sum(2) for t in (dk, dv))
        return dq, dk, dv
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(grad, q, k, v, out, lse, 0.0, causal)


class _Ring:
    """The cp group as a ring: this rank's index, and the global ranks it sends to and receives from."""

    def __init__(self, group, ranks: Sequence[int]) -> None:
        self.group, self.size = group, len(ranks)
        self.index = ranks.index(dist.get_rank())
        self.next, self.prev = ranks[(self.index + 1) % self.size], ranks[(self.index - 1) % self.size]

    def shift(self, t: torch.Tensor) -> tuple[torch.Tensor, list]:
        """Sends t to the next rank and receives the previous rank's into a new tensor; returns (it, the requests
        to wait on)."""
        got = torch.empty_like(t)
        ops = [dist.P2POp(dist.isend, t, self.next, self.group), dist.P2POp(dist.irecv, got, self.prev, self.group)]
        return got, dist.batch_isend_irecv(ops)


def _pairs(cp: int, mine: int, theirs: int) -> list[tuple[int, int, bool]]:
    """The (query chunk, key chunk, causal) blocks to compute when this rank (`mine`) holds the keys of `theirs`:
    a key chunk after the query chunk is masked out, the same chunk is causal, an earlier one is whole."""
    q_chunks, k_chunks = chunk_indices(cp, mine), chunk_indices(cp, theirs)
    return [(x, y, k_chunks[y] == q_chunks[x]) for x in (0, 1) for y in (0, 1) if k_chunks[y] <= q_chunks[x]]


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's two query chunks over the whole sequence's keys and values, which the ring
    brings one rank's shard at a time (module docstring). q (B, H, T, hd), k and v (B, H_kv, T, hd), T = the
    rank's share (two chunks of T / 2)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: _Ring) -> torch.Tensor:
        c = q.shape[2] // 2
        qs = (q[:, :, :c], q[:, :, c:])
        outs: list[Any] = [None, None]
        lses: list[Any] = [None, None]
        extra = None
        kv = torch.stack([k, v])
        for step in range(ring.size):
            theirs = (ring.index - step) % ring.size
            if step < ring.size - 1:
                nxt, reqs = ring.shift(kv)  # the next shard travels while this one computes
            for x, y, causal in _pairs(ring.size, ring.index, theirs):
                ks, vs = kv[0, :, :, y * c:(y + 1) * c], kv[1, :, :, y * c:(y + 1) * c]
                out, lse, extra = _block(qs[x], ks, vs, causal)
                outs[x], lses[x] = _merge(outs[x], lses[x], out, lse)
            if step < ring.size - 1:
                for r in reqs:
                    r.wait()
                kv = nxt
        # laid out (B, T, H, hd) as the flash kernel's output is, so the o projection's input (heads folded back
        # into the width) is a view of it, not a second copy that the projection would keep
        B, H, T, hd = q.shape
        out = torch.empty(B, T, H, hd, dtype=q.dtype, device=q.device).transpose(1, 2)
        out[:, :, :c], out[:, :, c:] = outs
        lse = torch.cat(lses, dim=2)
        ctx.ring, ctx.extra = ring, extra
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        ring, c = ctx.ring, q.shape[2] // 2
        grad = grad.contiguous()
        dq = torch.zeros_like(q, dtype=torch.float32)
        kv = torch.stack([k, v])
        dkv = torch.zeros_like(kv, dtype=torch.float32)  # the gradients of the K/V shard held, travelling with it
        for step in range(ring.size):
            theirs = (ring.index - step) % ring.size
            if step < ring.size - 1:
                nxt, reqs = ring.shift(kv)
            for x, y, causal in _pairs(ring.size, ring.index, theirs):
                qx, kx = slice(x * c, (x + 1) * c), slice(y * c, (y + 1) * c)
                gq, gk, gv = _block_backward(grad[:, :, qx], q[:, :, qx], kv[0, :, :, kx], kv[1, :, :, kx],
                                             out[:, :, qx], lse[:, :, qx], causal, ctx.extra)
                dq[:, :, qx] += gq
                dkv[0, :, :, kx] += gk
                dkv[1, :, :, kx] += gv
            sent = dkv
            dkv, dreqs = ring.shift(sent)  # on to the next rank; after the last step, home to its owner
            for r in dreqs:
                r.wait()
            del sent
            if step < ring.size - 1:
                for r in reqs:
                    r.wait()
                kv = nxt
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None


def _merge(out: torch.Tensor | None, lse: torch.Tensor | None, block_out: torch.Tensor,
           block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The online softmax: two partial attentions over disjoint keys, each normalised by its own log-sum-exp, as
    one over the union (fp32)."""
    block_out = block_out.float()
    if out is None:
        return block_out, block_lse
    new = torch.logaddexp(lse, block_lse)
    return out * torch.exp(lse - new).unsqueeze(-1) + block_out * torch.exp(block_lse - new).unsqueeze(-1), new


class RingAttentionCore(AttentionCore):
    """An attention core whose keys and values are the whole sequence's, held across the cp group (RingAttention).
    Apply with apply_cp, never by hand."""

    ring: _Ring

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return RingAttention.apply(q, k, v, self.ring)


def apply_cp(model: nn.Module, group, ranks: Sequence[int]) -> None:
    """Every block's attention core runs ring attention over `group` (global ranks `ranks`, in cp order)."""
    ring = _Ring(group, list(ranks))
    for module in model.modules():
        if type(module) is AttentionCore:
            module.__class__ = RingAttentionCore
            module.ring = ring


def place_rotary(models: Sequence[nn.Module], pos: torch.Tensor) -> None:
    """The rotary tables of each model (or pipeline stage) keep the rows of this rank's positions: the attention
    reads the first T rows, T the rank's share of a sequence (after the buffers are made: materialize)."""
    for m in models:
        m.rope_cos, m.rope_sin = m.rope_cos[pos.to(m.rope_cos.device)], m.rope_sin[pos.to(m.rope_sin.device)]


class ShardedLoader:
    """A training or evaluation loader whose batches keep this cp rank's positions of every sequence (inputs and
    targets alike); everything else is the loader's own (its position, its state for checkpoints)."""

    def __init__(self, loader: Any, pos: torch.Tensor) -> None:
        self.loader, self.pos = loader, pos

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.loader.next_batch()
        return x[:, self.pos], y[:, self.pos]

    def batches(self):
        for x, y in self.loader.batches():
            yield x[:, self.pos], y[:, self.pos]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)
