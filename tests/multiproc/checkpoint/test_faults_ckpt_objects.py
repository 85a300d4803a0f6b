"""Fault campaign, checkpoint tier: shard files and HDF5 objects that read bytes from outside the checkpoint.

An attacker who can write a checkpoint directory (and re-seal index.json's sizes and checksums and the COMMITTED
marker) tries to make our readers fetch the bytes of a file outside it: a dataset with external raw storage, an
external link, a soft link that walks through an external link, a virtual dataset, a symlinked shard file, a
symlinked step directory, a symlinked index.json. Each case asserts that `ckpt verify` exits 1 naming it, that
`ckpt export` (safetensors and Hugging Face) refuses and writes nothing, that a resume does not load it (it falls
back to the previous checkpoint with exactly the losses of a clean resume from that one) and that no file written
anywhere holds the outside file's bytes. One trained run is shared by every case.

    .venv/bin/python -m pytest -q tests/multiproc/checkpoint/test_faults_ckpt_objects.py
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
from click.testing import CliRunner
from faults import record

from helpers.training import SMALL
from hpctrain.checkpoint import manager as mgr_mod
from hpctrain.checkpoint.h5file import crc32
from hpctrain.cli.main import main as cli
from hpctrain.config import load_config
from hpctrain.job import session
from hpctrain.train.trainer import Trainer

pytestmark = pytest.mark.faults

SECRET = b"OUTSIDE-THE-CHECKPOINT-0123456789"  # recognisable bytes of the file outside
EMBEDDING = "/model.tok_embeddings.weight/0_0"  # the dataset the attacker replaces (shard-0.h5 of a 1-rank run)
STEP = "step_00000002"


def _fit(tmp: Path, *sets: str, ck: str = "ck") -> dict:
    cfg = load_config(None, SMALL + [f"job.run_root={tmp / 'runs'}", f"checkpoint.dir={tmp / ck}", *sets])
    with session.start(cfg) as s:
        return Trainer(cfg, s).fit()


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> tuple[Path, list[float]]:
    """(a checkpoints directory holding steps 1 and 2, the losses of a clean resume from step 1 to step 3)."""
    tmp = tmp_path_factory.mktemp("pristine")
    _fit(tmp, "train.steps=2", "checkpoint.every_steps=1")
    clean = _fit(tmp, "train.steps=3", f"train.resume={tmp / 'ck' / 'step_00000001'}", ck="clean")
    assert clean["resumed_from"] == 1
    return tmp / "ck", clean["losses"]


def _secret(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = (SECRET * (nbytes // len(SECRET) + 1))[:nbytes]
    return np.frombuffer(raw, dtype=dtype).reshape(shape)


def _reseal(ck: Path, shard: Path, arr: np.ndarray) -> None:
    """index.json made to describe the crafted embedding (crc32, no offset) and the shard's size as stat sees it
    (through a symlink), then the marker's checksums made to match again: what an attacker who knows the format
    does."""
    doc = json.loads((ck / "index.json").read_text())
    for e in doc["storage_data"]:
        if e["dataset"] == EMBEDDING:
            e.update(crc32=crc32(arr), file_offset=None)
    doc["files"]["shard-0.h5"] = shard.stat().st_size
    (ck / "index.json").write_text(json.dumps(doc))
    marker = json.loads((ck / "COMMITTED").read_text())
    for name in marker["files"]:
        marker["files"][name] = crc32(np.frombuffer((ck / name).read_bytes(), np.uint8))
    (ck / "COMMITTED").write_text(json.dumps(marker))


def _craft(kind: str, ck: Path, outside: Path) -> None:
    """Makes ck (a copy of a committed step) read its embedding from a file in `outside`, sizes and checksums
    re-sealed."""
    outside.mkdir()
    shard = ck / "shard-0.h5"
    with h5py.File(shard, "r") as f:
        shape, dtype = f[EMBEDDING].shape, f[EMBEDDING].dtype
    arr = _secret(shape, dtype)
    (outside / "secret.bin").write_bytes(arr.tobytes())
    with h5py.File(outside / "secret.h5", "w") as f:
        f["secret"] = arr
    if kind == "symlinked index.json":  # the same index, read from elsewhere: whatever it says would be believed
        shutil.move(ck / "index.json", outside / "index.json")
        os.symlink(outside / "index.json", ck / "index.json")
        return
    if kind in ("symlinked shard", "symlinked step directory"):
        if kind == "symlinked step directory":  # the whole step lives outside; the checkpoints directory links it
            shutil.move(ck, outside / STEP)
            os.symlink(outside / STEP, ck)
            shard = ck / "shard-0.h5"
        else:
            shutil.move(shard, outside / "shard.h5")
            os.symlink(outside / "shard.h5", shard)
        with h5py.File(shard, "r+") as f:  # the file the link reaches holds the embedding in plain
            del f[EMBEDDING]
            f[EMBEDDING] = arr
        _reseal(ck, shard, arr)
        return
    with h5py.File(shard, "r+") as f:
        del f[EMBEDDING]
        if kind == "external raw storage":
            f.create_dataset(EMBEDDING, shape, dtype, external=[(str(outside / "secret.bin"), 0, arr.nbytes)])
        elif kind == "external link":
            f[EMBEDDING] = h5py.ExternalLink(str(outside / "secret.h5"), "/secret")
        elif kind == "soft link":  # a soft link to a path that walks through an external link to the outside file
            f["/elsewhere"] = h5py.ExternalLink(str(outside / "secret.h5"), "/")
            f[EMBEDDING] = h5py.SoftLink("/elsewhere/secret")
        elif kind == "virtual dataset":
            layout = h5py.VirtualLayout(shape, dtype)
            layout[...] = h5py.VirtualSource(str(outside / "secret.h5"), "secret", shape)
            f.create_virtual_dataset(EMBEDDING, layout)
        else:
            raise AssertionError(kind)
    _reseal(ck, shard, arr)


def _files_holding_secret(root: Path, skip: Path) -> list[Path]:
    """Regular files under root (links not followed, `skip` left out) holding the outside file's bytes."""
    found = []
    for dirpath, _, names in os.walk(root):
        for name in names:
            p = Path(dirpath, name)
            if not p.is_symlink() and skip not in p.parents and SECRET[:24] in p.read_bytes():
                found.append(p)
    return found


# kind -> words the refusal must hold
KINDS = {
    "external raw storage": "external raw storage",
    "external link": "external link",
    "soft link": "soft link",
    "virtual dataset": "virtual",
    "symlinked shard": "symbolic link",
    "symlinked step directory": "symbolic link",
    "symlinked index.json": "symbolic link",
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_checkpoint_reading_outside_is_refused(tmp_path, pristine, kind) -> None:
    source, clean_losses = pristine
    shutil.copytree(source, tmp_path / "ck", symlinks=True)
    ck, outside = tmp_path / "ck" / STEP, tmp_path / "outside"
    _craft(kind, ck, outside)

    def ckpt(*args):
        return CliRunner().invoke(cli, ["ckpt", *map(str, args)])

    out = ckpt("verify", ck)
    named = {"symlinked step directory": f"{STEP}:", "symlinked index.json": f"{STEP}/index.json"}.get(
        kind, f"{STEP}/shard-0.h5")
    assert out.exit_code == 1 and KINDS[kind] in out.output and named in out.output, out.output
    assert not isinstance(out.exception, Exception) or isinstance(out.exception, SystemExit), out.exception
    for args in (("--to", "safetensors", "-o", tmp_path / "m.safetensors"), ("--format", "hf", "--out",
                                                                              tmp_path / "hf")):
        out = ckpt("export", ck, *args)
        assert out.exit_code == 1 and KINDS[kind] in out.output, out.output
    assert not (tmp_path / "m.safetensors").exists() and not (tmp_path / "hf").exists()
    assert not list(tmp_path.glob(".hf.*.tmp"))

    res = _fit(tmp_path, "train.steps=3")
    assert res["resumed_from"] == 1 and res["losses"] == clean_losses  # nothing of the crafted step was loaded
    if kind == "symlinked step directory":  # its marker is not read through the link: it never counts as newest
        assert (tmp_path / "ck" / STEP).is_symlink()
        with pytest.raises(mgr_mod.CheckpointCorrupt, match="symbolic link"):
            _fit(tmp_path, "train.steps=3", f"train.resume={ck}", ck="ck_other")
    else:
        assert (tmp_path / "ck" / f"{STEP}.unusable" / "UNUSABLE.txt").is_file()
        assert KINDS[kind] in (tmp_path / "ck" / f"{STEP}.unusable" / "UNUSABLE.txt").read_text()
    assert _files_holding_secret(tmp_path, skip=outside) == []
    record(f"checkpoint shard reading a file outside the checkpoint ({kind}), sizes and checksums re-sealed",
           "ckpt verify exits 1 naming it; ckpt export (safetensors, hf) refuses and writes nothing; resume does "
           "not load it (falls back, losses those of a clean resume from the previous checkpoint); no file written "
           "holds the outside bytes", tier="checkpoint")
