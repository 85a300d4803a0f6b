"""Runs training cases in one process (one rank) and records each case's per-step losses, pre-clip gradient norms
and final full weights, for tests/test_train_equivalence.py and tests/test_grad_scale_mutations.py; also, on rank
0, each FSDP module's reshard_after_forward and the all-gathers of the last step. A case may name a deliberate
gradient bug ("mutation": HPCTRAIN_TEST_MUTATION, for that case only). Used two ways:

    python tests/train_worker.py OUT CASES_JSON BASE_PORT      # one rank of a torchrun-style spawn
    run_case(overrides, out_file)                              # in the test process, as the 1-rank reference
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

import torch

from hpctrain import session
from hpctrain.config import load_config
from hpctrain.mutations import MUTATION_ENV
from hpctrain.train import Trainer

TINY = ["model.vocab_size=256", "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.max_seq_len=64",
        "data.source=synthetic", "data.seq_len=32", "train.steps=8", "train.lr=1e-3", "train.warmup_steps=2",
        "train.log_every=100", "train.peak_tflops=1", "train.micro_batch_size=8", "parallel.pp=1",
        "parallel.tp=1", "parallel.dp=-1", "parallel.timeout_s=180"]


def full_weights(model) -> dict[str, torch.Tensor]:
    """Every weight, whole: gathered over dp and tp, and over pipeline stages (each rank holds its own)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    # no cpu_offload: with it only global rank 0 keeps values, and other pipeline stages would come back empty
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    mine = {k: v.detach().float().cpu().clone() for k, v in sd.items()}
    if not dist.is_initialized():
        return mine
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {k: v for part in every for k, v in part.items()}


def fsdp_reshard(modules) -> dict[str, bool]:
    """reshard_after_forward of every FSDP module that holds parameters (blocks, roots, pipeline stage roots)."""
    from torch.distributed.fsdp import FSDPModule
    out, seen = {}, set()
    for k, root in enumerate(modules):
        for name, m in root.named_modules():
            if isinstance(m, FSDPModule) and id(m) not in seen:
                seen.add(id(m))
                group = m._get_fsdp_state()._fsdp_param_group
                if group is not None:
                    out[name or f"root{k}"] = group._reshard_after_forward
    return out


@contextlib.contextmanager
def counting_all_gathers(counter: list[int]):
    """Counts FSDP2's parameter all-gathers (it calls dist.all_gather_single)."""
    import torch.distributed as dist
    real = dist.all_gather_single

    def counted(*args, **kwargs):
        counter[0] += 1
        return real(*args, **kwargs)
    dist.all_gather_single = counted
    try:
        yield
    finally:
        dist.all_gather_single = real


def run_case(overrides: list[str], out: Path, inject_inf_step: int = 0) -> dict:
    """Trains one case; rank 0 saves {"losses", "grad_norms", "skipped", "scales", "weights", "fsdp", "gathers"} to
    `out`. grad_norms: the global pre-clip norm of each step (inf on a step skipped for non-finite gradients)."""
    cfg = load_config(None, TINY + overrides + [f"job.run_root={out.parent / (out.stem + '-runs')}"])
    with session.start(cfg) as s:
        tr = Trainer(cfg, s)
        losses, norms, skipped, scales = [], [], [], []
        gathers = [0]
        for step in range(cfg.train.steps):
            if inject_inf_step and step + 1 == inject_inf_step and s.rank == s.ident.world_size - 1:
                _poison_next_gradients(tr)
            last = step + 1 == cfg.train.steps
            with counting_all_gathers(gathers) if last else contextlib.nullcontext():
                row = tr.train_step()
            losses.append(row["loss"])
            norms.append(float(row["grad_norm"]))
            skipped.append(row["skipped"])
            scales.append(row["loss_scale"])
        weights = full_weights(tr.model)
        if s.rank == 0:
            torch.save({"losses": losses, "grad_norms": norms, "skipped": skipped, "scales": scales, "weights": weights,
                        "fsdp": fsdp_reshard([tr.model, *tr.pm.parts]), "gathers": gathers[0]}, out)
    return {"losses": losses}


def _poison_next_gradients(tr: Trainer) -> None:
    """Makes one gradient on this rank infinite in the next step (a hook that fires once)."""
    p = tr.params[0]
    state = {"armed": True}

    def hook(grad):
        if state["armed"]:
            state["armed"] = False
            return torch.full_like(grad, float("inf"))
        return grad

    p.register_hook(hook)


def main(out: str, cases_json: str, base_port: int) -> None:
    rank = int(os.environ["RANK"])
    errors = {}
    for i, case in enumerate(json.loads(cases_json)):
        os.environ["MASTER_PORT"] = str(base_port + i)
        # a case's deliberate bug (hpctrain.mutations.gradient_mutation), for this case only
        os.environ.pop(MUTATION_ENV, None)
        if case.get("mutation"):
            os.environ[MUTATION_ENV] = case["mutation"]
        try:
            run_case(case["overrides"], Path(out) / f"{case['name']}.pt", case.get("inject_inf_step", 0))
        except Exception as e:  # recorded so the test shows which case failed and why
            errors[case["name"]] = f"{type(e).__name__}: {e}"
    os.environ.pop(MUTATION_ENV, None)
    Path(out, f"errors-rank{rank}.json").write_text(json.dumps(errors))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
