"""Shared test helpers: the project's own executables, and fixtures for the real MPI and Slurm tiers.

CI sets HPCTRAIN_REQUIRE_MPI=1 and HPCTRAIN_REQUIRE_SLURM=1 (see .ci/run): there a missing mpiexec or an
unreachable local cluster fails the tests instead of skipping them.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
EXAMPLE = REPO / "slurm" / "examples" / "tiny-cpu.toml"


def tool(name: str) -> str | None:
    """Prefer the virtualenv's executables (its mpiexec belongs to the mpich wheel mpi4py uses)."""
    local = BIN / name
    return str(local) if local.exists() else shutil.which(name)


def env_with_venv() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def hpctrain(*args: str, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    """Runs the hpctrain CLI in a fresh process, as a user would."""
    return subprocess.run([tool("hpctrain") or "hpctrain", *args], capture_output=True, text=True,
                          timeout=timeout, env=env_with_venv(), stdin=subprocess.DEVNULL, cwd=REPO, **kw)


def run_mpiexec(mpiexec: str, *parts: list[str], timeout: float = 180) -> subprocess.CompletedProcess:
    """mpiexec with MPMD parts joined by ':' (each part may set its own -env)."""
    cmd = [mpiexec]
    for i, part in enumerate(parts):
        cmd += ([":"] if i else []) + part
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env_with_venv(), cwd=REPO,
                          stdin=subprocess.DEVNULL)


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_base_port(n: int) -> int:
    """A base port with n free ports above it, one per process group a worker starts in turn. Taken below the
    kernel's ephemeral range: gloo listens on ephemeral ports, and one that landed inside a worker's range
    (seen: a gloo socket of the previous case on base + 2) made the next case's ranks talk to it and hang."""
    import random

    def free(port: int) -> bool:
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
                return True
            except OSError:
                return False
    low, _ = _ephemeral_range()
    top = max(low - n - 1, 10000 + n)
    while True:
        base = random.randrange(10000, top)
        if all(free(base + i) for i in range(n)):
            return base


def spawn_ranks(world: int, cmd: list[str], ranks_per_node: int, run_id: str) -> list[subprocess.Popen]:
    """Starts `world` real processes with torchrun's variables; GROUP_RANK makes nodes of ranks_per_node ranks.
    The worker sets MASTER_PORT itself (one per process group it creates)."""
    procs = []
    for rank in range(world):
        env = env_with_venv() | {
            "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank % ranks_per_node),
            "LOCAL_WORLD_SIZE": str(ranks_per_node), "GROUP_RANK": str(rank // ranks_per_node),
            "MASTER_ADDR": "127.0.0.1", "TORCHELASTIC_RUN_ID": run_id,
        }
        procs.append(subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    return procs


def only_run_dir(root: Path) -> Path:
    dirs = [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")]
    assert len(dirs) == 1, f"expected one run directory under {root}, found {dirs}"
    return dirs[0]


def read_summary(root: Path) -> dict:
    return json.loads((only_run_dir(root) / "summary.json").read_text())


def _required(var: str) -> bool:
    return os.environ.get(var, "") not in ("", "0")


@pytest.fixture(scope="session")
def mpiexec() -> str:
    exe = tool("mpiexec")
    if exe is None:
        if _required("HPCTRAIN_REQUIRE_MPI"):
            pytest.fail("HPCTRAIN_REQUIRE_MPI is set but mpiexec is missing (make install adds the mpich wheel)")
        pytest.skip("no mpiexec")
    return exe


@pytest.fixture(scope="session")
def slurm_cluster() -> None:
    """The local cluster from slurm/cluster.sh must answer with idle nodes n1 and n2."""
    why = None
    if shutil.which("sinfo") is None:
        why = "no sinfo on PATH"
    else:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True, timeout=20)
        nodes = dict(line.split() for line in out.stdout.splitlines() if line.strip())
        if out.returncode != 0 or not {"n1", "n2"} <= set(nodes):
            why = f"local cluster not up (sinfo: {out.stdout.strip() or out.stderr.strip()})"
    if why:
        if _required("HPCTRAIN_REQUIRE_SLURM"):
            pytest.fail(f"HPCTRAIN_REQUIRE_SLURM is set but {why}; run `make slurm-up`")
        pytest.skip(why)
