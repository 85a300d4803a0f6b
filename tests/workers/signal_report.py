"""A task for tests/multiproc/job/test_entry_task.py, pickled by submitit: reports what the task's process did with the
signals it received before the task ran."""
from __future__ import annotations

import signal


def report() -> dict:
    from hpctrain.job import preempt

    flag = preempt.process_flag()
    handler = signal.getsignal(signal.SIGUSR2)
    return {"received": flag.received, "usr2_is_ours": getattr(handler, "__self__", None) is flag}
