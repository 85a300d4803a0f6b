"""`hpctrain doctor` on real processes: 4 gloo ranks with torchrun's variables, 2 "nodes" of 2 on this host, one
spawn running every case in turn (tests/workers/doctor_worker.py).

    PATH=$PWD/.venv/bin:$PATH .venv/bin/python -m pytest -q tests/multiproc/doctor/test_doctor_dist.py

A healthy run passes with every communicator measured (tp = intra, dp = inter, world), results checked, both
nodes' storage, clocks and environment; a node measuring 100x slower by the test seam (SEAM_DOCTOR_SLOW) fails and
is named in the --exclude= line on every rank; job.preflight with that node, outside Slurm, fails the training job
with the table before any model is built, and passes a healthy one into training; a preemption signal stops
the preflight on every rank and the training job requeues without training, as it would before its first step.
The test runs beside others: every verdict fails a value only below 0.05 x its peers' median (margins 0.95: the
doctor's rules, job.preflight_margin), which the seam's 100x crosses and this host's load does not.
"""
from __future__ import annotations

import json
from pathlib import Path

from faults import record

from helpers.launch import spawn_cases

WIDE = {"margin": 0.95, "storage_margin": 0.95}
PREFLIGHT = ["job.preflight=true", "job.preflight_margin=0.95"]
CASES = [
    {"name": "healthy", "kind": "doctor", "rules": WIDE},
    {"name": "slowed", "kind": "doctor", "slow": "node1:100", "rules": WIDE},
    {"name": "preflight_slowed", "kind": "train", "slow": "node0:100", "sets": PREFLIGHT},
    {"name": "preflight_healthy", "kind": "train", "sets": PREFLIGHT},
    {"name": "preflight_preempted", "kind": "train", "sets": PREFLIGHT, "preempt": 1},
]


def _seen(out: Path, name: str) -> list[dict]:
    return [json.loads((out / f"{name}-rank{r}.json").read_text()) for r in range(4)]


def test_doctor_on_four_ranks(tmp_path) -> None:
    spawn_cases("doctor_worker.py", tmp_path, CASES, run_id="doctor", world=4, ranks_per_node=2)

    healthy = _seen(tmp_path, "healthy")
    assert all(h["ok"] and h["exclude"] is None for h in healthy), (healthy[0]["fails"], [
        (n["node"], n["storage"]) for n in healthy[0]["nodes"]])
    h = healthy[0]
    assert [(g["axis"], g["aliases"], g["members"]) for g in h["groups"]] == [
        ("tp", ["intra"], [0, 1]), ("tp", ["intra"], [2, 3]), ("dp", ["inter"], [0, 2]), ("dp", ["inter"], [1, 3]),
        ("world", [], [0, 1, 2, 3])]
    assert all(g["wrong"] == 0 and all(bw > 0 for bw in g["busbw"].values()) for g in h["groups"])
    assert [n["node"] for n in h["nodes"]] == ["node0", "node1"]
    assert all(n["storage"]["write_gbps"] > 0 and n["storage"]["read_gbps"] > 0 for n in h["nodes"])
    assert all(abs(n["clock"]["offset_ms"]) < 50 for n in h["nodes"])  # one host, one clock
    # the doctor's duration is recorded, not judged (no test judges a speed; the test's own deadline bounds a hang)
    assert h["job"]["elapsed_s"] > 0 and (Path(h["run_dir"]) / "doctor.json").is_file()

    slowed = _seen(tmp_path, "slowed")
    assert all(s["failed_nodes"] == ["node1"] and s["exclude"] == "--exclude=node1" for s in slowed), slowed[0]
    record("a node measuring 100x slower (SEAM_DOCTOR_SLOW), 4 ranks on 2 nodes",
           "hpctrain doctor fails it by the median and names it in its --exclude= line on every rank", tier="unit")

    failing = _seen(tmp_path, "preflight_slowed")
    for f in failing:
        assert "preflight failed: not a Slurm job: not requeued" in f.get("raised", ""), f
        assert "--exclude=node0" in f["raised"] and "FAIL gemm rank 0 on node0" in f["raised"]
    assert not list((tmp_path / "preflight_slowed").glob("*/metrics.jsonl"))  # failed before any training step
    record("job.preflight with a node measuring 100x slower, outside Slurm",
           "the training job fails on every rank with the table and its --exclude= line before the model is built",
           tier="unit")

    passing = _seen(tmp_path, "preflight_healthy")
    assert all(p["summary"]["doctor"]["ok"] and p["summary"]["train"]["steps"] == 2 for p in passing), passing[0]

    preempted = _seen(tmp_path, "preflight_preempted")
    for p in preempted:  # stopped at the preflight's first round, on every rank; no model built, nothing trained
        assert p["summary"]["preflight"]["preempted"] and "train" not in p["summary"] and "doctor" not in p[
            "summary"], p["summary"]
    assert preempted[0]["summary"]["preflight"]["requeue"].startswith("not a Slurm job: nothing to requeue")
    record("USR2 to rank 1 of a training job with job.preflight, before the preflight (4 ranks, 2 nodes)",
           "every rank stops the preflight after its first round and trains nothing; rank 0 asks for the requeue",
           tier="unit")
