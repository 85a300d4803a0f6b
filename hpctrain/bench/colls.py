"""One small definition per collective, for torch.distributed and for MPI (mpi4py on host buffers).

A definition says how big the send and receive buffers are for a total of T elements, how the in-place
buffers alias one allocation, how to launch it on each backend (torch: async_op=True, returning what to wait for,
so the harness can issue calls back to back as nccl-tests' -z 0 does; MPI: a call that returns complete), and
what positions p of the receive buffer must hold
afterwards, as a formula over the closed-form inputs (pattern.py) of the group's members: a check never builds
another member's buffer. Placements a backend does not offer are left out (torch has no out-of-place all_reduce,
broadcast or reduce; gloo's alltoall and the ring exchange cannot alias) and print as N/A.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from hpctrain.bench.pattern import Pattern

TORCH_OPS = {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT, "min": dist.ReduceOp.MIN,
             "max": dist.ReduceOp.MAX, "avg": dist.ReduceOp.AVG}

# torch 2.13 renamed the tensor forms; an older torch on a cluster has only the old names.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class Ctx:
    """Where a collective runs: this rank's index in the group, the group's global ranks, op, root, placement."""
    idx: int
    members: list[int]
    op: str = "sum"
    root: int = 0  # group-local index
    inplace: bool = False
    group: Any = None  # torch ProcessGroup
    comm: Any = None  # mpi4py communicator over the same members
    hier: tuple[Any, Any] | None = None  # (intra, inter) torch groups: two-level all_reduce

    @property
    def n(self) -> int:
        return len(self.members)


def hierarchical_all_reduce(t: torch.Tensor, intra, inter, op: str = "sum") -> None:
    """Two-level all-reduce: reduce-scatter inside the node, all-reduce of the shard across nodes, all-gather
    inside the node, so each inter-node link carries 1/ranks_per_node of the data. t.numel() must divide by
    the intra group's size."""
    k = dist.get_world_size(intra)
    flat = t.view(-1)
    shard = torch.empty(flat.numel() // k, dtype=t.dtype, device=t.device)
    reduce_scatter_single(shard, flat, op=TORCH_OPS[op], group=intra)
    dist.all_reduce(shard, op=TORCH_OPS[op], group=inter)
    all_gather_single(flat, shard, group=intra)


def _mpi_op(op: str):
    from mpi4py import MPI
    ops = {"sum": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX}
    if op not in ops:
        raise ValueError(f"-o {op}: MPI has no such reduction (use sum, prod, min or max)")
    return ops[op]


def _src(send: torch.Tensor, ctx: Ctx):
    """MPI send argument: MPI_IN_PLACE for in-place placements."""
    from mpi4py import MPI
    return MPI.IN_PLACE if ctx.inplace else send.numpy()


@dataclass
class Coll:
    name: str
    sizes: Callable[[int, int], tuple[int, int]]  # (T, n) -> (send elements, recv elements)
    chunk: Callable[[int, int], int]  # (T, n) -> the table's count column
    align: Callable[[int], int]  # n -> T must be a multiple of this
    views: Callable[[torch.Tensor, Ctx, str], tuple[torch.Tensor, torch.Tensor]]  # (buf, ctx, backend) in place
    run_torch: Callable[[torch.Tensor, torch.Tensor, Ctx], Any]  # launches; returns a Work, a list of them, or None
    run_mpi: Callable[[torch.Tensor, torch.Tensor, Ctx], Any]  # returns when complete
    # (inputs, ctx, T, p) -> what receive positions p (int64) must hold; None: nothing to check on this rank
    expected: Callable[[Pattern, Ctx, int, torch.Tensor], torch.Tensor | None]
    placements: dict[str, tuple[str, ...]]  # backend -> subset of ("out", "in")
    reduces: bool = False  # inputs from the reduction's exact range (else the wide one)


def _same(buf: torch.Tensor, ctx: Ctx, backend: str):
    return buf, buf


def _chunk_of(buf: torch.Tensor, ctx: Ctx) -> torch.Tensor:
    return buf.view(ctx.n, -1)[ctx.idx]


def _all_reduce_torch(send, recv, ctx: Ctx):
    if ctx.hier is not None:
        # three dependent steps on two groups: each waits for the one before (on NCCL a stream wait only)
        return hierarchical_all_reduce(recv, *ctx.hier, op=ctx.op)
    return dist.all_reduce(recv, op=TORCH_OPS[ctx.op], group=ctx.group, async_op=True)


def _ring_torch(send, recv, ctx: Ctx):
    nxt, prv = ctx.members[(ctx.idx + 1) % ctx.n], ctx.members[(ctx.idx - 1) % ctx.n]
    ops = [dist.P2POp(dist.isend, send, nxt, group=ctx.group), dist.P2POp(dist.irecv, recv, prv, group=ctx.group)]
    return dist.batch_isend_irecv(ops)


def _ring_mpi(send, recv, ctx: Ctx):
    nxt, prv = (ctx.idx + 1) % ctx.n, (ctx.idx - 1) % ctx.n
    if ctx.inplace:
        ctx.comm.Sendrecv_replace(recv.numpy(), dest=nxt, source=prv)
    else:
        ctx.comm.Sendrecv(send.numpy(), dest=nxt, recvbuf=recv.numpy(), source=prv)


def _reduce_mpi(send, recv, ctx: Ctx):
    from mpi4py import MPI
    src = MPI.IN_PLACE if ctx.inplace and ctx.idx == ctx.root else send.numpy()
    ctx.comm.Reduce(src, recv.numpy(), op=_mpi_op(ctx.op), root=ctx.root)


def _reduce_scatter_views(buf, ctx: Ctx, backend: str):
    # torch (like NCCL) leaves rank i's result in chunk i of the input; MPI_IN_PLACE leaves it at the front
    return buf, (_chunk_of(buf, ctx) if backend == "torch" else buf.view(ctx.n, -1)[0])


def _reduce_scatter_mpi(send, recv, ctx: Ctx):
    if ctx.inplace:
        full = send.numpy()
        ctx.comm.Reduce_scatter_block(_src(send, ctx), full, op=_mpi_op(ctx.op))
    else:
        ctx.comm.Reduce_scatter_block(send.numpy(), recv.numpy(), op=_mpi_op(ctx.op))


def _alltoall_mpi(send, recv, ctx: Ctx):
    ctx.comm.Alltoall(_src(send, ctx), recv.numpy())


COLLS: dict[str, Coll] = {c.name: c for c in [
    Coll("all_reduce", sizes=lambda T, n: (T, T), chunk=lambda T, n: T, align=lambda n: 1, views=_same,
         run_torch=_all_reduce_torch,
         run_mpi=lambda s, r, c: c.comm.Allreduce(_src(s, c), r.numpy(), op=_mpi_op(c.op)),
         expected=lambda x, c, T, p: x.reduced(p),
         placements={"torch": ("in",), "mpi": ("out", "in")}, reduces=True),
    Coll("all_gather", sizes=lambda T, n: (T // n, T), chunk=lambda T, n: T // n, align=lambda n: n,
         views=lambda buf, c, b: (_chunk_of(buf, c), buf),
         run_torch=lambda s, r, c: all_gather_single(r, s, group=c.group, async_op=True),
         run_mpi=lambda s, r, c: c.comm.Allgather(_src(s, c), r.numpy()),
         expected=lambda x, c, T, p: x.values(p // (T // c.n), p % (T // c.n)),  # chunk k from member k
         placements={"torch": ("out", "in"), "mpi": ("out", "in")}),
    Coll("reduce_scatter", sizes=lambda T, n: (T, T // n), chunk=lambda T, n: T // n, align=lambda n: n,
         views=_reduce_scatter_views,
         run_torch=lambda s, r, c: reduce_scatter_single(r, s, op=TORCH_OPS[c.op], group=c.group, async_op=True),
         run_mpi=_reduce_scatter_mpi,
         expected=lambda x, c, T, p: x.reduced(c.idx * (T // c.n) + p),
         placements={"torch": ("out", "in"), "mpi": ("out", "in")}, reduces=True),
    Coll("alltoall", sizes=lambda T, n: (T, T), chunk=lambda T, n: T // n, align=lambda n: n, views=_same,
         run_torch=lambda s, r, c: dist.all_to_all_single(r, s, group=c.group, async_op=True),
         run_mpi=_alltoall_mpi,
         # chunk k comes from member k's chunk idx
         expected=lambda x, c, T, p: x.values(p // (T // c.n), c.idx * (T // c.n) + p % (T // c.n)),
         placements={"torch": ("out",), "mpi": ("out", "in")}),
    Coll("broadcast", sizes=lambda T, n: (T, T), chunk=lambda T, n: T, align=lambda n: 1, views=_same,
         run_torch=lambda s, r, c: dist.broadcast(r, src=c.members[c.root], group=c.group, async_op=True),
         run_mpi=lambda s, r, c: c.comm.Bcast(r.numpy(), root=c.root),
         expected=lambda x, c, T, p: x.values(c.root, p),
         placements={"torch": ("in",), "mpi": ("in",)}),
    Coll("reduce", sizes=lambda T, n: (T, T), chunk=lambda T, n: T, align=lambda n: 1, views=_same,
         run_torch=lambda s, r, c: dist.reduce(r, dst=c.members[c.root], op=TORCH_OPS[c.op], group=c.group,
                                                async_op=True),
         run_mpi=_reduce_mpi,
         expected=lambda x, c, T, p: x.reduced(p) if c.idx == c.root else None,
         placements={"torch": ("in",), "mpi": ("out", "in")}, reduces=True),
    Coll("sendrecv", sizes=lambda T, n: (T, T), chunk=lambda T, n: T, align=lambda n: 1, views=_same,
         run_torch=_ring_torch, run_mpi=_ring_mpi,
         expected=lambda x, c, T, p: x.values((c.idx - 1) % c.n, p),
         placements={"torch": ("out",), "mpi": ("out", "in")}),
]}
