"""One rank of the real-layout initialisation test (tests/multiproc/model/test_init_scale_shards.py, 4 ranks with
torchrun's variables): for each case, builds the parallel model on the session's mesh and saves every parameter's
shard, its box in the full tensor and the elements this rank drew (helpers.training.counting_tiles).

    python tests/workers/init_scale_worker.py OUT CASES_JSON BASE_PORT
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers
from helpers.training import TINY, counting_tiles  # noqa: E402
from hpctrain.config import load_config  # noqa: E402
from hpctrain.job import session
from hpctrain.model import transformer as model
from hpctrain.parallel import compose, materialize  # noqa: E402


def worker(out: str, cases_json: str, base_port: int) -> None:
    from torch.distributed.tensor import DTensor

    rank = int(os.environ["RANK"])
    errors = {}
    for i, case in enumerate(json.loads(cases_json)):
        os.environ["MASTER_PORT"] = str(base_port + i)
        try:
            cfg = load_config(None, TINY + case["overrides"] + [f"job.run_root={out}/{case['name']}-runs"])
            with session.start(cfg) as s:
                drawn = counting_tiles(pytest.MonkeyPatch())
                pm = compose.build(cfg, s.mesh, s.device)
                pieces = {}
                for name, p in pm.model.named_parameters():
                    name = model.clean_name(name)
                    offset, local_shape = materialize.shard_box(p)
                    local = p.to_local() if isinstance(p, DTensor) else p
                    pieces[name] = {"shape": tuple(p.shape), "offset": offset, "local": local.detach().clone(),
                                    "drawn": drawn.get(name, 0)}
                torch.save({"pieces": pieces, "dims": pm.dims}, Path(out) / f"{case['name']}-rank{rank}.pt")
        except Exception as e:  # recorded so the test names the case that failed
            errors[case["name"]] = f"{type(e).__name__}: {e}"
    Path(out, f"errors-rank{rank}.json").write_text(json.dumps(errors))


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2], int(sys.argv[3]))
