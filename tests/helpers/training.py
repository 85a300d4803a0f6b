"""Training references: the tiny model's settings, one case trained in one process with the product's own loop
(run_case), the layout spawn of workers/train_worker.py and its comparison with the 1-rank reference, and what a
rank draws at initialisation (counting_tiles, touched).
"""
from __future__ import annotations

import contextlib
import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING
from unittest import mock

import torch

from helpers.launch import WORKERS, free_base_port, spawn_ranks

if TYPE_CHECKING:
    import subprocess

    from hpctrain.train.trainer import Trainer


# run_case runs in the test process as the 1-rank reference (multiproc/parallel/test_train_equivalence.py,
# multiproc/parallel/test_grad_scale_mutations.py) and in every rank of workers/train_worker.py.

TINY = ["model.vocab_size=256", "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.max_seq_len=64",
        "data.source=synthetic", "data.seq_len=32", "train.steps=8", "train.lr=1e-3", "train.warmup_steps=2",
        "train.log_every=100", "train.peak_tflops=1", "train.micro_batch_size=8", "parallel.pp=1",
        "parallel.tp=1", "parallel.dp=-1", "parallel.timeout_s=180"]
# a smaller model still, for the one-process checkpoint tests
SMALL = TINY + ["model.dim=32", "model.n_heads=2", "model.n_layers=1", "data.seq_len=16", "train.micro_batch_size=2"]


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


def fsdp_groups(modules) -> dict[str, object]:
    """The FSDP parameter group of every FSDP module that holds parameters (blocks, roots, pipeline stage roots)."""
    from torch.distributed.fsdp import FSDPModule
    out, seen = {}, set()
    for k, root in enumerate(modules):
        for name, m in root.named_modules():
            if isinstance(m, FSDPModule) and id(m) not in seen:
                seen.add(id(m))
                group = m._get_fsdp_state()._fsdp_param_group
                if group is not None:
                    out[name or f"root{k}"] = group
    return out


def fsdp_reshard(modules) -> dict[str, bool]:
    """reshard_after_forward of every FSDP module that holds parameters."""
    return {name: g._reshard_after_forward for name, g in fsdp_groups(modules).items()}


def fsdp_meshes(modules) -> dict[str, tuple[int, ...]]:
    """The shape of the mesh each FSDP module shards over: (dp,) for FSDP, (replicas, shards) for HSDP."""
    return {name: tuple(g.mesh_info.mesh.shape) for name, g in fsdp_groups(modules).items()}


def fsdp_prefetch(modules) -> dict[str, int]:
    """How many modules each FSDP module gathers ahead of its forward (parallel.fsdp_prefetch; FSDP's implicit
    prefetch of one is not listed: 0)."""
    from torch.distributed.fsdp import FSDPModule
    return {name: len(m._get_fsdp_state()._states_to_forward_prefetch or []) for k, root in enumerate(modules)
            for name, m in root.named_modules() if isinstance(m, FSDPModule) and name.startswith("layers.")}


def fsdp_offload(modules) -> dict[str, bool]:
    """Whether each FSDP module keeps its shards in host memory (CPUOffloadPolicy: parallel.offload = "all")."""
    from torch.distributed.fsdp import CPUOffloadPolicy
    return {name: isinstance(g.offload_policy, CPUOffloadPolicy) for name, g in fsdp_groups(modules).items()}


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


def run_case(overrides: list[str], out: Path, inject_inf_step: int = 0, fp8: str = "",
             fp8_all_gather: bool = False) -> dict:
    """Trains one case with the product's own loop (Trainer.fit, checkpoints off) and watches every step through
    fit's on_step; rank 0 saves {"losses", "grad_norms", "skipped", "scales", "weights", "fsdp", "gathers"} to
    `out`. grad_norms: the global pre-clip norm of each step (inf on a step skipped for non-finite gradients);
    gathers: FSDP's all-gathers during the last step. inject_inf_step: the last rank's gradients turn infinite
    in that step. fp8: "rowwise" or "tensorwise" trains with train.precision = "fp8" on this CPU (torchao's
    float8 layers, their scaled matmuls emulated), which the product refuses for a CPU job: the config is loaded in
    bf16 and switched after its checks, and the trainer's device check is lifted for the case; fp8_all_gather sets
    train.fp8_all_gather with it."""
    from hpctrain.config import load_config
    from hpctrain.job import session
    from hpctrain.train.metrics import host_values
    from hpctrain.train.trainer import Trainer

    cfg = load_config(None, TINY + ["checkpoint.every_steps=0", "checkpoint.at_end=false"] + overrides
                      + [f"job.run_root={out.parent / (out.stem + '-runs')}"])
    steps = cfg.train.steps
    lifted = contextlib.ExitStack()
    if fp8:
        from hpctrain.train import trainer
        assert cfg.train.precision == "bf16", "an fp8 case is loaded in bf16, then switched"
        cfg.train.precision, cfg.train.fp8_scaling, cfg.train.fp8_all_gather = "fp8", fp8, fp8_all_gather
        lifted.enter_context(mock.patch.object(trainer, "float8_refusal", lambda *args: ""))
    with lifted, session.start(cfg) as s:
        tr = Trainer(cfg, s)
        poison = inject_inf_step and s.rank == s.ident.world_size - 1
        rows, gathers = [], [0]
        counting = contextlib.ExitStack()

        def before(step: int) -> None:  # what runs ahead of `step`
            if poison and step == inject_inf_step:
                _poison_next_gradients(tr)
            if step == steps:
                counting.enter_context(counting_all_gathers(gathers))

        def watch(row: dict) -> None:
            rows.append(host_values(row))
            if row["step"] == steps:
                counting.close()
            before(row["step"] + 1)

        before(1)
        with counting:
            summary = tr.fit(on_step=watch)
        first = 1 if cfg.train.resume in ("auto", "none") else rows[0]["step"]  # a named checkpoint: after it
        assert [r["step"] for r in rows] == list(range(first, steps + 1)) and summary["losses"] == [
            r["loss"] for r in rows]
        weights = full_weights(tr.model)
        # what a pipeline's stages still hold of the last step's outputs (the schedule's merged output: logits)
        import torch.distributed as dist
        kept = torch.tensor(float(sum(len(st.output_chunks) for st in tr.pipe.stages) if tr.pipe else 0))
        # and the receive buffers its stages hold between steps (each dropped after its micro-batch's backward)
        held = torch.tensor(float(sum(st.held_buffers() for st in tr.pipe.stages) if tr.pipe else 0))
        if dist.is_initialized():
            dist.all_reduce(kept)
            dist.all_reduce(held)
        if s.rank == 0:
            torch.save({"losses": summary["losses"], "grad_norms": [float(r["grad_norm"]) for r in rows],
                        "skipped": [bool(r["skipped"]) for r in rows], "scales": [r["loss_scale"] for r in rows],
                        "weights": weights, "fsdp": fsdp_reshard([tr.model, *tr.pm.parts]), "gathers": gathers[0],
                        "outputs_kept": int(kept), "recv_buffers": int(held),
                        "offload": fsdp_offload([tr.model, *tr.pm.parts]),
                        "fsdp_mesh": fsdp_meshes([tr.model, *tr.pm.parts]),
                        "prefetch": fsdp_prefetch([tr.model, *tr.pm.parts]),
                        "ddp_bucket_bytes": getattr(tr.model, "bucket_bytes_cap", None),
                        "compiled": len({id(m) for part in [tr.model, *tr.pm.parts] for m in part.modules()
                                         if type(m).__name__.endswith("OptimizedModule")
                                         or getattr(m, "_compiled_call_impl", None) is not None}),
                        # parallel.offload = "optimizer": AdamW's masters and state in host memory
                        "host_optimizer": type(tr.optimizer).__name__ == "HostAdamW" and all(
                            m.device.type == "cpu" for m in getattr(tr.optimizer, "params_of", {})),
                        "fused": fused_modules([tr.model, *tr.pm.parts]),
                        "float8": sorted({name for part in [tr.model, *tr.pm.parts]
                                          for name, m in part.named_modules() if type(m).__name__ == "Float8Linear"}),
                        # train.fp8_all_gather: FSDP's shards of torchao's float8-gathering weights
                        "float8_gathered": sum(type(getattr(p, "_local_tensor", p)).__name__
                                               == "WeightWithDynamicFloat8CastTensor"
                                               for part in [tr.model, *tr.pm.parts] for p in part.parameters()),
                        "float8_scales": float8_scales(tr.model, weights),
                        "run_dir": str(s.run_dir)},
                       out)
    return {"losses": summary["losses"]}


def float8_scales(model, weights: dict[str, torch.Tensor]) -> dict[str, tuple[float | None, float]]:
    """Under train.fp8_all_gather, each float8-gathered weight's scale as this rank holds it for the next gather
    (None: the gather computes its own) beside the scale of the whole weight after the last step (fp8 max over
    max|w|, in float64 as torchao computes it)."""
    from hpctrain.model.transformer import clean_name
    out = {}
    for name, p in model.named_parameters():
        local = getattr(p, "_local_tensor", p)
        if type(local).__name__ == "WeightWithDynamicFloat8CastTensor":
            whole = weights[clean_name(name)]
            want = (torch.finfo(local._dtype).max / whole.abs().max().double()).float().item()
            held = local._precomputed_scale
            out[clean_name(name)] = (None if held is None else held.item(), want)
    return out


def fused_modules(models) -> dict[str, int]:
    """The fused projections (model.fused_projections) a rank's model parts run, by class: FusedProjection in one
    process, ShardFusedProjection under tensor parallel."""
    from hpctrain.model.transformer import FusedProjection
    found: dict[str, int] = {}
    for m in {id(m): m for part in models for m in part.modules() if isinstance(m, FusedProjection)}.values():
        found[type(m).__name__] = found.get(type(m).__name__, 0) + 1
    return found


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


# --- layout equivalence: a spawn of workers/train_worker.py, and the comparison with the 1-rank reference -------

LOSS_TOL = 2e-5  # fp32, absolute, per step
WEIGHT_TOL = 2e-4  # fp32, max absolute difference of any weight after 8 AdamW steps at lr 1e-3
BF16_LOSS_TOL = 5e-2  # bf16 compute against the fp32 reference
NORM_RTOL = 1e-5  # fp32, relative, per step, the global pre-clip gradient norm: layouts reach 3e-7
BF16_NORM_RTOL = 1e-2  # bf16 (and fp16) compute against the fp32 reference: 1e-3 seen


def spawn_train_worker(world: int, cases: list[dict], out: Path) -> list[subprocess.Popen]:
    """`world` ranks of workers/train_worker.py on one node, each training every case in turn."""
    cmd = [sys.executable, str(WORKERS / "train_worker.py"), str(out), json.dumps(cases),
           str(free_base_port(len(cases)))]
    return spawn_ranks(world, cmd, ranks_per_node=world, run_id=f"train-{world}")


def compare_losses(got: dict, ref: dict, loss_tol: float) -> None:
    diffs = [abs(a - b) for a, b in zip(got["losses"], ref["losses"])]
    assert len(got["losses"]) == len(ref["losses"]) and max(diffs) <= loss_tol, (got["losses"], ref["losses"])


def norm_errors(got: list[float], ref: list[float]) -> list[float]:
    """Per-step relative error of the pre-clip gradient norm against the reference's."""
    assert len(got) == len(ref), (got, ref)
    return [abs(a - b) / b for a, b in zip(got, ref)]


def compare_runs(got: dict, ref: dict, loss_tol: float, weight_tol: float | None, norm_rtol: float) -> None:
    """A layout's run against the single-process reference: losses, gradient norms, and (weight_tol) weights."""
    compare_losses(got, ref, loss_tol)
    # the check that sees a gradient scale: losses and weights do not (AdamW), unless clipping engages
    worst = max(norm_errors(got["grad_norms"], ref["grad_norms"]))
    assert worst <= norm_rtol, f"grad norm relative error {worst:.3g} > {norm_rtol:g}: {got['grad_norms']} vs " \
                               f"{ref['grad_norms']}"
    assert set(got["weights"]) == set(ref["weights"])
    if weight_tol is not None:
        worst = max((got["weights"][k] - ref["weights"][k]).abs().max().item() for k in ref["weights"])
        assert worst <= weight_tol, f"max weight difference {worst}"


# --- initialisation: what a rank draws -------------------------------------------------------------------------

def counting_tiles(monkeypatch) -> dict[str, int]:
    """Elements drawn per parameter name, from the one place that draws (model.init_tile)."""
    from hpctrain.model import transformer as model

    drawn: dict[str, int] = {}
    real = model.init_tile

    def counted(name, *args):
        tile = real(name, *args)
        drawn[name] = drawn.get(name, 0) + tile.numel()
        return tile
    monkeypatch.setattr(model, "init_tile", counted)
    return drawn


def touched(shape, offset, local_shape) -> int:
    """Elements of the tiles a 2-D (or 1-D) box touches: the most a rank may draw for it."""
    from hpctrain.model.transformer import INIT_TILE

    if len(shape) < 2:
        shape, offset, local_shape = (1, *shape), (0, *offset), (1, *local_shape)
    assert len(shape) == 2
    total = 1
    for size, o, n, t in zip(shape, offset, local_shape, INIT_TILE):
        lo, hi = o // t * t, min(size, math.ceil((o + n) / t) * t)
        total *= hi - lo if n else 0
    return total
