"""One rank of the multi-process HDF5 checkpoint test (started twice by tests/multiproc/checkpoint/test_hdf5_storage.py
with
torchrun's variables). Several checks share one process group to pay for `import torch` once:

  reshard    save DTensors sharded one way (Shard(0), uneven Shard(0), Shard(1), Replicate), load them sharded
             another way and as plain full tensors on every rank
  from_one   load a checkpoint one process saved into DTensors over 2 ranks
  corrupt    a byte flipped in rank 1's file fails the load on every rank, naming shard-1.h5
  async      dcp.async_save through the same writer
  fsdp       save an FSDP2 model and its Adam state after one step; the test loads it in one process

Usage: tests/workers/hdf5_worker.py OUT PORT ONE_PROCESS_CHECKPOINT. Writes OUT/rank<r>.json:
{check: true | "what went wrong"}. The tensors
(helpers.ckpt_bytes.LAYOUTS, helpers.ckpt_bytes.reference) are shared with the test.
"""
from __future__ import annotations

import json
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import h5py
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, distribute_tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers
from helpers.ckpt_bytes import LAYOUTS, reference  # noqa: E402
from hpctrain.checkpoint.hdf5_storage import CheckpointCorrupt, HDF5Reader, HDF5Writer  # noqa: E402


def sharded(mesh, which: int, full: dict | None = None) -> dict:
    """The reference (or zeros) as DTensors, placed as saved (which=2) or as loaded (which=3)."""
    ref = reference()
    tensors = {name: distribute_tensor(t if full else torch.zeros_like(t), mesh, [LAYOUTS[name][which]])
               for name, t in ref["tensors"].items()}
    if full:
        return {"tensors": tensors, "step": ref["step"], "meta": ref["meta"]}
    return {"tensors": tensors, "step": torch.tensor(0), "meta": {"epoch": 0, "name": ""}}


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact, NaNs and bf16 included."""
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


def check_loaded(mesh, got: dict) -> None:
    ref = reference()
    for name, full in ref["tensors"].items():
        want = distribute_tensor(full, mesh, [LAYOUTS[name][3]]).to_local()
        local = got["tensors"][name].to_local() if isinstance(got["tensors"][name], DTensor) else got["tensors"][name]
        assert same(local, want), (name, local, want)
    assert got["step"].item() == 5 and got["meta"] == ref["meta"], (got["step"], got["meta"])


def check_reshard(mesh, out: Path) -> None:
    dcp.save(sharded(mesh, 2, full=True), storage_writer=HDF5Writer(out / "reshard"))
    names = sorted(p.name for p in (out / "reshard").iterdir())
    assert names == ["index.json", "shard-0.h5", "shard-1.h5"], names
    got = sharded(mesh, 3)
    dcp.load(got, storage_reader=HDF5Reader(out / "reshard"))
    check_loaded(mesh, got)
    plain = {"tensors": {k: torch.zeros_like(v) for k, v in reference()["tensors"].items()},
             "step": torch.tensor(0), "meta": {"epoch": 0, "name": ""}}
    dcp.load(plain, storage_reader=HDF5Reader(out / "reshard", verify="sampled"))
    for name, full in reference()["tensors"].items():
        assert same(plain["tensors"][name], full), name


def check_from_one(mesh, one_process_dir: str) -> None:
    got = sharded(mesh, 3)
    dcp.load(got, storage_reader=HDF5Reader(one_process_dir))
    check_loaded(mesh, got)


def check_corrupt(mesh, out: Path) -> None:
    path = out / "corrupt"
    dcp.save(sharded(mesh, 2, full=True), storage_writer=HDF5Writer(path))
    flipped = torch.tensor(1)
    if dist.get_rank() == 0:
        try:
            with h5py.File(path / "shard-1.h5", "r") as f:
                ds = f["/tensors.w/4_0"]
                at = (ds.id.get_offset() if ds.chunks is None else ds.id.get_chunk_info(0).byte_offset) + 5
            with open(path / "shard-1.h5", "r+b") as fh:
                fh.seek(at)
                byte = fh.read(1)[0]
                fh.seek(at)
                fh.write(bytes([byte ^ 0x10]))
        except Exception:
            flipped.zero_()
            traceback.print_exc()
    dist.broadcast(flipped, src=0)  # every rank goes on to the load, or none does
    assert flipped.item(), "rank 0 could not flip a byte in shard-1.h5"
    try:
        dcp.load(sharded(mesh, 2), storage_reader=HDF5Reader(path))  # rank r reads only shard-r.h5's "w"
    except CheckpointException as e:
        assert list(e.failures) == [1], e.failures  # rank 0's own reads were fine
        exc = e.failures[1][0]
        assert isinstance(exc, CheckpointCorrupt) and exc.path.endswith("shard-1.h5"), exc
        assert exc.dataset == "/tensors.w/4_0", exc
    else:
        raise AssertionError("the flipped byte was not caught")


def check_async(mesh, out: Path) -> None:
    """dcp.async_save drives the writer from a background thread."""
    dcp.async_save(sharded(mesh, 2, full=True), storage_writer=HDF5Writer(out / "async")).result()
    got = sharded(mesh, 3)
    dcp.load(got, storage_reader=HDF5Reader(out / "async"))
    check_loaded(mesh, got)


def check_fsdp(mesh, out: Path) -> None:
    """FSDP2 + Adam after one step, saved the way the trainer will; the full values go to fsdp_ref.pt."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(4, 6)).square().sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, storage_writer=HDF5Writer(out / "fsdp"))
    full = {k: v.full_tensor() for k, v in msd.items()}
    full |= {f"{p}.{k}": v.full_tensor() if isinstance(v, DTensor) else v
             for p, state in osd["state"].items() for k, v in state.items()}
    if dist.get_rank() == 0:
        torch.save(full, out / "fsdp_ref.pt")


def main(out: str, port: str, one_process_dir: str) -> None:
    os.environ["MASTER_PORT"] = port
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))  # a check gone wrong errors, not hangs
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    record = {}
    checks = {"reshard": lambda: check_reshard(mesh, Path(out)),
              "from_one": lambda: check_from_one(mesh, one_process_dir),
              "corrupt": lambda: check_corrupt(mesh, Path(out)),
              "async": lambda: check_async(mesh, Path(out)),
              "fsdp": lambda: check_fsdp(mesh, Path(out))}
    for name, check in checks.items():
        try:
            check()
            record[name] = True
        except (Exception, CheckpointException):
            record[name] = traceback.format_exc()
        passed = torch.tensor(int(record[name] is True))
        dist.all_reduce(passed, op=dist.ReduceOp.MIN)
        if not passed.item():  # the ranks may now be out of step in their collectives: stop here
            break
    Path(out, f"rank{dist.get_rank()}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
