"""Real MPI tier: `mpiexec -n 4` (the mpich wheel) runs rendezvous, mesh and group checks.

MPICH's MPMD form gives ranks 0-1 and 2-3 different SLURMD_NODENAME values, so the node split is learnt over
MPI (allgather of node names) exactly as under `srun --mpi=pmi2` on two Slurm nodes.
"""
from __future__ import annotations

import sys

import pytest

from conftest import EXAMPLE, read_summary, run_mpiexec

pytestmark = pytest.mark.mpi


def _train(root, *sets: str) -> list[str]:
    args = [sys.executable, "-m", "hpctrain.cli", "train", str(EXAMPLE), "--set", f"job.run_root={root}",
            "--set", "train.steps=0"]
    for s in sets:
        args += ["--set", s]
    return args


def test_mpiexec_two_named_nodes(mpiexec, tmp_path) -> None:
    root = tmp_path / "two"
    out = run_mpiexec(mpiexec, ["-n", "2", "-env", "SLURMD_NODENAME", "nodeA"] + _train(root),
                   ["-n", "2", "-env", "SLURMD_NODENAME", "nodeB"] + _train(root))
    assert out.returncode == 0, out.stdout + out.stderr
    s = read_summary(root)
    assert s["ok"] and s["launcher"] == "mpi" and s["world_size"] == 4 and s["num_nodes"] == 2
    assert [r["node"] for r in s["rank_map"]] == ["nodeA", "nodeA", "nodeB", "nodeB"]
    assert [r["local_rank"] for r in s["rank_map"]] == [0, 1, 0, 1]
    groups = s["checks"]["groups"]
    assert groups["tp"] == [[0, 1], [2, 3]] and groups["dp"] == [[0, 2], [1, 3]]
    assert groups["intra"] == [[0, 1], [2, 3]] and groups["inter"] == [[0, 2], [1, 3]]
    assert "layout pp=1 dp=2 tp=2" in out.stdout  # rank 0 prints the rank map first


def test_mpiexec_one_node_and_refusal(mpiexec, tmp_path) -> None:
    out = run_mpiexec(mpiexec, ["-n", "4"] + _train(tmp_path / "pp", "parallel.pp=2", "parallel.tp=2"))
    assert out.returncode == 0, out.stdout + out.stderr
    s = read_summary(tmp_path / "pp")
    assert s["ok"] and s["num_nodes"] == 1 and s["checks"]["groups"]["pp"] == [[0, 2], [1, 3]]

    # tp=3 cannot tile 4 ranks: every rank stops with the numbers in the message, none hangs.
    bad = run_mpiexec(mpiexec, ["-n", "4"] + _train(tmp_path / "bad", "parallel.tp=3"), timeout=120)
    assert bad.returncode != 0
    assert "world size 4 is not divisible by pp(1) * tp(3)" in bad.stdout + bad.stderr
