"""hpctrain bench through the real launchers: mpiexec (two named nodes, torch and MPI backends) and Slurm
(`--submit --wait` on the local 2-node cluster, intra- and inter-node groups)."""
from __future__ import annotations

import json
import sys

import pytest

from helpers.launch import EXAMPLE, hpctrain, run_mpiexec
from helpers.runs import only_run_dir

SMALL = ["-b", "1K", "-e", "64K", "-f", "8", "-n", "3", "-w", "1"]


def _rows(root) -> list[dict]:
    return [json.loads(line) for line in (only_run_dir(root) / "bench.jsonl").read_text().splitlines()]


def _all_right(rows: list[dict], colls: set[str], nranks: int, group: str) -> None:
    assert {r["coll"] for r in rows} == colls
    for r in rows:
        assert r["nranks"] == nranks and r["group"] == group
        checked = [r[f"{t}_wrong"] for t in ("oop", "ip") if r[f"{t}_busbw"] is not None]
        assert checked and all(w == 0 for w in checked), r


def _bench(root, *args: str) -> list[str]:
    return [sys.executable, "-m", "hpctrain.cli", "bench", *args, *SMALL, "--config", str(EXAMPLE),
            "--set", f"job.run_root={root}"]


@pytest.mark.mpi
def test_bench_under_mpiexec_on_two_named_nodes(mpiexec, tmp_path) -> None:
    for group, backend in (("intra", "torch"), ("inter", "mpi")):
        root = tmp_path / group
        cmd = _bench(root, "all", "--group", group, "--backend", backend)
        out = run_mpiexec(mpiexec, ["-n", "2", "-env", "SLURMD_NODENAME", "a"] + cmd,
                       ["-n", "2", "-env", "SLURMD_NODENAME", "b"] + cmd)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "# Out of bounds values : 0 OK" in out.stdout
        rows = _rows(root)
        _all_right(rows, {"all_reduce", "all_gather", "reduce_scatter", "alltoall", "broadcast", "reduce",
                          "sendrecv"}, 2, group)
        if backend == "mpi":  # MPI offers both placements of every collective but broadcast
            assert all(r["oop_busbw"] is not None for r in rows if r["coll"] != "broadcast")


@pytest.mark.slurm
def test_bench_submitted_to_slurm(slurm_cluster, tmp_path) -> None:
    for group in ("intra", "inter"):
        root = tmp_path / group
        out = hpctrain("bench", "all_reduce", "sendrecv", *SMALL, "--group", group, "--submit", "--wait",
                       "--config", str(EXAMPLE), "--set", f"job.run_root={root}", timeout=300)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "executor: slurm" in out.stdout and "# Out of bounds values : 0 OK" in out.stdout
        _all_right(_rows(root), {"all_reduce", "sendrecv"}, 2, group)
        summary = json.loads((only_run_dir(root) / "summary.json").read_text())
        assert [r["node"] for r in summary["rank_map"]] == ["n1", "n1", "n2", "n2"]
        members = summary["checks"]["groups"][group]
        assert members == ([[0, 1], [2, 3]] if group == "intra" else [[0, 2], [1, 3]])
