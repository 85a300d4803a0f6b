"""Pure tier for context parallelism (hpctrain.parallel.context, parallel.mesh's cp): the load-balanced positions,
the blocks each rank computes, the ring's block arithmetic in one process (every rank's blocks, merged by the
online softmax and differentiated by the kernel's backward with the merged output, against one causal attention),
the layout's cp groups and rank map, and the config's refusals. The ring over real processes:
tests/multiproc/parallel/test_train_equivalence.py.

    .venv/bin/python -m pytest tests/pure/parallel/test_context.py -q
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hpctrain.config import load_config
from hpctrain.parallel import context
from hpctrain.parallel.mesh import Layout, block_placement, format_rank_map, rank_table, resolve_layout
from hpctrain.parallel.plan import make_plan


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_positions_cover_the_sequence_once_early_and_late(cp) -> None:
    s = 8 * cp
    every = torch.cat([context.positions(s, cp, r) for r in range(cp)])
    assert sorted(every.tolist()) == list(range(s))
    c = s // (2 * cp)
    assert context.positions(s, cp, 0)[:c].tolist() == list(range(c))  # rank 0: the first chunk and the last
    assert context.positions(s, cp, 0)[c:].tolist() == list(range(s - c, s))
    with pytest.raises(ValueError, match="not divisible by 2 x cp"):
        context.positions(10, 4, 0)


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
def test_every_rank_computes_as_many_blocks_and_the_triangle_once(cp) -> None:
    """Causal load balance: each rank computes the same number of (query chunk, key chunk) blocks over the ring's
    steps, and together they compute every block on or below the diagonal exactly once, the diagonal causal."""
    seen, per_rank = [], []
    for r in range(cp):
        blocks = [(context.chunk_indices(cp, r)[x], context.chunk_indices(cp, j)[y], causal)
                  for j in range(cp) for x, y, causal in context._pairs(cp, r, j)]
        per_rank.append(len(blocks))
        seen += blocks
    assert len(set(per_rank)) == 1
    n = 2 * cp
    assert sorted(seen) == sorted((a, b, a == b) for a in range(n) for b in range(a + 1))


@pytest.mark.parametrize("cp, kv_heads", [(2, 4), (2, 2), (4, 1)])
def test_the_ring_blocks_give_causal_attention_and_its_gradients(cp, kv_heads) -> None:
    """Each rank's blocks (context._pairs, _block), merged by the online softmax (_merge), give the whole causal
    attention of its chunks; each block's backward with the merged output and log-sum-exp, summed, gives autograd's
    gradients of scaled_dot_product_attention (GQA: the kernel's grouped K/V heads)."""
    g = torch.Generator().manual_seed(cp + kv_heads)
    B, H, S, D = 2, 4, 8 * cp, 16
    q, k, v = (torch.randn(B, h, S, D, generator=g).requires_grad_(True) for h in (H, kv_heads, kv_heads))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv_heads != H)
    grad = torch.randn(ref.shape, generator=g)
    ref.backward(grad)
    c = S // (2 * cp)
    cut = lambda t, i: t.detach()[:, :, i * c:(i + 1) * c]  # noqa: E731
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for r in range(cp):
        mine = context.chunk_indices(cp, r)
        outs, lses = [None, None], [None, None]
        for j in range(cp):
            for x, y, causal in context._pairs(cp, r, j):
                out, lse, _ = context._block(cut(q, mine[x]), cut(k, context.chunk_indices(cp, j)[y]),
                                             cut(v, context.chunk_indices(cp, j)[y]), causal)
                outs[x], lses[x] = context._merge(outs[x], lses[x], out, lse)
        for x in (0, 1):
            assert torch.allclose(outs[x], cut(ref, mine[x]), atol=2e-6), (r, x)
        for j in range(cp):
            theirs = context.chunk_indices(cp, j)
            for x, y, causal in context._pairs(cp, r, j):
                gq, gk, gv = context._block_backward(cut(grad, mine[x]).contiguous(), cut(q, mine[x]),
                                                     cut(k, theirs[y]), cut(v, theirs[y]), outs[x], lses[x], causal,
                                                     None)
                dq[:, :, mine[x] * c:(mine[x] + 1) * c] += gq
                dk[:, :, theirs[y] * c:(theirs[y] + 1) * c] += gk
                dv[:, :, theirs[y] * c:(theirs[y] + 1) * c] += gv
    for ours, theirs in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
        assert torch.allclose(ours, theirs, atol=1e-5)


def test_a_merge_is_one_softmax_over_both_key_sets() -> None:
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=g) for _ in range(3))
    whole = F.scaled_dot_product_attention(q, k, v)
    a, la, _ = context._block(q, k[:, :, :2], v[:, :, :2], False)
    b, lb, _ = context._block(q, k[:, :, 2:], v[:, :, 2:], False)
    out, lse = context._merge(*context._merge(None, None, a, la), b, lb)
    assert torch.allclose(out, whole, atol=1e-6)
    assert torch.allclose(lse, torch.logsumexp(q @ k.transpose(-1, -2) / 8 ** 0.5, -1), atol=1e-5)


def test_layout_puts_cp_next_to_tp_and_inside_dp() -> None:
    lay = resolve_layout(1, -1, 2, 16, cp=2)
    assert (lay.dp, lay.cp, lay.data, str(lay)) == (8, 2, 4, "pp=1 dp=4 cp=2 tp=2")
    assert lay.group(0, "cp") == [0, 2] and lay.group(5, "cp") == [5, 7] and lay.group(6, "cp") == [4, 6]
    assert lay.coords(6) == {"pp": 0, "dp": 3, "tp": 0, "data": 1, "cp": 1}
    assert sorted(r for g in lay.groups("cp") for r in g) == list(range(16))
    assert lay.group(0, "dp") == [0, 2, 4, 6, 8, 10, 12, 14]  # gradients: every replica and cp rank
    assert resolve_layout(2, 2, 2, 16, cp=2) == Layout(2, 4, 2, 2)
    with pytest.raises(ValueError, match=r"pp\(1\) \* dp\(3\) \* cp\(2\) \* tp\(2\) = 12 != world size 16"):
        resolve_layout(1, 3, 2, 16, cp=2)
    with pytest.raises(ValueError, match=r"not divisible by pp\(1\) \* cp\(3\) \* tp\(2\)"):
        resolve_layout(1, -1, 2, 16, cp=3)
    text = format_rank_map(lay, rank_table(lay, block_placement(2, 8)))
    assert "cp_group" in text and "layout pp=1 dp=4 cp=2 tp=2" in text
    row = text.splitlines()[8]  # rank 6: data replica 1, cp rank 1
    assert row.split()[3:7] == ["0", "1", "1", "0"] and "[4,6]" in row


def test_config_refuses_what_cp_cannot_split(tmp_path) -> None:
    base = ["job.tasks_per_node=4", "parallel.cp=2", "model.max_seq_len=64"]
    with pytest.raises(ValueError, match="data.seq_len = 30 must be divisible by 2 x parallel.cp = 4"):
        load_config(None, base + ["data.seq_len=30"])
    with pytest.raises(ValueError, match="data.seq_len / parallel.cp = 6 must be divisible by parallel.tp = 4"):
        load_config(None, ["job.tasks_per_node=8", "parallel.cp=2", "parallel.tp=4", "model.max_seq_len=64",
                           "data.seq_len=12", "parallel.sequence_parallel=true"])
    with pytest.raises(ValueError, match="parallel.cp = 2 with train.precision = 'fp32' on GPUs"):
        load_config(None, base + ["data.seq_len=32", "job.gpus_per_node=4", "train.precision=fp32"])
    with pytest.raises(ValueError, match="parallel.cp = 0 must be"):
        load_config(None, ["parallel.cp=0"])
    cfg = load_config(None, base + ["data.seq_len=32", "train.micro_batch_size=2", "train.grad_accum=3"])
    plan = make_plan(cfg, block_placement(1, 4), training=True)
    assert (plan.layout, plan.global_batch) == (Layout(1, 4, 1, 2), 2 * 3 * 2)  # 2 replicas of the data
