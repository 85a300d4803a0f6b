"""How a failed launch ends: every rank gone within seconds, and the launcher told why.

    ending.wait_if_ending()        # a failure path: the hang watchdog, if it is ending the job, goes first
    ending.leave_task_error(text)  # inside a submitit task: the error result `submit --wait` reports
    ending.abort_launch(1)         # MPI_Abort under MPI (every rank of the launch); returns without MPI

Used by the command wrapper of hpctrain.cli.main, the session's teardown and the hang watchdog. Imports nothing of
hpctrain; mpi4py only where this process already started MPI, submitit only inside a submitit task.
"""
from __future__ import annotations

import os
import sys
import threading
import time

from hpctrain.hostprobe import mpi_running

# Set by the hang watchdog (hpctrain/hang/watchdog.py) while it ends the job: a failure of the main thread meanwhile
# (a collective timing out during the watchdog's grace period) leaves the ending to it, so every rank dumps first.
ENDING = threading.Event()


def wait_if_ending(limit_s: float = 120.0) -> None:
    """Called on a failure path before it ends the launch: waits while the hang watchdog ends it instead."""
    if ENDING.is_set():
        time.sleep(limit_s)


def leave_task_error(trace: str) -> None:
    """Inside a submitit task: its error result, as submitit writes it when a task raises. A rank that ends its
    launch with MPI_Abort never returns to submitit, and `wait` would otherwise wait for a result that never comes."""
    if "SUBMITIT_FOLDER" not in os.environ:  # set by submitit's task runner only
        return
    import submitit
    from submitit.core import utils

    with utils.temporary_save_path(submitit.JobEnvironment().paths.result_pickle) as tmp:
        utils.cloudpickle_dump(("error", trace), tmp)


def abort_launch(code: int = 1) -> None:
    """Ends every rank of this MPI launch now (MPI_Abort); returns without MPI.

    A failed rank must not exit normally under MPI: mpi4py's exit hook calls MPI_Finalize, which waits for peers
    that may be stuck in a collective or stopped, and the job would hold its nodes until the time limit."""
    if mpi_running():
        comm = sys.modules["mpi4py.MPI"].COMM_WORLD
        sys.stdout.flush()
        # said by us, flushed: MPICH's own "application called MPI_Abort" line can be lost when the launcher kills
        # the ranks first (seen once under load)
        print(f"hpctrain: rank {comm.Get_rank()} failed: MPI_Abort ends the launch", file=sys.stderr, flush=True)
        # flushed is not forwarded: mpiexec's proxy reads our pipe on its own schedule, and the abort kills it first
        # (the line, and the traceback before it, went missing under load); half a second lets it drain
        time.sleep(0.5)
        comm.Abort(code)
