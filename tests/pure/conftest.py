"""The pure tier runs in the test process only: a test here that starts a Python interpreter or a launcher
(mpiexec, srun, sbatch, torchrun, the hpctrain command), forks, or starts a multiprocessing child (spawn and
forkserver start a Python interpreter) fails, naming what it started. Tools that are neither (scontrol and sinfo
stand-ins, lfs, df, git) may still run. Such a test belongs in tests/multiproc/, and so does a whole training run
in the test process: the tier is kept well under a minute.
"""
from __future__ import annotations

import multiprocessing.util
import os
import subprocess
import sys

import pytest

REFUSED = ("python", "hpctrain", "mpiexec", "mpirun", "srun", "sbatch", "salloc", "torchrun")


def _refused(argv) -> str | None:
    args = [argv] if isinstance(argv, (str, bytes, os.PathLike)) else list(argv)
    if not args:
        return None
    first = os.fsdecode(args[0])
    # a string runs through the shell (or is a bare path): its first word is the program
    name = os.path.basename(first.split()[0] if isinstance(argv, str) and first.strip() else first)
    if first == sys.executable or name.startswith(REFUSED):
        return name
    return None


def _refuse(what: str) -> None:
    raise AssertionError(f"a pure test {what}: move it to tests/multiproc/")


@pytest.fixture(autouse=True)
def _no_python_or_launcher_children(monkeypatch):
    real_popen = subprocess.Popen.__init__

    def popen(self, args, *a, **kw):
        name = _refused(args)
        if name is not None:
            _refuse(f"started {name!r} ({args!r})")
        real_popen(self, args, *a, **kw)

    def posix_spawn(real):
        def guarded(path, argv, *a, **kw):
            name = _refused([path])
            if name is not None:
                _refuse(f"started {name!r} ({argv!r})")
            return real(path, argv, *a, **kw)
        return guarded

    def no_fork(*a, **kw):
        _refuse("forked a process")

    def no_mp_child(*a, **kw):
        _refuse("started a multiprocessing child (a Python interpreter)")

    monkeypatch.setattr(subprocess.Popen, "__init__", popen)
    for name in ("posix_spawn", "posix_spawnp"):
        monkeypatch.setattr(os, name, posix_spawn(getattr(os, name)))
    monkeypatch.setattr(os, "fork", no_fork)
    monkeypatch.setattr(os, "forkpty", no_fork)
    # multiprocessing's spawn and forkserver start methods launch sys.executable through this, not Popen
    monkeypatch.setattr(multiprocessing.util, "spawnv_passfds", no_mp_child)
    yield
