"""One rank of tests/multiproc/job/test_device_collectives.py (2 ranks with Slurm's variables, file rendezvous, the
NCCL code path emulated on gloo by tests/plugins/seams.py's emulate_nccl): the control collectives on the default
group NCCL alone would give, then on ours (and the gradient norm of a pipeline rank without gradients), then
training with asynchronous and final saves and a resume. Writes OUT/rank<r>.json.

    python tests/workers/device_collectives_worker.py OUT
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

TINY = ["model.vocab_size=256", "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.max_seq_len=64",
        "data.source=synthetic", "data.seq_len=32", "train.lr=1e-3", "train.warmup_steps=2", "train.log_every=100",
        "train.peak_tflops=1", "train.micro_batch_size=4", "parallel.backend=nccl", "parallel.timeout_s=120",
        "parallel.zero_stage=3", "job.nodes=1", "job.tasks_per_node=2", "job.gpus_per_node=2"]


def _outcome(fn) -> str:
    try:
        fn()
        return "ok"
    except Exception as e:  # noqa: BLE001 -- recorded for the test to judge
        return f"{type(e).__name__}: {e}"


def _host_collectives(rank: int, world: int, out: Path) -> dict[str, str]:
    """The control collectives that run on host tensors, each checked for its value."""
    import torch

    from hpctrain.checkpoint import manager, state
    from hpctrain.config import CheckpointConfig
    from hpctrain.job.preempt import PreemptionFlag

    mgr = manager.CheckpointManager(CheckpointConfig(dir=str(out / "none")), out, rank, writer=False)

    def rng() -> None:
        table = state.rng_table(world)
        assert table.shape[0] == world and torch.equal(table[rank], torch.get_rng_state())

    def need() -> None:
        assert mgr._need_bytes({"x": torch.ones(4)}) == int(world * 16 * 1.05) + (1 << 20)

    def any_rank() -> None:
        assert manager._any_rank(rank == 1) and not manager._any_rank(False)

    def poll() -> None:
        flag = PreemptionFlag(signals=())
        flag.received = 12 if rank == 0 else None
        assert flag.poll() is True

    return {"rng_table": _outcome(rng), "need_bytes": _outcome(need), "any_rank": _outcome(any_rank),
            "preempt_poll": _outcome(poll)}


def _object_collectives(rank: int) -> dict[str, str]:
    from hpctrain.checkpoint import manager

    def agree() -> None:
        assert manager._agree(rank, lambda: "from rank 0") == "from rank 0"

    def gather() -> None:
        assert manager._gather(rank) == [0, 1]

    return {"agree": _outcome(agree), "gather": _outcome(gather)}


def _no_grad_pp_rank(rank: int) -> dict:
    """The gradient norm over a pp group whose rank 1 holds parameters but no gradient (rank 0: a gradient of norm
    3). A tensor the code makes without naming a device is on torch's default device; on a GPU job that is the
    host, not the rank's device. Here the rank's device is the host too, so the default device is set to meta for
    the call: a zero made "on the default device" then joins no backend of the group (meta tensors skip the
    collective) and its peer waits out the group's timeout, as NCCL peers wait for a zero sent to gloo."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from hpctrain.train import optim

    pp_group = dist.new_group([0, 1], timeout=timedelta(seconds=10))
    p = torch.nn.Parameter(torch.ones(3))
    if rank == 0:
        p.grad = torch.tensor([2.0, 2.0, 1.0])
    try:
        with torch.device("meta"):
            norm = optim.grad_norm([p], pp_group)
        return {"norm": norm.item() if norm.device.type != "meta" else None, "device": norm.device.type}
    except Exception as e:  # noqa: BLE001 -- recorded for the test to judge
        return {"error": f"{type(e).__name__}: {e}"[:300]}


def _cpu_backend(pg) -> str:
    """The name of the backend a group hands host tensors to ("" when it has none)."""
    import torch

    return pg._get_backend(torch.device("cpu")).name() if torch.device("cpu") in pg._device_types else ""


def _train(overrides: list[str]) -> dict:
    import os

    from torch.distributed import distributed_c10d as c10d

    from hpctrain.config import load_config
    from hpctrain.job import session
    from hpctrain.train.trainer import Trainer

    try:
        with session.start(load_config(None, TINY + overrides)) as s:
            res = Trainer(s.cfg, s).fit()
            groups = [{"desc": pg.group_desc, "devices": sorted(d.type for d in pg._device_types),
                       "cpu_backend": _cpu_backend(pg)} for pg in c10d._world.pg_map]
        return {"steps": res["steps"], "resumed_from": res["resumed_from"], "groups": groups,
                "lazy_gloo": os.environ.get("TORCH_GLOO_LAZY_INIT")}
    except Exception as e:  # noqa: BLE001 -- recorded for the test to judge
        return {"error": f"{type(e).__name__}: {e}"}


def worker(out: Path) -> None:
    import seams
    import torch.distributed as dist

    from hpctrain.job import rendezvous

    seams.emulate_nccl()
    ident = rendezvous.identify("slurm")
    rank, world = ident.rank, ident.world_size
    result: dict = {}
    # 1. the fault: the default group NCCL alone gives, through our init path
    real = rendezvous.backend_config
    rendezvous.backend_config = lambda backend: backend
    try:
        rendezvous.init_distributed(ident, "nccl", 60, "", out / "rdzv-device-only")
        result["device_only_backend"] = dist.get_backend_config()
        result["device_only"] = _host_collectives(rank, world, out)
        dist.barrier(group=dist.new_group(backend="gloo"))  # both ranks done before teardown
    finally:
        rendezvous.backend_config = real
        dist.destroy_process_group()
    # 2. our default group
    rendezvous.init_distributed(ident, "nccl", 60, "", out / "rdzv-ours")
    result["backend"] = dist.get_backend_config()
    result["control"] = _host_collectives(rank, world, out) | _object_collectives(rank)
    result["no_grad_pp_rank"] = _no_grad_pp_rank(rank)
    dist.barrier(group=dist.new_group(backend="gloo"))
    dist.destroy_process_group()
    # 3. training: async periodic saves, a final save, then a resume
    ck = [f"checkpoint.dir={out / 'ck'}", "checkpoint.every_steps=2", "checkpoint.async_save=true"]
    result["train"] = _train(ck + ["train.steps=4", f"job.run_root={out / 'runs1'}"])
    if "error" not in result["train"]:
        result["resume"] = _train(ck + ["train.steps=6", f"job.run_root={out / 'runs2'}"])
    (out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins"))  # for seams
    worker(Path(sys.argv[1]))
