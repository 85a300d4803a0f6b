"""What the benchmarks share: the mpiexec to launch with, a driver that runs one script per world size and
collects each world's results/<name>-<n>ranks.json, and the results writer."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"


def mpiexec() -> str:
    """The venv's mpiexec (the mpich wheel mpi4py was built against) before any on PATH."""
    exe = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")
    if exe is None:
        sys.exit("no mpiexec found: `make install` adds the mpich wheel where the machine has no MPI")
    return exe


def run_worlds(script: str, name: str, ranks: list[int], argv: list[str]) -> dict[int, dict]:
    """Launches `script` under mpiexec -n N for each N; returns {N: that run's results JSON}."""
    worlds = {}
    for n in ranks:
        cmd = [mpiexec(), "-n", str(n), sys.executable, str(Path(script).resolve()), *argv]
        print(f"=== {' '.join(cmd)}", flush=True)
        if subprocess.call(cmd, cwd=HERE.parent):
            sys.exit(f"{name} failed on {n} ranks")
        worlds[n] = json.loads((RESULTS / f"{name}-{n}ranks.json").read_text())
    return worlds


def write_results(name: str, doc: dict, where: Path | None = None) -> Path:
    """Writes results/<name> (or where/<name>) as indented JSON and says where."""
    where = RESULTS if where is None else Path(where)
    where.mkdir(exist_ok=True)
    out = where / name
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"# wrote {out}", flush=True)
    return out
