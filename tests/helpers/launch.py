"""Where the tests find the project and how they start its processes: the repository's paths, the virtualenv's
executables, the hpctrain CLI and mpiexec in a fresh process, torchrun-style spawns of tests/workers/ scripts
(spawn_ranks, spawn_cases) and the worker side of a spawn over several cases (each_case).

Imports neither torch nor hpctrain: tests/conftest.py loads it for every test.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
WORKERS = TESTS / "workers"
PLUGINS = TESTS / "plugins"  # the test seams (seams.py) and the sitecustomize.py that installs them in a launch
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


def seam_env(**seams: str) -> dict[str, str]:
    """Environment for processes a launcher starts with test seams on (SEAM_FAULT=..., SEAM_DOCTOR_SLOW=...; see
    tests/plugins/seams.py): the variables, and tests/plugins first on PYTHONPATH so that every Python process
    started from it (the CLI, its ranks) loads the plugin's sitecustomize.py."""
    path = os.environ.get("PYTHONPATH", "")
    return {"PYTHONPATH": str(PLUGINS) + (os.pathsep + path if path else ""), **seams}


def required(var: str) -> bool:
    """CI sets HPCTRAIN_REQUIRE_MPI=1 and HPCTRAIN_REQUIRE_SLURM=1: a missing tier fails instead of skipping."""
    return os.environ.get(var, "") not in ("", "0")


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


def each_case(out: str, cases_json: str, base_port: int, body) -> None:
    """A worker's loop over its cases: each on its own MASTER_PORT (a fresh process group), body(case) run, and
    its error recorded by case name in out/errors-rank<R>.json rather than raised, so the test names the case."""
    errors = {}
    for i, case in enumerate(json.loads(cases_json)):
        os.environ["MASTER_PORT"] = str(base_port + i)
        try:
            body(case)
        except Exception as e:
            errors[case["name"]] = f"{type(e).__name__}: {e}"
    Path(out, f"errors-rank{os.environ['RANK']}.json").write_text(json.dumps(errors))


def spawn_cases(worker: str, out: Path, cases: list[dict], run_id: str, world: int = 4,
                ranks_per_node: int = 4) -> None:
    """Runs tests/workers/<worker> on `world` ranks over `cases` (see each_case) and fails with every case's
    error and the end of every rank's output when any case failed or any rank exited non-zero."""
    cmd = [sys.executable, str(WORKERS / worker), str(out), json.dumps(cases), str(free_base_port(len(cases)))]
    procs = spawn_ranks(world, cmd, ranks_per_node=ranks_per_node, run_id=run_id)
    logs = [p.communicate(timeout=600)[0] for p in procs]
    errors = {}
    for f in out.glob("errors-rank*.json"):
        errors.update(json.loads(f.read_text()))
    assert not errors and all(p.returncode == 0 for p in procs), f"{errors}\n" + "\n".join(x[-3000:] for x in logs)
