"""One writer per checkpoint directory (hpctrain/checkpoint/lock.py): live holders refused, stale locks taken over.

In this process, with fake `squeue` scripts on PATH; a real killed holder and racing takers are
tests/multiproc/checkpoint/test_ckpt_lock_processes.py's, the verdicts of the local Slurm cluster's own squeue
tests/cluster/checkpoint/test_ckpt_lock_slurm.py's.
    pytest -q tests/pure/checkpoint/test_ckpt_lock.py
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path

import pytest
from faults import record

from helpers.locks import HOST, dead_pid, write_lock
from hpctrain.checkpoint import lock
from hpctrain.checkpoint.lock import NAME, CheckpointDirLocked, acquire, this_holder


def fake_squeue(tmp_path: Path, monkeypatch, stdout: str = "", rc: int = 0, stderr: str = "",
                sleep: float = 0) -> Path:
    """A `squeue` first on PATH that answers with stdout/stderr/rc and leaves its arguments in a file."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    args = tmp_path / "squeue.args"
    script = bin_dir / "squeue"
    hang = f"exec sleep {sleep}\n" if sleep else ""  # exec: no grandchild holding the pipes after the kill
    script.write_text(f"#!/bin/sh\necho \"$@\" $SQUEUE_USERS > {args}\n{hang}printf '{stdout}'\nprintf '{stderr}' >&2\n"
                      f"exit {rc}\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return args


def test_acquire_release(tmp_path) -> None:
    root = tmp_path / "a" / "ckpt"  # created with parents
    lk = acquire(root)
    rec = json.loads((root / NAME).read_text())
    assert {k: rec[k] for k in ("host", "pid")} == {"host": HOST, "pid": os.getpid()}
    assert rec == lk.holder and set(this_holder()) <= set(rec)
    lk.release()
    assert not (root / NAME).exists()
    lk.release()  # a second release is a no-op
    with acquire(root) as again:
        assert again.path.exists()
    assert not (root / NAME).exists()


def test_this_holder_from_slurm_env(monkeypatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "1235")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    assert this_holder()["job_id"] == "1235" and this_holder()["restart"] == "2"
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "1234")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "1")
    assert this_holder()["job_id"] == "1234_1"






def test_unusable_directory_named(tmp_path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(OSError, match=f"cannot lock checkpoint directory {tmp_path / 'file' / 'ckpt'}"):
        acquire(tmp_path / "file" / "ckpt")


def test_own_pid_from_another_job_refused(tmp_path) -> None:
    write_lock(tmp_path, job_id="1234", started="2026-02-03T04:05:06+00:00")
    with pytest.raises(CheckpointDirLocked, match=rf"in use by job 1234 \(host {HOST}, pid {os.getpid()}, "
                                                  r"started 2026-02-03T04:05:06\+00:00\)"):
        acquire(tmp_path, {"job_id": "999"})


@pytest.mark.faults
def test_dead_pid_and_requeue_taken_over(tmp_path, monkeypatch) -> None:
    write_lock(tmp_path, pid=dead_pid())
    acquire(tmp_path).release()
    # A requeued job comes back elsewhere with the same id and a higher restart count; squeue is never asked.
    monkeypatch.setenv("PATH", str(tmp_path))
    write_lock(tmp_path, host="n9", pid=77, job_id="555", restart="0")
    acquire(tmp_path, {"job_id": "555", "restart": "1"}).release()
    # Same job, same incarnation, another host: two steps of one allocation; it cannot be proven gone.
    write_lock(tmp_path, host="n9", pid=77, job_id="555", restart="1")
    with pytest.raises(CheckpointDirLocked, match="squeue is not on PATH"):
        acquire(tmp_path, {"job_id": "555", "restart": "1"})
    record("stale lock: holder pid dead on this host, or an earlier incarnation of this requeued job",
           "taken over; the same job's same incarnation on another host is refused", tier="unit")


GONE = [("", 0, ""), ("COMPLETED", 0, ""), ("CANCELLED\\nCOMPLETED", 0, ""), ("TIMEOUT", 0, ""),
        ("", 1, "slurm_load_jobs error: Invalid job id specified")]
LIVE = ["RUNNING", "PENDING", "REQUEUED", "SUSPENDED", "STOPPED", "COMPLETING", "CONFIGURING", "SIGNALING",
        "COMPLETED\\nRUNNING", "SOME_NEW_STATE"]


@pytest.mark.faults
def test_squeue_verdicts(tmp_path, monkeypatch) -> None:
    root = tmp_path / "ckpt"
    env_path = os.environ["PATH"]
    monkeypatch.setenv("SQUEUE_USERS", "nobody")  # a user's squeue defaults must not filter the answer
    for stdout, rc, stderr in GONE:
        monkeypatch.setenv("PATH", env_path)
        args = fake_squeue(tmp_path, monkeypatch, stdout, rc, stderr)
        write_lock(root, host="n9", job_id="1234_7")
        acquire(root).release()
        assert args.read_text().split() == ["-h", "-a", "-t", "all", "-o", "%T", "-j", "1234_7"]
    for state in LIVE:
        monkeypatch.setenv("PATH", env_path)
        fake_squeue(tmp_path, monkeypatch, state)
        write_lock(root, host="n9", job_id="1234")
        with pytest.raises(CheckpointDirLocked, match="in use by job 1234 .*; two jobs") as e:
            acquire(root)
        assert "remove" not in str(e.value), state
    doubts = {"squeue failed: slurm_load_jobs error: Unable to contact slurm controller":
              {"rc": 1, "stderr": "slurm_load_jobs error: Unable to contact slurm controller"},
              "squeue did not answer": {"sleep": 3}}
    monkeypatch.setattr(lock, "SQUEUE_TIMEOUT", 0.5)
    for why, kw in doubts.items():
        monkeypatch.setenv("PATH", env_path)
        fake_squeue(tmp_path, monkeypatch, "", **kw)
        with pytest.raises(CheckpointDirLocked, match=f"may have ended, but {why}.*remove {root / NAME}"):
            acquire(root)
    with monkeypatch.context() as m:
        m.setattr(lock.os, "getuid", lambda: os.geteuid() + 1)  # the lock file is another user's
        for stdout, taken in (("", False), ("COMPLETED", True)):
            m.setenv("PATH", env_path)
            fake_squeue(tmp_path, m, stdout)
            write_lock(root, host="n9", job_id="1234")
            if taken:
                acquire(root).release()
            else:  # PrivateData=jobs hides other users' jobs: not listed proves nothing
                with pytest.raises(CheckpointDirLocked, match="does not list job 1234 and the lock file belongs to "
                                                              "another user"):
                    acquire(root)
    write_lock(root, host="n9", job_id="1234")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no squeue at all
    with pytest.raises(CheckpointDirLocked, match=f"squeue is not on PATH to ask Slurm: .*remove {root / NAME}"):
        acquire(root)
    monkeypatch.setenv("PATH", env_path)
    args = fake_squeue(tmp_path, monkeypatch, "")
    args.unlink(missing_ok=True)
    write_lock(root, host="n9", job_id="1234", cluster="other")  # squeue here knows nothing of that cluster's ids
    with pytest.raises(CheckpointDirLocked, match="it ran on cluster other"):
        acquire(root, {"cluster": "here"})
    assert not args.exists()
    assert (root / NAME).exists() and len(list(root.iterdir())) == 1
    record("lock of a job on another node; squeue says ended / running / pending / fails / hangs / is missing",
           "taken over only when squeue lists it ended or unknown; any doubt refused with advice", tier="unit")


GOOD = {"host": "n1", "pid": 5, "job_id": "", "restart": "0", "started": "x"}
MALFORMED = {"empty": b"", "not JSON": b"{host: n1", "a list": b"[]", "not UTF-8": b"\xff\xfe{}",
             "missing pid": b'{"host": "n1"}', "huge": json.dumps(GOOD | {"job_id": "1" * 70000}).encode(),
             "deep": b"[" * 50000, "lone surrogate": json.dumps(GOOD | {"host": "\ud800"}).encode()}
MALFORMED |= {f"{key} {value!r}": json.dumps(GOOD | {key: value}).encode()
              for key, value in [("pid", "5"), ("pid", True), ("pid", 0), ("pid", -1), ("pid", 2**40), ("host", 3)]}


@pytest.mark.faults
def test_malformed_lock_refused_with_advice(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(lock.time, "sleep", lambda s: None)
    for name, data in MALFORMED.items():
        (tmp_path / NAME).write_bytes(data)
        with pytest.raises(CheckpointDirLocked, match=f"lock file {tmp_path / NAME} that is not a valid holder record "
                                                      r".*if no job uses the directory, remove that file"):
            acquire(tmp_path)
        assert (tmp_path / NAME).read_bytes() == data, name
    record("malformed LOCK.json (empty, not JSON, wrong types, pid 0/-1/2**40, 70 KB, 50k-deep nesting, a lone "
           "surrogate)",
           "refused: names the file, says to remove it if no job uses the directory", tier="unit")


def test_record_written_late_is_read_not_judged_malformed(tmp_path) -> None:
    (tmp_path / NAME).write_bytes(b"")  # a holder between its O_EXCL create and its write
    later = threading.Timer(0.3, write_lock, (tmp_path,), {"job_id": "77"})
    later.start()
    with pytest.raises(CheckpointDirLocked, match="in use by job 77"):
        acquire(tmp_path)
    later.join()


@pytest.mark.faults
def test_release_leaves_another_holders_lock(tmp_path) -> None:
    first = acquire(tmp_path)
    first.release()
    second = acquire(tmp_path)  # same process, same holder fields: only the token differs
    first.release()
    assert (tmp_path / NAME).read_bytes() == json.dumps(second.holder).encode()
    other = write_lock(tmp_path, host="n9", job_id="31")  # as if taken over while we ran
    second.release()
    assert (tmp_path / NAME).read_bytes() == other
    record("release after the lock was taken over by another job", "the other job's lock file is left in place",
           tier="unit")


@pytest.mark.faults
def test_slow_taker_finds_the_lock_already_taken_over(tmp_path, monkeypatch) -> None:
    stale = write_lock(tmp_path, pid=dead_pid())
    judge, inner = lock._stale, []

    def judge_slowly(rec, me, **kw):  # the first taker judges; a second one takes over before the first acts
        verdict = judge(rec, me, **kw)
        if me["job_id"] == "slow" and not inner:
            inner.append(acquire(tmp_path, {"job_id": "fast"}))
        return verdict
    monkeypatch.setattr(lock, "_stale", judge_slowly)
    with pytest.raises(CheckpointDirLocked, match="in use by job fast"):
        acquire(tmp_path, {"job_id": "slow"})
    assert (tmp_path / NAME).read_bytes() == json.dumps(inner[0].holder).encode() != stale
    assert [p.name for p in tmp_path.iterdir()] == [NAME]
    record("a taker judges a lock stale, then another takes it over before the first acts",
           "the first finds other bytes, starts over and is refused; the second keeps its lock", tier="unit")


@pytest.mark.faults
def test_taker_killed_mid_takeover_needs_a_person(tmp_path, monkeypatch) -> None:
    stale = write_lock(tmp_path, pid=dead_pid())
    marker = tmp_path / f"{NAME}.takeover-{hashlib.blake2b(stale, digest_size=8).hexdigest()}"
    marker.write_text("{}")  # left by a taker killed between its marker and its replace
    monkeypatch.setattr(lock.time, "sleep", lambda s: None)
    with pytest.raises(CheckpointDirLocked, match=f"takeover by another process did not finish; .*remove "
                                                  f"{tmp_path / NAME} and {marker}"):
        acquire(tmp_path)
    marker.unlink()
    (tmp_path / NAME).unlink()
    acquire(tmp_path).release()
    record("a taker killed between its takeover marker and its replace", "takeovers of that lock refused, "
           "naming both files to remove", tier="unit")




