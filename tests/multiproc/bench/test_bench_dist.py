"""Multi-process tier of the benchmark: real processes on gloo with torchrun's variables, one spawn of 2 ranks
(one node) and one of 4 ranks (2 "nodes" of 2). Each worker runs every case in-process (tests/workers/bench_worker.py).

Every collective, with the check on, must count 0 wrong elements in every placement it offers, for float sum,
int32 max, double avg, bfloat16 sum (up to 1 MiB: several check chunks), int8 prod and half min, with the timed
calls launched back to back (-z 0, the default) and waited for one by one (-z 1); an injected wrong element must
fail the run; the ranks' times combine as nccl-tests' -a says (rank 0, mean, min, max of known per-rank times);
the two-level all-reduce must equal the flat one (and a single-process reference) on the session's own
intra/inter groups; --group intra and inter run on 2-rank groups, and --group cp on the cp groups of parallel.cp = 2
(its ring's send/receive).

    .venv/bin/python -m pytest tests/multiproc/bench/test_bench_dist.py -q
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from helpers.launch import EXAMPLE, WORKERS, free_base_port, spawn_ranks
from helpers.runs import only_run_dir
from hpctrain.bench.colls import COLLS
from hpctrain.bench.sweep import bus_factor

ALL_COLLS = ["all_reduce", "all_gather", "reduce_scatter", "alltoall", "broadcast", "reduce", "sendrecv"]
SMALL = ["-b", "1K", "-e", "64K", "-f", "8", "-n", "2", "-w", "1"]
SMALL_SIZES = [1024, 8192, 65536]
BIG = ["-b", "8K", "-e", "1M", "-f", "128", "-n", "1", "-w", "0"]
BIG_SIZES = [8192, 1 << 20]
ONE_SIZE = ["-b", "8K", "-e", "8K", "-n", "2", "-w", "1"]
ELEM = {"float": 4, "int32": 4, "double": 8, "bfloat16": 2, "half": 2, "int8": 1}


def _cases(out: Path, world: int) -> list:
    cases = [
        ("all", ["all", *SMALL, "-J", str(out / "extra.jsonl"), "--plot", str(out / "extra.png")]),
        ("int32_max", ["all", *SMALL, "-d", "int32", "-o", "max"]),
        ("double_avg", ["all", *SMALL, "-d", "double", "-o", "avg"]),
        # 512K elements: the check's chunks (64K on a host) end inside every collective's per-rank chunks
        ("bf16_sum", ["all", *BIG, "-d", "bfloat16"]),
        ("int8_prod", ["all", *SMALL, "-d", "int8", "-o", "prod"]),
        ("half_min", ["all", *SMALL, "-d", "half", "-o", "min"]),
        ("inject", ["all", "-b", "1K", "-e", "1K", "-n", "1", "-w", "0"]),  # the worker injects a wrong element
        ("blocking_max", ["all", *ONE_SIZE, "-a", "3", "-z", "1"]),
        ("world_time", "world_time"),
    ]
    if world == 4:
        cases += [
            ("hier", "hier"),
            ("hier_bench", ["all_reduce", "--algo", "hier", *SMALL]),
            ("intra", ["all", *ONE_SIZE, "--group", "intra", "-r", "1"]),
            ("inter", ["all", *ONE_SIZE, "--group", "inter"]),
            # context parallel's ring: the 2 cp groups of 2 ranks beside tp 2 (parallel.cp = 2), the send to the next
            ("cp", ["sendrecv", *ONE_SIZE, "--group", "cp", "--set", "parallel.cp=2"]),
        ]
    return cases


def _spawn(out: Path, world: int) -> dict:
    """Starts `world` workers, 2 ranks per node; returns the run root and every rank's record."""
    cases = _cases(out, world)
    base = free_base_port(len(cases))
    cmd = [sys.executable, str(WORKERS / "bench_worker.py"), str(out), str(EXAMPLE), str(base),
           json.dumps(cases)]
    procs = spawn_ranks(world, cmd, ranks_per_node=2, run_id=f"bench-{world}")
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * world, "\n".join(outs)
    return {"root": out, "world": world, "records": [json.loads((out / f"rank{r}.json").read_text())
                                                     for r in range(world)]}


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> dict:
    return _spawn(tmp_path_factory.mktemp("bench2"), 2)


@pytest.fixture(scope="module")
def four(tmp_path_factory) -> dict:
    return _spawn(tmp_path_factory.mktemp("bench4"), 4)


@pytest.fixture(params=[2, 4], ids=["2ranks", "4ranks"])
def spawned(request) -> dict:
    return request.getfixturevalue({2: "two", 4: "four"}[request.param])


def _run(spawned: dict, name: str) -> tuple[Path, list[dict]]:
    run_dir = only_run_dir(spawned["root"] / name)
    rows = [json.loads(line) for line in (run_dir / "bench.jsonl").read_text().splitlines()]
    return run_dir, rows


def _offered(coll: str) -> list[str]:
    """JSON tags of the placements torch offers for this collective."""
    return [{"out": "oop", "in": "ip"}[p] for p in COLLS[coll].placements["torch"]]


def _check_rows(rows: list[dict], *, colls, sizes, nranks: int, dtype: str, op: str, group: str, algo: str,
                average: int = 1, blocking: int = 0) -> None:
    assert [r["coll"] for r in rows] == [c for c in colls for _ in sizes]
    for r in rows:
        where = (r["coll"], r["size"])
        assert r["size"] in sizes, where
        T = r["size"] // ELEM[dtype]
        assert r["count"] == COLLS[r["coll"]].chunk(T, nranks), where
        assert (r["nranks"], r["dtype"], r["op"], r["group"], r["backend"], r["algo"], r["average"],
                r["blocking"]) == (nranks, dtype, op, group, "torch", algo, average, blocking), where
        for tag in ("oop", "ip"):
            if tag in _offered(r["coll"]):
                assert r[f"{tag}_wrong"] == 0, (where, tag, r)
                assert r[f"{tag}_time_us"] > 0, (where, tag)
                assert r[f"{tag}_busbw"] == pytest.approx(r[f"{tag}_algbw"] * bus_factor(r["coll"], nranks))
            else:
                assert [r[f"{tag}_{k}"] for k in ("time_us", "algbw", "busbw", "wrong")] == [None] * 4, (where, tag)


def _check_ok_run(spawned: dict, name: str, rows: list[dict]) -> Path:
    assert all(rec[name] == {"ok": True} for rec in spawned["records"]), (name, spawned["records"])
    run_dir = only_run_dir(spawned["root"] / name)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["ok"] and summary["world_size"] == spawned["world"] and summary["launcher"] == "torchrun"
    assert summary["bench"]["rows"] == len(rows) and summary["bench"]["wrong"] == 0
    text = (run_dir / "bench.txt").read_text()
    assert "# Out of bounds values : 0 OK" in text
    assert (run_dir / "busbw.png").stat().st_size > 0
    return run_dir


@pytest.mark.parametrize("name, dtype, op", [("all", "float", "sum"), ("int32_max", "int32", "max"),
                                             ("double_avg", "double", "avg"), ("bf16_sum", "bfloat16", "sum"),
                                             ("int8_prod", "int8", "prod"), ("half_min", "half", "min")])
def test_every_collective_zero_wrong(spawned, name, dtype, op):
    run_dir, rows = _run(spawned, name)
    _check_rows(rows, colls=ALL_COLLS, sizes=BIG_SIZES if name == "bf16_sum" else SMALL_SIZES,
                nranks=spawned["world"], dtype=dtype, op=op, group="world", algo="flat")
    _check_ok_run(spawned, name, rows)
    text = (run_dir / "bench.txt").read_text()
    for coll in ALL_COLLS:
        assert f"\n# {coll}\n# time: mean over ranks (-a 1), back-to-back launches, one wait (-z 0);" in text
    assert " -a 1 -z 0\n" in text  # the command's line
    if name == "all":  # -J and --plot write the same rows and a second plot
        assert (spawned["root"] / "extra.jsonl").read_text() == (run_dir / "bench.jsonl").read_text()
        assert (spawned["root"] / "extra.png").stat().st_size > 0


def test_blocking_calls_and_max_time_zero_wrong(spawned):
    """-z 1 (wait and barrier after each call) and -a 3 (the slowest rank's time): every collective still checks 0
    wrong, and the rows and the table say which definition they hold."""
    run_dir, rows = _run(spawned, "blocking_max")
    _check_rows(rows, colls=ALL_COLLS, sizes=[8192], nranks=spawned["world"], dtype="float", op="sum",
                group="world", algo="flat", average=3, blocking=1)
    _check_ok_run(spawned, "blocking_max", rows)
    text = (run_dir / "bench.txt").read_text()
    assert text.count("# time: max over ranks (-a 3), wait and barrier after each call (-z 1);") == len(ALL_COLLS)


def test_ranks_times_combine_as_nccl_tests_average(spawned):
    """Rank r's time r + 1 s: -a 0 gives rank 0's (1), -a 1 the mean, -a 2 the minimum, -a 3 the maximum; the
    same on every rank."""
    w = spawned["world"]
    for rank, rec in enumerate(spawned["records"]):
        assert rec["world_time"] == {"0": 1.0, "1": (w + 1) / 2, "2": 1.0, "3": float(w)}, (rank, rec["world_time"])


def test_injected_wrong_element_fails_the_run(spawned):
    errors = {rec["inject"].get("error") for rec in spawned["records"]}
    assert len(errors) == 1, errors  # every rank fails, with the same words
    (msg,) = errors
    assert msg and msg.startswith("RuntimeError") and "wrong element" in msg
    run_dir, rows = _run(spawned, "inject")
    assert [r["coll"] for r in rows] == ALL_COLLS  # rank 0 wrote the rows before failing
    wrong = sum(r[f"{tag}_wrong"] for r in rows for tag in _offered(r["coll"]))
    assert wrong > 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["ok"] is False and "wrong element" in summary["error"]
    assert summary["bench"]["wrong"] == wrong
    assert f"# Out of bounds values : {wrong} FAILED" in (run_dir / "bench.txt").read_text()


def test_injected_wrong_element_reaches_every_collective(spawned):
    """One corrupted element per checked placement: each offered placement of each collective counts exactly 1."""
    _, rows = _run(spawned, "inject")
    got = {(r["coll"], tag): r[f"{tag}_wrong"] for r in rows for tag in _offered(r["coll"])}
    assert got == {key: 1 for key in got}


def test_hierarchical_all_reduce_equals_flat(four):
    for rank, rec in enumerate(four["records"]):
        hier = rec["hier"]
        assert "error" not in hier, hier
        assert hier["intra"] == [[0, 1], [2, 3]][rank // 2] and hier["inter"] == [[0, 2], [1, 3]][rank % 2]
        for case in ("int64_sum", "int32_max", "float_sum", "float_min", "double_prod"):
            assert hier[case] == {"hier_eq_flat": True, "hier_eq_ref": True, "changed": True}, (rank, case)
        for case in ("randn_sum", "randn_avg"):
            r = hier[case]
            assert r["max_abs_ref"] > 1.0  # a real signal, not zeros
            assert r["max_diff_flat"] <= 1e-5 and r["max_diff_ref"] <= 1e-5, (rank, case, r)


def test_hierarchical_benchmark_rows(four):
    _, rows = _run(four, "hier_bench")
    _check_rows(rows, colls=["all_reduce"], sizes=SMALL_SIZES, nranks=4, dtype="float", op="sum", group="world",
                algo="hier")
    run_dir = _check_ok_run(four, "hier_bench", rows)
    assert "# all_reduce (hierarchical)" in (run_dir / "bench.txt").read_text()


@pytest.mark.parametrize("group, root", [("intra", 1), ("inter", 0)])
def test_node_groups_run_on_two_ranks(four, group, root):
    _, rows = _run(four, group)
    _check_rows(rows, colls=ALL_COLLS, sizes=[8192], nranks=2, dtype="float", op="sum", group=group, algo="flat")
    assert {r["root"] for r in rows} == {root}
    run_dir = _check_ok_run(four, group, rows)
    assert f"| group {group} (2 ranks each) |" in (run_dir / "bench.txt").read_text()


def test_cp_group_runs_the_ring(four):
    _, rows = _run(four, "cp")
    _check_rows(rows, colls=["sendrecv"], sizes=[8192], nranks=2, dtype="float", op="sum", group="cp", algo="flat")
    run_dir = _check_ok_run(four, "cp", rows)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["layout"] == {"pp": 1, "dp": 2, "tp": 2, "cp": 2, "data": 1}  # the example's tp = 2
    assert summary["checks"]["groups"]["cp"] == [[0, 2], [1, 3]]
