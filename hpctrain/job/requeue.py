"""After a hang, the Slurm job goes on without the suspect nodes: the first rank whose watchdog tripped, once every
live rank has dumped, asks `hpctrain diagnose` who stopped the job. Ranks that left no dump (stopped, dead, stuck
in the kernel; a rank whose answer reached the first rank through the job's store, hang/acks.json, dumped even
where a shared file system does not show its files yet) make their nodes suspect; the job is requeued without
them (preempt.requeue_excluding, as the preflight does) and resumes from its last committed checkpoint, at most
job.hang_requeues times per run. A culprit
that was alive and busy (it dumped its stack: a bug, a deadlock in code) is not a node's fault: the job just ends.

    why = after_hang(run_dir, limit=1, num_nodes=2)   # one line; RUN_DIR/hang.jsonl records every hang's outcome

hang.jsonl is read as untrusted (bounded, typed): a history that cannot be read allows no more requeues.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from hpctrain.hang import diagnose
from hpctrain.job import preempt
from hpctrain.job.hostlist import compress
from hpctrain.untrusted import Untrusted, parse_json, read_bytes

HISTORY = "hang.jsonl"
MAX_HISTORY_BYTES = 1 << 20  # a row per hang, a few hundred bytes each


def requeues_in(path: Path) -> int:
    """How many rows of a requeue history (one JSON object per line with "requeued": true or false, as hang.jsonl
    and preflight.jsonl hold) say the job was requeued; 0 when there is none. Raises Untrusted, naming the file and
    line, for a history that is not one (a link, too large, a row of another shape)."""
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


def after_hang(run_dir: str | Path, limit: int, num_nodes: int) -> str:
    """Requeues the job without the nodes of the ranks that left no hang dump, when it may; says what happened in
    one line and appends it to RUN_DIR/hang.jsonl. Never raises (the caller ends the job next)."""
    run_dir = Path(run_dir)
    history = run_dir / HISTORY
    unreadable = None
    try:
        before = requeues_in(history)
    except Untrusted as e:
        before, unreadable = limit, str(e)  # a history we cannot read: no more requeues
    record = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "restart": os.environ.get("SLURM_RESTART_COUNT", "0"),
              "requeued": False, "culprits": [], "nodes": []}
    try:
        report = diagnose.diagnose(run_dir, history=False)  # the job is ending: culprits only
        record["culprits"] = [{k: c[k] for k in ("rank", "node", "step", "phase", "dumped")}
                              for c in report["culprits"]]
        silent = sorted({c["node"] for c in report["culprits"] if not c["dumped"] and c["node"]})
        record["nodes"] = silent
        job = preempt.slurm_job_id()
        if not job:
            why = "not a Slurm job: not requeued (resubmit to resume from the last checkpoint)"
        elif unreadable:
            why = f"not requeued: {unreadable} (a history that cannot be read allows no more requeues)"
        elif before >= limit:
            why = f"not requeued: job.hang_requeues = {limit}, and this run was requeued after {before} hang(s)"
        elif not silent:
            why = ("not requeued: every culprit was alive and left its stack (a fault of the program, not of a "
                   "node: a requeue would hang again)")
        else:
            already = preempt.excluded_nodes(job)
            usable = preempt.usable_nodes(os.environ.get("SLURM_JOB_PARTITION", ""))
            if isinstance(already, str) or isinstance(usable, str):
                why = f"not requeued: {already if isinstance(already, str) else usable}"
            else:
                exclude, why = plan_requeue(silent, already, usable, num_nodes, 0)
                if exclude is None:
                    why = f"not requeued: {why}"
                else:
                    record["requeued"], why = preempt.requeue_excluding(exclude)
    except Exception as e:  # noqa: BLE001 - the job must end whatever this meets
        why = f"not requeued: {type(e).__name__}: {e}"
    record["why"] = why
    try:  # appended, never through a link
        fd = os.open(history, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(record) + "\n")
    except OSError:
        pass
    return why


MAX_REQUEUES = 3  # preflight requeues of one job; the excluded list only grows, this also bounds a failed update


def plan_requeue(failed: list[str], already: list[str], usable: list[str], needed: int,
                 requeued_before: int) -> tuple[list[str] | None, str]:
    """The one requeue policy, for a preflight's failed nodes and a hang's silent ones: (the job's new excluded
    list, why), or (None, why) when it must fail instead: nothing to exclude, too few usable nodes left in the
    partition for the job, or the job requeued MAX_REQUEUES times already."""
    if not failed:
        return None, "no failed check names a node to exclude"
    if requeued_before >= MAX_REQUEUES:
        return None, f"the preflight requeued this job {requeued_before} times already (at most {MAX_REQUEUES})"
    exclude = list(dict.fromkeys(already + failed))
    left = [n for n in usable if n not in exclude]
    if len(left) < needed:
        return None, (f"excluding {compress(exclude)} would leave {len(left)} usable node(s) of the partition "
                      f"({compress(left) or 'none'}) for a {needed}-node job")
    return exclude, f"requeued without {compress(exclude)}"
