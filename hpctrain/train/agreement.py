"""What every rank must agree on after a step, agreed without the host waiting for the device: whether any rank got
a preemption signal, whether SAVE_NOW appeared (rank 0 looks) and whether any rank's background save is still
writing. One all-reduce (MAX) of the three flags per step, read one step late:

    agree = StepAgreement(device, hb, local)    # local() -> this rank's (preempted, save_now, writing)
    ...after step N: flags = agree.receive()      # what the ranks sent after step N - 1 (Flags() before any)
                     ...act on flags (save, stop)...
                     agree.send(N)                # this rank's, for the next step to read
    ...at the end:   agree.finish()               # the last flags sent, read at once (Flags() if none)

The host that reads a device value waits for every kernel queued before it: read at once, the agreement of step N
would wait for step N's last kernel before the host could queue step N + 1's first (the device idles meanwhile).
Sent after step N and read after step N + 1 has been queued, the flags wait only for the point of the stream where
step N ended. On a GPU the flags go up from pinned memory and come back into it (non-blocking copies on the
current stream, which waits for NCCL's, not the host); the host then waits on an event recorded after the copy. On
a CPU (gloo) the all-reduce runs asynchronously and the host waits for it when it reads.

The cost is one step of latency: a signal that arrives during step N is acted on after step N + 1 (the save is
of step N + 1); the end of training reads the last flags at once (finish()).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Flags:
    """The flags of every rank after step `sent_at`, reduced (any rank's)."""
    preempt: bool = False
    save_now: bool = False
    writing: bool = False
    sent_at: int | None = None  # None: nothing was sent yet

    @property
    def requests(self) -> tuple[bool, bool]:
        """(save_now, writing), as Checkpointer.maybe_save takes them."""
        return self.save_now, self.writing


class StepAgreement:
    """hb: the heartbeat whose phase says where a rank waits (hang forensics); local(): this rank's flags."""

    def __init__(self, device: torch.device, hb, local: Callable[[], tuple[bool, bool, bool]], group=None) -> None:
        self.device, self.hb, self.local, self.group = device, hb, local, group
        self.pending: tuple | None = None  # (step, work, tensor read on the host, event)

    def send(self, step: int) -> None:
        """Starts the all-reduce of this rank's flags after `step` (collective: every rank sends after the same
        step). Call receive() before the next send."""
        if self.pending is not None:
            raise RuntimeError(f"the flags of step {self.pending[0]} were never received")
        self.hb.enter("collective", f"the ranks' flags after step {step} (preemption, checkpoints)")
        flags = self.local()
        cuda = self.device.type == "cuda"
        # from pinned memory, non_blocking: a copy from pageable memory would make the host wait for the stream
        t = torch.tensor([float(f) for f in flags], pin_memory=cuda).to(self.device, non_blocking=True)
        work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group, async_op=True) \
            if dist.is_initialized() else None
        if not cuda:
            self.pending = (step, work, t, None)
            return
        if work is not None:
            work.wait()  # NCCL: the current stream waits for the collective; the host goes on
        host = torch.empty(3, pin_memory=True)
        host.copy_(t, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self.pending = (step, None, host, event)

    def receive(self) -> Flags:
        """The flags sent after the previous step, on the host: waits for them only (on a GPU, for the stream up to
        where they were sent). Flags() when nothing was sent."""
        if self.pending is None:
            return Flags()
        step, work, t, event = self.pending
        self.hb.enter("collective", f"the ranks' flags of step {step} (preemption, checkpoints)")
        self.pending = None
        if work is not None:
            work.wait()
        if event is not None:
            event.synchronize()
        preempt, save_now, writing = (v > 0 for v in t.tolist())
        return Flags(preempt, save_now, writing, step)

    def finish(self) -> Flags:
        """The last flags sent, read at once (the end of training: nothing is queued behind them)."""
        return self.receive()
