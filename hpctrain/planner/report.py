"""One layout's prediction, as `hpctrain plan` prints it: the plan's checks (the same make_plan a submission runs),
model-state memory per GPU on the rank that holds the most, and the checkpoint's size, save and load time,
Young/Daly interval and preemption-warning check. Pure: no torch, no process group.

    out = evaluate(cfg, profile("h100-sxm"), storage_gbps=5.0)
    print(describe(out))            # or json.dumps(out)

Activation memory and step time are not predicted yet (issue 15 goes on): `memory_gb_per_gpu` counts model states
only, a lower bound, and says so in `notes`; a layout whose model states alone exceed the GPU's memory cannot fit.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from hpctrain import mesh
from hpctrain.plan import make_plan
from hpctrain.planner.ckpt_cost import NODE_MTBF_H, checkpoint_bytes, checkpoint_cost
from hpctrain.planner.memory import max_model_states

if TYPE_CHECKING:
    from hpctrain.config import Config
    from hpctrain.plan import Plan
    from hpctrain.planner.hardware import Hardware

GB = 1e9


def evaluate(cfg: Config, hw: Hardware, storage_gbps: float, node_mtbf_h: float = NODE_MTBF_H,
             plan: Plan | None = None) -> dict[str, Any]:
    """The prediction for cfg's own layout on hw: of `plan` when the caller has made it (a submission), else of
    the plan made here (ValueError for a layout that cannot run, as a submission)."""
    if plan is None:
        plan = make_plan(cfg, mesh.block_placement(cfg.job.nodes, cfg.job.tasks_per_node), training=True)
    states = max_model_states(plan, cfg.parallel.zero_stage, cfg.train.precision)
    ckpt = checkpoint_cost(checkpoint_bytes(plan.dims, cfg.world_size), storage_gbps, cfg.job.nodes, node_mtbf_h,
                           cfg.job.signal_delay_s)
    notes = list(plan.notes) + ["memory_gb_per_gpu counts model states only (parameters, gradients, AdamW): "
                                "activations and buffers come on top, not predicted yet"]
    fits = states["total"] <= hw.memory_gb * GB
    if not fits:
        notes.append(f"does not fit: model states alone need {states['total'] / GB:.1f} GB per GPU, "
                     f"{hw.name} has {hw.memory_gb:g} GB")
    if ckpt["fits_warning"] is False:
        notes.append(f"a checkpoint save takes about {ckpt['save_s']:.0f} s at {storage_gbps:g} GB/s, longer than "
                     f"job.signal_delay_s = {cfg.job.signal_delay_s}: a preemption or the time limit would end the "
                     f"job before its save commits; raise job.signal_delay_s or save less (ZeRO does not shrink it)")
    return {
        "gpu": hw.name, "layout": dataclasses.asdict(plan.layout) | {"zero_stage": cfg.parallel.zero_stage},
        "world_size": cfg.world_size, "num_params": plan.dims.num_params(),
        "micro_batch": plan.micro_batch, "global_batch": plan.global_batch, "precision": cfg.train.precision,
        "memory_gb_per_gpu": states["total"] / GB, "model_states_gb": {k: v / GB for k, v in states.items()},
        "gpu_memory_gb": hw.memory_gb, "fits": fits, "checkpoint": ckpt | {"storage_gbps": storage_gbps},
        "step_time_s": None, "tokens_per_s": None, "notes": notes,
    }


def describe(out: dict[str, Any]) -> str:
    """A few lines for a terminal."""
    lay, st, ck = out["layout"], out["model_states_gb"], out["checkpoint"]
    lines = [f"layout pp={lay['pp']} dp={lay['dp']} tp={lay['tp']} zero {lay['zero_stage']} on {out['world_size']} "
             f"{out['gpu']} GPUs; {out['num_params'] / 1e9:.3f} B parameters, {out['precision']}, global batch "
             f"{out['global_batch']} (micro {out['micro_batch']})",
             f"memory per GPU (largest rank): model states {out['memory_gb_per_gpu']:.2f} GB of "
             f"{out['gpu_memory_gb']:g} GB (parameters {st['params']:.2f}, gradients {st['grads']:.2f}, AdamW "
             f"{st['optimizer']:.2f}) -> {'fits' if out['fits'] else 'DOES NOT FIT'}",
             f"checkpoint {ck['size_gb']:.2f} GB: save/load {ck['save_s']:.1f} s at {ck['storage_gbps']:g} GB/s; "
             f"job MTBF {ck['job_mtbf_h']:.1f} h -> save every {ck['young_daly_interval_s'] / 60:.1f} min "
             f"(Young/Daly)"]
    lines += [f"note: {n}" for n in out["notes"]]
    return "\n".join(lines)
