"""What every rank runs: rendezvous, the topology-checked mesh, a checked all-reduce on every group, then the
job's payload. Launch it any way you like:

    hpctrain train CONFIG                      # one process
    mpiexec -n 4 hpctrain train CONFIG         # MPI gives identity
    srun --mpi=pmi2 hpctrain train CONFIG      # same inside Slurm
    torchrun --nproc-per-node 4 -m hpctrain.cli train CONFIG
    hpctrain submit CONFIG                     # through submitit (passes --run-dir)

Rank 0 writes summary.json into the run directory; a failed check makes every rank exit non-zero.
"""
from __future__ import annotations

import logging
import platform
import time
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist

from hpctrain import mesh, rendezvous, runs
from hpctrain.config import Config, dump_toml, load_config

log = logging.getLogger(__name__)


def _agree_run_dir(cfg: Config, run_dir: Path | None, rank: int) -> Path:
    """Direct launches get a fresh run directory made by rank 0 and broadcast to all."""
    if run_dir is not None:
        return run_dir
    box: list[Any] = [None]
    if rank == 0:
        box[0] = runs.new_run_dir(cfg.job.run_root, cfg.job.name)
        (box[0] / "config.toml").write_text(dump_toml(cfg))
    dist.broadcast_object_list(box, src=0)
    return box[0]


def check_groups(mesh_: mesh.Mesh, rank: int, device: torch.device) -> dict[str, Any]:
    """Runs mesh.verify_mesh on every rank and gathers the verdicts on all ranks."""
    mine = mesh.verify_mesh(mesh_, rank, device)
    every: list[Any] = [None] * mesh_.layout.world_size
    dist.all_gather_object(every, mine)
    bad = [f"rank {r} axis {axis}: expected {res['members']} got {res['got']}"
           for r, checks in enumerate(every) for axis, res in checks.items() if not res["ok"]]
    axes = {axis: sorted({tuple(c[axis]["members"]) for c in every}) for axis in mine}
    return {"ok": not bad, "failures": bad, "groups": {a: [list(g) for g in gs] for a, gs in axes.items()}}


def run(cfg: Config, run_dir: str | Path | None = None) -> dict[str, Any]:
    t0 = time.time()
    ident = rendezvous.identify(cfg.parallel.rendezvous)
    rdzv_dir = Path(run_dir) if run_dir else Path(cfg.job.run_root).absolute() / ".rendezvous"
    device = rendezvous.init_distributed(ident, cfg.parallel.backend, cfg.parallel.timeout_s,
                                         cfg.parallel.master_addr, rdzv_dir)
    try:
        run_dir = _agree_run_dir(cfg, Path(run_dir) if run_dir else None, ident.rank)
        runs.setup_logging(run_dir, ident.rank)
        log.info("rank %d/%d on %s (local rank %d, node %d/%d) via %s, job %s, device %s, startup %.1f s",
                 ident.rank, ident.world_size, ident.node_name, ident.local_rank, ident.node_index,
                 ident.num_nodes, ident.launcher, ident.job_id, device, time.time() - t0)
        return _skeleton(cfg, ident, device, run_dir, t0)
    finally:
        dist.destroy_process_group()


def _skeleton(cfg: Config, ident: rendezvous.Identity, device: torch.device, run_dir: Path, t0: float):
    idents: list[Any] = [None] * ident.world_size
    dist.all_gather_object(idents, ident)
    node_of_rank = [i.node_index for i in idents]
    summary: dict[str, Any] = {
        "ok": False, "launcher": ident.launcher, "job_id": ident.job_id, "world_size": ident.world_size,
        "num_nodes": ident.num_nodes, "backend": dist.get_backend(), "torch": torch.__version__,
        "python": platform.python_version(), "run_dir": str(run_dir),
    }
    try:
        # Every rank sees the same gathered identities, so a refusal happens on all ranks alike (no hang).
        layout = mesh.resolve_layout(cfg.parallel.pp, cfg.parallel.dp, cfg.parallel.tp, ident.world_size)
        rows = mesh.rank_table(layout, node_of_rank, [i.node_name for i in idents], [i.local_rank for i in idents])
        summary["layout"] = {"pp": layout.pp, "dp": layout.dp, "tp": layout.tp}
        summary["rank_map"] = rows
        mesh.check_topology(layout, node_of_rank)
        if ident.rank == 0:
            for line in mesh.format_rank_map(layout, rows).splitlines():
                log.info("%s", line)
        mesh_ = mesh.build_mesh(layout, node_of_rank, device.type)
        checks = check_groups(mesh_, ident.rank, device)
        summary["checks"] = checks
        summary["ok"] = checks["ok"]
    except ValueError as e:
        summary["error"] = str(e)
        log.error("%s", e)
        raise
    finally:
        summary["elapsed_s"] = round(time.time() - t0, 3)
        if ident.rank == 0:
            runs.write_json(run_dir / "summary.json", summary)
    if not summary["ok"]:
        raise RuntimeError("group checks failed:\n" + "\n".join(checks["failures"]))
    log.info("all-reduce checks passed on world, %s (%.1f s)", ", ".join(mesh.AXES + mesh.NODE_AXES),
             summary["elapsed_s"])
    return summary


def main(config_path: str | Path | None, run_dir: str | Path | None = None, overrides: Sequence[str] = ()):
    """Entry point of each rank (CLI and submitit): returns the summary."""
    return run(load_config(config_path, overrides), run_dir)

