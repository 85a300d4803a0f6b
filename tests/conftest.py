"""Fixtures for the real MPI and Slurm tiers; everything else the tests share is in tests/helpers/ (by domain).

Tests live in tier folders (pure/, multiproc/, cluster/) and import helpers (and faults) from here: this file puts
tests/ on sys.path before any test module is imported, and tests/plugins (the test seams, seams.py).

CI sets HPCTRAIN_REQUIRE_MPI=1 and HPCTRAIN_REQUIRE_SLURM=1 (see .ci/run): there a missing mpiexec or an
unreachable local cluster fails the tests instead of skipping them.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = str(Path(__file__).resolve().parent)
for _path in (TESTS, str(Path(TESTS) / "plugins")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from helpers.launch import required, tool  # noqa: E402


@pytest.fixture(scope="session")
def mpiexec() -> str:
    exe = tool("mpiexec")
    if exe is None:
        if required("HPCTRAIN_REQUIRE_MPI"):
            pytest.fail("HPCTRAIN_REQUIRE_MPI is set but mpiexec is missing (make install adds the mpich wheel)")
        pytest.skip("no mpiexec")
    return exe


@pytest.fixture(scope="session")
def slurm_cluster() -> None:
    """The local cluster from slurm/cluster.sh must answer with nodes n1 and n2 (and n3, the spare the preflight
    test moves a job to: a cluster brought up with 2 nodes fails that test, not this fixture)."""
    why = None
    if shutil.which("sinfo") is None:
        why = "no sinfo on PATH"
    else:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True, timeout=20)
        nodes = dict(line.split() for line in out.stdout.splitlines() if line.strip())
        if out.returncode != 0 or not {"n1", "n2"} <= set(nodes):
            why = f"local cluster not up (sinfo: {out.stdout.strip() or out.stderr.strip()})"
    if why:
        if required("HPCTRAIN_REQUIRE_SLURM"):
            pytest.fail(f"HPCTRAIN_REQUIRE_SLURM is set but {why}; run `make slurm-up`")
        pytest.skip(why)
