"""A step watchdog: a rank whose training loop makes no progress for `limit_s` dumps every thread's stack to its
log and ends the whole launch (MPI_Abort under MPI, else exit 1).

Why: gloo's collective timeout covers c10d calls, but a DTensor functional collective (e.g. the partial-norm
reduction inside the gradient norm under tensor parallel) was seen waiting past it for good when a peer was
stopped (SIGSTOP), so the job would have held its nodes until the time limit.

    dog = Watchdog(limit_s)    # a daemon thread
    dog.beat()                 # after every step
    dog.stop()
"""
from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time

log = logging.getLogger(__name__)


class Watchdog:
    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self.last = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="hpctrain-watchdog", daemon=True)
        self._thread.start()

    def beat(self) -> None:
        self.last = time.monotonic()

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(min(5.0, self.limit_s / 4)):
            idle = time.monotonic() - self.last
            if idle > self.limit_s:
                log.error("no training progress for %.0f s (limit %.0f s: parallel.timeout_s + 60): a peer is "
                          "stuck or stopped; stacks follow, then the launch is ended", idle, self.limit_s)
                for h in logging.getLogger().handlers:
                    h.flush()
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                from hpctrain import rendezvous
                rendezvous.abort_launch(1)  # returns without MPI
                os._exit(1)
