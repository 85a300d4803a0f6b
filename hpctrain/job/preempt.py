"""Preemption: Slurm's warning signal (USR2, as submitit asks sbatch for; SIGTERM where sites send that) sets a
flag; the ranks agree on it at the next step boundary with one all-reduce, save, and rank 0 requeues the job,
unless Slurm is ending it already (a user's plain scancel also sends SIGTERM: see requeue()).

    flag = process_flag()              # first thing in the process: installs the handlers (replacing submitit's)
    flag.end_on_signal(command != "train")   # once the command is known (hpctrain/cli/main.py's group)
    if flag.poll(device):                # collective: every rank calls it after the same step
        ...save, then requeue()...

The flag is the process's, installed before anything heavy is imported (the `hpctrain` console script,
hpctrain/entry.py, and `python -m hpctrain.cli` install it first; this module imports torch only to poll): a
signal during the imports, rendezvous, model build or resume is kept instead of killing the process. What it
means is decided once the command is known: for `train` a preemption, kept for the trainer's first poll
(session.start hands the flag to the payload as Session.preempt); every other command ends on it (Ended, raised
in the main thread: `finally` blocks run, the exit status is 128 + the signal's number), at once if it came
during the imports.
"""
from __future__ import annotations

import logging
import os
import re
import signal
from typing import TYPE_CHECKING, Any

from hpctrain.job.hostlist import compress, expand

if TYPE_CHECKING:
    import subprocess

    import torch

# subprocess is imported where scontrol and sinfo run: this module is the first the `hpctrain` command imports, and
# every millisecond before process_flag() is one in which a signal kills the process

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGUSR2, signal.SIGTERM)
_process_flag: PreemptionFlag | None = None


class Ended(SystemExit):
    """A signal to a command that is not a training job, raised in the main thread: it unwinds (finally blocks and
    context managers clean up) and the process exits with 128 + the signal's number, as a shell reports a process
    the signal killed (143 for SIGTERM)."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum

    def __str__(self) -> str:
        return f"ended by {signal.Signals(self.signum).name}"


class PreemptionFlag:
    def __init__(self, signals=SIGNALS) -> None:
        self.received: int | None = None
        self.signals = signals
        self.previous: dict[int, Any] = {}
        # what a signal means: None until the command is known (kept, as a preemption), False a preemption (kept
        # for poll()), True the end of the process (Ended; SIGINT taken too, for one way of ending)
        self.ends: bool | None = None
        self.ended = False  # Ended was raised: the process is unwinding, later signals wait for it
        self.install()

    def _taken(self) -> tuple[int, ...]:
        return (*self.signals, signal.SIGINT) if self.ends and self.signals else self.signals

    def install(self) -> None:
        """Takes the signals (again, after a restore() or another handler took them)."""
        for sig in self._taken():
            current = signal.getsignal(sig)
            if current != self._handler:
                self.previous[sig] = current
                signal.signal(sig, self._handler)

    def end_on_signal(self, ends: bool = True) -> None:
        """What a signal means from now on. ends=True (every command but `train`): the end of the process, as
        Ended raised in the main thread; one received before (during the imports) ends it now. False: a
        preemption, kept for poll(); SIGINT is given back."""
        if not ends and signal.SIGINT in self.previous and signal.SIGINT not in self.signals:
            signal.signal(signal.SIGINT, self.previous.pop(signal.SIGINT))
        self.ends = ends
        self.install()
        if ends and self.received is not None:
            self._end(self.received)

    def _end(self, signum: int) -> None:
        self.ended = True
        log.warning("received %s: ending (this command is not a training job)", signal.Signals(signum).name)
        raise Ended(signum)

    def _handler(self, signum, frame) -> None:
        if self.ends:
            if not self.ended:  # a second signal must not break off the clean-up of the first
                self._end(signum)
            return
        # only set a flag: saving inside a signal handler could interleave with a collective in flight
        if self.received is None:
            log.warning("received %s: %s", signal.Signals(signum).name,
                        "will checkpoint and stop at the next step boundary" if self.ends is False else
                        "kept: a preemption if this process trains, else its end")
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
        """Gives the signals back to the handlers they had before; what a signal means is undecided again."""
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous.clear()
        self.ends, self.ended = None, False

    def clear(self) -> None:
        """Forgets a signal that was acted on (a process that runs several sessions in turn starts each clean)."""
        self.received = None


def process_flag() -> PreemptionFlag:
    """The process's flag, installed on the first call (signal handlers belong to the whole process): the
    `hpctrain` command calls it before anything else, session.start again for other entry points."""
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
    import subprocess

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
    import subprocess

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
