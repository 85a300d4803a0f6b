"""Fault campaign, launch tier: a rank that fails, stops or dies must end the whole launch within seconds.

    PATH=$PWD/.venv/bin:$PATH .venv/bin/python -m pytest -q tests/cluster/job/test_faults_launch.py

Real processes under `mpiexec -n 2` (the mpich wheel) and on the local Slurm cluster. Faults come from outside
(SIGKILL to a rank's pid, found by its launcher's environment in /proc) or from the test seam
SEAM_FAULT=<raise|SIGNAME>:<rank>:<rendezvous|ready> (tests/plugins/seams.py). Each test records its fault and
the time until every rank was gone (tests/faults.py). Ranks stopped or asleep inside a step are the hang
watchdog's: tests/cluster/hang/test_hang.py and tests/multiproc/hang/test_hang_local.py.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from faults import record
from launches import Launch, mpi_train, rank_pids, wait_for_pids, wait_gone
from launches import sets as _sets

from helpers.launch import EXAMPLE, REPO, seam_env, tool

pytestmark = pytest.mark.faults
TIMEOUT_S = 8  # parallel.timeout_s of the MPI runs (the hang watchdog speaks after half of it)
# a model small enough that a step takes milliseconds, on generated tokens (no data file needed)
SMALL = ["data.source=synthetic", "model.n_layers=1", "model.dim=64", "train.log_every=1", "train.steps=100000",
         "checkpoint.at_end=false"]


@pytest.fixture(autouse=True)
def _no_leftover_shm():
    """MPICH removes its shared-memory segments at MPI_Finalize; MPI_Abort and SIGKILL leave them in /dev/shm
    (2 MB per node each). Remove those this test's launches left: new, and mapped by no live process."""
    shm = Path("/dev/shm")
    before = set(shm.glob("mpich_shm_*"))
    yield
    mapped = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            mapped |= {line.split()[-1] for line in maps.read_text().splitlines() if "/dev/shm/" in line}
        except OSError:
            continue
    for left in set(shm.glob("mpich_shm_*")) - before:
        if str(left) not in mapped:
            left.unlink(missing_ok=True)


def _mpi_train(root: Path, *sets: str) -> list[str]:
    return mpi_train(root, 2, f"parallel.timeout_s={TIMEOUT_S}", *SMALL, *sets)


@pytest.mark.mpi
def test_killed_rank_ends_mpi_launch(mpiexec, tmp_path) -> None:
    """SIGKILL of rank 1 once rank 0 has logged step 2: mpiexec ends rank 0 (a stopped or sleeping rank is the
    hang watchdog's: tests/cluster/hang/test_hang.py)."""
    root = tmp_path / "runs"
    launch = Launch(_mpi_train(root))
    pids: dict[int, int] = {}
    try:
        launch.wait_for(r"step 2/", 120)
        pids = rank_pids(b"PMI_RANK", str(root))
        assert sorted(pids) == [0, 1], pids
        os.kill(pids[1], signal.SIGKILL)
        gone = wait_gone([*pids.values(), launch.proc.pid], TIMEOUT_S + 20)
    finally:
        launch.kill(list(pids.values()))
    assert gone is not None and gone < 10, f"ranks alive {gone} s after SIGKILL:\n{launch.output[-3000:]}"
    assert launch.proc.returncode != 0
    record("SIGKILL of rank 1 during training (mpiexec -n 2)", "mpiexec ends rank 0, exit non-zero", gone, "mpi")


def _file_has(pattern: str, text: str) -> bool:
    return any(text in p.read_text(errors="replace") for p in Path("/").glob(pattern.lstrip("/")))


def _wait_for_file_text(pattern: str, text: str, timeout_s: float) -> None:
    t0 = time.monotonic()
    while not _file_has(pattern, text):
        assert time.monotonic() - t0 < timeout_s, f"{text!r} never appeared in {pattern}"
        time.sleep(0.02)


@pytest.mark.mpi
def test_raising_rank_ends_mpi_launch(mpiexec, tmp_path) -> None:
    """Rank 1 raises once the mesh is up while rank 0 goes on into training: the launch ends at once, long before
    rank 0's collective would time out."""
    root = tmp_path / "runs"
    launch = Launch(_mpi_train(root, f"parallel.timeout_s={TIMEOUT_S * 4}"), seam_env(SEAM_FAULT="raise:1:ready"))
    pids: dict[int, int] = {}
    try:
        pids = wait_for_pids(b"PMI_RANK", str(root), 2)
        _wait_for_file_text(f"{root}/*/logs/rank00001.log", "SEAM_FAULT", 120)
        gone = wait_gone([*pids.values(), launch.proc.pid], TIMEOUT_S * 4 + 20)
    finally:
        launch.kill(list(pids.values()))
    assert gone is not None and gone < 5, f"ranks alive {gone} s after the exception:\n{launch.output[-3000:]}"
    assert launch.proc.returncode != 0
    assert "RuntimeError: SEAM_FAULT: injected failure on rank 1 at ready" in launch.output
    assert "failed: MPI_Abort ends the launch" in launch.output and "Timed out" not in launch.output
    record("exception on rank 1 after start-up (mpiexec -n 2)", "traceback printed, MPI_Abort ends both ranks at "
           "once (no collective timeout), exit non-zero", gone, "mpi")


def _slurm_kill(tmp_path: Path, when: str, sig: signal.Signals = signal.SIGKILL,
                timeout_s: int = 60) -> tuple[float | None, Launch]:
    """hpctrain submit --wait on the 2-node cluster; rank 1 gets `sig` mid-training (from here) or SIGKILL during
    start-up (the hook). Returns the seconds until the four tasks were gone, and the finished submit."""
    root = tmp_path / "runs"
    hook = seam_env(SEAM_FAULT="SIGKILL:1:rendezvous") if when == "startup" else {}
    launch = Launch([tool("hpctrain"), "submit", str(EXAMPLE), "--wait",
                     *_sets(f"job.run_root={root}", f"parallel.timeout_s={timeout_s}", "job.wait_timeout_s=5",
                            *SMALL)], hook)
    pids: dict[int, int] = {}
    gone = job_id = None
    try:
        launch.wait_for(r"submitted job \d+", 60)
        job_id = re.search(r"submitted job (\d+)", launch.output).group(1)
        if when == "startup":  # rank 1 may be gone before all four were seen: collect the others meanwhile
            err = f"{root}/*/submitit/{job_id}_1_log.err"
            t0 = time.monotonic()
            while not ({0, 2, 3} <= set(pids) and _file_has(err, "SEAM_FAULT")):
                assert time.monotonic() - t0 < 120, f"rank 1 never reached the fault (tasks seen: {pids})"
                pids |= rank_pids(b"SLURM_PROCID", str(root))
                time.sleep(0.05)
        else:
            launch.wait_for(r"step 2/", 180)
            pids = wait_for_pids(b"SLURM_PROCID", str(root), 4)
            os.kill(pids[1], sig)
        gone = wait_gone(list(pids.values()), timeout_s + 80)
        launch.proc.wait(timeout=60)
    finally:
        if job_id and (launch.proc.poll() is None or gone is None):
            subprocess.run(["scancel", job_id], timeout=20)
        launch.kill(list(pids.values()))
    return gone, launch


@pytest.mark.slurm
def test_killed_rank_ends_slurm_job(slurm_cluster, tmp_path) -> None:
    """SIGKILL of rank 1 mid-training: the job ends at once (its peers see the connection drop and abort, and
    srun --kill-on-bad-exit=1 ends them too); --wait reports the failure."""
    gone, launch = _slurm_kill(tmp_path, "training")
    assert gone is not None and gone < 10, f"tasks alive {gone} s after SIGKILL of rank 1:\n{launch.output[-3000:]}"
    assert launch.proc.returncode == 1, launch.output[-3000:]
    record("SIGKILL of rank 1 during training (Slurm, 2 nodes x 2 tasks)",
           "the other 3 tasks end at once; submit --wait exits 1", gone, "slurm")


@pytest.mark.slurm
def test_rank_killed_during_startup_ends_slurm_job(slurm_cluster, tmp_path) -> None:
    """SIGKILL of rank 1 before it joins the process group: the others would wait parallel.timeout_s (60 s) in
    the rendezvous; srun --kill-on-bad-exit=1 (which submit passes) ends them. Blocked in the store, they take
    its SIGTERM for a preemption (flagged from process start), so Slurm's SIGKILL after KillWait (5 s on the
    local cluster, 30 s by default) is what ends them."""
    gone, launch = _slurm_kill(tmp_path, "startup")
    assert gone is not None and gone < 10, f"tasks alive {gone} s after SIGKILL of rank 1:\n{launch.output[-3000:]}"
    assert launch.proc.returncode == 1, launch.output[-3000:]
    record("SIGKILL of rank 1 during rendezvous (Slurm, 2 nodes x 2 tasks)",
           "srun --kill-on-bad-exit ends the other 3 tasks (SIGTERM is flagged; SIGKILL after KillWait = 5 s), "
           "not after the 60 s rendezvous timeout; submit --wait exits 1",
           gone, "slurm")


@pytest.mark.slurm
def test_raising_rank_ends_slurm_job(slurm_cluster, tmp_path) -> None:
    """Rank 1 raises once the mesh is up: MPI_Abort through srun's PMI2 ends the four tasks at once, and
    submit --wait reports rank 1's error from the result it left, without waiting job.wait_timeout_s (120 s)."""
    root = tmp_path / "runs"
    launch = Launch([tool("hpctrain"), "submit", str(EXAMPLE), "--wait",
                     *_sets(f"job.run_root={root}", "parallel.timeout_s=60", "job.wait_timeout_s=120", *SMALL)],
                    seam_env(SEAM_FAULT="raise:1:ready"))
    pids: dict[int, int] = {}
    job_id = None
    try:
        launch.wait_for(r"submitted job \d+", 60)
        job_id = re.search(r"submitted job (\d+)", launch.output).group(1)
        err = f"{root}/*/submitit/{job_id}_1_log.err"
        t0 = time.monotonic()
        while not _file_has(err, "SEAM_FAULT"):
            assert time.monotonic() - t0 < 120, "rank 1 never reached the fault"
            pids |= rank_pids(b"SLURM_PROCID", str(root))
            time.sleep(0.05)
        t_fault = time.monotonic()
        gone = wait_gone(list(pids.values()), 40)
        launch.proc.wait(timeout=60)
        reported = time.monotonic() - t_fault
    finally:
        if job_id and launch.proc.poll() is None:
            subprocess.run(["scancel", job_id], timeout=20)
        launch.kill(list(pids.values()))
    assert len(pids) == 4 and gone is not None and gone < 10, (pids, gone, launch.output[-3000:])
    assert launch.proc.returncode == 1 and reported < 30, (reported, launch.output[-3000:])
    assert "injected failure on rank 1 at ready" in launch.output
    record("exception on rank 1 after start-up (Slurm, 2 nodes x 2 tasks)",
           "MPI_Abort ends the 4 tasks; submit --wait exits 1 with rank 1's error at once (< 30 s, not after "
           "job.wait_timeout_s = 120 s)",
           gone, "slurm")


# --- a stranger at the rendezvous store ---------------------------------------------------------------------

STRANGER = r"""
import json, re, socket, sys
from pathlib import Path
import torch.distributed as dist
from hpctrain.job import rendezvous

rdzv = Path(sys.argv[1])
ident = rendezvous.identify("auto")
rendezvous.init_distributed(ident, "gloo", 30, "", rdzv)
dist.barrier()
if ident.rank == 0:
    store = dist.distributed_c10d._get_default_store()
    while hasattr(store, "underlying_store"):  # PrefixStores around the TCPStore rank 0 serves
        store = store.underlying_store
    keys = store.list_keys()
    out = {"port": store.port, "host": store.host, "keys": keys, "files": [p.name for p in rdzv.iterdir()]}
    # the names the job's keys would have without a job secret in front of them
    plain = [k.split("/", 1)[1] for k in keys if re.match(r"[0-9a-f]{32}/", k)] or keys
    stranger = dist.TCPStore(store.host, store.port, is_master=False, timeout=__import__("datetime").timedelta(5))
    out["stranger_finds"] = [k for k in plain if stranger.check([k])]
    out["stranger_lists"] = stranger.list_keys()
    out["other_addr"], out["other_addr_connects"] = sys.argv[2], None
    try:
        socket.create_connection((sys.argv[2], store.port), timeout=3).close()
        out["other_addr_connects"] = True
    except OSError as e:
        out["other_addr_connects"] = f"{type(e).__name__}: {e}"
    print("STRANGER " + json.dumps(out), flush=True)
dist.barrier()
dist.destroy_process_group()
"""


def _other_local_address() -> str:
    """An address of this host other than the 127.0.0.1 the store is published on: the first non-loopback IPv4
    address if there is one, else 127.0.0.2 (all of 127/8 is local, but a socket bound to 127.0.0.1 does not
    answer there)."""
    out = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout
    addrs = [a for a in re.findall(r"inet (\d+\.\d+\.\d+\.\d+)", out) if not a.startswith("127.")]
    return addrs[0] if addrs else "127.0.0.2"


@pytest.mark.parametrize("launcher", ["file", pytest.param("mpi", marks=pytest.mark.mpi)])
def test_stranger_at_the_store_finds_nothing(launcher, tmp_path, request) -> None:
    """One job of 2 ranks on one node (the store published on 127.0.0.1). A process outside the job that
    connects to the published port finds none of the job's keys under their plain names (they sit under the
    job's secret); the store does not answer on another address of this host; the address file is gone."""
    other = _other_local_address()
    cmd = [sys.executable, "-c", STRANGER, str(tmp_path), other]
    if launcher == "mpi":
        request.getfixturevalue("mpiexec")
        runs = [Launch([tool("mpiexec"), "-n", "2", *cmd])]
    else:
        runs = [Launch(cmd, {"SLURM_PROCID": str(r), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(r),
                             "SLURM_NODEID": "0", "SLURM_NNODES": "1", "SLURM_JOB_ID": "stranger"})
                for r in range(2)]
    for run in runs:
        run.proc.wait(timeout=120)
        run.kill([])
    out = runs[0].output
    assert all(run.proc.returncode == 0 for run in runs), out + runs[-1].output
    found = json.loads(out.split("STRANGER ", 1)[1].splitlines()[0])
    assert found["host"] == "127.0.0.1" and found["keys"], found
    assert all(re.match(r"[0-9a-f]{32}/", k) for k in found["keys"]), found["keys"]
    assert found["stranger_finds"] == [], found
    # the exposure rendezvous.py documents: TCPStore lists every key, prefix included, to any client
    assert sorted(found["stranger_lists"]) == sorted(found["keys"]), found
    assert found["other_addr_connects"] is not True, found
    assert found["files"] == [], found  # the address file (launchers without MPI) was removed after start-up
    record(f"a process outside the job connects to the rendezvous store ({launcher} rendezvous)",
           f"none of the job's {len(found['keys'])} keys under their plain names; no answer on {other}; "
           "address file gone", None, "mpi" if launcher == "mpi" else "unit")


# --- preemption signals during start-up ---------------------------------------------------------------------

def test_preemption_flag_before_torch() -> None:
    """The process's flag installs without importing torch (the `train` command installs it first thing), is
    the same object on every call, and flags USR2 and TERM instead of dying of them."""
    code = """
import os, signal, sys
from hpctrain.job import preempt
flag = preempt.process_flag()
assert "torch" not in sys.modules, "preempt imported torch"
os.kill(os.getpid(), signal.SIGTERM)
os.kill(os.getpid(), signal.SIGUSR2)
assert preempt.process_flag() is flag and flag.received == signal.SIGUSR2, flag.received
assert flag.poll() is True  # no torch.distributed: this rank's own verdict
print("FLAGGED")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0 and "FLAGGED" in out.stdout, out.stdout + out.stderr
    record("USR2 and TERM to a process that installed the preemption flag (no torch imported)",
           "flagged, process lives on", None, "unit")


@pytest.mark.mpi
@pytest.mark.parametrize("sig, rank, point", [("SIGUSR2", 1, "rendezvous"), ("SIGTERM", 0, "ready")])
def test_preemption_during_startup(mpiexec, tmp_path, sig, rank, point) -> None:
    """A preemption signal to one rank before training starts (during the rendezvous, or once the mesh is up and
    the model is about to be built): no rank dies of it; the ranks agree to stop before the first step, and
    rank 0 asks for the requeue; no traceback anywhere."""
    root = tmp_path / "runs"
    launch = Launch(_mpi_train(root, "train.steps=20"), seam_env(SEAM_FAULT=f"{sig}:{rank}:{point}"))
    try:
        launch.proc.wait(timeout=120)
    finally:
        launch.kill([])
    out = launch.output
    assert launch.proc.returncode == 0, out[-3000:]
    assert "Traceback" not in out
    (run,) = root.iterdir()
    summary = json.loads((run / "summary.json").read_text())
    train = summary["train"]
    assert summary["ok"] and train["preempted"] and train["steps"] == 0, summary
    assert train["requeue"] == "not a Slurm job: nothing to requeue (rerun the same command to resume)"
    assert f"received {sig}" in (run / "logs" / f"rank{rank:05d}.log").read_text() + out
    record(f"{sig} to rank {rank} during start-up ({point}; mpiexec -n 2)",
           "flagged; both ranks stop before the first step, rank 0 requeues; exit 0, no traceback", None, "mpi")
