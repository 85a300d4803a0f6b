"""`hpctrain diagnose` on run directories written here the way ranks write them (issue 17): real heartbeat files
and hang dumps (hpctrain.hang.heartbeat, hpctrain.hang.watchdog.dump_stacks), flight recorders shaped as torch 2.13
dumps
them. The real launches are in tests/multiproc/test_hang_local.py and tests/cluster/test_hang.py.

    PATH=$PWD/.venv/bin:$PATH .venv/bin/python -m pytest -q tests/pure/test_diagnose.py
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from faults import record

from helpers.launch import hpctrain
from hpctrain.hang import diagnose, watchdog
from hpctrain.hang.heartbeat import Heartbeat

NODES = ["n1", "n1", "n2", "n2"]  # tp=2 inside a node, dp=2 across: tp groups [0,1] [2,3], dp groups [0,2] [1,3]


def _beat(run: Path, rank: int, step: int, phase: str, detail: str = "", **facts) -> Heartbeat:
    hb = Heartbeat(run, rank, {"host": "h" + NODES[rank], "node": NODES[rank],
                               "coords": {"pp": 0, "dp": rank // 2, "tp": rank % 2}, **facts})
    hb.begin_step(step)
    hb.enter(phase, detail)
    return hb


def _entry(seq: int, desc: str, op: str = "all_reduce", retired: bool = True, t: int = 0) -> dict:
    return {"collective_seq_id": seq, "p2p_seq_id": 0, "is_p2p": False, "process_group": [str(seq), desc],
            "profiling_name": f"gloo:{op}", "retired": retired, "state": "scheduled", "time_created_ns": t,
            "input_sizes": [[4]]}


def _dump(run: Path, hb: Heartbeat, entries: list[dict] | None) -> None:
    (run / "hang").mkdir(exist_ok=True)
    watchdog.dump_stacks(watchdog.hang_path(run, hb.rank), hb, "no progress for 9 s", 9.0)
    if entries is not None:
        watchdog.hang_path(run, hb.rank, ".fr.json").write_text(json.dumps({"fr": {"entries": entries}}))


def _request(run: Path, rank: int) -> None:
    (run / "hang").mkdir(exist_ok=True)
    (run / "hang" / "request").write_text(json.dumps({"rank": rank, "reason": "no progress", "wall": time.time()}))


def _stopped_rank_1(run: Path, fr: bool = True) -> None:
    """Rank 1 stopped in step 812's forward: its tp peer 0 waits in the tp all-reduce of that forward; ranks 2, 3
    wait in the dp gradient reduction, for 0 and 1 (they never got there)."""
    _beat(run, 1, 812, "forward")
    history = ([_entry(k, "mesh_tp", t=k) for k in range(1, 41)]
               + [_entry(k, "mesh_dp", t=100 + k) for k in range(1, 10)])
    hb0 = _beat(run, 0, 812, "forward")
    _dump(run, hb0, history + [_entry(41, "mesh_tp", retired=False, t=200)] if fr else None)
    for r in (2, 3):
        hb = _beat(run, r, 812, "collective", "gradient reduction on dp")
        _dump(run, hb, history + [_entry(41, "mesh_tp", t=150), _entry(10, "mesh_dp", retired=False, t=300)]
              if fr else None)
    _request(run, 2)


def test_a_stopped_rank_is_found_through_the_waits(tmp_path) -> None:
    _stopped_rank_1(tmp_path)
    report = diagnose.diagnose(tmp_path)
    assert report["kind"] == "hang" and [c["rank"] for c in report["culprits"]] == [1], report
    lines = report["lines"]
    assert lines[1].startswith("rank 1 (n1) last seen in forward of step 812") and "left no hang dump" in lines[1]
    assert "rank 0 (n1) waited in all_reduce on the tp group (forward of step 812) for rank 1 (n1)" in lines
    assert ("ranks 2-3 (n2) waited in all_reduce on the dp group (gradient reduction on dp, step 812) for ranks "
            "0-1 (n1)") in lines
    assert report["waiting"]["2"] == {"op": "all_reduce", "group": "dp", "seq": 10, "for": [0]}
    assert "hang/rank00000.txt" in report["files"] and "heartbeat/rank00001.hb" in report["files"]
    out = hpctrain("diagnose", str(tmp_path))
    assert out.returncode == 1 and "rank 1 (n1) last seen in forward of step 812" in out.stdout, out.stdout


def test_without_flight_recorders_the_silent_rank_is_named(tmp_path) -> None:
    _stopped_rank_1(tmp_path, fr=False)
    report = diagnose.diagnose(tmp_path)
    assert [c["rank"] for c in report["culprits"]] == [1], report["lines"]


def test_a_busy_rank_is_named_with_its_stack(tmp_path) -> None:
    """Rank 3 computes (or sleeps) in step 5's forward while everyone else waits: it dumped, but waits for no one."""
    hist = [_entry(k, "mesh_tp") for k in range(1, 9)]
    _dump(tmp_path, _beat(tmp_path, 3, 5, "forward"), hist)
    _dump(tmp_path, _beat(tmp_path, 2, 5, "forward"), hist + [_entry(9, "mesh_tp", retired=False)])
    for r in (0, 1):
        _dump(tmp_path, _beat(tmp_path, r, 5, "collective", "gradient reduction on dp"),
              hist + [_entry(9, "mesh_tp"), _entry(3, "mesh_dp", retired=False)])
    _request(tmp_path, 0)
    report = diagnose.diagnose(tmp_path)
    assert [c["rank"] for c in report["culprits"]] == [3], report["lines"]
    busy = report["lines"][1]
    assert busy.startswith("rank 3 (n2) was busy in forward of step 5") and "test_diagnose.py" in busy, busy


def test_a_failed_run_names_the_rank_that_raised_first(tmp_path) -> None:
    _beat(tmp_path, 2, 7, "failed", failure="RuntimeError: CUDA error: an illegal memory access was encountered")
    for r in (0, 1, 3):
        _beat(tmp_path, r, 7, "failed", failure="DistBackendError: Connection closed by peer [10.0.0.3]:2901")
    report = diagnose.diagnose(tmp_path)
    assert report["kind"] == "failed" and [c["rank"] for c in report["culprits"]] == [2], report["lines"]
    assert "illegal memory access" in report["lines"][1]
    assert report["lines"][2].startswith("then ranks 0-1, 3 (n1, n2) failed: DistBackendError: Connection closed")


def test_a_killed_rank_is_the_one_that_ended_without_a_word(tmp_path) -> None:
    """SIGKILL (the OOM killer): rank 3's heartbeat stays mid-step; the others failed because it vanished."""
    _beat(tmp_path, 3, 40, "backward")
    for r in (0, 1, 2):
        _beat(tmp_path, r, 40, "failed", failure="RuntimeError: [gloo] Connection reset by peer")
    report = diagnose.diagnose(tmp_path)
    assert [c["rank"] for c in report["culprits"]] == [3], report["lines"]
    assert "ended in backward of step 40, since" in report["lines"][1]
    assert "without an error of its own" in report["lines"][1]


def test_finished_and_running_runs(tmp_path) -> None:
    beats = [_beat(tmp_path, r, 100, "forward") for r in range(4)]
    assert diagnose.diagnose(tmp_path)["kind"] == "running"
    for hb in beats:
        hb.close("done")
    report = diagnose.diagnose(tmp_path)
    assert report["kind"] == "finished" and report["lines"] == ["finished: every rank done (step 100)"]
    assert hpctrain("diagnose", str(tmp_path)).returncode == 0


def test_damaged_inputs_are_reported_not_trusted(tmp_path) -> None:
    _stopped_rank_1(tmp_path)
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
        return _entry(seq, "mesh_dp", retired=retired) | {"profiling_name": "nccl:all_reduce"}
    for r in (0, 2):
        hb = _beat(tmp_path, r, 9, "collective" if r == 0 else "optimizer")
        (tmp_path / "hang").mkdir(exist_ok=True)
        watchdog.dump_stacks(watchdog.hang_path(tmp_path, r), hb, "x", 9.0)
        gloo = [_entry(k, "mesh_dp", t=k) for k in range(1, 51)]
        ours = [nccl(k) for k in range(1, 12)] + ([nccl(12, retired=False)] if r == 0 else [])
        watchdog.hang_path(tmp_path, r, ".fr.json").write_text(json.dumps({"fr": {"entries": gloo},
                                                                            "nccl": {"entries": ours}}))
    _request(tmp_path, 0)
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
    _stopped_rank_1(run)
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
    _stopped_rank_1(run)
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
    hist = [_entry(k, "mesh_tp") for k in range(1, 9)]  # rank 3 alive and busy, rank 2 waits for it
    _dump(busy, _beat(busy, 3, 5, "forward"), hist)
    _dump(busy, _beat(busy, 2, 5, "forward"), hist + [_entry(9, "mesh_tp", retired=False)])
    _request(busy, 2)
    _stopped_rank_1(silent)
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
    _stopped_rank_1(tmp_path)
    req = json.loads((tmp_path / "hang" / "request").read_text())
    (tmp_path / "hang" / "request").write_text(json.dumps(req | {"wall": time.time() - 2, "grace_s": 3.8}))
    hb1 = _beat(tmp_path, 1, 812, "forward")
    watchdog.dump_stacks(watchdog.hang_path(tmp_path, 1), hb1, "no progress for 9 s", 9.0, frozen_s=6.2)
    watchdog.hang_path(tmp_path, 1, ".fr.json").write_text(json.dumps({"fr": {"entries": [_entry(41, "mesh_tp")]}}))
    report = diagnose.diagnose(tmp_path)
    assert [(c["rank"], c["dumped"]) for c in report["culprits"]] == [(1, False)], report["lines"]
    assert "its watchdog could not run for 6 s" in report["lines"][1], report["lines"][1]


def _metrics(run: Path, rows: list[dict]) -> None:
    with (run / "metrics.jsonl").open("a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def _log_row(step: int, slow: list[tuple[int, str, float]]) -> dict:
    """A log step's row as metrics.py writes it: the straggler report of the interval ending at `step`."""
    return {"step": step, "loss": 3.0, "rank_compute_s": [0.1] * 4, "rank_wait_s": [0.1] * 4,
            "stragglers": [{"rank": r, "host": h, "compute_s": 0.1 * (1 + e), "median_s": 0.1, "excess": e}
                           for r, h, e in slow]}


def test_a_crawling_run_names_its_stragglers_and_their_hosts(tmp_path) -> None:
    """A slowed job does not hang: diagnose names the ranks the report found slow, log interval after log interval,
    from metrics.jsonl, beside whatever else it says (finished, hang, failed)."""
    for hb in [_beat(tmp_path, r, 12, "forward") for r in range(4)]:
        hb.close("done")
    _metrics(tmp_path, [_log_row(1, []), _log_row(4, [(3, "n2", 2.4)]), {"step": 4, "val_loss": 3.1},
                        _log_row(8, [(3, "n2", 12.45), (0, "n1", 0.37)]), _log_row(12, [(3, "n2", 3.0)])])
    report = diagnose.diagnose(tmp_path)
    assert report["kind"] == "finished", report
    assert report["lines"][-1] == ("stragglers over 4 log intervals to step 12: rank 3 (n2) slow in 3 (worst "
                                   "+1245%), rank 0 (n1) slow in 1 (worst +37%); hosts: n2 (3), n1 (1)"), report
    assert [(r["rank"], r["host"], r["intervals"]) for r in report["stragglers"]["ranks"]] == [(3, "n2", 3),
                                                                                              (0, "n1", 1)]
    out = hpctrain("diagnose", str(tmp_path))
    assert out.returncode == 0 and "rank 3 (n2) slow in 3" in out.stdout, out.stdout

    hung = tmp_path / "hung"
    _stopped_rank_1(hung)
    _metrics(hung, [_log_row(800, [(1, "n1", 0.5)]), _log_row(810, [])])
    report = diagnose.diagnose(hung)
    assert report["kind"] == "hang" and [c["rank"] for c in report["culprits"]] == [1]
    assert report["lines"][-1].startswith("stragglers over 2 log intervals to step 810: rank 1 (n1) slow in 1")

    calm = tmp_path / "calm"
    for hb in [_beat(calm, r, 8, "forward") for r in range(4)]:
        hb.close("done")
    assert diagnose.diagnose(calm)["stragglers"] is None  # no report logged: no line
    _metrics(calm, [_log_row(4, []), _log_row(8, [])])
    assert diagnose.diagnose(calm)["lines"][-1] == ("stragglers: none over 2 log intervals to step 8 "
                                                    "(train.straggler_margin)")


def test_straggler_history_is_not_trusted(tmp_path, monkeypatch) -> None:
    for hb in [_beat(tmp_path, r, 9, "forward") for r in range(4)]:
        hb.close("done")
    bad = [{"step": 1, "stragglers": [{"rank": "3", "host": "n2", "excess": 1.0},  # rank not an int
                                      {"rank": 2, "host": ["n2"], "excess": 1.0},  # host not a string
                                      {"rank": 1, "host": "n1", "excess": "1.0"},  # excess not a number
                                      "rank 0"]},
           {"step": 2, "stragglers": {"rank": 3}}, [1, 2], "text"]
    _metrics(tmp_path, bad)
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "stragglers": [{"rank": 3, "host": "n2", "exc\n')  # a torn last line
    history = diagnose.diagnose(tmp_path)["stragglers"]
    assert history["log_intervals"] == 1 and history["ranks"] == [], history
    # only the file's end is read: a long run's first rows fall outside (and say so)
    monkeypatch.setattr(diagnose.stragglers, "MAX_METRICS_BYTES", 400)
    _metrics(tmp_path, [_log_row(s, [(2, "n2", 0.5)]) for s in (10, 20, 30)])
    history = diagnose.diagnose(tmp_path)["stragglers"]
    assert history["truncated"] and history["last_step"] == 30 and history["ranks"][0]["rank"] == 2, history
    assert 1 <= history["log_intervals"] < 4, history
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "metrics.jsonl").symlink_to(tmp_path / "metrics.jsonl")  # a link: not read
    for hb in [_beat(linked, r, 9, "forward") for r in range(4)]:
        hb.close("done")
    assert diagnose.diagnose(linked)["stragglers"] is None


# --- issue 25: nothing read from a run directory is trusted, round two ---------------------------------------------

def _forge_facts(path: Path, new_path: Path, facts: dict) -> None:
    """A heartbeat file whose facts region holds `facts` (the live line and its crc stay valid), written to
    new_path."""
    raw = bytearray(path.read_bytes())
    end = raw.index(b"\n", 256)  # the facts region's end, wherever this version puts it
    text = json.dumps(facts).encode()
    assert len(text) <= end - 256
    raw[256:end] = text.ljust(end - 256)
    new_path.write_bytes(bytes(raw))


def _cap_memory() -> None:
    """The child may map at most 3 GiB: code that sizes a list by a rank read from a file fails there, not in
    the machine's OOM killer."""
    import resource
    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))


@pytest.mark.faults
def test_a_heartbeat_naming_a_huge_rank_is_damaged(tmp_path) -> None:
    """A heartbeat naming rank 10^9 (in a file named for it) sized the world group by it: range(world) (a
    MemoryError, in the job's own hang path too). Ranks come from what the directory holds, bounded by the config's
    limit: the file is named damaged and the hang found as before."""
    _beat(tmp_path, 1, 30, "forward")  # stopped in step 30's forward: no dump
    for r in (0, 2, 3):  # the others wait in a world collective (the preemption poll) it never joined
        hb = _beat(tmp_path, r, 30, "collective", "preemption poll on the world")
        _dump(tmp_path, hb, [_entry(k, "default_pg", t=k) for k in range(1, 7)]
              + [_entry(7, "default_pg", retired=False, t=7)])
    _request(tmp_path, 0)
    huge = 10 ** 9
    _forge_facts(tmp_path / "heartbeat" / "rank00003.hb", tmp_path / "heartbeat" / f"rank{huge}.hb",
                 {"rank": huge, "pid": 1, "node": "n9", "coords": {"pp": 0, "dp": 0, "tp": 0}})
    out = hpctrain("diagnose", str(tmp_path), "--json", preexec_fn=_cap_memory, timeout=120)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    report = json.loads(out.stdout)
    assert [c["rank"] for c in report["culprits"]] == [1], report["lines"]
    assert report["waiting"]["0"] == {"op": "all_reduce", "group": "world", "seq": 7, "for": [1]}, report
    assert any(f"rank{huge}.hb" in p and "rank" in p for p in report["problems"]), report["problems"]
    record("a heartbeat naming rank 10^9 (file and facts) beside a world collective in flight",
           "diagnose (memory capped at 3 GiB) names the file damaged and still finds the stopped rank",
           tier="pure")


@pytest.mark.faults
def test_wrong_types_in_hang_files_are_damaged_input(tmp_path) -> None:
    """Every field read from a dump header, a flight recorder, a heartbeat's facts and hang/request is checked for
    its type: a dump header whose threads is a list, a request that is a JSON list, entries of the wrong shapes.
    Damaged input is skipped and named; the rest still gives the diagnosis."""
    _stopped_rank_1(tmp_path)
    path = watchdog.hang_path(tmp_path, 3)
    first, rest = path.read_text().split("\n", 1)
    header = json.loads(first.removeprefix("# hpctrain hang dump "))
    path.write_text("# hpctrain hang dump " + json.dumps(header | {"threads": ["MainThread"]})
                    + "\n" + rest)
    fr = watchdog.hang_path(tmp_path, 2, ".fr.json")
    data = json.loads(fr.read_text())
    data["fr"]["entries"] += [{"collective_seq_id": True, "process_group": [1, "mesh_dp"], "retired": False},
                              {"collective_seq_id": 99, "process_group": "mesh_dp", "retired": False},
                              {"collective_seq_id": 99, "process_group": ["1", ["mesh_dp"]], "retired": False},
                              {"collective_seq_id": 99, "process_group": ["1", "mesh_dp"], "retired": "no",
                               "profiling_name": ["gloo"]}, [], "entry"]
    fr.write_text(json.dumps(data))
    _forge_facts(tmp_path / "heartbeat" / "rank00002.hb", tmp_path / "heartbeat" / "rank00002.hb",
                 {"rank": 2, "pid": 1, "node": ["n2"], "coords": {"pp": 0, "dp": 1, "tp": 0}})
    report = diagnose.diagnose(tmp_path)
    assert [c["rank"] for c in report["culprits"]] == [1], report["lines"]
    problems = " | ".join(report["problems"])
    assert "hang/rank00003.txt" in problems and "threads" in problems, problems
    assert "rank00002.hb" in problems and "node" in problems, problems
    assert report["waiting"]["2"]["seq"] == 10, report["waiting"]  # the damaged entries were skipped
    (tmp_path / "hang" / "request").write_text('[{"rank": 2}]')
    report = diagnose.diagnose(tmp_path)
    assert report["lines"][0].startswith("hang: first seen by rank ?'s watchdog"), report["lines"]
    assert any("hang/request" in p for p in report["problems"]), report["problems"]
    (tmp_path / "hang" / "request").write_text(json.dumps({"rank": "2", "wall": [1], "grace_s": "x",
                                                           "reason": {"a": 1}}))
    report = diagnose.diagnose(tmp_path)
    assert [c["rank"] for c in report["culprits"]] == [1] and "rank ?" in report["lines"][0], report["lines"]
    assert hpctrain("diagnose", str(tmp_path)).returncode == 1
    record("a hang dump header whose threads is a list; a request that is a JSON list; wrong-typed flight "
           "recorder entries and heartbeat facts", "diagnose names each file damaged, skips it and still names "
           "the stopped rank", tier="pure")


@pytest.mark.faults
def test_links_are_not_followed_out_of_the_run_directory(tmp_path) -> None:
    """hang/, hang/heartbeat/ and heartbeat/ as links to another run's hang, a hang-<time>/ that is a link: none is
    followed (each is named), and a run directory that is itself a link is refused."""
    elsewhere = tmp_path / "elsewhere"
    _stopped_rank_1(elsewhere)
    run = tmp_path / "run"
    for hb in [_beat(run, r, 9, "forward") for r in range(4)]:
        hb.close("done")
    (run / "hang").symlink_to(elsewhere / "hang")
    report = diagnose.diagnose(run)
    assert report["kind"] == "finished", report["lines"]
    assert any(p.startswith("hang/") and "link" in p for p in report["problems"]), report["problems"]
    (run / "hang").unlink()
    (run / "hang").mkdir()
    (run / "hang" / "heartbeat").symlink_to(elsewhere / "heartbeat")
    assert diagnose.diagnose(run)["kind"] == "finished"
    other = tmp_path / "other"
    other.mkdir()
    (other / "heartbeat").symlink_to(elsewhere / "heartbeat")
    (other / "hang").symlink_to(elsewhere / "hang")
    report = diagnose.diagnose(other)
    assert report["kind"] == "unknown" and any("heartbeat" in p for p in report["problems"]), report
    (run / "hang-20261125-162530").symlink_to(elsewhere)
    with pytest.raises(ValueError, match="link"):
        diagnose.diagnose(run / "hang-20261125-162530")
    out = hpctrain("diagnose", str(run / "hang-20261125-162530"))
    assert out.returncode == 2 and "link" in out.stderr, out.stderr
    record("hang/, hang/heartbeat/ and heartbeat/ linked to another run's hang; a hang-<time>/ that is a link",
           "diagnose follows none of them (each named); the linked hang-<time>/ is refused with exit 2",
           tier="pure")


@pytest.mark.faults
def test_lone_surrogates_and_deep_nesting_in_run_files(tmp_path) -> None:
    """A flight recorder with a lone surrogate (it would reach the report and fail its printing) or nesting deeper
    than json's recursion; metrics.jsonl rows likewise: named or skipped, no traceback."""
    _stopped_rank_1(tmp_path)
    fr = watchdog.hang_path(tmp_path, 2, ".fr.json")
    fr.write_text(fr.read_text().replace('"mesh_dp"', '"mesh_\\ud800"'))
    watchdog.hang_path(tmp_path, 3, ".fr.json").write_text('{"fr": ' + "[" * 100000 + "]" * 100000 + "}")
    _metrics(tmp_path, [_log_row(800, [(1, "n1", 0.5)])])
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 805, "stragglers": [{"rank": 2, "host": "n\\udc00", "excess": 1.0}]}\n')
        f.write('{"step": 806, "stragglers": ' + "[" * 100000 + "]" * 100000 + "}\n")
    report = diagnose.diagnose(tmp_path)
    problems = " | ".join(report["problems"])
    assert "rank00002.fr.json" in problems and "surrogate" in problems, problems
    assert "rank00003.fr.json" in problems and "nested" in problems, problems
    assert report["stragglers"]["log_intervals"] == 1, report["stragglers"]
    assert [c["rank"] for c in report["culprits"]] == [1], report["lines"]
    out = hpctrain("diagnose", str(tmp_path))
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert json.loads(hpctrain("diagnose", str(tmp_path), "--json").stdout)["kind"] == "hang"
    record("a lone surrogate and 10^5-deep nesting in flight recorders and metrics.jsonl rows",
           "diagnose names the flight recorders damaged, skips the rows, prints its report (text and --json)",
           tier="pure")


@pytest.mark.faults
def test_a_damaged_hang_history_ends_the_job_without_a_requeue(tmp_path, monkeypatch) -> None:
    """requeues.jsonl nested past json's recursion (or holding rows of the wrong types) raised out of after_hang, which
    must never raise: no requeue, and the reason says which file."""
    from hpctrain.job import requeue as hangrequeue
    run = tmp_path / "run"
    run.mkdir()
    _stopped_rank_1(run)
    calls = _fake_slurm(tmp_path, monkeypatch)
    for text in ["[" * 100000 + "]" * 100000 + "\n", '{"requeued": "no"}\n', '["requeued"]\n']:
        (run / "requeues.jsonl").write_text(text)
        said = hangrequeue.after_hang(run, limit=1, num_nodes=2)
        assert said.startswith("not requeued: ") and "requeues.jsonl" in said, said
    assert not calls.exists() or "requeue" not in calls.read_text()
    record("requeues.jsonl nested 10^5 deep, or with rows of the wrong types, at a hang",
           "after_hang does not raise: no requeue, the reason names requeues.jsonl", tier="pure")
