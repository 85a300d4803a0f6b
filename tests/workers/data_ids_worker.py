"""One rank of tests/multiproc/data/test_data_ids_ranks.py: in one session of 2 gloo ranks, token files with no record
from
data build are opened the job-start way (data.check_ids_at_start, then open_sources), through the Trainer and
directly, and this rank records which files it scanned (every call of tokenfiles._scan_ids, slowed here so a scan
spans several rounds), what it then knows of each file or the error it raised, and its heartbeat's details.

    python tests/workers/data_ids_worker.py OUT BASE_PORT     # RANK, WORLD_SIZE...: helpers.launch.spawn_ranks
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers
from helpers.training import TINY  # noqa: E402
from hpctrain.config import load_config  # noqa: E402
from hpctrain.data import loader as data
from hpctrain.data import tokenfiles
from hpctrain.data.sources import open_source
from hpctrain.job import session
from hpctrain.train.trainer import Trainer  # noqa: E402


def main(out: Path, base_port: int) -> None:
    os.environ["MASTER_PORT"] = str(base_port)
    rank = int(os.environ["RANK"])
    scans: list[str] = []
    real = tokenfiles._scan_ids

    def slowed(source):
        scans.append(Path(source.name).name)
        for step in real(source):
            time.sleep(0.01)  # a slice every 10 ms: a file of 50 slices takes several rounds of 0.1 s
            yield step

    tokenfiles._scan_ids = slowed
    tokenfiles.SCAN_TOKENS = 2000
    files = out / "data"
    base = TINY + [f"job.run_root={out / 'runs'}", "checkpoint.at_end=false", "data.source=bin"]
    results: dict[str, dict] = {}
    cfg = load_config(None, base + [f"data.path={files / 'train.bin'}", "train.eval_every=1"])
    with session.start(cfg) as s:
        details: list[str] = []
        real_enter = s.heartbeat.enter
        s.heartbeat.enter = lambda phase, detail="": details.append(detail) or real_enter(phase, detail)

        def case(name: str, fn) -> None:
            first, seen = len(scans), len(details)
            try:
                value = fn()
            except ValueError as e:
                value = {"error": str(e)}
            results[name] = {"scans": scans[first:], "value": value, "details": details[seen:]}

        def direct(path: Path) -> dict:
            c = load_config(None, base + [f"data.path={path}"])
            data.check_ids_at_start(c, dist.group.WORLD, s.run_dir, s.heartbeat, round_s=0.1)
            checked = len(scans)
            source = open_source(c.data, 256)
            return {"max_id": source.max_id, "scans_on_open": len(scans) - checked}

        # the trainer's own call: the training file and its validation split, one rank each
        case("trainer", lambda: {"steps": Trainer(cfg, s).cfg.train.steps})
        case("one", lambda: direct(files / "one.bin"))
        case("bad", lambda: direct(files / "bad.bin"))
        case("differs", lambda: direct(files / f"rank{rank}" / "same.bin"))
        results["run_dir"] = {"value": str(s.run_dir)}
    (out / f"rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
