"""The planner's activation bytes per block are what the model keeps, counted: benchmarks/activation_memory.py's rows
at two ranks (tp=2 with and without sequence parallel, fp32 and bf16 autocast, recompute none, full, selective and
op; GPT's GeLU MLP; fused projections; bf16 weights through FSDP's mixed precision), each the bytes autograd (and
selective checkpointing's cache) keeps of block 0 of the real Trainer's model, against hpctrain.planner.activations.
Bytes, not times: deterministic.

    PATH=$PWD/.venv/bin:$PATH .venv/bin/python -m pytest -q tests/multiproc/planner/test_activation_counts.py
"""
from __future__ import annotations

import json
import subprocess
import sys

from helpers.launch import REPO, env_with_venv


def test_planner_counts_what_the_blocks_keep(tmp_path, mpiexec) -> None:
    subprocess.run([mpiexec, "-n", "2", sys.executable, str(REPO / "benchmarks" / "activation_memory.py"), "--world",
                    "--out", str(tmp_path), "--run-root", str(tmp_path / "runs")], cwd=REPO, env=env_with_venv(),
                   check=True, capture_output=True, timeout=600)
    rows = {r["name"]: r for r in json.loads((tmp_path / "activation_memory-2ranks.json").read_text())["rows"]}
    assert len(rows) == 19, sorted(rows)
    for name, r in rows.items():
        assert abs(r["planner_per_sbh"] - r["per_sbh"]) <= 0.001 * r["per_sbh"], (name, r)
        if r["name"].endswith("ac=none"):  # autocast's low-precision weight copies (none in fp32 or FSDP's bf16)
            assert r["weight_copy_bytes"] == r["planner_weight_copy_bytes"], (name, r)
    # fused projections keep what separate ones keep (v in its own storage, the input as its sequence shard) and
    # no low-precision copy of their weights: only o's and down's
    for sp in ("", " sp"):
        fused, separate = rows[f"tp2 bf16{sp} fused ac=none"], rows[f"tp2 bf16{sp} ac=none"]
        assert fused["activation_bytes"] == separate["activation_bytes"], (fused, separate)
        assert 0 < fused["weight_copy_bytes"] < separate["weight_copy_bytes"] / 2, (fused, separate)
    # sequence parallel keeps the norms' outputs as their sequence shards (parallel.tensor.SequenceGather): with
    # it the block keeps what the published accounting keeps (Korthikanti et al., benchmarks/README.md), plus the
    # norms' 1/rms
    for name in ("tp2 bf16 sp ac=none", "tp2 fp32 sp ac=none", "tp2 bf16 sp gelu ac=none"):
        assert rows[name]["per_sbh"] <= rows[name]["formula_per_sbh"] + 8 / 256 / 2, rows[name]
    # full recompute keeps the block's input only, in the compute dtype, a sequence shard with sequence parallel
    assert rows["tp2 bf16 sp ac=full"]["per_sbh"] == rows["tp2 bf16 sp ac=full"]["formula_per_sbh"] == 1.0


def test_planner_counts_a_context_parallel_ranks_share(tmp_path, mpiexec) -> None:
    """With cp = 2 a rank keeps what the planner says for its share of the tokens (half of one process's), the ring
    attention's output laid out so the o projection reads a view of it (no second copy kept)."""
    subprocess.run([mpiexec, "-n", "2", sys.executable, str(REPO / "benchmarks" / "context_parallel.py"), "--memory",
                    "--out", str(tmp_path), "--run-root", str(tmp_path / "runs")], cwd=REPO, env=env_with_venv(),
                   check=True, capture_output=True, timeout=600)
    rows = json.loads((tmp_path / "context_parallel-2ranks.json").read_text())["rows"]
    assert [r["cp"] for r in rows] == [2, 2, 2]
    for r in rows:
        assert abs(r["bytes"] - r["planner_bytes"]) <= 0.001 * r["bytes"], r
