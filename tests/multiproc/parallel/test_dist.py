"""Multi-process tier: 4 real processes on gloo, identity from torchrun's variables, 2 "nodes" of 2 ranks.

Each layout's group checks (one-hot all-reduce on world, pp, dp, tp) must pass, and the groups
recorded in summary.json must be the ones the rank arithmetic predicts. A layout whose tp group crosses the
node boundary must be refused on every rank with the same message, not hang.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from helpers.launch import EXAMPLE, WORKERS, free_base_port, spawn_ranks
from helpers.runs import read_summary

CASES = [
    ("tp2dp2", ["parallel.pp=1", "parallel.tp=2", "parallel.dp=2"]),
    ("pp2tp2", ["parallel.pp=2", "parallel.tp=2", "parallel.dp=1"]),
    ("pp2dp2", ["parallel.pp=2", "parallel.tp=1", "parallel.dp=-1"]),
    ("dp4", ["parallel.tp=1"]),
    ("tp4_refused", ["parallel.tp=4"]),
]

EXPECTED = {
    "tp2dp2": {"tp": [[0, 1], [2, 3]], "dp": [[0, 2], [1, 3]], "pp": [[0], [1], [2], [3]]},
    "pp2tp2": {"tp": [[0, 1], [2, 3]], "dp": [[0], [1], [2], [3]], "pp": [[0, 2], [1, 3]]},
    "pp2dp2": {"tp": [[0], [1], [2], [3]], "dp": [[0, 1], [2, 3]], "pp": [[0, 2], [1, 3]]},
    "dp4": {"tp": [[0], [1], [2], [3]], "dp": [[0, 1, 2, 3]], "pp": [[0], [1], [2], [3]]},
}


def test_four_ranks_two_nodes(tmp_path: Path) -> None:
    base = free_base_port(len(CASES))
    cmd = [sys.executable, str(WORKERS / "dist_worker.py"), str(tmp_path), str(EXAMPLE), str(base),
           json.dumps(CASES)]
    procs = spawn_ranks(4, cmd, ranks_per_node=2, run_id="test-dist")
    outs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, "\n".join(outs)
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]

    for name, groups in EXPECTED.items():
        assert all(rec[name] == {"ok": True} for rec in records), (name, records)
        summary = read_summary(tmp_path / name)
        assert summary["ok"] and summary["launcher"] == "torchrun" and summary["num_nodes"] == 2
        got = summary["checks"]["groups"]
        for axis, expected in groups.items():
            assert got[axis] == expected, (name, axis, got[axis])
        assert "intra" not in got and "inter" not in got  # training builds no per-node groups
        assert [row["node_index"] for row in summary["rank_map"]] == [0, 0, 1, 1]
        assert [row["local_rank"] for row in summary["rank_map"]] == [0, 1, 0, 1]

    errors = {rec["tp4_refused"].get("error") for rec in records}
    assert len(errors) == 1, errors  # every rank refused, with the same words
    (msg,) = errors
    assert msg and "tp(4)" in msg and "2 ranks per node" in msg
    assert read_summary(tmp_path / "tp4_refused")["ok"] is False
