"""Durable whole-file writes: a reader sees the old file or the new one, never half of one, and once the call
returns the new file survives a crash of the node. The one place that writes a file through a rename.

    write_atomic(path, text_or_bytes)                      # str is written as UTF-8
    write_atomic(path, secret, mode=0o600, unique=True)    # mode from creation; unique: several writers of path
    with replacing(path) as tmp:                           # for writers that need a path of their own (h5py,
        h5py.File(tmp, "w")...                             # np.save): tmp exists, empty, with the mode

The temporary file sits beside path (a rename is atomic only within one file system) and is created with `mode`
less the umask, as open() does, so it is never wider than asked. On success it is fsynced, renamed over path,
and path's directory is fsynced so the rename itself is durable. On any exception it is removed and the error
goes on; path is untouched. unique=False names it `<name>.tmp` (a leftover of a killed writer is replaced);
unique=True gives every call a random name, for targets that several processes may write at once.

Imports nothing of hpctrain and no torch: any module may use it. Tests: pytest tests/pure/test_fsutil.py
"""
from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["write_atomic", "replacing", "fsync_path"]


def fsync_path(path: str | os.PathLike) -> None:
    """fsync of a file or directory by name (a directory's makes the entries created or renamed in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def replacing(path: str | os.PathLike, *, mode: int = 0o666, unique: bool = False) -> Iterator[Path]:
    """Yields a new empty temporary file beside path for the caller to fill (and close); on a clean exit makes it
    path durably, on an exception removes it. See the module docstring."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{secrets.token_hex(4)}.tmp" if unique else f"{path.name}.tmp")
    if not unique:
        tmp.unlink(missing_ok=True)  # O_EXCL below: a leftover could carry another mode
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode))
    try:
        yield tmp
        fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


def write_atomic(path: str | os.PathLike, data: bytes | str, *, mode: int = 0o666, unique: bool = False) -> None:
    """Replaces path with data (str as UTF-8) in one write, durably. See the module docstring."""
    raw = data.encode("utf-8") if isinstance(data, str) else data
    with replacing(path, mode=mode, unique=unique) as tmp, open(tmp, "wb") as f:
        f.write(raw)
