"""HDF5 storage for DCP checkpoints: round trips, corruption caught, a JSON index, files plain h5py can read, and
2 real gloo processes saving one layout and loading another (tests/workers/hdf5_worker.py).
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from helpers.ckpt_bytes import reference
from helpers.launch import WORKERS, free_base_port, spawn_ranks
from hpctrain.checkpoint.h5file import chunk_shape as _chunk_shape
from hpctrain.checkpoint.hdf5_storage import CheckpointCorrupt, HDF5Reader, HDF5Writer
from hpctrain.checkpoint.index import json_decode, json_encode

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

# bf16 bit patterns that must survive as they are: a NaN with payload, -inf, -0, the smallest subnormal, 1, max
BF16_BITS = np.array([0x7FC1, 0xFF80, 0x8000, 0x0001, 0x3F80, 0x7F7F], dtype=np.uint16)


def training_state() -> dict:
    """What a trainer saves: fp32 weights (one spanning several 4 MiB chunks), bf16 and fp16 copies, optimizer
    moments and its int64 `step`, and plain Python values."""
    gen = torch.Generator().manual_seed(0)
    return {
        "model": {"wte": torch.randn(1100, 1024, generator=gen), "ln.bias": torch.randn(64, generator=gen),
                  "bf16": torch.from_numpy(BF16_BITS.copy()).view(torch.bfloat16),
                  "bf16_randn": torch.randn(33, 17, generator=gen).bfloat16(),
                  "fp16": torch.randn(5, 7, generator=gen).half(), "empty": torch.zeros(0, 4),
                  "odd/name%2F": torch.arange(6.0)},  # stored under a quoted group name
        "optim": {"step": torch.tensor(1234, dtype=torch.int64),
                  "exp_avg": [torch.randn(64, 8, generator=gen), torch.randn(3, generator=gen)]},
        "train_state": {"step": 12, "tokens_seen": 2**40, "lr": 3e-4, "data": {"epoch": 1, "name": "corpus"}},
    }


def zeros_like(state):
    """Same structure, every leaf zeroed; DCP loads into it in place (non-tensor leaves are replaced)."""
    if isinstance(state, dict):
        return {k: zeros_like(v) for k, v in state.items()}
    if isinstance(state, list):
        return [zeros_like(v) for v in state]
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    return type(state)()


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact, NaN payloads included."""
    return (a.dtype == b.dtype and a.shape == b.shape
            and bytes(a.contiguous().view(-1).view(torch.uint8).numpy()) == bytes(b.contiguous().view(-1)
                                                                                 .view(torch.uint8).numpy()))


def assert_same_state(got, want, path="") -> None:
    if isinstance(want, dict):
        assert got.keys() == want.keys(), path
        for k in want:
            assert_same_state(got[k], want[k], f"{path}.{k}")
    elif isinstance(want, list):
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same_state(g, w, f"{path}.{i}")
    elif isinstance(want, torch.Tensor):
        assert same(got, want), path
    else:
        assert type(got) is type(want) and got == want, (path, got, want)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """One checkpoint of training_state(), to be read (tests that damage it copy it first)."""
    path = tmp_path_factory.mktemp("ckpt") / "step-1"
    dcp.save(training_state(), storage_writer=HDF5Writer(path))
    return path


def copy(saved: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(saved, tmp_path / saved.name))


def load_failure(path: Path, verify: str = "full") -> BaseException:
    """The storage error behind DCP's CheckpointException (DCP wraps every rank's error in one)."""
    with pytest.raises(CheckpointException) as info:
        dcp.load(zeros_like(training_state()), storage_reader=HDF5Reader(path, verify=verify))
    (exc, _), = info.value.failures.values()
    return exc


def flip_byte(path: Path, dataset: str, at: int = 100) -> None:
    with h5py.File(path, "r") as f:
        ds = f[dataset]
        start = ds.id.get_offset() if ds.chunks is None else ds.id.get_chunk_info(0).byte_offset
    with open(path, "r+b") as fh:
        fh.seek(start + at)
        byte = fh.read(1)[0]
        fh.seek(start + at)
        fh.write(bytes([byte ^ 0x01]))


def test_round_trip_every_training_dtype(saved: Path) -> None:
    for verify in ("full", "sampled", "none"):
        got = zeros_like(training_state())
        dcp.load(got, storage_reader=HDF5Reader(saved, verify=verify))
        assert_same_state(got, training_state())
    with h5py.File(saved / "shard-0.h5", "r") as f:
        wte = f["model.wte/0_0"]
        assert wte.chunks is None and wte.attrs["dtype"] == "float32"  # contiguous by default
        assert f["model.bf16/0"].dtype == np.uint16 and f["model.bf16/0"].attrs["dtype"] == "bfloat16"
        assert f["optim.step/scalar"][()] == 1234 and f["train_state.step/bytes"].dtype == np.uint8


def test_index_records_where_contiguous_data_starts(saved: Path, tmp_path: Path) -> None:
    """index.json's file_offset (the read-ahead hint) is where HDF5 put each contiguous dataset's bytes; chunked
    datasets record none."""
    def offsets(path: Path) -> list[tuple[int | None, int | None]]:  # (recorded, where HDF5 has it or None)
        md = HDF5Reader(path).read_metadata()
        with h5py.File(path / "shard-0.h5", "r") as f:
            return [(s.file_offset, None if f[s.dataset].chunks else f[s.dataset].id.get_offset())
                    for s in md.storage_data.values()]

    contiguous = offsets(saved)
    assert all(got == want for got, want in contiguous) and sum(x is not None for x, _ in contiguous) >= 10
    dcp.save(training_state(), storage_writer=HDF5Writer(tmp_path, chunk_bytes=1 << 20))
    mixed = offsets(tmp_path)  # scalars and small tensors stay contiguous
    assert all(got == want for got, want in mixed) and sum(x is None for x, _ in mixed) >= 3
    got = zeros_like(training_state())
    dcp.load(got, storage_reader=HDF5Reader(tmp_path))  # located through HDF5 instead
    assert_same_state(got, training_state())


def test_float8_round_trip(tmp_path: Path) -> None:
    bits = torch.arange(256, dtype=torch.uint8)  # every bit pattern, NaNs included
    state = {"e4m3": bits.view(torch.float8_e4m3fn), "e5m2": bits.view(torch.float8_e5m2)}
    dcp.save(state, storage_writer=HDF5Writer(tmp_path))
    got = zeros_like(state)
    dcp.load(got, storage_reader=HDF5Reader(tmp_path))
    assert_same_state(got, state)


def test_index_is_json_and_rebuilds_metadata(tmp_path: Path) -> None:
    written = dcp.save(training_state(), storage_writer=HDF5Writer(tmp_path))
    raw = (tmp_path / "index.json").read_bytes()
    assert raw.startswith(b"{") and raw.isascii()  # a pickle starts with b"\x80" and is binary
    doc = json.loads(raw)
    assert doc["format"] == "hpctrain-dcp-hdf5" and doc["checksum"] == "crc32"
    assert doc["files"] == {"shard-0.h5": (tmp_path / "shard-0.h5").stat().st_size}
    assert doc["state_dict_metadata"]["optim.step"] == {
        "type": "tensor", "dtype": "int64", "requires_grad": False, "size": [], "chunks": [{"offsets": [],
                                                                                          "sizes": []}]}
    assert doc["state_dict_metadata"]["train_state.data.name"] == {"type": "bytes"}
    entry = next(e for e in doc["storage_data"] if e["fqn"] == "model.bf16")
    assert entry["file"] == "shard-0.h5" and entry["dataset"] == "/model.bf16/0" and entry["dtype"] == "bfloat16"
    read = HDF5Reader(tmp_path).read_metadata()
    assert read.state_dict_metadata == written.state_dict_metadata
    assert read.planner_data == written.planner_data and read.planner_data["optim.exp_avg.1"] == (
        "optim", "exp_avg", 1)
    assert read.storage_data == written.storage_data and read.version == written.version


def test_planner_data_json_codec() -> None:
    data = {"a": ("x", 0), "b": [1, 2.5, None, True], "__tuple__": 1, "nested": {(1, 2): "k"}}
    assert json_decode(json.loads(json.dumps(json_encode(data)))) == data
    assert json_decode(json_encode({"__tuple__": [1]})) == {"__tuple__": [1]}
    with pytest.raises(TypeError, match="no pickle"):
        json_encode({"a": object()})


def test_chunked_layout_round_trip(tmp_path: Path) -> None:
    dcp.save(training_state(), storage_writer=HDF5Writer(tmp_path, chunk_bytes=4 << 20))
    with h5py.File(tmp_path / "shard-0.h5", "r") as f:
        assert f["model.wte/0_0"].chunks == (550, 1024)  # 2 equal chunks <= 4 MiB
    got = zeros_like(training_state())
    dcp.load(got, storage_reader=HDF5Reader(tmp_path, verify="full"))
    assert_same_state(got, training_state())
    flip_byte(tmp_path / "shard-0.h5", "/model.wte/0_0")
    assert "crc32" in str(load_failure(tmp_path))


def test_chunk_shape() -> None:
    mib = 1 << 20
    assert _chunk_shape((1100, 1024), 4, 4 * mib) == (550, 1024)  # two equal chunks, no padded edge
    assert _chunk_shape((1408, 1024), 4, 4 * mib) == (704, 1024)
    assert _chunk_shape((8, 4096, 4096), 2, 4 * mib) == (1, 512, 4096)  # whole trailing dims first
    assert _chunk_shape((3, 4 * mib), 1, mib) == (1, mib)  # one row is bigger than a chunk
    assert _chunk_shape((7, 5), 4, 4 * mib) == (7, 5)
    assert _chunk_shape((), 8, mib) is None and _chunk_shape((0, 4), 4, mib) is None


def test_overwrite_uncommits_and_drops_stale_shards(tmp_path: Path) -> None:
    (tmp_path / "shard-3.h5").write_bytes(b"left over from a 4-rank save")
    (tmp_path / "index.json").write_text("{}")
    dcp.save({"x": torch.arange(3)}, storage_writer=HDF5Writer(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["index.json", "shard-0.h5"]
    got = {"x": torch.zeros(3, dtype=torch.int64)}
    dcp.load(got, storage_reader=HDF5Reader(tmp_path))
    assert got["x"].tolist() == [0, 1, 2]


def test_flipped_byte_is_caught(saved: Path, tmp_path: Path) -> None:
    path = copy(saved, tmp_path)
    flip_byte(path / "shard-0.h5", "/model.wte/0_0", at=5 * 4096)
    exc = load_failure(path)
    assert isinstance(exc, CheckpointCorrupt), exc
    assert exc.path == str(path / "shard-0.h5") and exc.dataset == "/model.wte/0_0" and "crc32" in exc.reason
    assert "shard-0.h5 dataset /model.wte/0_0: crc32" in str(exc)
    got = zeros_like(training_state())
    dcp.load(got, storage_reader=HDF5Reader(path, verify="none"))  # nothing checked: the damage is loaded
    assert not same(got["model"]["wte"], training_state()["model"]["wte"])

    path2 = copy(saved, tmp_path / "bytes")
    flip_byte(path2 / "shard-0.h5", "/train_state.data.name/bytes", at=2)  # caught before it is parsed
    assert isinstance(load_failure(path2), CheckpointCorrupt)


def test_sampled_checks_a_deterministic_subset(tmp_path: Path) -> None:
    # 128 datasets: the sample (1/8, keyed on the random save id) has some and misses some but for ~1e-7 odds
    state = {f"layer{i}": torch.full((64,), float(i)) for i in range(128)}
    dcp.save(state, storage_writer=HDF5Writer(tmp_path / "saved"))
    reader = HDF5Reader(tmp_path / "saved", verify="sampled")
    datasets = [s.dataset for s in reader.read_metadata().storage_data.values()]
    picks = {d: reader.verifies("shard-0.h5", d) for d in datasets}
    again = HDF5Reader(tmp_path / "saved", verify="sampled")
    again.read_metadata()
    assert picks == {d: again.verifies("shard-0.h5", d) for d in datasets}
    checked, skipped = [d for d, v in picks.items() if v], [d for d, v in picks.items() if not v]
    assert 0 < len(checked) < 40, len(checked)

    for dataset, caught in ((checked[0], True), (skipped[0], False)):
        path = Path(shutil.copytree(tmp_path / "saved", tmp_path / dataset.replace("/", "_")))
        flip_byte(path / "shard-0.h5", dataset, at=7)
        with pytest.raises(CheckpointException) if caught else contextlib.nullcontext() as info:
            dcp.load(zeros_like(state), storage_reader=HDF5Reader(path, verify="sampled"))
        if caught:
            assert list(info.value.failures.values())[0][0].dataset == dataset
        with pytest.raises(CheckpointException, match=f"dataset {dataset}: crc32"):
            dcp.load(zeros_like(state), storage_reader=HDF5Reader(path, verify="full"))


def test_truncated_or_missing_files(saved: Path, tmp_path: Path) -> None:
    path = copy(saved, tmp_path)
    shard = path / "shard-0.h5"
    os.truncate(shard, shard.stat().st_size - 1000)
    for verify in ("full", "none"):  # sizes are checked whatever `verify` says
        exc = load_failure(path, verify)
        assert isinstance(exc, CheckpointCorrupt) and exc.path == str(shard) and "index.json says" in exc.reason, exc
    shard.unlink()
    exc = load_failure(path)
    assert isinstance(exc, CheckpointCorrupt) and exc.reason == "missing"
    (path / "index.json").unlink()
    with pytest.raises(CheckpointException, match="index.json: missing: the save never finished"):
        dcp.load(zeros_like(training_state()), storage_reader=HDF5Reader(path))


def test_without_checksums(tmp_path: Path) -> None:
    dcp.save(training_state(), storage_writer=HDF5Writer(tmp_path, checksum=False))
    assert json.loads((tmp_path / "index.json").read_text())["checksum"] is None
    got = zeros_like(training_state())
    dcp.load(got, storage_reader=HDF5Reader(tmp_path, verify="full"))
    assert_same_state(got, training_state())
    with pytest.raises(ValueError, match="verify='all'"):
        HDF5Reader(tmp_path, verify="all")


# Lists every tensor of every shard file with h5py and numpy only: what a user without hpctrain can do.
PLAIN_H5PY_LISTING = r"""
import json, sys, zlib
from urllib.parse import unquote
import h5py, numpy as np
rows = []
for path in sys.argv[1:]:
    with h5py.File(path, "r") as f:
        def visit(name, obj):
            if not isinstance(obj, h5py.Dataset) or obj.attrs["dtype"] == "json":  # non-tensor values
                return
            arr = obj[...]
            if obj.attrs["dtype"] == "bfloat16":  # bf16 bits are the high half of a float32
                arr = (arr.astype(np.uint32) << 16).view(np.float32)
            group, leaf = name.rsplit("/", 1)  # /<quoted fqn>/<offsets joined by _>
            offsets = [] if leaf == "scalar" else [int(x) for x in leaf.split("_")]
            rows.append({"file": path.rsplit("/", 1)[-1], "fqn": unquote(group), "dtype": obj.attrs["dtype"],
                         "offsets": offsets, "shape": list(arr.shape),
                         "crc_ok": bool(zlib.crc32(obj[...].tobytes()) == obj.attrs["crc32"]),
                         "sum": float(arr.astype(np.float64).sum())})
        f.visititems(visit)
print(json.dumps({"rows": rows, "imported": sorted({m.split(".")[0] for m in sys.modules} & {"torch", "hpctrain"})}))
"""


def list_with_plain_h5py(directory: Path) -> list[dict]:
    files = sorted(str(p) for p in directory.glob("shard-*.h5"))
    out = subprocess.run([sys.executable, "-c", PLAIN_H5PY_LISTING, *files], capture_output=True, text=True,
                         timeout=60, check=True)
    doc = json.loads(out.stdout)
    assert doc["imported"] == []
    return doc["rows"]


def flat_tensors(state, prefix: str = "") -> dict[str, torch.Tensor]:
    """{fqn: tensor} named the way DCP's planner flattens a state dict."""
    if isinstance(state, torch.Tensor):
        return {prefix: state}
    items = state.items() if isinstance(state, dict) else enumerate(state) if isinstance(state, list) else ()
    return {k: v for key, sub in items for k, v in flat_tensors(sub, f"{prefix}.{key}" if prefix else str(key)).items()}


def test_shard_files_list_with_plain_h5py(saved: Path) -> None:
    rows = {row["fqn"]: row for row in list_with_plain_h5py(saved)}
    tensors = flat_tensors(training_state())
    assert rows.keys() == tensors.keys() and "optim.exp_avg.1" in rows and "model.odd/name%2F" in rows
    assert all(row["crc_ok"] for row in rows.values()), rows  # zlib's crc32 of the bytes: the attribute
    for fqn, t in tensors.items():
        want = t.float().numpy().astype(np.float64).sum()  # the same numpy sum over the same values
        assert rows[fqn]["shape"] == list(t.shape) and rows[fqn]["dtype"] == str(t.dtype)[6:], rows[fqn]
        assert rows[fqn]["sum"] == want or (np.isnan(want) and np.isnan(rows[fqn]["sum"])), (fqn, rows[fqn], want)


def test_two_ranks_save_one_layout_load_another(tmp_path: Path) -> None:
    """1 process -> 2 ranks, 2 ranks Shard(0) -> 2 ranks Shard(1) and plain, corruption seen by every rank,
    FSDP2 + Adam on 2 ranks -> 1 process. One spawn for all of it."""
    one = tmp_path / "one"
    dcp.save(reference(), storage_writer=HDF5Writer(one))
    cmd = [sys.executable, str(WORKERS / "hdf5_worker.py"), str(tmp_path), str(free_base_port(1)), str(one)]
    procs = spawn_ranks(2, cmd, ranks_per_node=2, run_id="test-hdf5")
    try:
        outs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outs)
    for rank in range(2):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert all(v is True for v in record.values()), f"rank {rank}:\n" + "\n".join(
            f"{k}: {v}" for k, v in record.items() if v is not True)

    # 2 ranks -> 1 process, plain full tensors
    got = zeros_like(reference())
    dcp.load(got, storage_reader=HDF5Reader(tmp_path / "reshard"))
    assert_same_state(got, reference())
    rows = list_with_plain_h5py(tmp_path / "reshard")
    assert sorted((r["file"], r["fqn"], tuple(r["offsets"])) for r in rows if r["fqn"] == "tensors.w") == [
        ("shard-0.h5", "tensors.w", (0, 0)), ("shard-1.h5", "tensors.w", (4, 0))]

    # FSDP2 + Adam saved on 2 ranks -> a plain model and optimizer in this process
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd}, storage_reader=HDF5Reader(tmp_path / "fsdp"))
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    want = torch.load(tmp_path / "fsdp_ref.pt")
    for name, p in model.named_parameters():
        assert same(p.detach(), want[name]), name
        assert opt.state[p].keys() == {"step", "exp_avg", "exp_avg_sq"}, opt.state[p].keys()
        for key, value in opt.state[p].items():
            assert same(value, want[f"{name}.{key}"]), (name, key)
