"""Hang files as ranks write them, and a watchdog under test in this process: run directories with heartbeats,
flight-recorder-shaped hang dumps, hang requests and metrics rows (what `hpctrain diagnose` reads; NODES is the
placement they describe), and `a_watchdog`, a watchdog over one heartbeat whose end of the job is recorded
instead of done.
"""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from hpctrain.hang import ending, watchdog
from hpctrain.hang.heartbeat import Heartbeat

NODES = ["n1", "n1", "n2", "n2"]  # tp=2 inside a node, dp=2 across: tp groups [0,1] [2,3], dp groups [0,2] [1,3]


def beat(run: Path, rank: int, step: int, phase: str, detail: str = "", **facts) -> Heartbeat:
    hb = Heartbeat(run, rank, {"host": "h" + NODES[rank], "node": NODES[rank],
                               "coords": {"pp": 0, "dp": rank // 2, "tp": rank % 2}, **facts})
    hb.begin_step(step)
    hb.enter(phase, detail)
    return hb


def entry(seq: int, desc: str, op: str = "all_reduce", retired: bool = True, t: int = 0) -> dict:
    return {"collective_seq_id": seq, "p2p_seq_id": 0, "is_p2p": False, "process_group": [str(seq), desc],
            "profiling_name": f"gloo:{op}", "retired": retired, "state": "scheduled", "time_created_ns": t,
            "input_sizes": [[4]]}


def dump(run: Path, hb: Heartbeat, entries: list[dict] | None) -> None:
    (run / "hang").mkdir(exist_ok=True)
    watchdog.dump_stacks(watchdog.hang_path(run, hb.rank), hb, "no progress for 9 s", 9.0)
    if entries is not None:
        watchdog.hang_path(run, hb.rank, ".fr.json").write_text(json.dumps({"fr": {"entries": entries}}))


def request(run: Path, rank: int) -> None:
    (run / "hang").mkdir(exist_ok=True)
    (run / "hang" / "request").write_text(json.dumps({"rank": rank, "reason": "no progress", "wall": time.time()}))


def stopped_rank_1(run: Path, fr: bool = True) -> None:
    """Rank 1 stopped in step 812's forward: its tp peer 0 waits in the tp all-reduce of that forward; ranks 2, 3
    wait in the dp gradient reduction, for 0 and 1 (they never got there)."""
    beat(run, 1, 812, "forward")
    history = ([entry(k, "mesh_tp", t=k) for k in range(1, 41)]
               + [entry(k, "mesh_dp", t=100 + k) for k in range(1, 10)])
    hb0 = beat(run, 0, 812, "forward")
    dump(run, hb0, history + [entry(41, "mesh_tp", retired=False, t=200)] if fr else None)
    for r in (2, 3):
        hb = beat(run, r, 812, "collective", "gradient reduction on dp")
        dump(run, hb, history + [entry(41, "mesh_tp", t=150), entry(10, "mesh_dp", retired=False, t=300)]
              if fr else None)
    request(run, 2)


def metrics(run: Path, rows: list[dict]) -> None:
    with (run / "metrics.jsonl").open("a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def log_row(step: int, slow: list[tuple[int, str, float]]) -> dict:
    """A log step's row as metrics.py writes it: the straggler report of the interval ending at `step`."""
    return {"step": step, "loss": 3.0, "rank_compute_s": [0.1] * 4, "rank_wait_s": [0.1] * 4,
            "stragglers": [{"rank": r, "host": h, "compute_s": 0.1 * (1 + e), "median_s": 0.1, "excess": e}
                           for r, h, e in slow]}


# --- a watchdog under test in this process ----------------------------------------------------------------------

def until_ended(ended: list[str], failure: str, limit_s: float = 20) -> float:
    """Waits for the watchdog under test to end the job; the seconds it took."""
    t0 = time.monotonic()
    while not ended:
        assert time.monotonic() - t0 < limit_s, failure
        time.sleep(0.05)
    return time.monotonic() - t0


# every watchdog a_watchdog made: tests/conftest.py stops them after each test, before its monkeypatch is undone.
# One left running kept looking after its test; at its long limit it called the real end_job, restored by then,
# which exits the process: the pytest worker, a minute later, in another test (seen: test_a_stop_during_a_look_is_a_
# freeze's, 60 s on, ended the worker running test_faults_ckpt.py, 'node down: Not properly terminated').
LIVE: list[watchdog.Watchdog] = []


def a_watchdog(tmp_path, monkeypatch, limits: watchdog.Limits, phase: str, step: int = 5):
    ended: list[str] = []
    monkeypatch.setattr(watchdog, "end_job", lambda peers, run_dir, message: ended.append(message))
    monkeypatch.setattr(ending, "ENDING", threading.Event())  # this process's own stays clear
    # a request "from another rank" here has no first rank behind it to say its requeue is done (hang/ended)
    monkeypatch.setattr(watchdog, "END_WAIT_S", 0.5)
    hb = Heartbeat(tmp_path, 2, {"node": "n1"})
    hb.begin_step(step)
    hb.enter(phase, "all_reduce of the loss on dp" if phase == "collective" else "")
    dog = watchdog.Watchdog(hb, tmp_path, limits)
    LIVE.append(dog)
    return dog, hb, ended
