"""The job's plan (hpctrain.parallel.plan): one call gives the layout, the model dimensions, the pipeline's stages and
the
batch plan; bad configs are refused with the messages the checks always gave; and each check runs once, on the
login node (a dry run) and through a rank's session and trainer.

    PATH=$PWD/.venv/bin:$PATH .venv/bin/python -m pytest -q tests/pure/parallel/test_plan.py
"""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from helpers.launch import EXAMPLE
from helpers.training import TINY
from hpctrain.cli.main import main as cli
from hpctrain.config import load_config
from hpctrain.job import session
from hpctrain.model.transformer import ModelDims
from hpctrain.parallel import mesh, plan
from hpctrain.parallel.mesh import Layout, block_placement
from hpctrain.parallel.plan import make_plan, with_training
from hpctrain.parallel.stages import StagePlan, describe
from hpctrain.train.trainer import Trainer

PP = ["model.n_layers=4", "parallel.pp=2", "parallel.tp=2", "train.micro_batch_size=2", "train.grad_accum=4"]


def test_one_call_gives_every_decision() -> None:
    cfg = load_config(None, PP + ["model.vocab_size=250"])
    p = make_plan(cfg, block_placement(2, 4))
    assert p.layout == Layout(2, 2, 2) and p.node_of_rank == (0, 0, 0, 0, 1, 1, 1, 1)
    assert p.dims == ModelDims.from_config(cfg.model, 2) and p.dims.vocab_size == 256
    assert p.stages == StagePlan.build(cfg.parallel, 4)
    assert (p.micro_batch, p.global_batch) == (2, 2 * 4 * 2)
    assert p.notes[0] == describe(p.stages, 4) and "padded to 256" in p.notes[-1]
    with pytest.raises(AttributeError):
        p.micro_batch = 3  # frozen


def test_global_batch_sets_the_micro_batch() -> None:
    p = make_plan(load_config(None, ["train.global_batch_size=32", "train.grad_accum=2"]), [0, 0, 0, 0])
    assert (p.layout, p.stages, p.micro_batch, p.global_batch) == (Layout(1, 4, 1), None, 4, 32)


def test_no_training_no_model() -> None:
    """train.steps = 0 (benchmarks), and a session: layout and topology only; the model's checks are not the
    job's. with_training adds them without checking the layout again."""
    cfg = load_config(None, ["train.steps=0", "parallel.pp=2", "model.tie_embeddings=true",
                             "parallel.pp_schedule=zbv", "parallel.pp_virtual_stages=2", "model.n_layers=4"])
    p = make_plan(cfg, [0, 0])
    assert (p.layout, p.training, p.dims, p.stages, p.notes) == (Layout(2, 1, 1), False, None, None, ())
    assert make_plan(cfg, [0, 0], training=False) == p
    with pytest.raises(ValueError, match="untie them"):
        with_training(p, cfg)
    trained = load_config(None, PP)
    assert with_training(make_plan(trained, [0] * 8, training=False), trained) == make_plan(trained, [0] * 8)


@pytest.mark.parametrize("sets, nodes, message", [
    (["parallel.tp=3"], [0] * 8, "world size 8 is not divisible by pp(1) * tp(3) = 3, so dp cannot be inferred"),
    (["parallel.tp=2", "parallel.dp=3"], [0] * 8, "pp(1) * dp(3) * tp(2) = 6 != world size 8"),
    (["parallel.tp=4"], block_placement(4, 2), "tp(4) does not divide the 2 ranks per node: every tensor-parallel "
                                               "group must lie inside one node"),
    (["parallel.tp=2", "model.n_heads=3", "model.dim=96"], [0] * 4,
     "model.n_heads = 3 is not divisible by parallel.tp = 2"),
    (["train.global_batch_size=30", "train.grad_accum=4"], [0, 0],
     "train.global_batch_size = 30 is not divisible by dp(2) x train.grad_accum(4) = 8"),
    (["parallel.pp=2"], [0, 0], "train.grad_accum = 1 micro-batches: 1F1B needs at least pp = 2"),
])
def test_bad_configs_keep_their_messages(sets, nodes, message) -> None:
    with pytest.raises(ValueError) as e:
        make_plan(load_config(None, sets), nodes)
    assert message in str(e.value), str(e.value)


CHECKS = [(mesh, "resolve_layout"), (mesh, "check_topology"), (plan, "_check_supported"), (plan, "_batch_plan")]


def count_checks(monkeypatch) -> dict[str, int]:
    calls = {name: 0 for _, name in CHECKS} | {"from_config": 0}

    def counted(owner, name):
        real = getattr(owner, name)

        def wrapper(*a, **k):
            calls[name] += 1
            return real(*a, **k)
        monkeypatch.setattr(owner, name, wrapper)

    for owner, name in CHECKS:
        counted(owner, name)
    real_dims = ModelDims.from_config

    def from_config(cls, *a, **k):
        calls["from_config"] += 1
        return real_dims(*a, **k)
    monkeypatch.setattr(ModelDims, "from_config", classmethod(from_config))
    return calls


def test_dry_run_checks_once(monkeypatch, tmp_path) -> None:
    calls = count_checks(monkeypatch)
    res = CliRunner().invoke(cli, ["submit", str(EXAMPLE), "--dry-run", "--set", f"job.run_root={tmp_path}"])
    assert res.exit_code == 0, res.output
    assert calls == {"resolve_layout": 1, "check_topology": 1, "_check_supported": 1, "_batch_plan": 1,
                     "from_config": 1}


def test_session_and_trainer_check_once(monkeypatch, tmp_path) -> None:
    """One rank: the session makes the plan's layout part, the trainer adds its training part once and the parallel
    model uses it; a checkpoint records the plan's layout (no longer read from the session's summary)."""
    cfg = load_config(None, TINY + ["model.dim=32", "model.n_heads=2", "model.n_layers=1", "data.seq_len=16",
                                    "train.micro_batch_size=2", "train.steps=1", f"job.run_root={tmp_path / 'runs'}",
                                    f"checkpoint.dir={tmp_path / 'ck'}", "checkpoint.every_steps=1"])
    calls = count_checks(monkeypatch)
    with session.start(cfg) as s:
        assert s.plan.layout == s.mesh.layout == Layout(1, 1, 1) and not s.plan.training
        assert s.mesh.coords == {"pp": 0, "dp": 0, "tp": 0} and s.mesh.rank == 0
        assert calls == {"resolve_layout": 1, "check_topology": 1, "_check_supported": 0, "_batch_plan": 0,
                         "from_config": 0}
        tr = Trainer(cfg, s)
        assert tr.plan.layout is s.plan.layout and tr.pm.dims is tr.plan.dims and tr.micro_batch == 2
        s.summary.pop("layout")  # the trainer's save must not need it
        tr.fit()
    assert calls == {"resolve_layout": 1, "check_topology": 1, "_check_supported": 1, "_batch_plan": 1,
                     "from_config": 1}
    marker = json.loads((tmp_path / "ck" / "step_00000001" / "COMMITTED").read_text())
    assert marker["layout"] == {"pp": 1, "dp": 1, "tp": 1, "cp": 1, "replicate": 1,
                                "zero_stage": cfg.parallel.zero_stage}
