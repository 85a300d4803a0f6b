"""Token files without a record from data build, checked once at job start (issue 26): 2 gloo ranks in one session
(tests/workers/data_ids_worker.py) open them the way a job does. Each file is scanned by exactly one rank (two
files: one each, the ranks taken host by host), the others are sent the result and scan nothing, not even when
they open the file afterwards (the trainer's validation split included); the result is cached beside the data;
ranks that wait see progress in their heartbeat, round after round; a file with an id past the vocabulary fails
every rank with the usual message; a file that differs between ranks fails every rank naming both. The one-process
checks and the login node: tests/pure/data/test_data_ids.py.

    PATH=$PWD/.venv/bin:$PATH .venv/bin/python -m pytest -q tests/multiproc/data/test_data_ids_ranks.py
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from faults import record

from helpers.launch import WORKERS, free_base_port, spawn_ranks
from hpctrain.job import runs

pytestmark = pytest.mark.faults


def tokens(path: Path, n: int, bad_at: int | None = None, offset: int = 0) -> None:
    ids = ((np.arange(n) + offset) % 200).astype("<u2")
    if bad_at is not None:
        ids[bad_at] = 300
    path.parent.mkdir(parents=True, exist_ok=True)
    ids.tofile(path)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("ids")
    files = out / "data"
    tokens(files / "train.bin", 60_000)
    tokens(files / "train.val.bin", 20_000)
    tokens(files / "one.bin", 100_000)  # 50 slices of 2000 tokens, 10 ms each: about 5 rounds of 0.1 s
    tokens(files / "bad.bin", 20_000, bad_at=15_000)
    tokens(files / "rank0" / "same.bin", 20_000)
    tokens(files / "rank1" / "same.bin", 20_000, offset=1)  # a node-local copy that is not the same
    cmd = [sys.executable, str(WORKERS / "data_ids_worker.py"), str(out), str(free_base_port(1))]
    procs = spawn_ranks(2, cmd, ranks_per_node=2, run_id="ids")
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(x[-3000:] for x in logs)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)] + [{"out": out}]


def test_the_trainer_checks_each_file_once_on_one_rank(ranks) -> None:
    r0, r1, out = ranks[0]["trainer"], ranks[1]["trainer"], ranks[2]["out"]
    assert "error" not in r0["value"] and "error" not in r1["value"], (r0, r1)
    assert r0["scans"] == ["train.bin"] and r1["scans"] == ["train.val.bin"], (r0["scans"], r1["scans"])
    for name in ("train.bin", "train.val.bin"):
        cache = json.loads((out / "data" / f"{name}.ids.json").read_text())
        assert cache["max_id"] == 199 and cache["min_id"] == 0
    log0 = runs.rank_log_path(Path(ranks[0]["run_dir"]["value"]), 0).read_text()
    assert "train.bin: no record of its ids from data build; rank 0" in log0, log0
    assert "train.val.bin: no record of its ids from data build; rank 1" in log0, log0
    assert "token ids checked in" in log0 and "0 of 2 files left" in log0
    record("2-rank job (the Trainer) on a raw training file and its validation split, neither with a record",
           "each file scanned by exactly one rank (one each), the other rank scans none, also when the evaluator "
           "opens its split; both results cached beside the data", tier="multi-process")


def test_one_file_one_scanning_rank_and_the_others_wait_with_progress(ranks) -> None:
    r0, r1 = ranks[0]["one"], ranks[1]["one"]
    assert r0["scans"] == ["one.bin"] and r1["scans"] == [], (r0, r1)
    assert r0["value"] == r1["value"] == {"max_id": 199, "scans_on_open": 0}
    # the waiting rank's heartbeat moved every round (the watchdog's clock starts again each time)
    assert len(r1["details"]) >= 3 and r1["details"][-1].endswith("0 of 1 files left"), r1["details"]
    assert r1["details"][0].startswith("token ids: ") and r1["details"][0].endswith("1 of 1 files left")


def test_a_bad_file_fails_every_rank(ranks) -> None:
    r0, r1 = ranks[0]["bad"], ranks[1]["bad"]
    assert r0["scans"] == ["bad.bin"] and r1["scans"] == [], (r0, r1)
    for r in (r0, r1):
        assert "bad.bin" in r["value"]["error"] and "ids up to 300 but model.vocab_size = 256" in r["value"]["error"]
    record("2-rank job on a raw token file holding id 300 past a vocabulary of 256, no record",
           "scanned by rank 0 alone; every rank fails with the ValueError naming the file, the id and the "
           "vocabulary", tier="multi-process")


def test_a_file_that_differs_between_ranks_fails_every_rank(ranks) -> None:
    r0, r1 = ranks[0]["differs"], ranks[1]["differs"]
    assert r0["scans"] == r1["scans"] == []
    for r in (r0, r1):
        assert "rank 1" in r["value"]["error"] and "every rank must read the same file" in r["value"]["error"]
    record("2-rank job whose ranks read different token files at the same path (node-local copies that differ)",
           "every rank fails naming the file, both ranks' sizes and hashes; nothing scanned", tier="multi-process")
