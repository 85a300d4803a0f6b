"""What every rank runs: the session (rendezvous, topology-checked mesh, checked all-reduce on every group),
then the job's payload. Launch it any way you like:

    hpctrain train CONFIG                      # one process
    mpiexec -n 4 hpctrain train CONFIG         # MPI gives identity
    srun --mpi=pmi2 hpctrain train CONFIG      # same inside Slurm
    torchrun --nproc-per-node 4 -m hpctrain.cli train CONFIG
    hpctrain submit CONFIG                     # through submitit (passes --run-dir)

Rank 0 writes summary.json into the run directory; a failed check makes every rank exit non-zero.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from hpctrain import session
from hpctrain.config import Config, load_config


def run(cfg: Config, run_dir: str | Path | None = None) -> dict[str, Any]:
    with session.start(cfg, run_dir) as s:
        pass  # the skeleton's payload is the session's own group check
    return s.summary


def main(config_path: str | Path | None, run_dir: str | Path | None = None, overrides: Sequence[str] = ()):
    """Entry point of each rank (CLI and submitit): returns the summary."""
    return run(load_config(config_path, overrides), run_dir)
