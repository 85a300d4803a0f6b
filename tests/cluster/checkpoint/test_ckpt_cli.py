"""`hpctrain ckpt ls|inspect|verify|export` on real checkpoints: one written by `hpctrain train` in this process
(one rank), one by two ranks under mpiexec (tp=2, so tensors are split along dim 0 or dim 1, norms whole), and a
bf16 state dict saved straight through DCP. Exports are read back with the reader below (written from the
safetensors format description) and compared with DCP's own resharding load of the same checkpoint."""
from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import h5py
import pytest
import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner, Result

from helpers.launch import EXAMPLE, REPO, env_with_venv, tool
from helpers.runs import only_run_dir
from hpctrain.checkpoint.hdf5_storage import HDF5Reader, HDF5Writer
from hpctrain.cli.main import main as cli
from hpctrain.config import load_config
from hpctrain.model.transformer import ModelDims, Transformer

TINY = ["--set", "model.dim=32", "--set", "model.n_layers=2", "--set", "model.n_heads=2", "--set", "data.seq_len=32",
        "--set", "data.source=synthetic", "--set", "train.peak_tflops=1", "--set", "checkpoint.every_steps=2"]
STEPS = {"one": 4, "two": 2}  # the one-rank run commits steps 2 and 4, the two-rank run step 2
TOKENS_PER_STEP = 8 * 32  # the example's micro batch of 8 (dp=1) x data.seq_len
LAYOUTS = ["one", "two"]


def ckpt(*args) -> Result:
    return CliRunner().invoke(cli, ["ckpt", *map(str, args)])


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt_cli")
    mpiexec, two = tool("mpiexec"), None
    if mpiexec:  # started first: it trains while the one-rank run below does
        two = subprocess.Popen([mpiexec, "-n", "2", tool("hpctrain"), "train", str(EXAMPLE), *TINY, "--set",
                                "parallel.tp=2", "--set", "train.steps=2", "--set", f"job.run_root={root / 'two'}"],
                               env=env_with_venv(), cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    res = CliRunner().invoke(cli, ["train", str(EXAMPLE), *TINY, "--set", "parallel.tp=1", "--set", "train.steps=4",
                                   "--set", f"job.run_root={root / 'one'}"])
    assert res.exit_code == 0, res.output + repr(res.exception)
    out = {"one": only_run_dir(root / "one")}
    if two is not None:
        log = two.communicate(timeout=300)[0]
        assert two.returncode == 0, log[-3000:]
        out["two"] = only_run_dir(root / "two")
    return out


@pytest.fixture(params=LAYOUTS)
def run(request, runs) -> tuple[str, Path]:
    if request.param not in runs:
        request.getfixturevalue("mpiexec")  # skips, or fails where CI requires MPI
    return request.param, runs[request.param]


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:08d}"


def test_ls_lists_committed_and_partial(runs, tmp_path) -> None:
    run_dir = runs["one"]
    partial = run_dir / "checkpoints" / "step_00000006.partial"  # a save killed before its commit
    partial.mkdir()
    (partial / "shard-0.h5").write_bytes(b"\0" * 100)
    try:
        res, res2 = ckpt("ls", run_dir), ckpt("ls", run_dir / "checkpoints")
    finally:
        shutil.rmtree(partial)
    assert res.exit_code == 0, res.output
    assert res2.output == res.output
    head, *rows = [line.split() for line in res.output.splitlines()[1:]]
    assert head == ["step", "status", "size", "shards", "saved_at", "world", "layout"]
    assert [r[:2] for r in rows] == [["2", "committed"], ["4", "committed"], ["6", "partial"]]  # newest last
    assert rows[0][4] == "1" and rows[0][6] == "1" and "tp=1" in rows[0]  # shard files, world size, layout
    assert rows[2][2:5] == ["100", "B", "1"]
    if "two" in runs:
        rows = ckpt("ls", runs["two"]).output.splitlines()[2:]
        assert len(rows) == 1 and rows[0].split()[4] == "2" and "tp=2" in rows[0]

    missing = ckpt("ls", tmp_path / "nope")
    assert missing.exit_code == 2 and "does not exist" in missing.output
    empty = ckpt("ls", tmp_path)
    assert empty.exit_code == 0 and empty.output.startswith("no checkpoints in ")


def test_ls_starts_without_torch(runs) -> None:
    """`ckpt ls` in a new process lists the run's checkpoints without importing torch, h5py or numpy: on a login
    node importing torch from a shared file system can take tens of seconds."""
    code = ("import sys\nfrom hpctrain.cli.main import main\ntry:\n    main(['ckpt', 'ls', sys.argv[1]])\n"
            "except SystemExit as e:\n    print('exit', e.code)\n"
            "print('imported', sorted({'torch', 'h5py', 'numpy'} & set(sys.modules)))\n")
    out = subprocess.run([sys.executable, "-c", code, str(runs["one"])], capture_output=True, text=True, timeout=120,
                         env=env_with_venv(), cwd=REPO)
    lines = out.stdout.splitlines()
    assert [line.split()[:2] for line in lines[2:4]] == [["2", "committed"], ["4", "committed"]], out.stdout
    assert lines[-2:] == ["exit 0", "imported []"], out.stdout + out.stderr


def test_inspect_lists_every_model_tensor(run) -> None:
    name, run_dir = run
    res = ckpt("inspect", run_dir, "--json")  # a run directory means its newest committed checkpoint
    assert res.exit_code == 0, res.output
    info = json.loads(res.output)
    cfg = load_config(run_dir / "config.toml")
    dims = ModelDims.from_config(cfg.model, tp=cfg.parallel.tp)
    with torch.device("meta"):
        model = Transformer(dims)
    want = {f"model.{n}": list(p.shape) for n, p in model.named_parameters()}
    tensors = {t["fqn"]: t for t in info["tensors"]}
    assert {fqn: t["shape"] for fqn, t in tensors.items() if fqn.startswith("model.")} == want
    assert all(t["dtype"] == "float32" for t in tensors.values() if t["fqn"].startswith("model."))
    assert info["totals"]["params"] == dims.num_params()
    assert "optimizer.state.layers.0.attention.wq.weight.exp_avg" in tensors
    shards = 2 if name == "two" else 1  # tp=2 splits wq along dim 0 and wo along dim 1; norms stay whole
    assert tensors["model.layers.0.attention.wq.weight"]["num_shards"] == shards
    assert tensors["model.layers.0.attention.wo.weight"]["num_shards"] == shards
    assert tensors["model.norm.weight"]["num_shards"] == 1
    step = STEPS[name]
    assert info["committed"] and info["step"] == step and info["tokens_seen"] == step * TOKENS_PER_STEP
    assert info["world_size"] == cfg.parallel.tp and info["layout"]["tp"] == cfg.parallel.tp
    assert len(info["files"]) == cfg.parallel.tp and info["provenance"]["torch"] == torch.__version__

    text = ckpt("inspect", step_dir(run_dir, step))
    assert text.exit_code == 0, text.output
    assert f"step        {step}, tokens seen {step * TOKENS_PER_STEP}" in text.output
    for fqn, shape in want.items():
        assert f"{fqn} " in text.output and str(shape) in text.output


def _flip_byte(shard: Path, dataset: str) -> None:
    with h5py.File(shard, "r") as f:
        ds = f[dataset]
        start = ds.id.get_offset() if ds.chunks is None else ds.id.get_chunk_info(0).byte_offset
        at = start + ds.id.get_storage_size() // 2
    with open(shard, "r+b") as fh:
        fh.seek(at)
        b = fh.read(1)
        fh.seek(at)
        fh.write(bytes([b[0] ^ 0x40]))


def test_verify_finds_flipped_byte_truncation_and_missing_marker(run, tmp_path) -> None:
    name, run_dir = run
    src = step_dir(run_dir, STEPS[name])
    for mode in ("--full", "--sampled"):
        res = ckpt("verify", src, mode)
        assert res.exit_code == 0 and res.output.startswith("OK "), res.output

    ck = shutil.copytree(src, tmp_path / src.name)
    shard = sorted(ck.glob("shard-*.h5"))[-1]  # with two ranks: the second rank's file
    index = json.loads((ck / "index.json").read_text())
    dataset = next(e["dataset"] for e in index["storage_data"]
                   if e["fqn"] == "model.layers.1.feed_forward.w2.weight" and e["file"] == shard.name)
    _flip_byte(shard, dataset)
    res = ckpt("verify", ck)
    assert res.exit_code == 1, res.output
    lines = res.output.splitlines()  # one line per problem: exactly the damaged dataset
    assert len(lines) == 1 and f"{shard} dataset {dataset}: crc32" in lines[0], res.output
    res = ckpt("export", ck, "--to", "safetensors", "-o", tmp_path / "m.safetensors")
    assert res.exit_code == 1 and f"dataset {dataset}: crc32" in res.output, res.output
    assert not list(tmp_path.glob("m.safetensors*"))  # neither the file nor its temporary

    (ck / "COMMITTED").unlink()
    os.truncate(shard, shard.stat().st_size // 2)
    res = ckpt("verify", ck)
    assert res.exit_code == 1, res.output
    assert "COMMITTED: missing" in res.output
    assert f"{shard}: {shard.stat().st_size} bytes, index.json says" in res.output and "truncated" in res.output


def read_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A safetensors file: u64 little-endian header length, JSON header, then the tensors back to back."""
    dtypes = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8, "F8_E4M3": torch.float8_e4m3fn}
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    meta = header.pop("__metadata__", {})
    data = raw[8 + n:]
    spans = sorted(h["data_offsets"] for h in header.values())
    assert spans[0][0] == 0 and spans[-1][1] == len(data), "the data section holds the tensors and nothing else"
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), "no gaps, no overlaps"
    out = {}
    for name, h in header.items():
        (begin, end), dtype = h["data_offsets"], dtypes[h["dtype"]]
        assert (8 + n + begin) % dtype.itemsize == 0, f"{name} is not aligned"
        flat = torch.frombuffer(bytearray(data[begin:end]), dtype=dtype) if end > begin else torch.empty(0, dtype=dtype)
        out[name] = flat.reshape(h["shape"])
    return out, meta


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                     b.reshape(-1).view(torch.uint8))


def check_export(ck: Path, out: Path, want: dict[str, torch.Tensor]) -> None:
    """Export ck to out, read it back (and with the safetensors package when installed), compare to want."""
    res = ckpt("export", ck, "--to", "safetensors", "-o", out)
    assert res.exit_code == 0, res.output
    got, meta = read_safetensors(out)
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert same_bits(got[k], v), k
    assert meta["format"] == "pt"
    try:
        from safetensors.torch import load_file
    except ImportError:
        return
    theirs = load_file(out)
    assert sorted(theirs) == sorted(want)
    for k, v in want.items():
        assert same_bits(theirs[k], v), k


def test_export_equals_resharded_load(run, tmp_path) -> None:
    name, run_dir = run
    ck = step_dir(run_dir, STEPS[name])
    md = HDF5Reader(ck).read_metadata()
    full = {fqn: torch.full(tuple(m.size), float("nan"), dtype=m.properties.dtype)
            for fqn, m in md.state_dict_metadata.items() if fqn.startswith("model.")}
    dcp.load(full, storage_reader=HDF5Reader(ck))  # no process group: one process reads every shard
    assert not any(v.isnan().any() for v in full.values())
    want = {fqn.removeprefix("model."): v for fqn, v in full.items()}
    out = tmp_path / "model.safetensors"
    check_export(ck, out, want)
    assert read_safetensors(out)[1]["step"] == str(STEPS[name])


def test_export_keeps_bf16_bits(tmp_path) -> None:
    g = torch.Generator().manual_seed(0)
    model = {"emb": torch.randn(7, 3, generator=g).bfloat16(), "odd": torch.randn(5, generator=g).bfloat16(),
             "scale": torch.tensor(2.5), "f8": torch.randn(4, generator=g).to(torch.float8_e4m3fn),
             "steps": torch.arange(3)}
    dcp.save({"model": model, "optimizer": {"m": torch.ones(3)}}, storage_writer=HDF5Writer(tmp_path / "ck"))
    check_export(tmp_path / "ck", tmp_path / "out.safetensors", model)  # optimizer state is left out
    raw = (tmp_path / "out.safetensors").read_bytes()
    header = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])
    assert header["emb"]["dtype"] == "BF16" and header["f8"]["dtype"] == "F8_E4M3"
