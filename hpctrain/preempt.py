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


def _scontrol(*args: str) -> subprocess.CompletedProcess | str:
    """scontrol's answer, or why there was none (not on PATH, not runnable, no answer in 60 s)."""
    try:
        return subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=60,
                              stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        return "no scontrol on PATH (a container without the Slurm client?)"
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"scontrol {' '.join(args)} failed: {e}"


def requeue() -> str:
    """Puts this Slurm job back in the queue (it restarts with the same job id and run directory) unless Slurm is
    ending it already; returns one line saying what happened (the caller logs it, after the checkpoint is
    committed, so nothing here may raise).

    Requeued only while the job is RUNNING. Measured on Slurm 22.05: a plain `scancel` marks the job COMPLETING
    before its tasks get SIGTERM (so does the time limit, with Reason=TimeLimit), and `scontrol requeue` of a
    COMPLETING job succeeds and runs it again: the user's cancel would be undone. A preemption leaves the job
    RUNNING through its GraceTime (SIGTERM, or the --signal USR2 with preempt_send_user_signal), and so do
    `scancel --signal=USR2` and the time limit's USR2@signal_delay_s warning."""
    job = os.environ.get("SLURM_ARRAY_JOB_ID") and (
        f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}") or os.environ.get("SLURM_JOB_ID")
    if not job:
        return "not a Slurm job: nothing to requeue (rerun the same command to resume)"
    resume = "submit the same config with train.resume=<run dir> to resume from the committed checkpoint"
    show = _scontrol("show", "job", "-o", job)
    if isinstance(show, str) or show.returncode:
        why = show if isinstance(show, str) else f"scontrol show job {job}: {show.stderr.strip()}"
        return f"job {job} not requeued: {why}; {resume}"
    # first match: later fields (Comment, Command, WorkDir) may hold anything
    state, reason = (m.group(1) if (m := re.search(rf"\b{key}=(\S+)", show.stdout)) else "?"
                     for key in ("JobState", "Reason"))
    if state != "RUNNING":
        return (f"job {job} not requeued: Slurm is ending it (JobState={state} Reason={reason}: a user's scancel, "
                f"or the time limit); {resume}")
    out = _scontrol("requeue", job)
    if isinstance(out, str) or out.returncode:
        why = out if isinstance(out, str) else out.stderr.strip()
        return f"job {job} not requeued: scontrol requeue {job} failed: {why}; {resume}"
    return f"requeued job {job}"
