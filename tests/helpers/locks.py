"""Checkpoint directory locks as another holder would have left them (hpctrain/checkpoint/lock.py's record)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

HOST = socket.gethostname()


def dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()  # reaped: a zombie would still answer kill(pid, 0)
    return p.pid


def write_lock(root: Path, **fields) -> bytes:
    """A checkpoint directory lock record (hpctrain/checkpoint/lock.py) held by this host and process unless
    fields say otherwise; returns its bytes."""
    from hpctrain.checkpoint.lock import NAME

    rec = {"host": socket.gethostname(), "pid": os.getpid(), "job_id": "", "restart": "0", "cluster": "",
           "started": "2026-01-01T00:00:00+00:00"} | fields
    root.mkdir(parents=True, exist_ok=True)
    data = json.dumps(rec).encode()
    (root / NAME).write_bytes(data)
    return data
