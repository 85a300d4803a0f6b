"""hpctrain/planner/fds.py: the open files one rank of a layout needs, and the dry run's refusal past the limit.
Pure: arithmetic and a config, no process.

    .venv/bin/python -m pytest -q tests/pure/planner/test_fds.py
"""
from __future__ import annotations

import pytest

from hpctrain.config import load_config
from hpctrain.parallel.mesh import Layout
from hpctrain.planner import fds

# the case: 64 nodes x 8 GPUs, tp 8 inside a node, dp 64 across, asynchronous saves, MPI identity
BIG = fds.Job(world_size=512, tasks_per_node=8, pp=1, dp=64, tp=8, nccl=True, async_save=True, data_files=1,
              mpi=True)


def rows(need: fds.Need) -> dict[str, tuple[int, int]]:
    return {what: (r0, other) for what, r0, other in need.rows}


def test_rank0_holds_the_store_and_every_peer_of_the_world_groups():
    got = rows(fds.estimate(BIG))
    assert got["rendezvous store"] == (512 + 4, 1)
    # rank 0 gathers (checkpoint planning): every peer; others: ring 2, barrier 2*9, tree 9, root 1 -> 30
    assert got["gloo world (512 ranks)"] == (4 + 511, 4 + 30)
    assert got["gloo asynchronous saves (512 ranks)"] == (4 + 511, 4 + 30)
    assert got["gloo pp (1 rank)"] == (4, 4) and got["gloo dp (64 ranks)"] == (67, 67) and got["gloo tp (8 ranks)"] \
        == (11, 11)
    assert got["NCCL (4 communicators)"] == (4 * (5 + 2 * 8),) * 2
    assert got["MPI (identity exchange)"] == (19, 19) and got["token files"] == (1, 1)
    need = fds.estimate(BIG)
    # past the 1024 a login node hands jobs on rank 0 only; every other rank stays far below it
    assert need.total(0) > 1024 > 2 * need.total(1), (need.total(0), need.total(1))
    without = fds.estimate(fds.Job(**{**BIG.__dict__, "async_save": False}))
    assert need.total(0) - without.total(0) == 515


def test_small_groups_count_every_peer_and_an_axis_spanning_the_world_reuses_it():
    assert fds.peers(4, gathers=False) == 3 and fds.peers(16, gathers=False) == 15 and fds.peers(64, False) == 21
    got = rows(fds.estimate(fds.Job(world_size=4, tasks_per_node=4, pp=1, dp=4, tp=1)))
    assert "gloo dp (4 ranks)" not in got and got["gloo world (4 ranks)"] == (7, 7)
    assert not [w for w in got if w.startswith(("NCCL", "MPI", "gloo async"))], got


def cfg(*overrides: str):
    return load_config(None, ["job.nodes=64", "job.tasks_per_node=8", "job.gpus_per_node=8", "parallel.tp=8",
                              "checkpoint.async_save=true", *overrides])


def test_dry_run_check_refuses_past_job_nofile_naming_numbers_and_fixes():
    c = cfg("job.nofile=1024")
    need = fds.estimate(fds.job_of(c, Layout(1, 64, 8))).total(0)
    with pytest.raises(ValueError) as e:
        fds.check(c, Layout(1, 64, 8), host_hard_limit=1 << 20)
    msg = str(e.value)
    assert f"may need {need} open files" in msg and "job.nofile = 1024" in msg, msg
    assert "ulimit -Hn" in msg and "checkpoint.async_save = false (515 fewer on rank 0)" in msg, msg
    assert "rendezvous store" in msg  # the table comes with the refusal
    lines = fds.check(cfg(f"job.nofile={need}"), Layout(1, 64, 8), host_hard_limit=1)
    assert lines[0].endswith(f"rank 0 {need}, any other rank {fds.estimate(fds.job_of(c, Layout(1, 64, 8))).total(1)}")


def test_without_job_nofile_the_hosts_hard_limit_is_assumed_and_said():
    c = cfg()
    need = fds.estimate(fds.job_of(c, Layout(1, 64, 8))).total(0)
    lines = fds.check(c, Layout(1, 64, 8), host_hard_limit=need)
    assert f"this host's hard limit {need}, assumed to be the compute nodes'" in lines[1], lines
    with pytest.raises(ValueError, match=f"this host's hard limit {need - 1}"):
        fds.check(c, Layout(1, 64, 8), host_hard_limit=need - 1)


def test_job_of_reads_backend_files_and_mpi_from_the_config():
    j = fds.job_of(load_config(None, ["data.source=bin", "data.paths=['a.bin', 'b.bin']", "train.eval_every=10",
                                      "job.mpi=''"]), Layout(1, 1, 1))
    assert (j.data_files, j.nccl, j.mpi, j.async_save) == (4, False, False, False)  # 2 training + 2 validation
    j = fds.job_of(cfg("data.source=bin", "data.path=a.bin", "data.val_path=v.bin", "train.eval_every=5"),
                   Layout(1, 64, 8))
    assert (j.data_files, j.nccl, j.mpi, j.world_size, j.tasks_per_node) == (2, True, True, 512, 8)


def test_job_nofile_must_not_be_negative():
    with pytest.raises(ValueError, match=r"job.nofile = -1 must be >= 0"):
        load_config(None, ["job.nofile=-1"])


def test_a_real_submission_past_the_limit_is_refused_before_anything_is_made(tmp_path) -> None:
    """Not only the dry run: `hpctrain submit` refuses the layout with the numbers, and no run directory is made."""
    from click.testing import CliRunner

    from helpers.launch import REPO
    from hpctrain.cli.main import main

    runs = tmp_path / "runs"
    res = CliRunner().invoke(main, ["submit", str(REPO / "slurm" / "examples" / "tiny-cpu.toml"), "--set",
                                    f"job.run_root={runs}", "--set", "job.nofile=10"])
    assert res.exit_code == 2, (res.output, res.exception)
    assert "open files" in res.output and "job.nofile = 10" in res.output, res.output
    assert not runs.exists() or not any(runs.iterdir())
