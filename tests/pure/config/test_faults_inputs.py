"""Fault campaign, inputs: hostile or broken configs, run roots and token files. Each is refused with a
ValueError that names the key or file and the offending value, on the login node, before anything is submitted;
never a traceback, a corrupted sbatch script or a job that trains on bad ids. The same inputs through the
`hpctrain` command in its own process (exit 2, no traceback) are tests/multiproc/cli/test_faults_cli.py's.

    .venv/bin/python -m pytest tests/pure/config/test_faults_inputs.py -q
"""
from __future__ import annotations

import dataclasses
import errno
import json
import os
import typing

import h5py
import numpy as np
import pytest
from faults import record

from helpers.refusals import refused
from hpctrain.config import SECTIONS, DataConfig, TrainConfig, load_config
from hpctrain.data import loader as data
from hpctrain.data import tokenfiles
from hpctrain.data.sources import open_source
from hpctrain.job import runs

pytestmark = pytest.mark.faults


# --- 1. line breaks and NUL in [job] strings --------------------------------------------------------------

@pytest.mark.parametrize("override, key", [
    ('job.partition="debug\\n#SBATCH --uid=0"', "job.partition"),
    ('job.account="proj\\r"', "job.account"),
    ('job.qos="normal\\u0000"', "job.qos"),
    ('job.constraint="a100\\nrm -rf /"', "job.constraint"),
    ('job.run_root="runs\\nx"', "job.run_root"),
    ('job.name="x\\ny"', "job.name"),
    ('job.sbatch_extra=["--comment=a\\nb"]', "job.sbatch_extra[0]"),  # TOML basic strings: the escape is a newline
    ('job.setup=["module load x", "set -e\\nrm -rf /tmp/x"]', "job.setup[1]"),
    ('job.srun_args=["--mpi=pmi2", "--x\\r\\n"]', "job.srun_args[1]"),
    ('job.setup=["echo a\\u0000b"]', "job.setup[0]"),
])
def test_line_break_or_nul_in_a_job_string_is_refused(override, key):
    msg = refused(load_config, None, [override], fragments=[key, "line break or NUL"])
    assert "\n" not in msg and "\r" not in msg and "\x00" not in msg  # the value is shown escaped
    record("newline, CR or NUL in a [job] string or list entry (would break out of the #SBATCH header)",
           "ValueError at load naming the key and the escaped value", tier="pure")


def test_strings_outside_job_may_hold_newlines():
    # only [job] reaches the sbatch script; a path elsewhere is written to config.toml with escapes
    assert load_config(None, ['train.resume="a\\nb"']).train.resume == "a\nb"


# --- 2. strings that are not UTF-8 ------------------------------------------------------------------------

@pytest.mark.parametrize("override, key", [
    ("data.path=/scratch/\udcff.bin", "data.path"),  # argv bytes that are not UTF-8 arrive as surrogates
    ('train.resume="\ud800"', "train.resume"),
    ("checkpoint.dir=\ud800", "checkpoint.dir"),
    ("parallel.master_addr=\udc80", "parallel.master_addr"),
    ("job.setup=['echo \udcff']", "job.setup[0]"),
    ("job.run_root=\udcff", "job.run_root"),
])
def test_string_that_is_not_utf8_is_refused(override, key):
    refused(load_config, None, [override], fragments=[key, "UTF-8"])
    record("lone surrogate (non-UTF-8 argv bytes) in any config string", "ValueError at load naming the key",
           tier="pure")


def test_every_string_field_is_checked_for_utf8():
    """Generic, not key by key: every str and list[str] field of every section."""
    checked = 0
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            kind = typing.get_type_hints(cls)[f.name]
            if kind is str or kind == list[str]:
                value = "\udcff" if kind is str else ["\udcff"]
                with pytest.raises(ValueError, match=f"{section}.{f.name}.*UTF-8"):
                    cls(**{f.name: value})
                checked += 1
    assert checked >= 15


def test_surrogate_escape_in_a_config_file_names_file_and_line(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[data]\npath = "\\ud800"\n')
    refused(load_config, path, fragments=[str(path), "line 2"])
    record("TOML escape of a lone surrogate in a config file", "ValueError naming the file and line", tier="pure")


# --- 3. non-finite numbers --------------------------------------------------------------------------------

FLOAT_KEYS = [f"{section}.{f.name}" for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)
              if typing.get_type_hints(cls)[f.name] is float]


@pytest.mark.parametrize("key", FLOAT_KEYS)
@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "1e400"])
def test_non_finite_float_is_refused(key, value):
    refused(load_config, None, [f"{key}={value}"], fragments=[key, "finite"])
    record("inf, -inf or nan in any float key (train.lr = inf was accepted)", "ValueError at load naming the key",
           tier="pure")


def test_float_keys_cover_every_section_with_floats():
    assert {"train.lr", "train.loss_scale", "job.mem_gb", "checkpoint.chunk_mb"} <= set(FLOAT_KEYS)


def test_huge_int_for_a_float_is_refused_not_an_overflow():
    refused(load_config, None, ["train.lr=" + "9" * 400], fragments=["train.lr", "finite"])
    refused(TrainConfig, lr=float("inf"), fragments=["train.lr = inf", "finite"])  # sections check themselves
    record("400-digit integer for a float key", "ValueError naming the key instead of OverflowError", tier="pure")


# --- 4. absurd world sizes --------------------------------------------------------------------------------

def test_absurd_world_size_is_refused_at_load():
    refused(load_config, None, ["job.nodes=10000000000"],
            fragments=["job.nodes = 10000000000", "job.tasks_per_node = 1", "1048576"])
    refused(load_config, None, ["job.nodes=131073", "job.tasks_per_node=8"],
            fragments=["131073", "8", "1048584", "1048576"])
    assert load_config(None, ["job.nodes=131072", "job.tasks_per_node=8"]).world_size == 1 << 20
    assert load_config(None, ["job.nodes=2048", "job.tasks_per_node=8"]).world_size == 16384
    record("job.nodes = 10^10 (world size past 2^20 ranks)", "ValueError at load naming both numbers", tier="pure")


# --- 5. config files that cannot be read ------------------------------------------------------------------

def test_unreadable_config_files_name_the_path(tmp_path, monkeypatch):
    refused(load_config, tmp_path / "missing.toml", fragments=[str(tmp_path / "missing.toml"), "No such file"])
    refused(load_config, tmp_path, fragments=[str(tmp_path), "directory"])
    bad = tmp_path / "bad.toml"
    bad.write_text("[job]\nnodes = 2\n[train\n")
    refused(load_config, bad, fragments=[str(bad), "not valid TOML", "line 3"])
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes(b'[job]\nname = "x"\n# caf\xe9\n')
    refused(load_config, latin1, fragments=[str(latin1), "UTF-8", "line 3"])
    locked = tmp_path / "locked.toml"
    locked.write_text("[job]\n")
    locked.chmod(0)
    if os.access(locked, os.R_OK):  # root reads whatever the mode says: fail the read as the kernel would
        def denied(self, *args, **kwargs):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        monkeypatch.setattr(type(locked), "read_bytes", denied)
    refused(load_config, locked, fragments=[str(locked), "Permission denied"])
    record("config file missing, unreadable, a directory, invalid TOML or not UTF-8",
           "ValueError naming the path (and the line)", tier="pure")


def test_deeply_nested_or_huge_config_is_refused(tmp_path):
    deep = tmp_path / "deep.toml"
    deep.write_text("[job]\nname = " + "[" * 5000 + '"x"' + "]" * 5000 + "\n")
    refused(load_config, deep, fragments=[str(deep), "nests arrays or tables too deeply"])
    refused(load_config, None, ["job.name=" + "[" * 5000 + "1" + "]" * 5000], fragments=["job.name"])
    huge = tmp_path / "huge.toml"
    huge.write_bytes(b"# " + b"x" * (2 << 20) + b"\n")
    refused(load_config, huge, fragments=[str(huge), "bytes"])
    record("config file (or --set value) of arrays nested 5000 deep; a 2 MiB config file", "ValueError naming the "
           "file or key (RecursionError out of tomllib before)", tier="pure")


# --- 6. run_root that cannot hold run directories ---------------------------------------------------------

def test_run_root_that_is_or_is_under_a_file(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    refused(runs.new_run_dir, afile, "job", fragments=["job.run_root", str(afile), "is a file"])
    refused(runs.new_run_dir, afile / "deeper" / "runs", "job",
            fragments=["job.run_root", str(afile / "deeper" / "runs"), str(afile), "is a file"])
    record("job.run_root is a file, or lies under one", "ValueError naming run_root and the file", tier="pure")


def test_run_root_not_writable(tmp_path, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    if os.access(locked, os.W_OK):  # root writes whatever the mode says: refuse as the kernel would for a user
        real_mkdir = os.mkdir

        def mkdir(path, *args, **kwargs):
            if os.path.dirname(os.fspath(path)) == str(locked):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(path))
            return real_mkdir(path, *args, **kwargs)
        monkeypatch.setattr(os, "mkdir", mkdir)
    refused(runs.new_run_dir, locked, "job", fragments=["job.run_root", str(locked), "Permission denied"])
    assert list(locked.iterdir()) == []
    record("job.run_root not writable", "ValueError naming run_root and the reason", tier="pure")


# --- 7. token ids against the model's vocabulary ----------------------------------------------------------

def bin_file(tmp_path, ids, meta=None, name="tok.bin", dtype="<u2"):
    path = tmp_path / name
    np.asarray(ids).astype(dtype).tofile(path)
    if meta is not None:
        (tmp_path / f"{name}.json").write_text(json.dumps(meta))
    return path


IDS = list(range(1, 40)) + [300] + list(range(40, 80))  # one id past a 256 vocab, in the middle


def test_sidecar_understating_the_vocab_is_caught(tmp_path):
    path = bin_file(tmp_path, IDS, {"dtype": "uint16", "num_tokens": len(IDS), "vocab_size": 256})
    refused(open_source, DataConfig(source="bin", path=str(path), seq_len=8), 256,
            fragments=[str(path), "300", "model.vocab_size = 256"])
    assert open_source(DataConfig(source="bin", path=str(path), seq_len=8), 301).vocab_size == 301
    record("token file whose sidecar says vocab_size 256 but holds id 300",
           "ValueError naming the file, the id and the vocab size", tier="pure")


def test_hdf5_attribute_understating_the_vocab_is_caught(tmp_path):
    path = tmp_path / "tok.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("tokens", data=np.array(IDS, dtype=np.uint16)).attrs["vocab_size"] = 256
    refused(open_source, DataConfig(source="hdf5", path=str(path), seq_len=8), 256,
            fragments=[str(path), "300", "model.vocab_size = 256"])
    record("HDF5 tokens with attribute vocab_size 256 holding id 300",
           "ValueError naming the file, the id and the vocab size", tier="pure")


@pytest.mark.parametrize("meta, fragments", [
    ({"vocab_size": -5}, ["vocab_size", "-5"]),
    ({"vocab_size": "256"}, ["vocab_size", "'256'"]),
    ({"vocab_size": 2.5}, ["vocab_size", "2.5"]),
    ({"vocab_size": True}, ["vocab_size", "True"]),
    ({"num_tokens": "many"}, ["num_tokens", "'many'"]),
    ({"dtype": "float32"}, ["dtype", "float32"]),
    ({"dtype": "nonsense"}, ["dtype", "nonsense"]),
    ({"dtype": 7}, ["dtype", "7"]),
    ({"byteorder": "middle"}, ["byteorder", "middle"]),
    ([1, 2], ["sidecar", "[1, 2]"]),
])
def test_untrusted_sidecar_values_are_refused(tmp_path, meta, fragments):
    path = bin_file(tmp_path, range(100), meta)
    refused(open_source, DataConfig(source="bin", path=str(path), seq_len=8), 256,
            fragments=[str(path), *fragments])
    record("sidecar with a negative, wrongly typed or nonsense vocab_size, num_tokens, dtype or byteorder",
           "ValueError naming the file, the key and the value", tier="pure")


def test_sidecar_that_is_not_json(tmp_path):
    path = bin_file(tmp_path, range(100))
    (tmp_path / "tok.bin.json").write_text("{vocab_size: 256")
    refused(open_source, DataConfig(source="bin", path=str(path), seq_len=8), 256,
            fragments=[str(tmp_path / "tok.bin.json"), "JSON"])


@pytest.mark.parametrize("dtype, ids, fragments", [
    ("<i2", [5, -3, 7] * 10, ["-3", "negative"]),
    ("<f4", [1.0, 2.5] * 10, ["float32", "integer"]),
    ("<u8", [1, 2 ** 63 + 5] * 10, [str(2 ** 63 + 5), "model.vocab_size = 256"]),
])
def test_untrusted_ids_in_npy_are_refused(tmp_path, dtype, ids, fragments):
    path = tmp_path / "tok.npy"
    np.save(path, np.array(ids, dtype=dtype))
    (tmp_path / "tok.npy.json").write_text(json.dumps({"vocab_size": 256}))  # the sidecar lies
    refused(open_source, DataConfig(source="bin", path=str(path), seq_len=4), 256,
            fragments=[str(path), *fragments])
    record("token file with negative ids, float tokens or ids past 2^63 (uint64)",
           "ValueError naming the file and the id or dtype", tier="pure")


def test_hdf5_untrusted_attribute_and_dtype(tmp_path):
    path = tmp_path / "tok.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("tokens", data=np.arange(50, dtype=np.uint16)).attrs["vocab_size"] = -1
    refused(open_source, DataConfig(source="hdf5", path=str(path), seq_len=8), 256,
            fragments=[str(path), "vocab_size", "-1"])
    with h5py.File(path, "w") as f:
        f.create_dataset("tokens", data=np.arange(50, dtype=np.float64))
    refused(open_source, DataConfig(source="hdf5", path=str(path), seq_len=8), 256,
            fragments=[str(path), "float64", "integer"])
    record("HDF5 tokens with vocab_size attribute -1, or float tokens", "ValueError naming the file", tier="pure")


def test_scan_is_cached_by_size_and_mtime(tmp_path, monkeypatch):
    path = bin_file(tmp_path, range(200), {"vocab_size": 256})
    scans = []
    real = tokenfiles._scan_ids
    monkeypatch.setattr(tokenfiles, "_scan_ids", lambda *a: scans.append(1) or real(*a))
    cfg = DataConfig(source="bin", path=str(path), seq_len=8)
    assert open_source(cfg, 256).max_id == 199 and len(scans) == 1
    assert open_source(cfg, 256).max_id == 199 and len(scans) == 1  # a second run does not rescan
    ids = np.fromfile(path, dtype="<u2")
    ids[7] = 300  # rewritten in place, same size: the new mtime invalidates the cache
    ids.tofile(path)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1000))
    refused(open_source, cfg, 256, fragments=[str(path), "300", "model.vocab_size = 256"])
    assert len(scans) == 2
    (tmp_path / "tok.bin.ids.json").write_text("garbage")  # a damaged cache is rescanned, not trusted
    refused(open_source, cfg, 256, fragments=["300"])
    assert len(scans) == 3


def test_scan_cache_falls_back_when_the_files_directory_is_not_writable(tmp_path, monkeypatch):
    path = bin_file(tmp_path, range(200), {"vocab_size": 256})
    (tmp_path / "tok.bin.ids.json").mkdir()  # cannot be written as a file, whoever we run as
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    scans = []
    real = tokenfiles._scan_ids
    monkeypatch.setattr(tokenfiles, "_scan_ids", lambda *a: scans.append(1) or real(*a))
    cfg = DataConfig(source="bin", path=str(path), seq_len=8)
    assert open_source(cfg, 256).max_id == 199
    assert open_source(cfg, 256).max_id == 199 and len(scans) == 1
    assert len(list((tmp_path / "cache").rglob("*.json"))) == 1


def test_loader_refuses_ids_past_the_vocab_in_a_batch(tmp_path):
    path = bin_file(tmp_path, [1] * 200, {"vocab_size": 256})
    source = open_source(DataConfig(source="bin", path=str(path), seq_len=8), 256)
    loader = data.TokenLoader(source, 8, 4, 0, 1, seed=0)
    loader.next_batch()
    with open(path, "r+b") as f:  # the file changes under a running job (its cache key is not re-read)
        f.write(np.full(200, 999, dtype="<u2").tobytes())
    refused(loader.next_batch, fragments=[str(path), "999", "256"])
    record("token file overwritten with id 999 while the loader runs", "ValueError at the next batch naming "
           "the file, the id and the vocab size", tier="pure")
