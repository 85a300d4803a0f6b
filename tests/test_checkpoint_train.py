"""Checkpoints in training, multi-process on CPU (4 gloo ranks): a run preempted (USR2) at step 4 and resumed
in the same layout is bitwise the uninterrupted run; the same checkpoint (dp=2, tp=2, ZeRO-3) loads into dp=4 and
tp=4 and the following losses match; an asynchronous save writes the same bytes as a synchronous one."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from conftest import REPO, free_base_port, spawn_ranks

LAYOUT = ["parallel.tp=2", "parallel.zero_stage=3", "train.micro_batch_size=4"]
LOSS_TOL, WEIGHT_TOL = 2e-5, 2e-4  # across layouts: fp32 reduction order differs


def _cases(out: Path) -> list[dict]:
    ck = lambda name: f"checkpoint.dir={out / name}"  # noqa: E731
    step4 = out / "ckB" / "step_00000004"
    return [
        {"name": "full", "overrides": LAYOUT + ["train.steps=8", ck("ckA"), "checkpoint.at_end=false"]},
        {"name": "first", "overrides": LAYOUT + ["train.steps=8", ck("ckB")], "preempt_at": 4},
        {"name": "resumed", "overrides": LAYOUT + ["train.steps=8", ck("ckB"), "checkpoint.at_end=false"]},
        {"name": "dp4", "overrides": ["parallel.zero_stage=3", "train.micro_batch_size=2", "train.steps=8",
                                      f"train.resume={step4}", ck("ckD"), "checkpoint.at_end=false"]},
        {"name": "tp4", "overrides": ["parallel.tp=4", "train.steps=8", f"train.resume={step4}", ck("ckE"),
                                      "checkpoint.at_end=false"]},
        {"name": "async", "overrides": LAYOUT + ["train.steps=8", "checkpoint.every_steps=2",
                                                 "checkpoint.async_save=true", "checkpoint.keep=3", ck("ckF")]},
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("ckpt")
    cases = _cases(out)
    cmd = [sys.executable, str(REPO / "tests" / "ckpt_worker.py"), str(out), json.dumps(cases),
           str(free_base_port(len(cases)))]
    procs = spawn_ranks(4, cmd, ranks_per_node=4, run_id="ckpt")  # one node: tp=4 must fit
    logs = [p.communicate(timeout=600)[0] for p in procs]
    errors = {}
    for f in out.glob("errors-rank*.json"):
        errors.update(json.loads(f.read_text()))
    assert not errors and all(p.returncode == 0 for p in procs), f"{errors}\n" + "\n".join(x[-3000:] for x in logs)
    return {"out": out} | {c["name"]: torch.load(out / f"{c['name']}.pt") for c in cases}


def test_same_layout_resume_is_bitwise(runs) -> None:
    # USR2 on one rank after step 4: every rank stopped there, with a committed checkpoint
    assert runs["first"]["preempted"] and runs["first"]["steps"] == 4 and runs["first"]["resumed_from"] is None
    assert runs["first"]["losses"] == runs["full"]["losses"][:4]
    assert runs["resumed"]["resumed_from"] == 4
    assert runs["resumed"]["losses"] == runs["full"]["losses"][4:]
    for k, v in runs["full"]["weights"].items():
        assert torch.equal(v, runs["resumed"]["weights"][k]), k


@pytest.mark.parametrize("layout", ["dp4", "tp4"])
def test_reshard_on_load(runs, layout) -> None:
    got, ref = runs[layout], runs["full"]
    assert got["resumed_from"] == 4 and len(got["losses"]) == 4
    assert max(abs(a - b) for a, b in zip(got["losses"], ref["losses"][4:])) <= LOSS_TOL
    worst = max((got["weights"][k] - ref["weights"][k]).abs().max().item() for k in ref["weights"])
    assert worst <= WEIGHT_TOL


def test_async_save_writes_what_sync_writes(runs) -> None:
    sync, asyn = runs["out"] / "ckB" / "step_00000004", runs["out"] / "ckF" / "step_00000004"
    assert (asyn / "COMMITTED").is_file()
    assert json.loads((asyn / "train_state.json").read_text())["step"] == 4
    shards = sorted(p.name for p in sync.glob("*.h5"))
    assert shards == sorted(p.name for p in asyn.glob("*.h5")) and len(shards) == 4
    for name in shards:
        with h5py.File(sync / name) as a, h5py.File(asyn / name) as b:
            def walk(group_a, group_b):
                assert sorted(group_a) == sorted(group_b)
                for key in group_a:
                    if isinstance(group_a[key], h5py.Group):
                        walk(group_a[key], group_b[key])
                    elif not key.startswith("bytes"):
                        assert np.array_equal(group_a[key][()], group_b[key][()]), (name, group_a[key].name)
            walk(a, b)


def test_keep_last_k(runs) -> None:
    steps = sorted(p.name for p in (runs["out"] / "ckF").iterdir())
    assert steps == ["step_00000004", "step_00000006", "step_00000008"]  # keep = 3; 8 is the final save
    assert sorted(p.name for p in (runs["out"] / "ckB").iterdir()) == ["step_00000004"]
