"""One rank of the multi-process CPU tests (started 4 times by tests/multiproc/parallel/test_dist.py with torchrun's
variables).

Runs several layouts in one process to pay for `import torch` once; each layout gets its own port and run
root. Writes what happened per layout to <out>/rank<r>.json.
"""
import json
import os
import sys
from pathlib import Path

from hpctrain.config import load_config
from hpctrain.train import trainer as train


def main(out: str, example: str, base_port: int, cases_json: str) -> None:
    rank = int(os.environ["RANK"])
    record = {}
    for i, (name, overrides) in enumerate(json.loads(cases_json)):
        os.environ["MASTER_PORT"] = str(base_port + i)
        cfg = load_config(example, overrides + [f"job.run_root={out}/{name}", "train.steps=0"])
        try:
            summary = train.run(cfg)
            record[name] = {"ok": summary["ok"]}
        except ValueError as e:
            record[name] = {"error": str(e)}
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
