"""Runs a command and records its peak resident size, from a process small enough not to count in it: a child's
ru_maxrss keeps the resident size it had before exec, and a child forked from pytest starts as large as pytest.

    python tests/workers/peak_rss.py RESULT_JSON KILL_MB TIMEOUT_S CMD...

The command inherits stdout and stderr. It is killed when its resident size passes KILL_MB (sampled every 20 ms)
or after TIMEOUT_S. RESULT_JSON gets {"rc", "peak_mb" (the kernel's high-water mark, from wait4), "killed"}.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time


def resident_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def main(result: str, kill_mb: float, timeout_s: float, cmd: list[str]) -> None:
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
    deadline, killed = time.monotonic() + timeout_s, False
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if not killed and (resident_mb(proc.pid) > kill_mb or time.monotonic() > deadline):
            os.kill(proc.pid, signal.SIGKILL)
            killed = True
        time.sleep(0.02)
    proc.returncode = os.waitstatus_to_exitcode(status)
    with open(result, "w") as f:
        json.dump({"rc": proc.returncode, "peak_mb": usage.ru_maxrss / 1024, "killed": killed}, f)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4:])
