"""Fixtures for the real MPI and Slurm tiers; everything else the tests share is in tests/helpers/ (by domain).

Tests live in tier folders (pure/, multiproc/, cluster/) and import helpers (and faults) from here: this file puts
tests/ on sys.path before any test module is imported, and tests/plugins (the test seams, seams.py).

CI sets HPCTRAIN_REQUIRE_MPI=1 and HPCTRAIN_REQUIRE_SLURM=1 (see .ci/run): there a missing mpiexec or an
unreachable local cluster fails the tests instead of skipping them.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

TESTS = str(Path(__file__).resolve().parent)
for _path in (TESTS, str(Path(TESTS) / "plugins")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from helpers.launch import required, tool  # noqa: E402

# fixtures more than one tier's modules use: the tokenized-data tests' tokenizer and inputs (module-scoped)
pytest_plugins = ("helpers.tokenized",)


@pytest.fixture(scope="session")
def mpiexec() -> str:
    exe = tool("mpiexec")
    if exe is None:
        if required("HPCTRAIN_REQUIRE_MPI"):
            pytest.fail("HPCTRAIN_REQUIRE_MPI is set but mpiexec is missing (make install adds the mpich wheel)")
        pytest.skip("no mpiexec")
    return exe


@pytest.fixture(scope="session")
def _slurm_up() -> None:
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


def _queued() -> set[str]:
    """Jobs pending, running or suspended (not those completing: a test's own scancel leaves its job so a moment)."""
    out = subprocess.run(["squeue", "-h", "-t", "PD,CF,R,S", "-o", "%i"], capture_output=True, text=True, timeout=20)
    return set(out.stdout.split())


@pytest.fixture
def slurm_cluster(_slurm_up) -> Iterator[None]:
    """The cluster, as each Slurm test must find it, whatever the test before it did. A node Slurm drained with
    "Kill task failed" (a step's tasks outlived UnkillableStepTimeout after SIGKILL: CI-34, on a loaded host) is
    put back in service, with a warning: the test it happened in reports it; the tests after it need their 3 nodes.
    A job the test left in the queue (it timed out waiting, it failed before its job ended) is cancelled after it,
    with a warning, so that it cannot start on the next test's nodes."""
    out = subprocess.run(["sinfo", "-h", "-N", "-t", "drain,draining,drained", "-o", "%N|%E"], capture_output=True,
                         text=True, timeout=20)
    for line in out.stdout.splitlines():
        node, _, reason = line.partition("|")
        if "Kill task failed" in reason:
            warnings.warn(f"slurm_cluster: {node} was drained ({reason}); put back in service", stacklevel=1)
            subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], timeout=20)
    before = _queued()
    yield
    left = sorted(_queued() - before)
    if left:
        warnings.warn(f"slurm_cluster: the test left job(s) {', '.join(left)} in the queue; cancelled", stacklevel=1)
        subprocess.run(["scancel", *left], timeout=20)


# --- no hang watchdog outlives its test ------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def _no_watchdog_outlives_its_test(monkeypatch) -> Iterator[None]:
    """Stops the watchdogs a test made in this process (helpers.hang.a_watchdog), while its monkeypatch still holds
    (this fixture asks for it, so it is undone after this teardown), then fails the test if any hang watchdog thread
    is still alive: one left behind calls the real end_job at its limit, which exits the process (a pytest worker,
    in a later test: 'node down: Not properly terminated')."""
    yield
    import threading
    hang = sys.modules.get("helpers.hang")
    for dog in hang.LIVE if hang else []:
        dog.stop()
        dog._thread.join(30)
    if hang:
        hang.LIVE.clear()
    alive = [t for t in threading.enumerate() if t.name == "hpctrain-watchdog" and t.is_alive()]
    assert not alive, f"a hang watchdog outlived its test: {alive}"


# --- tests at once (`make test` runs pytest -n 3, pytest-xdist) ---------------------------------------------------
# A serial run left this host idle half of its time: tests wait on Slurm's scheduler, a requeue's hold, a hang limit,
# a launcher. Under xdist, units of work, handed out in this order:
# - the tests on the local Slurm cluster: one unit, run in order by one worker (three nodes; those tests wait for an
#   idle queue), the longest and the run's critical path;
# - every module with a module-scoped fixture of its own or a shared one (the training runs of many layouts that
#   its tests compare, spawned once): a unit each, so the fixture runs once;
# - every other test, a unit of its own (a module of many slow tests is spread over the workers: CI-15's
#   test_faults_ckpt.py, 230 s, ran on one worker).
# Measured on fresh clones: this order 15:49 of pytest (CI-18); the heavy modules in collection order instead, so
# that they start after the Slurm unit's busiest minutes, 16:56 (CI-19: they were the last to end).
# A test marked `alone` judges speeds measured on this host (the doctor's verdicts, stragglers): it waits until the
# other workers' tests have ended, and no test starts beside it. Every test takes a lock on the run's lock file,
# shared or (alone) exclusive, after passing a gate that an alone test holds while it waits, so it is never starved.

def _decorated(node, word: str) -> bool:
    import ast
    return any(word in ast.unparse(d) for d in node.decorator_list)


def slurm_tests(path: Path) -> frozenset[str]:
    """The test functions of a module that use the local Slurm cluster (the slurm_cluster fixture or the slurm
    mark, on the function or the module), read from its source: the controller that hands out work collects
    nothing itself."""
    import ast
    tree = ast.parse(path.read_text())
    marked = any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
                 and "slurm" in ast.unparse(n.value) for n in tree.body)
    out = set()
    for n in tree.body:
        if isinstance(n, ast.FunctionDef) and n.name.startswith("test"):
            args = {a.arg for a in n.args.args}
            if marked or "slurm_cluster" in args or _decorated(n, "mark.slurm"):
                out.add(n.name)
    return frozenset(out)


def _module_fixtures(path: Path) -> frozenset[str]:
    """Names of the fixtures a file defines with a scope wider than one test."""
    import ast

    def wide(decorator) -> bool:
        return isinstance(decorator, ast.Call) and "fixture" in ast.unparse(decorator.func) and any(
            k.arg == "scope" and isinstance(k.value, ast.Constant) and k.value.value in ("module", "class", "package")
            for k in decorator.keywords)
    return frozenset(n.name for n in ast.parse(path.read_text()).body
                     if isinstance(n, ast.FunctionDef) and any(wide(d) for d in n.decorator_list))


def shares_a_fixture(path: Path, shared: frozenset[str]) -> bool:
    """Whether a test module has a module-scoped fixture of its own, or a test of it takes one of `shared` (those
    of the conftest files and helpers)."""
    import ast
    if _module_fixtures(path):
        return True
    return any(isinstance(n, ast.FunctionDef) and {a.arg for a in n.args.args} & shared
               for n in ast.walk(ast.parse(path.read_text())))


def pytest_xdist_make_scheduler(config, log):
    import functools

    from xdist.scheduler import LoadScopeScheduling
    root = Path(config.rootpath)
    shared = frozenset().union(*(_module_fixtures(f) for f in [*root.glob("tests/**/conftest.py"),
                                                                *root.glob("tests/helpers/*.py")]))
    slurm = functools.lru_cache(maxsize=None)(lambda file: slurm_tests(root / file))
    bound = functools.lru_cache(maxsize=None)(lambda file: shares_a_fixture(root / file, shared))

    class TierScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file, _, rest = nodeid.partition("::")
            if file.startswith("tests/cluster/") and rest.split("[")[0] in slurm(file):
                return "slurm"
            return file if bound(file) else nodeid

        def _assign_work_unit(self, node) -> None:
            # the next unit: the first of the earliest kind (Slurm, modules with a shared fixture, single tests)
            first = min(self.workqueue, key=lambda scope: 0 if scope == "slurm" else 1 if "::" not in scope else 2)
            self.workqueue.move_to_end(first, last=False)
            super()._assign_work_unit(node)

    config.option.loadscopereorder = False  # collection order within each kind
    return TierScheduling(config, log)


def pytest_collection_modifyitems(config, items) -> None:
    """The scheduler's reading of the sources (slurm_tests) must agree with the fixtures each test really uses. The
    cluster tests marked `alone` go after the other cluster tests: the Slurm unit runs in collection order, and an
    alone test waits for every running test to end. First in the unit (CI-21), the doctor's two waited 97 s for the
    heavy modules the other workers start with, and the host ran at 10-60% for a minute."""
    cluster = [i for i, item in enumerate(items) if item.nodeid.startswith("tests/cluster/")]
    if cluster:
        lo, hi = cluster[0], cluster[-1] + 1
        items[lo:hi] = sorted(items[lo:hi], key=lambda item: item.get_closest_marker("alone") is not None)
    for item in items:
        file = item.nodeid.split("::")[0]
        if file.startswith("tests/cluster/"):
            uses = "slurm_cluster" in item.fixturenames or item.get_closest_marker("slurm") is not None
            if uses != (item.originalname in slurm_tests(Path(config.rootpath, file))):
                raise pytest.UsageError(f"{item.nodeid}: uses the Slurm cluster = {uses}, but slurm_tests() reads "
                                        f"its source otherwise; take slurm_cluster as an argument or mark it slurm")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        yield
        return
    # the run's own folder, the parent of every worker's basetemp: pytest removes it with old runs
    base = Path(item.config.option.basetemp).parent
    alone = item.get_closest_marker("alone") is not None
    with open(base / "tests.gate", "a") as gate, open(base / "tests.room", "a") as room:
        fcntl.flock(gate, fcntl.LOCK_EX)
        if not alone:
            fcntl.flock(gate, fcntl.LOCK_UN)
        fcntl.flock(room, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        yield  # setup (module fixtures included), call, teardown; closing the files releases both locks
