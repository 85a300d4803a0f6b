"""`hpctrain doctor` with no processes: the storage probe's bounds (a cap on what is asked, a share of the free
space at run time, nothing left behind on an error), what a signal means before and after the command is known
(hpctrain/job/preempt.py), and doctor's reads of files it did not write (preflight.jsonl, doctor.json).

    .venv/bin/python -m pytest -q tests/pure/doctor/test_doctor_probe.py
"""
from __future__ import annotations

import errno
import os
import re
import signal
from collections import namedtuple

import click
import pytest
from faults import record

from helpers.refusals import refused
from hpctrain import hostprobe
from hpctrain.cli import doctor as cli_doctor
from hpctrain.doctor import measure as doctor
from hpctrain.job import preempt, requeue
from hpctrain.untrusted import MAX_DEPTH, Untrusted

pytestmark = pytest.mark.faults

MiB = 1 << 20
Usage = namedtuple("Usage", "total used free")


def test_probe_bytes_are_a_share_of_the_free_space():
    free = 100 * hostprobe.BLOCK * 10  # room for 100 blocks at a tenth
    assert hostprobe.probe_bytes(128 * MiB, free, 1) == (128 * MiB, None)  # asked, and within bounds
    size, why = hostprobe.probe_bytes(10_000 * MiB, free, 1)
    assert size == 100 * hostprobe.BLOCK and why.startswith("probe shrunk from 10000 to 400 MiB")
    size, why = hostprobe.probe_bytes(10_000 * MiB, free, 4)  # four nodes writing at once share it
    assert size == 25 * hostprobe.BLOCK and "shared by 4 node(s)" in why
    assert hostprobe.probe_bytes(128 * MiB, hostprobe.BLOCK * 5, 1)[0] == 0  # less than a block: no probe


def _count_writes(monkeypatch) -> list[int]:
    """The bytes of each os.write of the probe; past 64 MiB in all the test fails at once (a regression must not
    write the 16 GiB it asks for)."""
    written: list[int] = []
    real = os.write

    def write(fd, data):
        assert sum(written) < 64 * MiB, "the probe wrote more than 64 MiB"
        n = real(fd, data)
        written.append(n)
        return n
    monkeypatch.setattr(hostprobe.os, "write", write)
    return written


def test_storage_probe_writes_at_most_its_share_and_leaves_nothing(tmp_path, monkeypatch):
    written = _count_writes(monkeypatch)
    out = hostprobe.storage(tmp_path, 64 * MiB, "n1")  # the free space here is far above 640 MiB
    assert "shrunk" not in out and out["bytes"] == sum(written) == 64 * MiB and out["write_gbps"] > 0
    written.clear()
    # a file system that has 120 MiB free: a tenth, in whole 4 MiB blocks, is 12 MiB
    monkeypatch.setattr(hostprobe.shutil, "disk_usage", lambda path: Usage(1 << 40, 0, 120 * MiB))
    out = hostprobe.storage(tmp_path, 16 << 10 << 20, "n1")
    assert sum(written) == out["bytes"] == 12 * MiB and out["asked"] == 16 << 30, out
    assert out["shrunk"].startswith("probe shrunk from 16384 to 12 MiB"), out
    written.clear()
    monkeypatch.setattr(hostprobe.shutil, "disk_usage", lambda path: Usage(1 << 40, 0, 30 * MiB))
    out = hostprobe.storage(tmp_path, 128 * MiB, "n1")
    assert written == [] and "too little to probe" in out["error"], out
    assert os.listdir(tmp_path) == []
    record("doctor storage probe larger than a tenth of the free space (120 MiB free, 16 GiB asked)",
           "shrunk to 12 MiB and said so in the result; 30 MiB free: nothing written, the node's storage fails",
           tier="pure")


def _without_tmpfile(monkeypatch) -> None:
    """A file system that makes no unnamed files: open with O_TMPFILE says EOPNOTSUPP (NFS, older kernels say
    EISDIR), and the probe falls back to a name it unlinks at once."""
    real = os.open

    def open_(path, flags, *args, **kwargs):
        if flags & os.O_TMPFILE == os.O_TMPFILE:
            raise OSError(errno.EOPNOTSUPP, "Operation not supported")
        return real(path, flags, *args, **kwargs)
    monkeypatch.setattr(hostprobe.os, "open", open_)


def _listings_at_open(monkeypatch, directory) -> list[list[str]]:
    """What `directory` holds just after each os.open of the probe returns."""
    inner, seen = hostprobe.os.open, []

    def open_(*args, **kwargs):
        fd = inner(*args, **kwargs)
        seen.append(os.listdir(directory))
        return fd
    monkeypatch.setattr(hostprobe.os, "open", open_)
    return seen


def test_storage_probe_file_never_has_a_name(tmp_path, monkeypatch):
    """Where the file system makes unnamed files (this machine's ext4 and tmpfs do), no name of the probe's is in the
    directory at any moment, so a SIGKILL at any point leaves nothing (CI-41: one landed between the create and the
    unlink and left the file). Without O_TMPFILE the name is there from the create to the unlink."""
    seen = _listings_at_open(monkeypatch, tmp_path)
    out = hostprobe.storage(tmp_path, 8 * MiB, "n1")
    assert out["bytes"] == 8 * MiB and seen == [[]], (out, seen)
    monkeypatch.undo()
    _without_tmpfile(monkeypatch)
    seen = _listings_at_open(monkeypatch, tmp_path)
    out = hostprobe.storage(tmp_path, 8 * MiB, "n1")
    assert out["bytes"] == 8 * MiB and len(seen) == 1 and seen[0][0].startswith(".hpctrain-doctor-n1-"), seen
    assert os.listdir(tmp_path) == []
    record("SIGKILL to `hpctrain doctor` at any moment of its storage probe", "no probe file left: the file never "
           "has a name (O_TMPFILE; without it, a name for the microseconds from create to unlink)", tier="pure")


def test_storage_probe_file_is_gone_whatever_happens(tmp_path, monkeypatch):
    """Without O_TMPFILE the probe's file is unlinked as soon as it is made: an error (or any end of the process)
    leaves none."""
    _without_tmpfile(monkeypatch)
    seen: list[list[str]] = []

    def fsync(fd):
        seen.append(os.listdir(tmp_path))
        raise OSError(5, "Input/output error")
    monkeypatch.setattr(hostprobe.os, "fsync", fsync)
    out = hostprobe.storage(tmp_path, 8 * MiB, "n1")
    assert seen == [[]], seen  # already unlinked while it was being written
    assert "Input/output error" in out["error"] and os.listdir(tmp_path) == []

    real, calls = os.unlink, []

    def unlink(path):
        calls.append(path)
        if len(calls) == 1:
            raise OSError(1, "Operation not permitted")
        real(path)
    monkeypatch.undo()
    _without_tmpfile(monkeypatch)
    monkeypatch.setattr(hostprobe.os, "unlink", unlink)  # a file system that refuses to unlink an open file
    out = hostprobe.storage(tmp_path, 8 * MiB, "n1")
    assert "Operation not permitted" in out["error"] and os.listdir(tmp_path) == []


def test_a_signal_as_the_probe_file_opens_leaves_no_file(tmp_path, monkeypatch):
    """A signal's handler raises (preempt.Ended) at the first bytecode after open returns, before the descriptor is
    stored and the name unlinked: seen once in a full run, SIGTERM to `hpctrain doctor` left its probe file."""
    class Signalled(BaseException):
        pass
    _without_tmpfile(monkeypatch)
    real_open, opened = hostprobe.os.open, []

    def open_then_signal(*args, **kwargs):
        opened.append(real_open(*args, **kwargs))  # made; the probe's frame never sees the descriptor
        raise Signalled
    monkeypatch.setattr(hostprobe.os, "open", open_then_signal)
    with pytest.raises(Signalled):
        hostprobe.storage(tmp_path, 8 * MiB, "n1")
    os.close(opened.pop())
    assert os.listdir(tmp_path) == []

    def refused(*args, **kwargs):
        raise FileExistsError(17, "File exists")  # O_EXCL: the name was someone else's, which is left alone
    planted = []
    monkeypatch.setattr(hostprobe.os, "open", refused)
    monkeypatch.setattr(hostprobe.Path, "unlink", lambda self, missing_ok=False: planted.append(self))
    out = hostprobe.storage(tmp_path, 8 * MiB, "n1")
    assert "File exists" in out["error"] and planted == []


def test_storage_mb_cap():
    refused(doctor.Options, storage_mb=hostprobe.MAX_STORAGE_MB + 1,
            fragments=[f"storage_mb = {hostprobe.MAX_STORAGE_MB + 1}", f"between 1 and {hostprobe.MAX_STORAGE_MB}"])
    refused(doctor.Options, storage_mb=0, fragments=["storage_mb = 0"])
    assert doctor.Options(storage_mb=hostprobe.MAX_STORAGE_MB).storage_mb == hostprobe.MAX_STORAGE_MB


# --- what a signal means -------------------------------------------------------------------------------------

@pytest.fixture
def flag():
    """A flag of this test only (the process's own is left alone), its handlers given back afterwards."""
    f = preempt.PreemptionFlag()
    yield f
    f.restore()


def test_a_signal_before_the_command_is_known_is_kept_then_means_what_the_command_says(flag):
    before_int = signal.getsignal(signal.SIGINT)
    os.kill(os.getpid(), signal.SIGTERM)
    assert flag.received == signal.SIGTERM  # kept: the process lives on
    flag.end_on_signal(False)  # train: a preemption, for the first poll
    assert flag.received == signal.SIGTERM and signal.getsignal(signal.SIGINT) is before_int
    with pytest.raises(preempt.Ended) as info:
        flag.end_on_signal(True)  # any other command: ends at once
    assert info.value.code == 128 + signal.SIGTERM and str(info.value) == "ended by SIGTERM"


def test_a_command_that_is_not_training_ends_on_term_usr2_and_int(flag):
    # what SIGINT had before: Python's default_int_handler, or SIG_IGN where the test process was started in the
    # background of a non-interactive shell (a CI run started with `&` failed on assuming the first)
    before_int = signal.getsignal(signal.SIGINT)
    flag.end_on_signal(True)
    for sig in (signal.SIGUSR2, signal.SIGINT):
        flag.ended = False
        with pytest.raises(preempt.Ended) as info:
            os.kill(os.getpid(), sig)
        assert info.value.code == 128 + sig and isinstance(info.value, SystemExit)
    os.kill(os.getpid(), signal.SIGTERM)  # a second signal while the first one's clean-up runs: no second raise
    flag.restore()
    assert signal.getsignal(signal.SIGINT) is before_int and flag.ends is None


# --- files doctor reads and did not write --------------------------------------------------------------------

@pytest.mark.parametrize("content, why", [
    (b'{"requeued": true}\n{"requeued": false}\n{"requeued": true}\n', None),
    (b'{"requeued": "yes"}\n', "line 1: not a row with"),
    (b'{"requeued": true}\n[1]\n', "line 2: not a row with"),
    (b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1) + b"\n", "line 1: JSON nested more than"),
    (b'{"requeued": true, "why": "\\ud800"}\n', "lone surrogate"),
    (b"\xff\n", "not UTF-8"),
    (b"x" * (requeue.MAX_HISTORY_BYTES + 1), "more than the"),
])
def test_requeue_history_is_read_as_untrusted(tmp_path, content, why):
    history = tmp_path / requeue.HISTORY
    assert requeue.requeues_in(history) == 0
    history.write_bytes(content)
    if why is None:
        assert requeue.requeues_in(history) == 2
        return
    with pytest.raises(Untrusted, match=why):
        requeue.requeues_in(history)
    requeued, said = requeue.requeue_without(["n1"], tmp_path, 3, 2)  # a history that cannot be read requeues nothing
    assert not requeued and said.startswith("not requeued: ") and why in said


def test_requeue_history_symlink_is_not_followed(tmp_path):
    history = tmp_path / requeue.HISTORY
    (tmp_path / "elsewhere").write_text('{"requeued": false}\n')
    history.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(Untrusted, match="symbolic link"):
        requeue.requeues_in(history)
    with pytest.raises(OSError, match="cannot append to"):
        requeue.record(tmp_path, {"requeued": True})
    assert (tmp_path / "elsewhere").read_text() == '{"requeued": false}\n'  # untouched
    history.unlink()
    requeue.record(tmp_path, {"cause": "preflight", "requeued": True})
    requeue.record(tmp_path, {"cause": "hang", "requeued": False})
    assert requeue.requeues_in(history) == 1
    record("crafted requeues.jsonl (nested, surrogate, wrong type, huge, symlink)",
           "Untrusted naming the file and line; no requeue; a symlink is neither read nor appended to", tier="pure")


@pytest.mark.parametrize("content, why", [
    (None, "left no doctor.json"),
    (b"[" * 100_000, "nested more than"),
    (b'{"ok": "yes"}', 'is not a doctor report (no true or false "ok")'),
    (b'{"ok": true}', "is not a doctor report this version can show (KeyError"),
    (b'{"ok": true, "job": 3, "checks": []}', "is not a doctor report this version can show"),
])
def test_doctor_json_is_read_as_untrusted(tmp_path, content, why):
    path = tmp_path / "doctor.json"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(click.ClickException, match=re.escape(why)):
        cli_doctor._render(cli_doctor._read_report(path), path)
