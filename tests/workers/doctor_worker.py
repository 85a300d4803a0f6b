"""One rank of tests/multiproc/doctor/test_doctor_dist.py (4 ranks with torchrun's variables, 2 "nodes" of 2 named
node0 and node1): each case runs the doctor (doctor.run) or a training job with job.preflight, in one process,
and writes what it saw to <out>/<case>-rank<r>.json. A case's "preempt": that rank signals itself (USR2) first."""
from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins"))  # for seams
os.environ["SLURMD_NODENAME"] = f"node{os.environ['GROUP_RANK']}"  # the node names the doctor blames
import seams  # noqa: E402

from helpers.launch import EXAMPLE, each_case  # noqa: E402
from hpctrain.config import load_config  # noqa: E402
from hpctrain.doctor import measure as doctor
from hpctrain.job import preempt, session
from hpctrain.train import trainer as train

SMALL = ["data.source=synthetic", "model.n_layers=1", "model.dim=64", "train.steps=2", "train.log_every=1",
         "checkpoint.at_end=false", "parallel.timeout_s=120"]


def main(out: str, cases_json: str, base_port: int) -> None:
    def case(c: dict) -> None:
        with seams.doctor_slow(c.get("slow")):  # "slow": a node, as SEAM_DOCTOR_SLOW names it
            seen = run(c)
        Path(out, f"{c['name']}-rank{os.environ['RANK']}.json").write_text(json.dumps(seen, default=str))

    def run(c: dict) -> dict:
        cfg = load_config(EXAMPLE, SMALL + [f"job.run_root={out}/{c['name']}"] + c.get("sets", []))
        seen: dict = {}
        if c["kind"] == "doctor":
            with session.start(cfg) as s:
                report = doctor.run(s, doctor.Options(storage_mb=16, rules=c.get("rules", {})))
                seen = {k: report[k] for k in ("ok", "failed_nodes", "unattributed", "exclude", "job", "groups",
                                               "nodes")}
                seen["run_dir"] = str(s.run_dir)
                seen["fails"] = [r for r in report["checks"] if not r["ok"]]
        else:  # a training job with job.preflight = true
            if c.get("preempt") == int(os.environ["RANK"]):  # a preemption that arrives before the preflight
                preempt.process_flag()
                os.kill(os.getpid(), signal.SIGUSR2)
            try:
                seen["summary"] = train.run(cfg)
            except RuntimeError as e:
                seen["raised"] = str(e)
        return seen
    each_case(out, cases_json, base_port, case)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
