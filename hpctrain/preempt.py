"""Preemption: Slurm's warning signal (USR2, as submitit asks sbatch for; SIGTERM where sites send that) sets a
flag; the ranks agree on it at the next step boundary with one all-reduce, save, and rank 0 requeues the job,
unless Slurm is ending it already (a user's plain scancel also sends SIGTERM: see requeue()).

    flag = process_flag()              # first thing in the rank: installs the handlers (replacing submitit's)
    if flag.poll(device):                # collective: every rank calls it after the same step
        ...save, then requeue()...

The flag is the process's, installed before torch is even imported (this module imports it only to poll): a
signal during imports, rendezvous, model build or resume is kept for the trainer's first poll instead of killing
the rank. session.start hands it to the payload as Session.preempt.
"""
from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
from typing import TYPE_CHECKING, Any

from hpctrain.hostlist import compress, expand

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGUSR2, signal.SIGTERM)
_process_flag: PreemptionFlag | None = None


class PreemptionFlag:
    def __init__(self, signals=SIGNALS) -> None:
        self.received: int | None = None
        self.signals = signals
        self.previous: dict[int, Any] = {}
        self.install()

    def install(self) -> None:
        """Takes the signals (again, after a restore() or another handler took them)."""
        for sig in self.signals:
            current = signal.getsignal(sig)
            if current != self._handler:
                self.previous[sig] = current
                signal.signal(sig, self._handler)

    def _handler(self, signum, frame) -> None:
        # only set a flag: saving inside a signal handler could interleave with a collective in flight
        if self.received is None:
            log.warning("received %s: will checkpoint and stop at the next step boundary",
                        signal.Signals(signum).name)
        self.received = signum

    def poll(self, device: torch.device | None = None) -> bool:
        """Whether any rank got a signal: the same answer on every rank. Collective (one all-reduce): every rank
        calls it after the same step. device: the trainer passes the rank's, so on GPUs the flag rides NCCL (no
        TCP round trip per step); None works too (gloo beside NCCL serves host tensors)."""
        import torch
        import torch.distributed as dist

        t = torch.tensor([float(self.received is not None)], device=device)
        if dist.is_initialized():
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item() > 0)

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def clear(self) -> None:
        """Forgets a signal that was acted on (a process that runs several sessions in turn starts each clean)."""
        self.received = None


def process_flag() -> PreemptionFlag:
    """The process's flag, installed on the first call (signal handlers belong to the whole process): the
    `train` command calls it before anything else, session.start again for other entry points."""
    global _process_flag
    if _process_flag is None:
        _process_flag = PreemptionFlag()
    _process_flag.install()
    return _process_flag


def _scontrol(*args: str, ignore_term: bool = False) -> subprocess.CompletedProcess | str:
    """scontrol's answer, or why there was none (not on PATH, not runnable, no answer in 60 s). ignore_term: the
    command starts with SIGTERM ignored (set by a shell trap and kept across exec; a handler would not be), so the
    SIGTERM Slurm sends the job's processes at a requeue does not kill it; from any thread (the hang watchdog's
    too), since this process's own handlers are left alone."""
    cmd = ["scontrol", *args]
    if ignore_term:
        cmd = ["sh", "-c", 'trap "" TERM; exec scontrol "$@"', "scontrol", *args]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        return "no scontrol on PATH (a container without the Slurm client?)"
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"scontrol {' '.join(args)} failed: {e}"
    if ignore_term and out.returncode == 127:  # the shell's "not found"
        return "no scontrol on PATH (a container without the Slurm client?)"
    return out


def slurm_job_id() -> str | None:
    """This process's Slurm job as scontrol names it (an array task as <array job>_<task>), None outside Slurm."""
    env = os.environ
    if env.get("SLURM_ARRAY_JOB_ID"):
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return env.get("SLURM_JOB_ID")


def requeue(ignore_term: bool = False) -> str:
    """Puts this Slurm job back in the queue (it restarts with the same job id and run directory) unless Slurm is
    ending it already; returns one line saying what happened (the caller logs it, after the checkpoint is
    committed, so nothing here may raise).

    Requeued only while the job is RUNNING. Measured on Slurm 22.05: a plain `scancel` marks the job COMPLETING
    before its tasks get SIGTERM (so does the time limit, with Reason=TimeLimit), and `scontrol requeue` of a
    COMPLETING job succeeds and runs it again: the user's cancel would be undone. A preemption leaves the job
    RUNNING through its GraceTime (SIGTERM, or the --signal USR2 with preempt_send_user_signal), and so do
    `scancel --signal=USR2` and the time limit's USR2@signal_delay_s warning."""
    job = slurm_job_id()
    if not job:
        return "not a Slurm job: nothing to requeue (rerun the same command to resume)"
    resume = "submit the same config with train.resume=<run dir> to resume from the committed checkpoint"
    show = _scontrol("show", "job", "-o", job, ignore_term=ignore_term)
    if isinstance(show, str) or show.returncode:
        why = show if isinstance(show, str) else f"scontrol show job {job}: {show.stderr.strip()}"
        return f"job {job} not requeued: {why}; {resume}"
    # first match: later fields (Comment, Command, WorkDir) may hold anything
    state, reason = (m.group(1) if (m := re.search(rf"\b{key}=(\S+)", show.stdout)) else "?"
                     for key in ("JobState", "Reason"))
    if state != "RUNNING":
        return (f"job {job} not requeued: Slurm is ending it (JobState={state} Reason={reason}: a user's scancel, "
                f"or the time limit); {resume}")
    out = _scontrol("requeue", job, ignore_term=ignore_term)
    if isinstance(out, str) or out.returncode:
        why = out if isinstance(out, str) else out.stderr.strip()
        return f"job {job} not requeued: scontrol requeue {job} failed: {why}; {resume}"
    return f"requeued job {job}"


def _job_field(job: str, key: str) -> str:
    """One field of `scontrol show job -o` (the first match: later fields such as Comment may hold anything)."""
    show = _scontrol("show", "job", "-o", job)
    if isinstance(show, str) or show.returncode:
        raise OSError(show if isinstance(show, str) else f"scontrol show job {job}: {show.stderr.strip()}")
    m = re.search(rf"\b{key}=(\S*)", show.stdout)
    return m.group(1) if m else ""


def excluded_nodes(job: str) -> list[str] | str:
    """The nodes the job may not run on (its ExcNodeList), or why they cannot be read."""
    try:
        return expand(_job_field(job, "ExcNodeList"))
    except (OSError, ValueError) as e:
        return f"job {job}: cannot read its excluded nodes: {e}"


USABLE_STATES = ("idle", "mixed", "allocated", "completing", "planned")  # others: down, drained, failing


def usable_nodes(partition: str) -> list[str] | str:
    """The partition's nodes that can run jobs (busy ones included), or why they cannot be listed."""
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-p", partition, "-o", "%N %T"], capture_output=True, text=True,
                             timeout=60, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"cannot list the nodes of partition {partition!r}: {e}"
    if out.returncode:
        return f"sinfo -p {partition}: {out.stderr.strip()}"
    rows = [line.split() for line in out.stdout.splitlines() if len(line.split()) == 2]
    return list(dict.fromkeys(name for name, state in rows if state in USABLE_STATES))


def requeue_excluding(nodes: list[str]) -> tuple[bool, str]:
    """Requeues this running job (requeue(): only while it is RUNNING) with ExcNodeList = nodes; (requeued, one line
    saying what happened). Measured on Slurm 22.05: ExcNodeList is refused on a running job ("Job is no longer
    pending execution") but accepted right after `scontrol requeue`, while the job is COMPLETING, and it cannot start
    again before this process, one of its own, has ended: so requeue, then update, with no window. Slurm sends the
    job's processes SIGTERM at the requeue: the scontrol commands start with it ignored, or the update would die
    with them (seen); this process keeps its handlers (the preemption flag takes the signal), so any thread may
    call it (the hang watchdog does). Not `requeuehold` + `release`: a release that came too early, or died so,
    left the job held for good (seen). If the update fails the job runs again, maybe on the same node: the caller
    bounds the requeues. Here the job ran again on another node ~15 s later (cred_expire=10)."""
    job = slurm_job_id()
    said = requeue(ignore_term=True)
    if said != f"requeued job {job}":
        return False, said
    excl = compress(nodes)
    update = _scontrol("update", f"JobId={job}", f"ExcNodeList={excl}", ignore_term=True)
    if isinstance(update, str) or update.returncode:
        why = update if isinstance(update, str) else update.stderr.strip() or f"exit status {update.returncode}"
        return True, f"requeued job {job}, but scontrol update ExcNodeList={excl} failed: {why}"
    return True, f"requeued job {job} without {excl} (ExcNodeList={excl})"
