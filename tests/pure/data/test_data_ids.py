"""No pass over the token ids on the login node (issue 26): `data build` records the range of the ids beside the
data, tied to the file by its identity; submission and --dry-run read only that record; a file without one is
named ("one rank checks its N GB at job start") and its ids are checked once at job start
(data.check_ids_at_start), here in one process. The multi-rank check (one rank scans, the others are sent the
result): tests/multiproc/data/test_data_ids_ranks.py; the CLI's dry run on a large file:
tests/multiproc/data/test_data_ids_dry_run.py.

    .venv/bin/python -m pytest -q tests/pure/data/test_data_ids.py
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
from faults import record

from helpers.launch import EXAMPLE
from helpers.refusals import refused
from hpctrain.config import DataConfig, load_config
from hpctrain.data import loader as data
from hpctrain.data import tokenfiles
from hpctrain.data.build import build_dataset
from hpctrain.data.sources import open_source
from hpctrain.data.tokenfiles import ArraySource, HDF5Source, file_identity
from hpctrain.hang.heartbeat import Heartbeat
from hpctrain.job import launch

pytestmark = pytest.mark.faults

SUFFIX_SOURCE = {".bin": "bin", ".npy": "bin", ".h5": "hdf5"}


@pytest.fixture
def scans(monkeypatch) -> list[str]:
    """The name of every file whose ids are scanned from now on (a scan is one call of tokenfiles._scan_ids)."""
    seen: list[str] = []
    real = tokenfiles._scan_ids
    def counted(source, *rest):
        seen.append(Path(getattr(source, "name", "?")).name)
        return real(source, *rest)
    monkeypatch.setattr(tokenfiles, "_scan_ids", counted)
    return seen


@pytest.fixture
def texts(tmp_path: Path) -> Path:
    root = tmp_path / "src"
    root.mkdir()
    (root / "a.txt").write_text("plain words for a small corpus, repeated. " * 40)
    (root / "b.md").write_text("# heading\nsome more text, with {braces} and ~tildes~\n" * 30)
    return root


def raw_file(path: Path, n: int = 4096, bad_at: int | None = None) -> Path:
    """A raw uint16 token file with no sidecar (made by something else than data build); id 300 at bad_at."""
    ids = (np.arange(n) % 200).astype("<u2")
    if bad_at is not None:
        ids[bad_at] = 300
    ids.tofile(path)
    return path


def cfg_for(path: Path, *sets: str):
    return load_config(str(EXAMPLE), [f"data.path={path}", "data.source=" + SUFFIX_SOURCE[path.suffix], *sets])


# --- the login node -----------------------------------------------------------------------------------------



def test_submission_reads_the_record_alone(texts, tmp_path, scans) -> None:
    """check_layout (what submit runs before anything is submitted) on a raw file whose ids would fail: it goes
    on, naming the file; on a built file whose record says the ids do not fit: refused from the record alone."""
    lines: list[str] = []
    cfg = cfg_for(raw_file(tmp_path / "raw.bin", bad_at=2000))
    launch.check_layout(cfg, lines.append)
    assert f"{tmp_path / 'raw.bin'}: no record of its ids from data build; one rank checks its 8.2 kB of token ids " \
           f"at job start" in lines
    build_dataset([texts], tmp_path / "built.bin")
    top = max(ArraySource(tmp_path / "built.bin").read(0, 10 ** 6))
    launch.check_layout(cfg_for(tmp_path / "built.bin"), lines.append)  # fits: nothing to say
    assert len(lines) == sum("planner" in line or "padded" in line for line in lines) + 1
    refused(launch.check_layout, cfg_for(tmp_path / "built.bin", "model.vocab_size=100"), print,
            fragments=["built.bin", f"ids up to {top}", "model.vocab_size = 100"])
    assert scans == []
    record("submission of a raw token file holding an id past the vocabulary, and of a built file whose record's "
           "largest id is past it", "the first goes on, named with its check at job start; the second is refused "
           "naming file, id and vocabulary; no id read for either", tier="pure")


@pytest.mark.parametrize("suffix", [".bin", ".npy", ".h5"])
def test_data_build_records_the_ids_of_exactly_that_file(texts, tmp_path, suffix, scans) -> None:
    path = tmp_path / f"c{suffix}"
    build_dataset([texts], path)
    reader = HDF5Source if suffix == ".h5" else ArraySource
    source = reader(path, scan=False)
    top = int(source.read(0, len(source)).max())
    assert source.max_id == top and source.unchecked == "" and scans == []
    del source  # closes its HDF5 handle
    if suffix == ".h5":  # a token rewritten in place: the attributes no longer describe the tokens
        with h5py.File(path, "r+") as f:
            f["tokens"][0] = 7
    else:
        shutil.copy(path, tmp_path / "copy")  # a new mtime: re-staged
        os.replace(tmp_path / "copy", path)
    stale = reader(path, scan=False)
    assert stale.max_id is None and "for another file" in stale.unchecked and scans == []
    assert reader(path).max_id == top and scans == [path.name]  # checked when asked to scan


DAMAGED = {
    "text": lambda key: "not an entry", "list": lambda key: ["a", "list"],
    "no identity": lambda key: {"min_id": 0, "max_id": 10},
    "max_id as text": lambda key: key | {"min_id": 0, "max_id": "10"},
    "min_id a bool": lambda key: key | {"min_id": False, "max_id": 10},
    "min_id above 0": lambda key: key | {"min_id": 3, "max_id": 10},
    "max_id below -1": lambda key: key | {"min_id": 0, "max_id": -7},
    "another dtype": lambda key: key | {"dtype": "<u4", "min_id": 0, "max_id": 10},
    "another sample": lambda key: key | {"sample": "0" * 32, "min_id": 0, "max_id": 10},
    "another mtime": lambda key: key | {"mtime_ns": key["mtime_ns"] + 1, "min_id": 0, "max_id": 10},
}


@pytest.mark.parametrize("case", list(DAMAGED))
def test_a_damaged_or_foreign_record_is_not_trusted(tmp_path, case, scans) -> None:
    path = raw_file(tmp_path / "tok.bin", bad_at=100)
    entry = DAMAGED[case](file_identity(path) | {"dtype": "<u2"})
    (tmp_path / "tok.bin.json").write_text(json.dumps({"vocab_size": 256, "ids": entry}))
    source = ArraySource(path, scan=False)
    assert source.max_id is None and "for another file" in source.unchecked and scans == []
    refused(open_source, DataConfig(source="bin", path=str(path), seq_len=8), 256, fragments=["300"])
    assert scans == ["tok.bin"]
    record("data build record (sidecar \"ids\") damaged (a wrong type, a bool, min_id > 0, max_id < -1) or for "
           "another file (dtype, first and last MiB, mtime)", "not trusted: the ids are left unchecked at "
           "submission, and scanned when opened for training, which refuses id 300", tier="pure")


def test_a_forged_record_is_caught_by_the_loader(tmp_path) -> None:
    """A record that names the file exactly but understates its ids is believed on opening (nothing but a scan
    could tell); every batch is still checked against the vocabulary."""
    path = raw_file(tmp_path / "tok.bin", n=400, bad_at=None)
    np.full(400, 300, dtype="<u2").tofile(path)
    (tmp_path / "tok.bin.json").write_text(json.dumps({"vocab_size": 256, "ids": file_identity(path) | {
        "dtype": "<u2", "min_id": 0, "max_id": 10}}))
    source = open_source(DataConfig(source="bin", path=str(path), seq_len=8), 256)
    assert source.max_id == 10 and source.vocab_size == 256
    refused(data.TokenLoader(source, 8, 2, 0, 1, seed=0).next_batch, fragments=[str(path), "300", "256"])
    record("data build record naming the file exactly but claiming max_id 10 for ids of 300",
           "opened on its word; the first batch is a ValueError naming the file, id 300 and vocabulary 256",
           tier="pure")


# --- job start, one process ---------------------------------------------------------------------------------

def test_job_start_checks_each_file_once_with_progress(tmp_path, monkeypatch, scans, caplog) -> None:
    """check_ids_at_start in one process (no group): the training file and its validation split scanned once
    each, a slice at a time with progress in the log and the heartbeat, the result kept in the run directory when
    neither the data's directory nor the user's cache can take it; opening them afterwards scans nothing."""
    monkeypatch.setattr(tokenfiles, "SCAN_TOKENS", 1000)
    raw_file(tmp_path / "tok.bin", n=20_000)
    raw_file(tmp_path / "tok.val.bin", n=5_000)
    for name in ("tok.bin.ids.json", "tok.val.bin.ids.json"):
        (tmp_path / name).mkdir()  # the data's directory takes no cache file, whoever we run as
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "tok.bin"))  # a file: no directory can be made in it
    run_dir = tmp_path / "run"
    hb = Heartbeat(None, 0)
    details: list[str] = []
    real_enter = hb.enter
    monkeypatch.setattr(hb, "enter", lambda phase, detail="": details.append(f"{phase}: {detail}") or
                        real_enter(phase, detail))
    job = load_config(None, ["data.source=bin", f"data.path={tmp_path / 'tok.bin'}", "data.seq_len=8",
                             "train.eval_every=10"])
    cfg = job.data
    with caplog.at_level(logging.INFO, logger="hpctrain.data.loader"):
        data.check_ids_at_start(job, None, run_dir, hb, round_s=0.0)
    assert scans == ["tok.bin", "tok.val.bin"]
    # round_s 0: a slice of each file per round, and a heartbeat move and a log line after each round
    assert len(details) == 20 and all(d.startswith("startup: token ids: ") for d in details), details
    assert details[0].endswith("2 of 2 files left") and details[-1].endswith("0 of 2 files left"), details
    assert caplog.text.count("files left") == 20
    assert "no record of its ids from data build; rank 0" in caplog.text and "token ids checked in" in caplog.text
    assert len(list((run_dir / "ids").glob("*.json"))) == 2
    assert open_source(cfg, 256).max_id == 199 and data.open_val_source(cfg, 256).max_id == 199
    assert len(scans) == 2
    tokenfiles._checked_here.clear()  # a requeued job: a new process, the same run directory
    assert ArraySource(tmp_path / "tok.bin", scan=False, run_dir=run_dir).max_id == 199 and len(scans) == 2


def test_hdf5_attributes_of_the_wrong_shape_are_no_record(texts, tmp_path, scans) -> None:
    path = tmp_path / "c.h5"
    build_dataset([texts], path)
    with h5py.File(path, "r+") as f:
        f["tokens"].attrs["ids_sample"] = np.arange(3)  # an array where a hash belongs
    assert HDF5Source(path, scan=False).max_id is None and scans == []
    with h5py.File(path, "r+") as f:
        f["tokens"].attrs["ids_sample"] = "0" * 32
        f["tokens"].attrs["num_tokens"] = np.arange(3)
    refused(HDF5Source, path, scan=False, fragments=["num_tokens"])  # the record's own check names it
