"""Pure tests of the benchmark: size parsing and sweeps, bus bandwidth arithmetic, the nccl-tests table, the
JSON rows, option checks, the seeded data / wrong-element count, how the ranks' times combine (-a) and the timed
loop's shape (-z), and the host buffers of the MPI backend on a device job. No processes, no torch.distributed.

    .venv/bin/python -m pytest tests/pure/bench/test_bench_pure.py -q
"""
from __future__ import annotations

import dataclasses
import re
import sys
import types

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from hpctrain.bench import harness
from hpctrain.bench.colls import COLLS, Ctx
from hpctrain.bench.harness import DTYPES, Options, count_wrong
from hpctrain.bench.pattern import make_data, reduce_inputs
from hpctrain.bench.sweep import (
    Row,
    bandwidths,
    bus_factor,
    combine_times,
    format_row,
    parse_size,
    size_sweep,
    summary_lines,
    table_header,
)
from hpctrain.cli import main as cli

ALL_COLLS = ["all_reduce", "all_gather", "reduce_scatter", "alltoall", "broadcast", "reduce", "sendrecv"]


def refused(fragments, **kw) -> str:
    """Options(**kw) must raise ValueError naming every fragment."""
    with pytest.raises(ValueError) as info:
        Options(**({"colls": ["all_reduce"], "sizes": [1024]} | kw))
    msg = str(info.value)
    for fragment in fragments:
        assert fragment in msg, f"{fragment!r} not in {msg!r}"
    return msg


# --- bus bandwidth ----------------------------------------------------------------------------------------

# Hand-computed nccl-tests factors: all_reduce 2(n-1)/n; gather/scatter/alltoall (n-1)/n; the rest 1.
FACTORS = {
    2: {"all_reduce": 1.0, "all_gather": 0.5, "reduce_scatter": 0.5, "alltoall": 0.5},
    4: {"all_reduce": 1.5, "all_gather": 0.75, "reduce_scatter": 0.75, "alltoall": 0.75},
    8: {"all_reduce": 1.75, "all_gather": 0.875, "reduce_scatter": 0.875, "alltoall": 0.875},
}


@pytest.mark.parametrize("n", [2, 4, 8])
def test_bus_factors_by_hand(n):
    want = FACTORS[n] | {"broadcast": 1.0, "reduce": 1.0, "sendrecv": 1.0}
    assert set(want) == set(COLLS) == set(ALL_COLLS)  # one factor per defined collective
    for coll, factor in want.items():
        assert bus_factor(coll, n) == pytest.approx(factor, abs=1e-12), coll


def test_bandwidths_by_hand():
    # 1e9 bytes in 0.5 s = 2 GB/s algorithm bandwidth; all_reduce on 4 ranks moves 2*3/4 of it per link
    assert bandwidths(10**9, 0.5, "all_reduce", 4) == pytest.approx((2.0, 3.0))
    # 64 KiB in 100 us: 0.65536 GB/s; all_gather on 8 ranks: * 7/8
    algbw, busbw = bandwidths(65536, 100e-6, "all_gather", 8)
    assert algbw == pytest.approx(0.65536) and busbw == pytest.approx(0.65536 * 7 / 8)
    assert bandwidths(1024, 1e-3, "broadcast", 2) == pytest.approx((1.024e-3, 1.024e-3))
    assert bandwidths(1024, 0.0, "all_reduce", 4) == (0.0, 0.0)  # a zero time reports no bandwidth


# --- sizes ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, want", [
    ("8", 8), ("64K", 64 * 1024), ("1M", 1024**2), ("2G", 2 * 1024**3), ("1m", 1024**2), ("16k", 16384),
    ("64KB", 65536), (" 4M ", 4 * 1024**2), ("0", 0),
])
def test_parse_size(text, want):
    assert parse_size(text) == want


@pytest.mark.parametrize("text", ["", "K", "abc", "1.5K", "-8", "1T", "8 K B x", "0x10", "1KK"])
def test_parse_size_refuses_naming_the_text(text):
    with pytest.raises(ValueError) as info:
        parse_size(text)
    assert repr(text) in str(info.value)


def test_size_sweep_factor_and_step():
    assert size_sweep(1024, 65536, 8) == [1024, 8192, 65536]
    assert size_sweep(8, 128) == [8, 16, 32, 64, 128]  # factor 2 by default
    assert size_sweep(1024, 60000, 8) == [1024, 8192]  # max is an upper bound, not a member
    assert size_sweep(64, 64, 2) == [64]
    assert size_sweep(8, 32, step=8) == [8, 16, 24, 32]
    assert size_sweep(8, 30, step=8) == [8, 16, 24]
    assert size_sweep(8, 32, factor=1, step=8) == [8, 16, 24, 32]  # the factor does not matter with a step


@pytest.mark.parametrize("args, fragments", [
    ((0, 1024), ["-b 0", "-e 1024"]),
    ((2048, 1024), ["-b 2048", "-e 1024"]),
    ((-8, 1024), ["-b -8"]),
    ((8, 1024, 1), ["-f 1"]),
    ((8, 1024, 0), ["-f 0"]),
])
def test_size_sweep_refuses(args, fragments):
    with pytest.raises(ValueError) as info:
        size_sweep(*args)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_size_sweep_refuses_negative_step():
    with pytest.raises(ValueError, match="-i -8"):
        size_sweep(8, 32, step=-8)


# --- table and JSON ---------------------------------------------------------------------------------------

def _res(time_us, algbw, busbw, wrong):
    return {"time_us": time_us, "algbw": algbw, "busbw": busbw, "wrong": wrong}


def _row(coll="all_gather", out=None, inp=None, size=65536, **kw) -> Row:
    base = dict(coll=coll, size=size, count=4096, dtype="float", op="sum", root=0, nranks=4, group="world",
                backend="torch", algo="flat", out=out, inp=inp)
    return Row(**(base | kw))


def _ends(line: str) -> list[int]:
    return [m.end() for m in re.finditer(r"\S+", line)]


def test_table_columns_line_up():
    head = table_header("all_gather")
    assert head[0] == "# all_gather"
    assert head[1] == ("# time: mean over ranks (-a 1), back-to-back launches, one wait (-z 0); bandwidths from "
                       "that time")
    head = head[:1] + head[2:]  # the columns
    names, units = head[2], head[3]
    assert names.split() == ["#", "size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong",
                             "time", "algbw", "busbw", "#wrong"]
    row = format_row(_row(out=_res(1234.5, 0.05, 0.04, 0), inp=_res(987654.3, 123.45, 92.59, 3)))
    assert row.split() == ["65536", "4096", "float", "none", "-1", "1234.5", "0.05", "0.04", "0",
                           "987654.3", "123.45", "92.59", "3"]
    name_ends = _ends(names)[1:]  # without the leading '#'
    assert _ends(row) == name_ends  # every number ends under its header
    unit_ends = _ends(units)[1:]
    assert [u for u in units.split()[1:]] == ["(B)", "(elements)", "(us)", "(GB/s)", "(GB/s)", "(us)", "(GB/s)",
                                              "(GB/s)"]
    assert set(unit_ends) <= set(name_ends)
    assert len(names) == len(row)
    # the placement titles sit over their four columns: out-of-place over the first time..#wrong, in-place after
    title = head[1]
    oop_start, oop_end = title.index("out-of-place"), title.index("out-of-place") + len("out-of-place")
    ip_start = title.index("in-place")
    first_time_start = name_ends[5] - 9  # the time column is 9 wide
    assert first_time_start <= oop_start and oop_end <= name_ends[8]
    assert name_ends[8] < ip_start and ip_start + len("in-place") <= name_ends[12]


def test_table_na_cells_and_columns():
    # torch all_reduce: in-place only; the out-of-place cells print N/A and the columns still line up
    row = format_row(_row("all_reduce", inp=_res(5.0, 1.0, 1.5, 0), count=16384))
    assert row.split()[:9] == ["65536", "16384", "float", "sum", "-1", "N/A", "N/A", "N/A", "N/A"]
    assert _ends(row) == _ends(table_header("x")[3])[1:]
    # alltoall: out-of-place only
    cells = format_row(_row("alltoall", out=_res(5.0, 1.0, 0.75, 0))).split()
    assert cells[5:9] == ["5.0", "1.00", "0.75", "0"] and cells[9:] == ["N/A"] * 4
    # check off: timings printed, #wrong N/A
    cells = format_row(_row("sendrecv", out=_res(5.0, 1.0, 1.0, None))).split()
    assert cells[8] == "N/A"


@pytest.mark.parametrize("coll, op, shown", [
    ("all_reduce", "max", ["max", "-1"]), ("reduce_scatter", "sum", ["sum", "-1"]), ("reduce", "prod", ["prod", "2"]),
    ("broadcast", "sum", ["none", "2"]), ("all_gather", "sum", ["none", "-1"]), ("alltoall", "sum", ["none", "-1"]),
    ("sendrecv", "sum", ["none", "-1"]),
])
def test_table_redop_and_root_columns(coll, op, shown):
    """Like nccl-tests: the reduction only for reducing collectives, the root only for rooted ones."""
    cells = format_row(_row(coll, op=op, root=2, inp=_res(1.0, 1.0, 1.0, 0))).split()
    assert cells[3:5] == shown


def test_summary_lines():
    ok = [_row(out=_res(1, 1, 2.0, 0), inp=_res(1, 1, 4.0, 0)), _row("all_reduce", inp=_res(1, 1, 6.0, 0))]
    assert summary_lines(ok) == ["# Out of bounds values : 0 OK", "# Avg bus bandwidth    : 4", "#"]
    bad = ok + [_row("sendrecv", out=_res(1, 1, 8.0, 3), size=1024)]
    lines = summary_lines(bad)
    assert lines[0] == "# Out of bounds values : 3 FAILED"
    assert lines[1] == "# Avg bus bandwidth    : 5"  # (2 + 4 + 6 + 8) / 4
    assert summary_lines(bad, min_bytes_for_avg=2048)[1] == "# Avg bus bandwidth    : 4"  # the 1 KiB row left out
    unchecked = [_row(out=_res(1, 1, 2.0, None))]
    assert summary_lines(unchecked)[0] == "# Out of bounds values : 0 OK"
    assert summary_lines([])[:2] == ["# Out of bounds values : 0 OK", "# Avg bus bandwidth    : 0"]


def test_row_json_fields():
    row = _row("alltoall", out=_res(12.5, 1.25, 0.9375, 0), group="inter", nranks=2)
    d = row.to_json()
    assert list(d) == ["coll", "size", "count", "dtype", "op", "root", "nranks", "group", "backend", "algo",
                       "average", "blocking", "oop_time_us", "oop_algbw", "oop_busbw", "oop_wrong", "ip_time_us",
                       "ip_algbw", "ip_busbw", "ip_wrong"]
    assert d["coll"] == "alltoall" and d["size"] == 65536 and d["count"] == 4096 and d["group"] == "inter"
    assert d["nranks"] == 2 and d["backend"] == "torch" and d["algo"] == "flat"
    assert (d["average"], d["blocking"]) == (1, 0)  # nccl-tests' defaults
    other = _row(average=3, blocking=1).to_json()
    assert (other["average"], other["blocking"]) == (3, 1)
    assert (d["oop_time_us"], d["oop_algbw"], d["oop_busbw"], d["oop_wrong"]) == (12.5, 1.25, 0.9375, 0)
    assert d["ip_time_us"] is d["ip_algbw"] is d["ip_busbw"] is d["ip_wrong"] is None
    d = _row("all_reduce", inp=_res(1.0, 2.0, 3.0, 7)).to_json()
    assert d["oop_wrong"] is None and d["ip_wrong"] == 7


# --- options ----------------------------------------------------------------------------------------------

def test_options_defaults_and_aliases():
    o = Options(colls=list(COLLS), sizes=[1024])
    assert (o.iters, o.warmup, o.check, o.dtype, o.op, o.group, o.backend, o.algo, o.average, o.blocking) == (
        20, 5, True, "float", "sum", "world", "torch", "flat", 1, 0)
    for alias, name in [("fp32", "float"), ("float64", "double"), ("bf16", "bfloat16"), ("fp16", "half"),
                        ("int", "int32"), ("long", "int64")]:
        assert Options(colls=["all_reduce"], sizes=[8], dtype=alias).dtype == name
    Options(colls=["all_reduce"], sizes=[8], algo="hier")  # the one valid hier combination
    Options(colls=["all_reduce"], sizes=[8], backend="mpi", dtype="double")
    Options(colls=["all_reduce"], sizes=[8], dtype="double", op="avg")


@pytest.mark.parametrize("kw, fragments", [
    ({"colls": ["all_reduce", "allgather", "bcast"]}, ["allgather", "bcast", "all_reduce", "sendrecv"]),
    ({"dtype": "float8"}, ["float8", "bfloat16"]),
    ({"op": "mean"}, ["mean", "avg"]),
    ({"op": "avg", "dtype": "int32"}, ["avg", "int32"]),
    ({"op": "avg", "dtype": "uint8"}, ["avg", "uint8"]),
    ({"group": "node"}, ["node", "intra", "inter"]),
    ({"backend": "nccl"}, ["nccl", "torch", "mpi"]),
    ({"backend": "mpi", "dtype": "bfloat16"}, ["mpi", "bfloat16"]),
    ({"backend": "mpi", "dtype": "fp16"}, ["mpi", "half"]),
    ({"algo": "ring"}, ["ring", "flat", "hier"]),
    ({"algo": "hier", "colls": ["all_gather"]}, ["hier", "all_gather"]),
    ({"algo": "hier", "colls": ["all_reduce", "reduce"]}, ["hier", "all_reduce, reduce"]),
    ({"algo": "hier", "group": "intra"}, ["hier", "--group intra"]),
    ({"algo": "hier", "backend": "mpi"}, ["hier", "--backend mpi"]),
    ({"iters": 0}, ["-n 0"]),
    ({"warmup": -1}, ["-w -1"]),
    ({"root": -1}, ["-r -1"]),
    ({"average": 4}, ["-a 4", "0 (rank 0)", "1 (mean)", "2 (min)", "3 (max)"]),
    ({"blocking": 2}, ["-z 2", "0 (back-to-back", "1 (wait and barrier"]),
])
def test_options_refused_naming_the_value(kw, fragments):
    refused(fragments, **kw)


@pytest.mark.parametrize("argv, fragments", [
    (["allreduce"], ["allreduce"]),
    (["all_reduce", "-b", "1X"], ["'1X'"]),
    (["all_reduce", "-b", "64K", "-e", "1K"], ["-b 65536", "-e 1024"]),
    (["all_reduce", "-f", "1"], ["-f 1"]),
    (["all_reduce", "-d", "float8"], ["float8"]),
    (["all_reduce", "--algo", "hier", "--group", "inter"], ["--group inter"]),
    (["all_reduce", "-a", "4"], ["'-a'", "4 is not in the range"]),
    (["all_reduce", "-z", "2", "--submit"], ["'-z'", "2 is not in the range"]),  # before a job is submitted
])
def test_cli_bench_refuses_before_starting(argv, fragments):
    """Bad options exit 2 with the value named, before any rendezvous (nothing here starts a process group)."""
    result = CliRunner().invoke(cli.main, ["bench", *argv])
    assert result.exit_code == 2, result.output
    for fragment in fragments:
        assert fragment in result.output, result.output


# --- data and checking ------------------------------------------------------------------------------------

def test_make_data_is_seeded():
    a = make_data(3, 1000, torch.float32, "sum", seed=5)
    assert a.dtype == torch.float32 and a.shape == (1000,)
    assert torch.equal(a, make_data(3, 1000, torch.float32, "sum", seed=5))
    assert not torch.equal(a, make_data(2, 1000, torch.float32, "sum", seed=5))  # ranks differ
    assert not torch.equal(a, make_data(3, 1000, torch.float32, "sum", seed=6))  # seeds differ
    assert set(a.unique().tolist()) == {0.0, 1.0, 2.0, 3.0}
    # the same values in every type, so the reference does not depend on the element type
    for dtype in DTYPES.values():
        assert torch.equal(make_data(3, 1000, dtype, "sum", 5).double(), a.double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8, torch.bfloat16])
def test_prod_data_is_ones_and_twos(dtype):
    x = make_data(1, 4096, dtype, "prod", seed=0)
    assert set(x.unique().double().tolist()) == {1.0, 2.0}
    # so an 8-rank product is a power of two, exact in float
    ref = reduce_inputs([make_data(r, 4096, dtype, "prod", 0) for r in range(8)], "prod")
    assert bool(((ref >= 1) & (ref <= 256) & (torch.log2(ref) == torch.log2(ref).round())).all())


def test_reduce_inputs_by_hand():
    xs = [torch.tensor([1, 3, 0]), torch.tensor([2, 1, 3]), torch.tensor([2, 2, 1])]
    assert reduce_inputs(xs, "sum").tolist() == [5, 6, 4]
    assert reduce_inputs(xs, "prod").tolist() == [4, 6, 0]
    assert reduce_inputs(xs, "min").tolist() == [1, 1, 0]
    assert reduce_inputs(xs, "max").tolist() == [2, 3, 3]
    assert reduce_inputs(xs, "avg").tolist() == pytest.approx([5 / 3, 2, 4 / 3])


def test_count_wrong_exact():
    want = torch.tensor([0.0, 1.0, 2.0, 12.0], dtype=torch.float64)
    assert count_wrong(torch.tensor([0, 1, 2, 12], dtype=torch.int32), want, "sum") == 0
    assert count_wrong(torch.tensor([0, 1, 3, 99], dtype=torch.int32), want, "max") == 2
    got = want.float().clone()
    got[1] = torch.nextafter(got[1], torch.tensor(2.0))  # one ulp off is wrong for exact ops
    assert count_wrong(got, want, "sum") == 1


def test_count_wrong_avg_tolerance():
    want = torch.tensor([5 / 3, 2.0, 4 / 3, 0.0], dtype=torch.float64)
    assert count_wrong(want.float(), want, "avg") == 0  # float32 rounding of a thirds is fine
    off = want.float()
    off[0] = off[0] * (1 + 2 * torch.finfo(torch.float32).eps)  # a couple of ulps: within tolerance
    assert count_wrong(off, want, "avg") == 0
    off[2] = off[2] * (1 + 1e-4)  # far beyond float32 rounding
    off[3] = 1e-30  # zero must stay zero
    assert count_wrong(off, want, "avg") == 2
    # the tolerance follows the element type: half rounding passes in half, fails if judged as float
    assert count_wrong(want.half(), want, "avg") == 0
    assert count_wrong(want.half().float(), want, "avg") > 0




@pytest.mark.parametrize("dtype, op, nranks", [
    ("float", "sum", 1024), ("half", "sum", 512), ("bfloat16", "sum", 64), ("int8", "sum", 32), ("int8", "prod", 6),
    ("half", "prod", 16), ("bfloat16", "prod", 64),
    ("int8", "prod", 8),  # one 8-GPU node
    ("uint8", "prod", 8),
    ("half", "prod", 32),
    ("int8", "sum", 128),
    ("bfloat16", "sum", 256),  # 32 x 8 GPUs
])
def test_reference_is_exact_in_the_element_type(dtype, op, nranks):
    """The check compares against a float64 reference, so the reference must be representable in the element type
    (partial results of sum and prod of these non-negative inputs are no larger than the final one)."""
    ref = reduce_inputs([make_data(r, 4096, DTYPES[dtype], op, 0, nranks) for r in range(nranks)], op)
    assert torch.equal(ref.to(DTYPES[dtype]).double(), ref), f"max {ref.max().item()}"


# --- timing definitions: -a and -z, as nccl-tests ----------------------------------------------------------

def test_combine_times_by_hand():
    """nccl-tests' -a over every rank's time per call: 0 rank 0's own, 1 the mean, 2 the minimum, 3 the maximum."""
    per_rank = [5.0, 1.0, 3.0, 7.0]
    assert [combine_times(per_rank, a) for a in range(4)] == [5.0, 4.0, 1.0, 7.0]
    assert combine_times([2.5], 1) == 2.5
    with pytest.raises(ValueError, match="-a 4"):
        combine_times(per_rank, 4)


class Recorder:
    """Stand-ins for a launch that returns a work handle, the device sync and the barrier; `log` is what ran."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.launched = 0

    def launch(self):
        self.launched += 1
        i = self.launched
        self.log.append(f"launch {i}")
        return types.SimpleNamespace(wait=lambda: self.log.append(f"wait {i}"))

    def sync(self) -> None:
        self.log.append("sync")

    def barrier(self) -> None:
        self.log.append("barrier")


def test_timed_loop_blocking_0_launches_all_then_waits_once():
    r = Recorder()
    harness.timed_loop(r.launch, 3, 0, r.sync, r.barrier)
    assert r.log == ["launch 1", "launch 2", "launch 3", "wait 1", "wait 2", "wait 3", "sync"]


def test_timed_loop_blocking_1_waits_and_passes_a_barrier_after_each_call():
    r = Recorder()
    harness.timed_loop(r.launch, 2, 1, r.sync, r.barrier)
    assert r.log == ["launch 1", "wait 1", "sync", "barrier", "launch 2", "wait 2", "sync", "barrier"]


def test_timed_loop_waits_for_batched_and_finished_launches():
    """A launch may return several works (the ring exchange's send and receive) or None (complete on return)."""
    log: list[str] = []
    works = [types.SimpleNamespace(wait=lambda k=k: log.append(f"wait {k}")) for k in ("send", "recv")]
    harness.timed_loop(lambda: works, 2, 0, lambda: log.append("sync"), lambda: None)
    assert log == ["wait send", "wait recv", "wait send", "wait recv", "sync"]
    harness.timed_loop(lambda: None, 2, 1, lambda: log.append("sync"), lambda: log.append("barrier"))
    assert log[5:] == ["sync", "barrier", "sync", "barrier"]


@pytest.mark.parametrize("blocking", [0, 1])
def test_run_placement_times_the_loop_of_its_blocking_mode(blocking):
    """run_placement on a stand-in all-reduce: warm-up launches, their waits, the barrier, then the timed loop of
    -z's shape, the combined time from this rank's seconds per call, then the checked call."""
    r = Recorder()
    coll = dataclasses.replace(COLLS["all_reduce"], run_torch=lambda s, recv, c: r.launch())
    opts = Options(colls=["all_reduce"], sizes=[64], iters=3, warmup=1, check=False, blocking=blocking)
    seen = []
    res = harness.run_placement(coll, Ctx(idx=0, members=[0], inplace=True), 16, opts, torch.device("cpu"),
                                harness.Inputs(opts, torch.float32, 1), lambda t: seen.append(t) or 42.0,
                                lambda x: x, r.barrier)
    timed = (["launch 2", "launch 3", "launch 4", "wait 2", "wait 3", "wait 4"] if blocking == 0 else
             ["launch 2", "wait 2", "barrier", "launch 3", "wait 3", "barrier", "launch 4", "wait 4", "barrier"])
    assert r.log == ["launch 1", "wait 1", "barrier"] + timed  # (no sync on the host)
    assert len(seen) == 1 and seen[0] > 0 and res["time_us"] == 42.0e6  # world_time's result is what is reported


# --- the MPI backend's buffers on a device job -------------------------------------------------------------

class OneRankComm:
    """An mpi4py communicator of one member that records what each call is handed; the fake mpi4py below gives
    MPI.IN_PLACE and the reduction ops."""

    def __init__(self, in_place) -> None:
        self.in_place, self.handed = in_place, []

    def _take(self, *bufs) -> None:
        self.handed += [type(b).__name__ for b in bufs if b is not self.in_place]

    def _copy(self, src, dst) -> None:
        self._take(src, dst)
        if src is not self.in_place:
            dst[...] = src.reshape(dst.shape)

    def Allreduce(self, src, dst, op):
        self._copy(src, dst)

    def Allgather(self, src, dst):
        self._copy(src, dst)

    def Reduce_scatter_block(self, src, dst, op):
        self._copy(src, dst)

    def Alltoall(self, src, dst):
        self._copy(src, dst)

    def Reduce(self, src, dst, op, root):
        self._copy(src, dst)

    def Bcast(self, buf, root):
        self._take(buf)

    def Sendrecv(self, src, dest, recvbuf, source):
        self._copy(src, recvbuf)

    def Sendrecv_replace(self, buf, dest, source):
        self._take(buf)


@pytest.mark.faults
def test_mpi_backend_hands_mpi_host_buffers_on_a_device_job(monkeypatch):
    """`--backend mpi` in a GPU job: the buffers are host memory whatever the job's device (meta stands in for a
    GPU); they were allocated on the device and .numpy() failed on them."""
    from faults import record

    in_place = object()
    fake = types.ModuleType("mpi4py")
    fake.MPI = types.SimpleNamespace(IN_PLACE=in_place, SUM="sum", PROD="prod", MIN="min", MAX="max")
    monkeypatch.setitem(sys.modules, "mpi4py", fake)
    device = torch.device("meta")
    assert harness.buffer_device("mpi", device) == torch.device("cpu")
    assert harness.buffer_device("torch", torch.device("cuda", 3)) == torch.device("cuda", 3)
    opts = Options(colls=list(COLLS), sizes=[256], iters=2, warmup=1, backend="mpi")
    for name, coll in COLLS.items():
        for placement in coll.placements["mpi"]:
            comm = OneRankComm(in_place)
            ctx = Ctx(idx=0, members=[0], inplace=placement == "in", comm=comm)
            send, recv = harness.alloc_buffers(coll, ctx, 64, torch.float32, device, "mpi")
            assert send.device.type == recv.device.type == "cpu", name
            res = harness.run_placement(coll, ctx, 64, opts, device, harness.Inputs(opts, torch.float32, 1),
                                        lambda t: t, lambda x: x, lambda: None)
            assert res["wrong"] == 0, (name, placement)
            assert comm.handed and set(comm.handed) == {np.ndarray.__name__}, (name, placement, comm.handed)
    record("`hpctrain bench --backend mpi` on a job whose device is not the host (stand-in device)",
           "every collective's buffers handed to MPI are host (numpy) arrays and check 0 wrong", None, "unit")
