"""The one requeue policy: a Slurm job goes on without its bad nodes. Two causes ask for it: a failed preflight
(job.preflight: the doctor's checks name the failed nodes) and a hang (the ranks that left no hang dump: stopped,
dead, stuck in the kernel; a rank whose answer reached the first rank through the job's store, hang/acks.json,
dumped even where a shared file system does not show its files yet). Both go through requeue_without(): one
history, RUN_DIR/requeues.jsonl (a row per attempt, its cause, what was excluded and why), and one limit,
job.node_requeues, counted over both causes. The job is requeued with the nodes added to its excluded list
(preempt.requeue_excluding) and resumes from its last committed checkpoint. A hang's culprit that was alive and
busy (it dumped its stack: a bug, a deadlock in code) is not a node's fault: the job just ends.

    requeued, why = requeue_without(["n2"], run_dir, limit=2, num_nodes=2)   # the preflight's call
    why = after_hang(run_dir, limit=2, num_nodes=2)                            # the hang watchdog's, never raises

requeues.jsonl is read as untrusted (bounded, typed): a history that cannot be read allows no more requeues.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from hpctrain.hang import diagnose
from hpctrain.job import preempt
from hpctrain.job.hostlist import compress
from hpctrain.untrusted import Untrusted, parse_json, read_bytes

HISTORY = "requeues.jsonl"
MAX_HISTORY_BYTES = 1 << 20  # a row per attempt, a few hundred bytes each


def requeues_in(path: Path) -> int:
    """How many rows of the requeue history (one JSON object per line with "requeued": true or false) say the job
    was requeued; 0 when there is none. Raises Untrusted, naming the file and line, for a history that is not one
    (a link, too large, a row of another shape)."""
    if not os.path.lexists(path):
        return 0
    count = 0
    for i, line in enumerate(read_bytes(path, MAX_HISTORY_BYTES).splitlines(), 1):
        if not line.strip():
            continue
        row = parse_json(line, f"{path.name} line {i}")
        if not isinstance(row, dict) or not isinstance(row.get("requeued"), bool):
            raise Untrusted(f"{path.name} line {i}: not a row with \"requeued\": true or false")
        count += row["requeued"]
    return count


def record(run_dir: Path, row: dict[str, Any]) -> None:
    """Appends one row to RUN_DIR/requeues.jsonl, never through a link planted in its place (OSError)."""
    path = Path(run_dir) / HISTORY
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise OSError(f"cannot append to {path}: {e.strerror}") from None
    with os.fdopen(fd, "a") as f:
        f.write(json.dumps(row) + "\n")


def plan_requeue(failed: list[str], already: list[str], usable: list[str], needed: int, requeued_before: int,
                 limit: int) -> tuple[list[str] | None, str]:
    """The decision, pure: (the job's new excluded list, why), or (None, why) when the job must end instead:
    nothing to exclude, the job requeued `limit` times already (job.node_requeues), or too few usable nodes left
    in the partition for the job."""
    if not failed:
        return None, "no failed check names a node to exclude"
    if requeued_before >= limit:
        return None, (f"job.node_requeues = {limit}, and this job was requeued without bad nodes {requeued_before} "
                      f"time(s) already")
    exclude = list(dict.fromkeys(already + failed))
    left = [n for n in usable if n not in exclude]
    if len(left) < needed:
        return None, (f"excluding {compress(exclude)} would leave {len(left)} usable node(s) of the partition "
                      f"({compress(left) or 'none'}) for a {needed}-node job")
    return exclude, f"requeued without {compress(exclude)}"


def requeue_without(nodes: list[str], run_dir: Path, limit: int, num_nodes: int) -> tuple[bool, str]:
    """Rank 0: requeues the Slurm job with `nodes` added to its excluded ones, unless that leaves the partition too
    few usable nodes, or the job was requeued `limit` times already (RUN_DIR/requeues.jsonl counts them; a
    history that cannot be read requeues nothing). (requeued, why); the caller records the attempt."""
    try:
        before = requeues_in(Path(run_dir) / HISTORY)
    except Untrusted as e:
        return False, f"not requeued: {e} (a history that cannot be read allows no more requeues)"
    job = preempt.slurm_job_id()
    if not job:
        return False, "not a Slurm job: not requeued (resubmit to resume from the last checkpoint)"
    already = preempt.excluded_nodes(job)
    usable = preempt.usable_nodes(os.environ.get("SLURM_JOB_PARTITION", ""))
    if isinstance(already, str) or isinstance(usable, str):
        return False, f"not requeued: {already if isinstance(already, str) else usable}"
    exclude, why = plan_requeue(nodes, already, usable, num_nodes, before, limit)
    if exclude is None:
        return False, f"not requeued: {why}"
    return preempt.requeue_excluding(exclude)


def after_hang(run_dir: str | Path, limit: int, num_nodes: int) -> str:
    """Requeues the job without the nodes of the ranks that left no hang dump, when it may; says what happened in
    one line and records it in RUN_DIR/requeues.jsonl. Never raises (the caller ends the job next)."""
    run_dir = Path(run_dir)
    row = {"cause": "hang", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
           "restart": os.environ.get("SLURM_RESTART_COUNT", "0"), "requeued": False, "culprits": [], "nodes": []}
    try:
        report = diagnose.diagnose(run_dir, history=False)  # the job is ending: culprits only
        row["culprits"] = [{k: c[k] for k in ("rank", "node", "step", "phase", "dumped")}
                           for c in report["culprits"]]
        silent = sorted({c["node"] for c in report["culprits"] if not c["dumped"] and c["node"]})
        row["nodes"] = silent
        if silent:
            row["requeued"], why = requeue_without(silent, run_dir, limit, num_nodes)
        elif not preempt.slurm_job_id():
            why = "not a Slurm job: not requeued (resubmit to resume from the last checkpoint)"
        else:
            why = ("not requeued: every culprit was alive and left its stack (a fault of the program, not of a "
                   "node: a requeue would hang again)")
    except Exception as e:  # noqa: BLE001 - the job must end whatever this meets
        why = f"not requeued: {type(e).__name__}: {e}"
    row["why"] = why
    try:
        record(run_dir, row)
    except OSError:
        pass
    return why
