"""The layout search over a 128-GPU job (hpctrain plan --search): tens of thousands of layouts evaluated, about 20 s
on a quiet 2-core machine (the rest of the report: tests/pure/planner/test_planner_report.py).

    PATH=$PWD/.venv/bin:$PATH .venv/bin/python -m pytest -q tests/multiproc/planner/test_planner_search.py
"""
from __future__ import annotations

import json

from click.testing import CliRunner

from helpers.launch import REPO
from hpctrain.cli.main import main as cli
from hpctrain.config import load_config
from hpctrain.planner.hardware import profile

LLAMA = REPO / "slurm" / "examples" / "llama-70b.toml"


def test_search_ranks_what_fits_and_names_the_rest() -> None:
    from hpctrain.planner.search import SCHEDULES, search
    cfg = load_config(LLAMA, [])
    fit, why = search(cfg, profile("h100-sxm"), 5.0, 6000.0, 128)
    speeds = [o["tokens_per_s"] for o in fit]
    assert fit and speeds == sorted(speeds, reverse=True)
    lay = [o["layout"] for o in fit]
    assert all(o["fits"] for o in fit) and all(x["pp"] * x["dp"] * x["cp"] * x["tp"] == 128 for x in lay)
    assert {x["cp"] for x in lay} == {1, 2}  # 8192-token sequences: cp 2 keeps 4096 per rank, cp 4 too few
    assert {x["offload"] for x in lay} == {"none"}  # layouts fit without: offload is not searched
    assert all(o["layout"]["micro_batch"] * o["layout"]["grad_accum"] * o["layout"]["dp"] == 128 for o in fit)
    own = {"pp": 1, "dp": 16, "tp": 8, "zero_stage": 3, "micro_batch": 1, "grad_accum": 8, "ac": "full"}
    assert any(own.items() <= o["layout"].items() for o in fit)  # the config's own layout is among them
    assert {o["layout"]["sequence_parallel"] for o in fit if o["layout"]["tp"] > 1} == {False, True}
    assert {(o["layout"]["schedule"], o["layout"]["virtual_stages"]) for o in fit if o["layout"]["pp"] > 1} == set(
        SCHEDULES)
    assert any("does not divide the 8 ranks per node" in r for r in why)  # tp across nodes
    oom = next(e for r, e in why.items() if r.startswith("out of memory on h100-sxm"))
    assert oom[0] > 0 and 0 < oom[1] <= oom[2]
    # the command's wiring, on 4 nodes (32 GPUs: a shorter search): a ranked list of layouts of that job
    out = CliRunner().invoke(cli, ["plan", str(LLAMA), "--search", "--json", "--set", "job.nodes=4",
                                   "--set", "parallel.dp=-1"])
    assert out.exit_code == 0, out.output
    listed = json.loads(out.output)
    assert listed and all(o["layout"]["pp"] * o["layout"]["dp"] * o["layout"]["cp"] * o["layout"]["tp"] == 32
                          for o in listed)
    assert [o["tokens_per_s"] for o in listed] == sorted((o["tokens_per_s"] for o in listed), reverse=True)
