"""Where runs and checkpoints go, judged before submission: a stand-in mount table puts job.run_root or
checkpoint.dir on an NFS home, a stand-in `lfs` reports a Lustre quota; the dry run's warnings name the key, the
file system and the fix ($SCRATCH). Pure: no processes but the stand-in lfs.

    .venv/bin/python -m pytest -q tests/pure/job/test_storage_warnings.py
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from helpers.training import SMALL
from hpctrain import hostprobe
from hpctrain.config import load_config
from hpctrain.job import launch
from hpctrain.parallel import mesh
from hpctrain.parallel.plan import make_plan

MOUNTS = """\
/dev/sda2 / ext4 rw,relatime 0 0
nfs1.site:/export/home /home nfs4 rw,relatime,vers=4.2,actimeo=60 0 0
nfs2.site:/projects /proj\\040data nfs rw,relatime,vers=3 0 0
10.0.0.1@o2ib:/scratch /scratch lustre rw,flock 0 0
"""


def test_nfs_home_is_named_with_scratch_as_the_fix() -> None:
    note = hostprobe.nfs_warning("job.run_root", Path("/home/u1/hpctrain/runs"), MOUNTS, home="/home/u1",
                                 scratch="/scratch/u1")
    assert note.startswith("warning: job.run_root = '/home/u1/hpctrain/runs' is on an NFS home directory (nfs4 at "
                           "/home)") and "put job.run_root on $SCRATCH (/scratch/u1)" in note, note
    # NFS outside the home directory (a mount point with a space in it), and no $SCRATCH to suggest
    note = hostprobe.nfs_warning("checkpoint.dir", Path("/proj data/ck"), MOUNTS, home="/home/u1")
    assert "is on NFS (nfs at /proj data)" in note and "a scratch or Lustre file system" in note, note
    for quiet in ("/scratch/u1/hpctrain", "/tmp/runs", "/homework"):  # Lustre, a local disk, not below /home
        assert hostprobe.nfs_warning("job.run_root", Path(quiet), MOUNTS, "/home/u1", "/scratch/u1") is None


def test_room_for_fewer_checkpoints_than_kept() -> None:
    gb = 10**9
    assert hostprobe.room_warning("checkpoint.dir", Path("/c"), 10 * gb, 2, 100 * gb, (31 * gb, "q")) is None
    note = hostprobe.room_warning("checkpoint.dir", Path("/c"), 10 * gb, 2, 100 * gb,
                                  (29 * gb, "the Lustre user quota (lfs quota -u 1000)"))
    assert ("the Lustre user quota (lfs quota -u 1000) leaves 29 GB, less than checkpoint.keep + 1 = 3 checkpoints "
            "of about 10 GB") in note and note.endswith("ask for more quota or put checkpoint.dir on scratch"), note
    note = hostprobe.room_warning("job.run_root", Path("/r"), 10 * gb, 2, 5 * gb, None)
    assert "its free space leaves 5 GB" in note and "larger file system" in note, note


@pytest.mark.parametrize("text,left", [
    ("  /lustre  1024  0  4096  -  12  0  0  -", 3072 << 10),            # the hard limit counts
    ("  /lustre  1024  2048  0  -  12  0  0  -", 1024 << 10),            # else the soft one
    ("/very/long/lustre/mount/point\n  5000*  0  4096  -  1  0  0  -", 0),  # name on its own line; past the limit
    ("  /lustre  1024  0  0  -  12  0  0  -", None),                     # no limit
    ("lfs: quotactl failed: Operation not supported", None),
    ("", None),
])
def test_lfs_quota_output(text, left) -> None:
    assert hostprobe.lfs_quota_left(text) == left


def test_quota_asked_of_lustre_only(tmp_path, monkeypatch) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    asked = tmp_path / "asked"
    # user quota: 3 MiB left; group quota: 1 MiB left
    (bindir / "lfs").write_text(f"#!/bin/sh\necho \"$@\" >> {asked}\ncase \"$3\" in\n"
                                "-u) echo '/l 1024 0 4096 - 1 0 0 -';;\n-g) echo '/l 1024 0 2048 - 1 0 0 -';;\nesac\n")
    (bindir / "lfs").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    monkeypatch.setattr(hostprobe, "file_system", lambda path: "ext4")
    assert hostprobe.quota_left(tmp_path / "not" / "yet") is None and not asked.exists()
    monkeypatch.setattr(hostprobe, "file_system", lambda path: "lustre")
    left, which = hostprobe.quota_left(tmp_path / "not" / "yet")  # asked of the nearest existing directory
    assert left == 1 << 20 and which == f"the Lustre group quota (lfs quota -g {tmp_path.stat().st_gid})"
    assert asked.read_text().split("\n")[0] == f"quota -q -u {os.getuid()} {tmp_path}"


def test_dry_run_check_warns(tmp_path, monkeypatch) -> None:
    # run_root on an NFS home, checkpoint.dir on Lustre with a quota smaller than the checkpoints kept
    home, scratch = tmp_path / "home", tmp_path / "scratch"
    monkeypatch.setattr(hostprobe, "mount_table", lambda: f"srv:/home {home} nfs4 rw 0 0\n"
                                                          f"fs@o2ib:/s {scratch} lustre rw 0 0\n")
    monkeypatch.setattr(hostprobe, "quota_left", lambda path: (1000, "the Lustre user quota (lfs quota -u 7)"))
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("SCRATCH", raising=False)
    cfg = load_config(None, SMALL + [f"job.run_root={home / 'runs'}", f"checkpoint.dir={scratch / 'ck'}"])
    notes: list[str] = []
    launch.check_storage(cfg, make_plan(cfg, mesh.block_placement(1, 1)), notes.append)
    assert len(notes) == 2 and notes[0].startswith(f"warning: job.run_root = '{home / 'runs'}' is on an NFS home "
                                                   "directory"), notes
    assert notes[1].startswith(f"warning: checkpoint.dir = '{scratch / 'ck'}': the Lustre user quota (lfs quota -u "
                               "7) leaves 1e-06 GB"), notes
    notes.clear()  # checkpoints in the run directory: the room is asked of run_root
    cfg = load_config(None, SMALL + [f"job.run_root={scratch / 'runs'}"])
    launch.check_storage(cfg, make_plan(cfg, mesh.block_placement(1, 1)), notes.append)
    assert len(notes) == 1 and notes[0].startswith(f"warning: job.run_root = '{scratch / 'runs'}': the Lustre"), notes
