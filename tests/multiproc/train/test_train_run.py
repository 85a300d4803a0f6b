"""Training through the product's own entry points, in this process (the `hpctrain` command through click): bad
training input is refused before anything starts. One rank: the host reads nothing from the device between log
steps (every read of a tensor's value by hpctrain's code is counted; on a GPU each is a host sync), with the same
per-step losses as a step that reads at once. `hpctrain train` in its own process is
tests/multiproc/cli/test_train_cli.py's."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from helpers.launch import EXAMPLE
from hpctrain.cli.main import main as cli
from hpctrain.config import load_config
from hpctrain.job import session
from hpctrain.parallel import pipeline
from hpctrain.train import optim
from hpctrain.train.metrics import host_values
from hpctrain.train.trainer import Trainer


@pytest.mark.parametrize("sets, fragment", [
    (["model.n_heads=3", "model.dim=96"], "model.n_heads = 3 is not divisible by parallel.tp = 2"),
    (["train.global_batch_size=30", "train.grad_accum=4"],
     "train.global_batch_size = 30 is not divisible by dp(2) x train.grad_accum(4) = 8"),
    (["parallel.pp=2", "parallel.dp=1"], "train.grad_accum = 1 micro-batches: 1F1B needs at least pp = 2"),
    (["parallel.pp=2", "parallel.dp=1", "parallel.pp_layers=[3, 3]"], "parallel.pp_layers = [3, 3] sums to 6"),
    (["train.precision=fp4"], "train.precision = 'fp4' is not one of fp32, bf16, fp16, fp8"),
    (["train.precision=fp8"], "train.precision = 'fp8' needs GPUs with float8 matmuls"),  # the example is on CPUs
    (["parallel.zero_stage=4"], "parallel.zero_stage = 4 must be 0, 1, 2 or 3"),
])
def test_bad_training_input_refused_at_dry_run(sets, fragment, tmp_path) -> None:
    args = ["submit", str(EXAMPLE), "--dry-run", "--set", f"job.run_root={tmp_path}"]
    for s in sets:
        args += ["--set", s]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 2, res.output
    assert fragment in res.output
    assert "#SBATCH" not in res.output and not any(tmp_path.iterdir())


def test_missing_data_warns_at_dry_run_and_refuses_submission(tmp_path) -> None:
    sets = ["--set", "data.path=/nonexistent/tokens.bin", "--set", f"job.run_root={tmp_path}"]
    dry = CliRunner().invoke(cli, ["submit", str(EXAMPLE), "--dry-run", *sets])
    assert dry.exit_code == 0 and "warning: data.path = '/nonexistent/tokens.bin' does not exist" in dry.output
    real = CliRunner().invoke(cli, ["submit", str(EXAMPLE), *sets])
    assert real.exit_code == 2 and "data.path = '/nonexistent/tokens.bin' does not exist" in real.output
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_vocab_padding_is_announced(tmp_path) -> None:
    res = CliRunner().invoke(cli, ["submit", str(EXAMPLE), "--dry-run", "--set", "model.vocab_size=250",
                                   "--set", "data.source=synthetic"])
    assert res.exit_code == 0, res.output
    assert "model.vocab_size = 250 padded to 256" in res.output


# --- host syncs -------------------------------------------------------------------------------------------------

READS = ("item", "tolist", "__bool__", "__float__", "__int__")
PACKAGE = str(Path(optim.__file__).parents[1])  # hpctrain/ (optim is hpctrain/train/optim.py)
STEP_CASE = ["model.vocab_size=256", "model.dim=32", "model.n_layers=1", "model.n_heads=2", "model.max_seq_len=32",
             "data.source=synthetic", "data.seq_len=32", "train.micro_batch_size=2", "train.steps=6",
             "train.log_every=3", "train.warmup_steps=1", "checkpoint.at_end=false", "parallel.pp=1", "parallel.tp=1",
             "parallel.dp=-1"]


def host_reads(monkeypatch) -> list[str]:
    """Records every read of a tensor's value into Python made by hpctrain's own code, as "file:function". torch's
    internals are left out: what they read on the host (AdamW's step counts) lives on the host."""
    reads: list[str] = []
    for name in READS:
        def spy(self, *args, _real=getattr(torch.Tensor, name), **kwargs):
            code = sys._getframe(1).f_code
            if code.co_filename.startswith(PACKAGE):
                reads.append(f"{Path(code.co_filename).name}:{code.co_name}")
            return _real(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, spy)
    return reads


def poison_next_gradients(tr: Trainer) -> None:
    p, armed = tr.params[0], [True]

    def hook(grad):
        if armed[0]:
            armed[0] = False
            return torch.full_like(grad, float("inf"))
        return grad
    p.register_hook(hook)


def test_train_step_leaves_its_metrics_on_the_device(tmp_path, monkeypatch) -> None:
    cfg = load_config(None, STEP_CASE + [f"job.run_root={tmp_path}"])
    with session.start(cfg) as s:
        ref = Trainer(cfg, s)
        want = [ref.train_step()["loss"] for _ in range(4)]  # read at once, as callers that step by hand get them
        tr = Trainer(cfg, s)
        reads = host_reads(monkeypatch)
        rows = [tr.train_step(sync=False) for _ in range(4)]
        monkeypatch.undo()
    # fused AdamW decides a non-finite step's skip on the device (found_inf): nothing is read
    assert reads == []
    assert all(isinstance(r["loss"], torch.Tensor) and isinstance(r["grad_norm"], torch.Tensor) for r in rows)
    assert [host_values(r)["loss"] for r in rows] == want  # the same numbers, read late


def test_fused_optimizer_skips_a_non_finite_step_on_the_device(tmp_path, monkeypatch) -> None:
    cfg = load_config(None, STEP_CASE + [f"job.run_root={tmp_path}"])
    with session.start(cfg) as s:
        tr = Trainer(cfg, s)
        tr.train_step(sync=False)
        weights = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
        state = {n: {k: v.clone() for k, v in tr.optimizer.state[p].items()} for n, p in tr.model.named_parameters()}
        poison_next_gradients(tr)
        reads = host_reads(monkeypatch)
        row = tr.train_step(sync=False)
        monkeypatch.undo()
        assert reads == []  # the skip was decided on the device
        assert isinstance(row["skipped"], torch.Tensor) and bool(row["skipped"])
        for n, p in tr.model.named_parameters():
            assert torch.equal(p, weights[n]), n  # nothing reached the weights, the moments or the step count
            assert all(torch.equal(v, state[n][k]) for k, v in tr.optimizer.state[p].items()), n
        row = tr.train_step()
        assert row["skipped"] is False and not torch.equal(tr.params[0], weights["tok_embeddings.weight"])


# The per-step agreement (train/agreement.py): the flags every rank sent after the step before, read from their host
# copy (on a GPU pinned memory behind an event of that step), one read per step.
AGREEMENTS = ("agreement.py:receive",)


def test_fit_reads_the_device_on_log_steps_only(tmp_path, monkeypatch) -> None:
    cfg = load_config(None, STEP_CASE + [f"job.run_root={tmp_path}"])
    with session.start(cfg) as s:
        ref = Trainer(cfg, s)
        want = [ref.train_step()["loss"] for _ in range(6)]
        tr = Trainer(cfg, s)
        step = tr.train_step
        reads = host_reads(monkeypatch)
        tr.train_step = lambda *a, **k: reads.append(f"step {tr.step + 1}") or step(*a, **k)
        out = tr.fit()
        monkeypatch.undo()
    per_step: dict[int, list[str]] = {}
    agreed: dict[int, int] = {}
    for r in reads[reads.index("step 1"):]:
        if r.startswith("step "):
            current = per_step.setdefault(int(r.split()[1]), [])
            n = int(r.split()[1])
        elif r in AGREEMENTS:
            agreed[n] = agreed.get(n, 0) + 1
        else:
            current.append(r)
    assert {k for k, v in per_step.items() if v} == {1, 3, 6}, per_step  # log_every = 3, the first and the last
    # one read of the agreed flags per step from the second on (the first has none to read), two after the last
    # (its own, read at once as training ends)
    assert agreed == {k: 1 for k in range(2, 6)} | {6: 2}, agreed
    assert out["losses"] == want


def test_untimed_pipeline_step_takes_no_barrier_and_no_time(monkeypatch) -> None:
    """Timing a pipeline step (for the bubble) puts barriers around it and synchronises the device: only the steps
    the trainer logs are timed; the others run the schedule alone."""
    barriers, seen = [], []
    stage = pipeline.timed_stage_class().__new__(pipeline.timed_stage_class())
    stage.busy_s, stage._events, stage.timing, stage.device = 0.0, [], True, torch.device("cpu")

    class Schedule:
        def step(self, *args, **kwargs):
            seen.append(stage.timing)
            stage._timed(lambda: sum(range(10000)))
    pipe = pipeline.Pipeline.__new__(pipeline.Pipeline)
    pipe.stages, pipe.schedule, pipe.first, pipe.last, pipe.device, pipe.group = [stage], Schedule(), True, False, \
        torch.device("cpu"), None
    pipe.busy_s = pipe.wall_s = 0.0
    pipe.steps = 0
    pipe.shapes_known, pipe.no_outputs = False, {}
    monkeypatch.setattr(torch.distributed, "barrier", lambda group=None: barriers.append(group))
    pipe.step(torch.zeros(1), torch.zeros(1), timed=False)
    assert barriers == [] and seen == [False] and stage.busy_s == 0.0
    assert pipe.timing() == {"steps": 0, "wall_s": 0.0, "busy_s": 0.0}
    pipe.step(torch.zeros(1), torch.zeros(1))
    t = pipe.timing()
    assert barriers == [None, None] and seen == [False, True] and t["steps"] == 1 and 0 < t["busy_s"] <= t["wall_s"]


# --- the watchdog's one owner -----------------------------------------------------------------------------------

def test_the_session_configures_the_watchdog_whole(tmp_path, monkeypatch) -> None:
    """session.start makes the watchdog with everything it does, the hang requeue of a payload that resumes
    included; the trainer only moves the heartbeat (begin_training: where its first step, with the long limit, is)."""
    from hpctrain.job import requeue

    cfg = load_config(None, STEP_CASE + [f"job.run_root={tmp_path}", "parallel.hang_timeout_s=60",
                                         "job.node_requeues=2"])
    with session.start(cfg, resumes=True) as s:
        end = s.watchdog.on_end
        assert (end.func, end.args) == (requeue.after_hang, (s.run_dir, 2, 1))
        Trainer(cfg, s).fit()
        assert s.heartbeat.first_step == 1 and s.heartbeat.step == 6
    with session.start(cfg) as s:  # benchmarks, the doctor: a hang just ends them
        assert s.watchdog is not None and s.watchdog.on_end is None
    with session.start(load_config(None, STEP_CASE + [f"job.run_root={tmp_path}", "job.node_requeues=0"]),
                       resumes=True) as s:
        assert s.watchdog.on_end is None
