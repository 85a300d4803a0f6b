"""hpctrain.fsutil: the one atomic, durable file writer (pure tier, no torch).

    pytest tests/pure/test_fsutil.py
"""
from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest

from hpctrain import fsutil
from hpctrain.fsutil import fsync_path, replacing, write_atomic


def _record_fsyncs(monkeypatch) -> list[Path]:
    """Replaces os.fsync with one that records what each fd names (and still fsyncs)."""
    seen: list[Path] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        seen.append(Path(os.readlink(f"/proc/self/fd/{fd}")))
        real(fd)
    monkeypatch.setattr(fsutil.os, "fsync", fsync)
    return seen


def test_text_and_bytes(tmp_path) -> None:
    write_atomic(tmp_path / "a.json", '{"x": "\u00e9"}\n')
    assert (tmp_path / "a.json").read_bytes() == '{"x": "\u00e9"}\n'.encode("utf-8")
    write_atomic(tmp_path / "a.json", b"\x00\x01")  # replaces
    assert (tmp_path / "a.json").read_bytes() == b"\x00\x01"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json"]  # no temporary left


def test_modes_from_creation(tmp_path) -> None:
    old = os.umask(0o022)
    try:
        write_atomic(tmp_path / "default", "x")
        write_atomic(tmp_path / "private", "x", mode=0o600, unique=True)
        write_atomic(tmp_path / "lock", "x", mode=0o644)
        (tmp_path / "wide").write_text("old")
        os.chmod(tmp_path / "wide", 0o666)
        write_atomic(tmp_path / "wide", "new", mode=0o600)  # the old file's mode is not inherited
        (tmp_path / "left.tmp").write_text("a killed writer's")
        os.chmod(tmp_path / "left.tmp", 0o666)
        write_atomic(tmp_path / "left", "x", mode=0o600)  # nor a leftover temporary's
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
    assert modes == {"default": 0o644, "private": 0o600, "lock": 0o644, "wide": 0o600, "left": 0o600}


def test_private_temporary_is_never_wider(tmp_path, monkeypatch) -> None:
    """While the data is written, the temporary already has the final mode (a secret never sits world-readable)."""
    modes = []
    real_replace = os.replace

    def replace(src, dst):
        modes.append(stat.S_IMODE(os.stat(src).st_mode))
        real_replace(src, dst)
    monkeypatch.setattr(fsutil.os, "replace", replace)
    old = os.umask(0)
    try:
        write_atomic(tmp_path / "secret", "s", mode=0o600, unique=True)
    finally:
        os.umask(old)
    assert modes == [0o600]


def test_fsyncs_file_before_rename_and_directory_after(tmp_path, monkeypatch) -> None:
    events: list[tuple[str, Path]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", Path(os.readlink(f"/proc/self/fd/{fd}"))))
        real_fsync(fd)

    def replace(src, dst) -> None:
        events.append(("replace", Path(dst)))
        real_replace(src, dst)
    monkeypatch.setattr(fsutil.os, "fsync", fsync)
    monkeypatch.setattr(fsutil.os, "replace", replace)
    target = tmp_path / "index.json"
    write_atomic(target, "{}")
    assert [e[0] for e in events] == ["fsync", "replace", "fsync"]
    assert events[0][1].parent == tmp_path and events[0][1].name.startswith("index.json.")  # the temporary
    assert events[1][1] == target and events[2][1] == tmp_path


def test_replacing_gives_a_path_and_fsyncs_what_was_written(tmp_path, monkeypatch) -> None:
    seen = _record_fsyncs(monkeypatch)
    out = tmp_path / "tokens.bin"
    with replacing(out) as tmp:
        assert tmp.parent == tmp_path and tmp.exists() and tmp.stat().st_size == 0 and not out.exists()
        tmp.write_bytes(b"abc")  # the caller writes and closes, as h5py or np.save would
    assert out.read_bytes() == b"abc" and seen == [tmp, tmp_path]


def test_failure_removes_the_temporary_and_keeps_the_target(tmp_path, monkeypatch) -> None:
    target = tmp_path / "state.json"
    target.write_text("old")
    with pytest.raises(RuntimeError, match="writer died"):
        with replacing(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("writer died")
    assert target.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]

    def full(fd: int) -> None:
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(fsutil.os, "fsync", full)
    with pytest.raises(OSError, match="No space"):
        write_atomic(target, "new", unique=True)
    assert target.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_concurrent_writers_use_their_own_temporaries(tmp_path, monkeypatch) -> None:
    """unique=True: writers of one target never share a temporary; the target ends whole, one writer's bytes."""
    target = tmp_path / "cache.json"
    num_writers = 8
    barrier = threading.Barrier(num_writers)
    temporaries: list[Path] = []
    real_replace = os.replace

    def replace(src, dst) -> None:
        temporaries.append(Path(src))
        barrier.wait(timeout=10)  # every writer holds its filled temporary before any rename
        real_replace(src, dst)
    monkeypatch.setattr(fsutil.os, "replace", replace)
    payloads = [f"writer {i} ".encode() * 1000 for i in range(num_writers)]
    errors: list[BaseException] = []

    def write(i: int) -> None:
        try:
            write_atomic(target, payloads[i], unique=True)
        except BaseException as e:  # noqa: BLE001 -- reported by the assert below
            errors.append(e)
    threads = [threading.Thread(target=write, args=(i,)) for i in range(num_writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(set(temporaries)) == num_writers
    assert target.read_bytes() in payloads
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache.json"]


def test_fsync_path_opens_directories(tmp_path, monkeypatch) -> None:
    seen = _record_fsyncs(monkeypatch)
    fsync_path(tmp_path)
    assert seen == [tmp_path]


def test_imports_nothing_of_hpctrain() -> None:
    """Level 0: any module may use it (checked on the source: other tests may have imported torch already)."""
    source = Path(fsutil.__file__).read_text()
    assert "import torch" not in source and "from hpctrain" not in source and "import hpctrain" not in source
