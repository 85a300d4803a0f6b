"""Fault campaign, a spent disk quota (EDQUOT) during a save: wherever it strikes (the step's directory, a shard,
the index, an attached file, the commit marker; in the foreground or the background), the save is abandoned with
nothing of it left, the last committed checkpoint stays, a periodic save is skipped and training goes on, a final
save fails the job naming the quota, and the next job resumes. The quota is a stand-in: a patched call raises
OSError(EDQUOT), as a real quota does at the write or, on NFS, at the flush. A Lustre quota that lfs reports too
small refuses the save before a byte is written.

    PATH=$PWD/.venv/bin:$PATH .venv/bin/python -m pytest -q tests/multiproc/checkpoint/test_faults_quota.py
"""
from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from faults import record

from helpers.launch import TESTS, free_base_port, spawn_ranks
from helpers.training import SMALL
from hpctrain import hostprobe
from hpctrain.checkpoint import hdf5_storage, inspection
from hpctrain.checkpoint import manager as mgr_mod
from hpctrain.checkpoint.manager import committed
from hpctrain.config import load_config
from hpctrain.hf import load as hf_import
from hpctrain.job import session
from hpctrain.train.trainer import Trainer

pytestmark = pytest.mark.faults
HERE = Path(__file__).resolve().parent
QUOTA = "ask for more quota or put checkpoint.dir on scratch"


def inject(point: str, step: int, setattr=setattr) -> None:
    """The save of `step` meets a spent quota at `point`; every other file is written as usual. setattr: pytest's
    monkeypatch.setattr in process, the builtin in a child process."""
    name = mgr_mod.step_name(step)

    def spent(path) -> OSError:
        return OSError(errno.EDQUOT, "Disk quota exceeded (injected)", str(path))

    def failing(real, hit):
        def call(*args, **kwargs):
            if hit(*args):
                raise spent(args[-1] if point == "attach" else args[0])
            return real(*args, **kwargs)
        return call

    partial = name + ".partial"
    if point == "mkdir":  # the step's temporary directory
        setattr(Path, "mkdir", failing(Path.mkdir, lambda p, *a: p.name == partial))
    elif point == "shard":  # where a quota shows up when writes are buffered (NFS): the shard's flush
        setattr(hdf5_storage, "fsync", failing(hdf5_storage.fsync, lambda p: Path(p).parent.name == partial))
    elif point == "index":  # the coordinator's index.json, inside DCP's finish
        setattr(hdf5_storage, "write_atomic", failing(hdf5_storage.write_atomic,
                                                      lambda p, *a: Path(p).parent.name == partial))
    elif point == "attach":  # rank 0 copying the tokenizer into the step at its commit
        setattr(shutil, "copyfile", failing(shutil.copyfile, lambda src, dst: Path(dst).parent.name == partial))
    elif point == "marker":  # the commit marker, written after the step directory was renamed into place
        setattr(mgr_mod, "write_atomic", failing(mgr_mod.write_atomic,
                                                 lambda p, *a: Path(p) == Path(p).parent.with_name(name) / "COMMITTED"))
    else:
        raise AssertionError(point)


def _fit(tmp: Path, *sets: str) -> dict:
    cfg = load_config(None, SMALL + [f"job.run_root={tmp / 'runs'}", f"checkpoint.dir={tmp / 'ck'}", *sets])
    with session.start(cfg) as s:
        return Trainer(cfg, s).fit()


def _steps(root: Path) -> list[int]:
    return [s for s, _ in committed(root)]


def _left_of(root: Path, step: int) -> list[str]:
    """Whatever in the checkpoint directory carries the step's name (its .partial, .old, an uncommitted copy)."""
    return sorted(p.name for p in root.iterdir() if p.name.startswith(mgr_mod.step_name(step)))


def _rank_logs(tmp: Path) -> list[str]:
    return [p.read_text() for p in sorted((tmp / "runs").glob("*/logs/rank*.log"))]


@pytest.mark.parametrize("point,mode", [("mkdir", "sync"), ("shard", "sync"), ("shard", "async"), ("index", "sync"),
                                        ("attach", "sync"), ("marker", "sync"), ("marker", "async")])
def test_periodic_save_over_quota_is_skipped(tmp_path, monkeypatch, point, mode) -> None:
    if point == "attach":  # a run that records its tokenizer in every checkpoint
        tokenizer = tmp_path / "tokenizer.json"
        tokenizer.write_text("{}")
        monkeypatch.setattr(hf_import, "tokenizer_files", lambda *a: ({"tokenizer.json": tokenizer}, []))
    inject(point, 3, monkeypatch.setattr)
    background = "true" if mode == "async" else "false"
    res = _fit(tmp_path, "train.steps=4", "checkpoint.every_steps=1", f"checkpoint.async_save={background}")
    ck = tmp_path / "ck"
    assert res["steps"] == 4 and _steps(ck) == [2, 4], _steps(ck)
    assert _left_of(ck, 3) == [] and not inspection.verify(ck / "step_00000002").problems
    (log,) = _rank_logs(tmp_path)
    assert log.count("periodic checkpoint skipped") == 1 and f"disk quota exceeded on {ck}" in log, log[-3000:]
    assert QUOTA in log
    monkeypatch.undo()
    assert _fit(tmp_path, "train.steps=5")["resumed_from"] == 4
    where = {"mkdir": "making the step's directory", "shard": "flushing a shard", "index": "writing the index",
             "attach": "copying the tokenizer in", "marker": "writing the commit marker"}[point]
    record(f"disk quota exceeded (EDQUOT) {where} during a periodic {mode} save",
           "the save is skipped with a warning naming the quota, nothing of it left; training goes on to its last "
           "step; the earlier checkpoint verifies; the next job resumes from the last one", tier="checkpoint")


# A job whose final save meets a spent quota, in a process of its own: its exit status and stderr are the point.
# argv: the injection point, then the config's --set items.
FINAL = """
import sys
sys.path[:0] = [{tests!r}, {here!r}]
from helpers.training import SMALL
from test_faults_quota import inject
from hpctrain.job import session
from hpctrain.config import load_config
from hpctrain.train.trainer import Trainer
inject(sys.argv[1], 2)
cfg = load_config(None, SMALL + sys.argv[2:])
with session.start(cfg) as s:
    Trainer(cfg, s).fit()
"""


@pytest.mark.parametrize("point,resave", [("shard", False), ("marker", False), ("marker", True)])
def test_final_save_over_quota_fails_the_job(tmp_path, point, resave) -> None:
    ck = tmp_path / "ck"
    # resave: the job repeats step 2 from step 1, so its save replaces a committed copy of its own step
    _fit(tmp_path, "train.steps=2" if resave else "train.steps=1", "checkpoint.every_steps=1")
    before = sorted(p.name for p in ck.iterdir())
    marker = (ck / "step_00000002" / "COMMITTED").read_bytes() if resave else None
    sets = [f"job.run_root={tmp_path / 'runs'}", f"checkpoint.dir={ck}", "train.steps=2"]
    if resave:
        sets.append(f"train.resume={ck / 'step_00000001'}")
    out = subprocess.run([sys.executable, "-c", FINAL.format(tests=str(TESTS), here=str(HERE)), point, *sets],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, f"exit {out.returncode}: {out.stderr[-3000:]}"
    assert f"disk quota exceeded on {ck}" in out.stderr and QUOTA in out.stderr, out.stderr[-3000:]
    assert sorted(p.name for p in ck.iterdir()) == before  # nothing half-committed, nothing left
    if resave:  # the committed copy it was replacing is back, whole
        assert (ck / "step_00000002" / "COMMITTED").read_bytes() == marker
        assert not inspection.verify(ck / "step_00000002").problems
    resumed = 2 if resave else 1
    assert _fit(tmp_path, "train.steps=3")["resumed_from"] == resumed
    what = "replacing a committed copy of its step" if resave else "of a new step"
    record(f"disk quota exceeded (EDQUOT) at the {point} of the final save, {what}",
           "the job exits 1 naming the quota; the checkpoint directory holds what it held before the job"
           + (" (the replaced copy restored, verifying)" if resave else "") + "; the next job resumes from the "
           "last committed checkpoint", tier="checkpoint")


def test_lustre_quota_refuses_before_writing(tmp_path, monkeypatch) -> None:
    # lfs says 4 KB are left under the hard limit: each save is refused before its directory is made
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "lfs").write_text("#!/bin/sh\n[ \"$1\" = quota ] && echo '  /lustre  4096*  0  4100  -  1  0  0  -'\n")
    (bindir / "lfs").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    monkeypatch.setattr(hostprobe, "file_system", lambda path: "lustre")
    res = _fit(tmp_path, "train.steps=3", "checkpoint.every_steps=1", "checkpoint.at_end=false")
    ck = tmp_path / "ck"
    assert res["steps"] == 3 and _steps(ck) == [] and _left_of(ck, 1) == []
    (log,) = _rank_logs(tmp_path)
    assert log.count("periodic checkpoint skipped") == 2 and "the Lustre user quota (lfs quota -u" in log, log[-3000:]
    with pytest.raises(mgr_mod.NoSpace, match=f"disk quota exceeded on {tmp_path / 'b' / 'ck'}; {QUOTA}"):
        _fit(tmp_path / "b", "train.steps=2")
    record("a Lustre quota (lfs quota) with less room than the next checkpoint", "periodic saves skipped before "
           "writing, with a warning naming the quota; a final save fails the job naming it", tier="checkpoint")


# Two ranks: rank 1 meets the quota flushing its shard of step 3, rank 0 writing the marker of step 4, both in the
# background. argv: MASTER_PORT, then the config's --set items.
TWO_RANKS = """
import os, sys
sys.path[:0] = [{tests!r}, {here!r}]
os.environ["MASTER_PORT"] = sys.argv[1]
from helpers.training import SMALL
from test_faults_quota import inject
from hpctrain.job import session
from hpctrain.config import load_config
from hpctrain.train.trainer import Trainer
inject(*(("marker", 4) if os.environ["RANK"] == "0" else ("shard", 3)))
cfg = load_config(None, SMALL + sys.argv[2:])
with session.start(cfg) as s:
    print("steps", Trainer(cfg, s).fit()["steps"])
"""


@pytest.mark.faults
def test_quota_on_one_rank_skips_the_save_on_every_rank(tmp_path) -> None:
    ck = tmp_path / "ck"
    sets = [f"job.run_root={tmp_path / 'runs'}", f"checkpoint.dir={ck}", "train.steps=6", "checkpoint.every_steps=1",
            "checkpoint.async_save=true"]
    cmd = [sys.executable, "-c", TWO_RANKS.format(tests=str(TESTS), here=str(HERE)), str(free_base_port(1)), *sets]
    procs = spawn_ranks(2, cmd, ranks_per_node=2, run_id="quota")
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 and "steps 6" in o for p, o in zip(procs, outs)), "\n".join(o[-3000:] for o in outs)
    assert _steps(ck) == [5, 6] and _left_of(ck, 3) == _left_of(ck, 4) == []
    for log in _rank_logs(tmp_path):
        assert log.count("periodic checkpoint skipped") == 2 and log.count(f"disk quota exceeded on {ck}") == 2, log
    record("disk quota exceeded on one rank of two (rank 1's shard of one background save, rank 0's commit marker "
           "of the next)", "both saves skipped on both ranks with the quota named; training goes on to its last step "
           "and commits later saves", tier="multi-process")
