"""`hpctrain diagnose` on run directories written here the way ranks write them (issue 17): real heartbeat files
and hang dumps (hpctrain.hang.heartbeat, hpctrain.hang.watchdog.dump_stacks), flight recorders shaped as torch 2.13
dumps
them. The same as a command (`hpctrain diagnose` in a child process): tests/multiproc/hang/test_diagnose_cli.py. The
real
launches are in tests/multiproc/hang/test_hang_local.py and tests/cluster/hang/test_hang.py.

    PATH=$PWD/.venv/bin:$PATH .venv/bin/python -m pytest -q tests/pure/hang/test_diagnose.py
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from faults import record

from helpers.hang import beat, dump, entry, log_row, metrics, request, stopped_rank_1
from hpctrain.hang import diagnose, watchdog


def test_without_flight_recorders_the_silent_rank_is_named(tmp_path) -> None:
    stopped_rank_1(tmp_path, fr=False)
    report = diagnose.diagnose(tmp_path)
    assert [c["rank"] for c in report["culprits"]] == [1], report["lines"]


def test_a_busy_rank_is_named_with_its_stack(tmp_path) -> None:
    """Rank 3 computes (or sleeps) in step 5's forward while everyone else waits: it dumped, but waits for no one."""
    hist = [entry(k, "mesh_tp") for k in range(1, 9)]
    dump(tmp_path, beat(tmp_path, 3, 5, "forward"), hist)
    dump(tmp_path, beat(tmp_path, 2, 5, "forward"), hist + [entry(9, "mesh_tp", retired=False)])
    for r in (0, 1):
        dump(tmp_path, beat(tmp_path, r, 5, "collective", "gradient reduction on dp"),
              hist + [entry(9, "mesh_tp"), entry(3, "mesh_dp", retired=False)])
    request(tmp_path, 0)
    report = diagnose.diagnose(tmp_path)
    assert [c["rank"] for c in report["culprits"]] == [3], report["lines"]
    busy = report["lines"][1]
    assert busy.startswith("rank 3 (n2) was busy in forward of step 5") and "test_diagnose.py" in busy, busy


def test_a_failed_run_names_the_rank_that_raised_first(tmp_path) -> None:
    beat(tmp_path, 2, 7, "failed", failure="RuntimeError: CUDA error: an illegal memory access was encountered")
    for r in (0, 1, 3):
        beat(tmp_path, r, 7, "failed", failure="DistBackendError: Connection closed by peer [10.0.0.3]:2901")
    report = diagnose.diagnose(tmp_path)
    assert report["kind"] == "failed" and [c["rank"] for c in report["culprits"]] == [2], report["lines"]
    assert "illegal memory access" in report["lines"][1]
    assert report["lines"][2].startswith("then ranks 0-1, 3 (n1, n2) failed: DistBackendError: Connection closed")


def test_a_killed_rank_is_the_one_that_ended_without_a_word(tmp_path) -> None:
    """SIGKILL (the OOM killer): rank 3's heartbeat stays mid-step; the others failed because it vanished."""
    beat(tmp_path, 3, 40, "backward")
    for r in (0, 1, 2):
        beat(tmp_path, r, 40, "failed", failure="RuntimeError: [gloo] Connection reset by peer")
    report = diagnose.diagnose(tmp_path)
    assert [c["rank"] for c in report["culprits"]] == [3], report["lines"]
    assert "ended in backward of step 40, since" in report["lines"][1]
    assert "without an error of its own" in report["lines"][1]




def test_damaged_inputs_are_reported_not_trusted(tmp_path) -> None:
    stopped_rank_1(tmp_path)
    (tmp_path / "heartbeat" / "rank00009.hb").write_bytes(b"\0" * 1024)  # not a heartbeat
    big = watchdog.hang_path(tmp_path, 3, ".fr.json")
    with big.open("r+b") as f:  # a flight recorder over the size limit is not read
        f.truncate(diagnose.MAX_DUMP_BYTES + 1)
    outside = tmp_path.parent / "elsewhere.txt"
    outside.write_text("# hpctrain hang dump {}\n")
    (tmp_path / "hang" / "rank00007.txt").symlink_to(outside)  # a link out of the run directory: ignored
    report = diagnose.diagnose(tmp_path)
    assert any("rank00009.hb" in p for p in report["problems"]), report["problems"]
    assert [c["rank"] for c in report["culprits"]] == [1] and "7" not in report["waiting"], report
    with pytest.raises(ValueError, match="not a run directory"):
        diagnose.diagnose(tmp_path / "nope")


def test_ranges() -> None:
    assert diagnose.ranges([6, 0, 1, 2, 3, 4, 7]) == "0-4, 6-7"
    assert diagnose.ranges([5]) == "5"


def test_nccl_and_gloo_count_apart(tmp_path) -> None:
    """An NCCL job's group has a gloo side (host tensors) numbering its collectives apart: rank 2's gloo #50 on dp
    is no sign that it reached NCCL's #12 there."""
    def nccl(seq: int, retired: bool = True) -> dict:
        return entry(seq, "mesh_dp", retired=retired) | {"profiling_name": "nccl:all_reduce"}
    for r in (0, 2):
        hb = beat(tmp_path, r, 9, "collective" if r == 0 else "optimizer")
        (tmp_path / "hang").mkdir(exist_ok=True)
        watchdog.dump_stacks(watchdog.hang_path(tmp_path, r), hb, "x", 9.0)
        gloo = [entry(k, "mesh_dp", t=k) for k in range(1, 51)]
        ours = [nccl(k) for k in range(1, 12)] + ([nccl(12, retired=False)] if r == 0 else [])
        watchdog.hang_path(tmp_path, r, ".fr.json").write_text(json.dumps({"fr": {"entries": gloo},
                                                                            "nccl": {"entries": ours}}))
    request(tmp_path, 0)
    report = diagnose.diagnose(tmp_path)
    assert report["waiting"]["0"]["for"] == [2] and [c["rank"] for c in report["culprits"]] == [2], report


def _fake_slurm(tmp_path: Path, monkeypatch, nodes: str = "n1 idle\nn2 idle\nn3 idle") -> Path:
    """Stand-ins for scontrol (logs each call) and sinfo (lists `nodes`), job 77 in partition debug."""
    calls = tmp_path / "calls"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(
        f"#!/bin/sh\necho \"$*\" >> {calls}\n"
        "[ \"$1\" = show ] && echo 'JobId=77 JobName=x JobState=RUNNING Reason=None ExcNodeList=(null)'\nexit 0\n")
    (bin_dir / "sinfo").write_text(f"#!/bin/sh\nprintf '{nodes}\\n'\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_JOB_PARTITION", "debug")
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    return calls


def test_a_hung_job_is_requeued_without_the_silent_ranks_node(tmp_path, monkeypatch) -> None:
    from hpctrain.job import requeue as hangrequeue
    run = tmp_path / "run"
    run.mkdir()
    stopped_rank_1(run)
    calls = _fake_slurm(tmp_path, monkeypatch)
    said = hangrequeue.after_hang(run, limit=1, num_nodes=2)
    assert said == "requeued job 77 without n1 (ExcNodeList=n1)", said
    assert calls.read_text().splitlines()[-2:] == ["requeue 77", "update JobId=77 ExcNodeList=n1"]
    again = hangrequeue.after_hang(run, limit=1, num_nodes=2)  # the requeued job hung too: the limit
    assert again.startswith("not requeued: job.node_requeues = 1") and calls.read_text().count("requeue 77") == 1
    history = [json.loads(line) for line in (run / "requeues.jsonl").read_text().splitlines()]
    assert [h["requeued"] for h in history] == [True, False] and history[0]["nodes"] == ["n1"]
    assert [h["cause"] for h in history] == ["hang", "hang"]
    assert history[0]["culprits"][0] == {"rank": 1, "node": "n1", "step": 812, "phase": "forward", "dumped": False}


def test_preflight_and_hang_requeues_share_one_limit(tmp_path, monkeypatch) -> None:
    """One policy: a requeue the preflight made counts against job.node_requeues when the job later hangs."""
    from hpctrain.job import requeue
    run = tmp_path / "run"
    run.mkdir()
    stopped_rank_1(run)
    calls = _fake_slurm(tmp_path, monkeypatch)
    requeue.record(run, {"cause": "preflight", "requeued": True, "why": "requeued without n3"})
    said = requeue.after_hang(run, limit=1, num_nodes=2)
    assert said.startswith("not requeued: job.node_requeues = 1, and this job was requeued without bad nodes 1"), said
    assert not calls.exists() or "requeue 77" not in calls.read_text()
    assert requeue.after_hang(run, limit=2, num_nodes=2).startswith("requeued job 77 without n1")


def test_hangs_that_are_not_a_nodes_fault_end_the_job(tmp_path, monkeypatch) -> None:
    from hpctrain.job import requeue as hangrequeue
    busy, silent = tmp_path / "busy", tmp_path / "silent"
    busy.mkdir()
    silent.mkdir()
    hist = [entry(k, "mesh_tp") for k in range(1, 9)]  # rank 3 alive and busy, rank 2 waits for it
    dump(busy, beat(busy, 3, 5, "forward"), hist)
    dump(busy, beat(busy, 2, 5, "forward"), hist + [entry(9, "mesh_tp", retired=False)])
    request(busy, 2)
    stopped_rank_1(silent)
    calls = _fake_slurm(tmp_path, monkeypatch, nodes="n1 idle\nn2 idle\nn3 down")
    assert "every culprit was alive" in hangrequeue.after_hang(busy, limit=1, num_nodes=2)
    left = hangrequeue.after_hang(silent, limit=1, num_nodes=2)  # without n1 only n2 is usable: too few
    assert left.startswith("not requeued: excluding n1 would leave 1 usable node(s)"), left
    assert "requeue" not in calls.read_text()
    monkeypatch.delenv("SLURM_JOB_ID")
    assert hangrequeue.after_hang(silent, limit=1, num_nodes=2).startswith("not a Slurm job")


def test_a_dump_from_a_woken_rank_does_not_count(tmp_path) -> None:
    """Slurm sends SIGCONT when it ends or requeues a job: the stopped rank wakes, its watchdog (frozen until then)
    dumps too. That dump came too late to be an answer: the rank is still the one that stopped the job."""
    stopped_rank_1(tmp_path)
    req = json.loads((tmp_path / "hang" / "request").read_text())
    (tmp_path / "hang" / "request").write_text(json.dumps(req | {"wall": time.time() - 2, "grace_s": 3.8}))
    hb1 = beat(tmp_path, 1, 812, "forward")
    watchdog.dump_stacks(watchdog.hang_path(tmp_path, 1), hb1, "no progress for 9 s", 9.0, frozen_s=6.2)
    watchdog.hang_path(tmp_path, 1, ".fr.json").write_text(json.dumps({"fr": {"entries": [entry(41, "mesh_tp")]}}))
    report = diagnose.diagnose(tmp_path)
    assert [(c["rank"], c["dumped"]) for c in report["culprits"]] == [(1, False)], report["lines"]
    assert "its watchdog could not run for 6 s" in report["lines"][1], report["lines"][1]


def test_straggler_history_is_not_trusted(tmp_path, monkeypatch) -> None:
    for hb in [beat(tmp_path, r, 9, "forward") for r in range(4)]:
        hb.close("done")
    bad = [{"step": 1, "stragglers": [{"rank": "3", "host": "n2", "excess": 1.0},  # rank not an int
                                      {"rank": 2, "host": ["n2"], "excess": 1.0},  # host not a string
                                      {"rank": 1, "host": "n1", "excess": "1.0"},  # excess not a number
                                      "rank 0"]},
           {"step": 2, "stragglers": {"rank": 3}}, [1, 2], "text"]
    metrics(tmp_path, bad)
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "stragglers": [{"rank": 3, "host": "n2", "exc\n')  # a torn last line
    history = diagnose.diagnose(tmp_path)["stragglers"]
    assert history["log_intervals"] == 1 and history["ranks"] == [], history
    # only the file's end is read: a long run's first rows fall outside (and say so)
    monkeypatch.setattr(diagnose.stragglers, "MAX_METRICS_BYTES", 400)
    metrics(tmp_path, [log_row(s, [(2, "n2", 0.5)]) for s in (10, 20, 30)])
    history = diagnose.diagnose(tmp_path)["stragglers"]
    assert history["truncated"] and history["last_step"] == 30 and history["ranks"][0]["rank"] == 2, history
    assert 1 <= history["log_intervals"] < 4, history
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "metrics.jsonl").symlink_to(tmp_path / "metrics.jsonl")  # a link: not read
    for hb in [beat(linked, r, 9, "forward") for r in range(4)]:
        hb.close("done")
    assert diagnose.diagnose(linked)["stragglers"] is None


# --- issue 25: nothing read from a run directory is trusted, round two ---------------------------------------------













@pytest.mark.faults
def test_a_damaged_hang_history_ends_the_job_without_a_requeue(tmp_path, monkeypatch) -> None:
    """requeues.jsonl nested past json's recursion (or holding rows of the wrong types) raised out of after_hang, which
    must never raise: no requeue, and the reason says which file."""
    from hpctrain.job import requeue as hangrequeue
    run = tmp_path / "run"
    run.mkdir()
    stopped_rank_1(run)
    calls = _fake_slurm(tmp_path, monkeypatch)
    for text in ["[" * 100000 + "]" * 100000 + "\n", '{"requeued": "no"}\n', '["requeued"]\n']:
        (run / "requeues.jsonl").write_text(text)
        said = hangrequeue.after_hang(run, limit=1, num_nodes=2)
        assert said.startswith("not requeued: ") and "requeues.jsonl" in said, said
    assert not calls.exists() or "requeue" not in calls.read_text()
    record("requeues.jsonl nested 10^5 deep, or with rows of the wrong types, at a hang",
           "after_hang does not raise: no requeue, the reason names requeues.jsonl", tier="pure")
