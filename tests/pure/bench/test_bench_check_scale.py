"""The benchmark's result check at scale: closed-form expected values (hpctrain/bench/pattern.py) against a
brute-force reference over materialised inputs, a simulated world of every collective (right and misrouted
results), and the check's memory for one rank of a simulated 128-rank job.

The memory tests run the harness's own run_placement on one rank of torch's fake process group (its collectives
do nothing: it simulates sizes, never correctness, which tests/multiproc/bench/test_bench_dist.py proves on real gloo
ranks) and count the bytes of every tensor storage torch creates meanwhile.

    .venv/bin/python -m pytest tests/pure/bench/test_bench_check_scale.py -q
    # prints memory and time, closed form vs materialised
    .venv/bin/python tests/pure/bench/test_bench_check_scale.py
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import time
import weakref

import pytest
import seams
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from hpctrain.bench import harness
from hpctrain.bench.colls import COLLS, Ctx
from hpctrain.bench.harness import DTYPES, Options
from hpctrain.bench.pattern import Pattern, exact_limit, reduce_inputs

OPS = ["sum", "prod", "min", "max", "avg"]
MIB = 1 << 20


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the tensor storages created while active (views and in-place results of existing tensors
    are not new memory); a storage counts until torch frees it."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.now = self.peak = 0

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage._cdata
                if key not in given and key not in self.live:
                    self.live[key] = storage.nbytes()
                    self.now += storage.nbytes()
                    self.peak = max(self.peak, self.now)
                    weakref.finalize(storage, self._free, key)
        return out


@contextlib.contextmanager
def fake_rank(rank: int, world: int):
    """This process as one rank of a `world`-rank job on torch's fake process group (sizes only), on one thread:
    the bytes do not depend on it, and on 2 shared cores spinning worker threads cost seconds."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)


def check_path(coll: str, nbytes: int, world: int, rank: int = 5, op: str = "sum", dtype: str = "float",
               track: bool = True) -> tuple[int, float]:
    """(peak bytes torch allocates beyond the send/receive buffers, seconds) of one checked run_placement of
    `coll` on `nbytes` for rank `rank` of `world` fake ranks: filling the input, the run, the check."""
    opts = Options(colls=[coll], sizes=[nbytes], iters=1, warmup=0, op=op, dtype=dtype)
    c = COLLS[coll]
    ctx = Ctx(idx=rank, members=list(range(world)), op=op, inplace="out" not in c.placements["torch"])
    tdtype = DTYPES[dtype]
    T = nbytes // tdtype.itemsize // c.align(world) * c.align(world)
    with fake_rank(rank, world):
        buffers = harness.alloc_buffers(c, ctx, T, tdtype, torch.device("cpu"), "torch")
        inputs = harness.Inputs(opts, tdtype, world)
        tracker = LiveBytes() if track else contextlib.nullcontext()
        t0 = time.perf_counter()
        with tracker:
            harness.run_placement(c, ctx, T, opts, torch.device("cpu"), inputs, lambda x: x, lambda x: x, lambda: None,
                            buffers=buffers)
        seconds = time.perf_counter() - t0
    return (tracker.peak if track else 0), seconds


# --- memory at a simulated 128 ranks --------------------------------------------------------------------

def test_all_reduce_check_at_128_ranks_is_o_message():
    """The 4 MiB all-reduce check of one rank of 128 needs less than its message size again (2.5 GiB when every
    rank's input was built), and the same bytes as on 2 ranks."""
    peak128, _ = check_path("all_reduce", 4 * MIB, world=128)
    peak2, _ = check_path("all_reduce", 4 * MIB, world=2, rank=1)
    assert 0 < peak128 <= 4 * MIB, peak128 / MIB
    assert peak128 == peak2


@pytest.mark.parametrize("coll, dtype, op", [(c, "float", "sum") for c in COLLS] + [
    ("all_reduce", "bfloat16", "prod"), ("all_reduce", "int8", "max"), ("reduce_scatter", "half", "avg")])
def test_every_check_at_128_ranks_is_o_message(coll, dtype, op):
    peak, _ = check_path(coll, 4 * MIB, world=128, rank=0, op=op, dtype=dtype)
    assert peak <= 4 * MIB, (coll, dtype, op, peak / MIB)


def test_check_memory_does_not_grow_with_the_message():
    """Checking works chunk by chunk: a 32 MiB message needs the same bytes as a 4 MiB one (so -e 8G runs)."""
    small, _ = check_path("all_reduce", 4 * MIB, world=128)
    big, _ = check_path("all_reduce", 32 * MIB, world=128)
    assert big == small


def test_the_measure_sees_a_materialising_check(monkeypatch):
    """The tracker is the test's instrument: an expected value built from every member's input (the old check)
    must blow the bound."""
    def materialised(x, c, T, p):
        return reduce_inputs([x.values(j, torch.arange(T)) for j in range(c.n)], c.op)[p]

    monkeypatch.setattr(COLLS["all_reduce"], "expected", materialised)
    peak, _ = check_path("all_reduce", MIB // 4, world=128)
    assert peak > 100 * MIB // 4


# --- the closed form is the brute-force reduction ---------------------------------------------------------

CASES = [(d, op) for d, op in itertools.product(DTYPES, OPS) if op != "avg" or DTYPES[d].is_floating_point]


@pytest.mark.parametrize("dtype, op", CASES)
def test_closed_form_equals_materialised_reduction(dtype, op):
    i = torch.arange(3000) + 2**32 - 1000  # indices across 2**32 (an 8 GiB int8 message) too
    for n in (1, 2, 3, 4, 5, 7, 8, 12, 13, 64, 128, 200):
        pat = Pattern(7, DTYPES[dtype], op, n)
        inputs = [pat.values(j, i).to(DTYPES[dtype]) for j in range(n)]  # what each member holds
        want = pat.reduced(i)
        ref = reduce_inputs(inputs, op)
        if op == "avg":
            torch.testing.assert_close(want, ref, rtol=1e-15, atol=0)
        else:
            assert torch.equal(want.double(), ref), (n, (want.double() != ref).sum())
            # the reference is exact in the element type: a correct result compares equal
            assert torch.equal(ref.to(DTYPES[dtype]).double(), ref), n


@pytest.mark.parametrize("op", ["sum", "prod", "min", "max"])
def test_reduced_values_vary_by_element(op):
    """Not a constant per element even when every residue is held equally often (n = 12 = lcm(1..4)), so a
    result written to the wrong position is caught; and at every element, members with different residues hold
    different values (b_i a unit mod m_i), so a missing or doubled member changes the sum."""
    i = torch.arange(4096)
    for n in (4, 12, 24 if op == "prod" else 128):  # products of 2**n must stay exact in float32
        pat = Pattern(0, torch.float32, op, n)
        assert pat.reduced(i).unique().numel() >= 3, (n, pat.reduced(i).unique())
        m = pat.kinds[pat.kind(i), 1]
        x = torch.stack([pat.values(j, i) for j in range(n)]).sort(0).values
        assert torch.equal((x.diff(dim=0) != 0).sum(0) + 1, m.clamp(max=n)), n


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_data_movement_values_differ_between_members(dtype):
    """The wide pattern: every member of a group up to its modulus holds a different value at every element,
    exactly representable in the type and never the sentinel."""
    pat = Pattern(3, DTYPES[dtype], None, 64)
    x = torch.stack([pat.values(j, torch.arange(2048)) for j in range(64)])
    assert (x.sort(0).values.diff(dim=0) != 0).all()
    assert int(x.min()) >= 0 and int(x.max()) < exact_limit(DTYPES[dtype])
    assert torch.equal(x.to(DTYPES[dtype]).long(), x)


def test_harness_at_128_members_right_result_and_injection():
    """run_placement on a stand-in all-reduce that writes the right bf16 result of 128 members: 0 wrong; with
    one wrong element injected (tests/plugins/seams.py) exactly 1, also where element 0 sums to 256 and 256 + 1
    rounds back to 256 in bf16."""
    n, T = 128, 4096
    seed = next(s for s in range(100) if int(Pattern(s, torch.bfloat16, "sum", n).reduced(torch.arange(1))) == 256)
    opts = Options(colls=["all_reduce"], sizes=[2 * T], iters=1, warmup=0, dtype="bfloat16", seed=seed)
    inputs = harness.Inputs(opts, torch.bfloat16, n)
    pat = inputs.pattern(COLLS["all_reduce"])

    def write_right(send, recv, ctx) -> None:  # complete on return: nothing to wait for
        recv.copy_(pat.reduced(torch.arange(recv.numel())))

    right = dataclasses.replace(COLLS["all_reduce"], run_torch=write_right)
    ctx = Ctx(idx=0, members=list(range(n)), inplace=True)  # the root: it injects
    for inject, wrong in ((False, 0), (True, 1)):
        with seams.wrong_element() if inject else contextlib.nullcontext():
            res = harness.run_placement(right, ctx, T, opts, torch.device("cpu"), inputs, lambda x: x, lambda x: x,
                                        lambda: None)
        assert res["wrong"] == wrong, inject


# --- a simulated world: every collective by brute force, checked by the harness --------------------------

def simulate(coll: str, sends: list[torch.Tensor], idx: int, op: str, root: int, shift: int) -> torch.Tensor | None:
    """What member idx receives, from every member's send buffer; shift=1 misroutes the data by one place."""
    n = len(sends)
    rows = [s.view(n, -1) for s in sends]  # (n, T // n): chunk k of each member
    if coll == "all_reduce" or (coll == "reduce" and idx == root):
        return reduce_inputs(sends, op).roll(shift)  # misrouted: every element one position off
    if coll == "reduce":
        return None
    if coll == "reduce_scatter":
        return reduce_inputs([r[(idx + shift) % n] for r in rows], op)  # the next member's chunk
    if coll == "all_gather":
        return torch.cat([sends[(k + shift) % n] for k in range(n)])  # chunks rotated
    if coll == "alltoall":
        return torch.cat([rows[k][(idx + shift) % n] for k in range(n)])  # the wrong chunk of every member
    if coll == "broadcast":
        return sends[(root + shift) % n]
    return sends[(idx - 1 + shift) % n]  # sendrecv: its own input instead of the previous member's


@pytest.mark.parametrize("coll", list(COLLS))
@pytest.mark.parametrize("dtype, op", [("float", "sum"), ("int32", "max"), ("double", "avg"), ("bfloat16", "sum"),
                                       ("half", "prod"), ("int8", "min"), ("uint8", "sum")])
def test_simulated_world_zero_wrong_and_misrouting_caught(coll, dtype, op):
    """Every member's result built by brute force from every member's input passes the harness's check; the same
    result misrouted by one place fails on many elements (most, but for products of ones and twos)."""
    c, tdtype = COLLS[coll], DTYPES[dtype]
    for n in (2, 3, 4, 5):
        T, root = 60 * c.align(n), n - 1
        pat = harness.Inputs(Options(colls=[coll], sizes=[T], op=op, dtype=dtype), tdtype, n).pattern(c)
        sends = [torch.empty(c.sizes(T, n)[0], dtype=tdtype) for _ in range(n)]
        for j, buf in enumerate(sends):
            pat.fill(buf, j, chunk=7)  # chunk edges fall inside every collective's chunks
        received = caught = 0
        for idx in range(n):
            ctx = Ctx(idx=idx, members=list(range(n)), op=op, root=root)
            right, misrouted = (simulate(coll, sends, idx, op, root, shift) for shift in (0, 1))
            if right is None:
                assert harness.check_recv(c, pat, ctx, T, torch.zeros(T, dtype=tdtype), chunk=7) is None
                continue
            assert harness.check_recv(c, pat, ctx, T, right.to(tdtype), chunk=7) == 0, (n, idx)
            caught += harness.check_recv(c, pat, ctx, T, misrouted.to(tdtype), chunk=7)
            received += right.numel()
        assert caught > received // 4, (n, caught, received)


# --- figures ----------------------------------------------------------------------------------------------

def _materialised(x, c, T, p):
    return reduce_inputs([x.values(j, torch.arange(T)).to(x.dtype) for j in range(c.n)], c.op)[p]


def main() -> None:
    """The 4 MiB float all-reduce check of one rank of 128: closed form against materialising every member's
    input in one piece (what the check did before)."""
    coll, chunk = COLLS["all_reduce"], harness.check_chunk
    for name, expected, steps in (("closed form", coll.expected, chunk), ("materialised", _materialised,
                                                                          lambda device: 1 << 62)):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(coll, "expected", expected)
            mp.setattr(harness, "check_chunk", steps)
            peak, _ = check_path("all_reduce", 4 * MIB, world=128)
            seconds = min(check_path("all_reduce", 4 * MIB, world=128, track=False)[1] for _ in range(3))
        print(f"{name:>13}: peak {peak / MIB:8.1f} MiB beyond the buffers, {seconds * 1e3:8.1f} ms "
              "(fill + check, one thread, 128 simulated ranks)")


if __name__ == "__main__":
    main()
