"""One layout's prediction, as `hpctrain plan` prints it: the plan's checks (the same make_plan a submission runs),
memory per GPU (the highest peak of live tensor bytes over the pipeline ranks and the dp ranks that hold the most,
peak.py, plus MARGIN), step time, throughput, MFU and HFU (timing.py), and the checkpoint's size, save and
load time, Young/Daly interval and preemption-warning check. Pure: no torch, no process group.

    out = evaluate(cfg, profile("h100-sxm"), storage_gbps=5.0)
    print(describe(out))            # or json.dumps(out)

Not counted: the allocator's fragmentation and caching (MARGIN is added for it), NCCL's own buffers, the CUDA
context.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hpctrain.parallel import mesh
from hpctrain.parallel.plan import make_plan
from hpctrain.planner import timing
from hpctrain.planner.activations import ActivationModel, mode_of
from hpctrain.planner.ckpt_cost import NODE_MTBF_H, checkpoint_bytes, checkpoint_cost
from hpctrain.planner.hardware import CPU
from hpctrain.planner.memory import Coords, host_states, model_states, stage_shapes, tp_local, zero1_partition
from hpctrain.planner.peak import peak

if TYPE_CHECKING:
    from hpctrain.config import Config
    from hpctrain.parallel.plan import Plan
    from hpctrain.planner.hardware import Hardware

GIB = 2 ** 30  # memory figures in GiB: an "80 GB" GPU holds 80 GiB (hardware.Hardware.memory_gib)
MEASURED_SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b")  # in-flight counts measured (planner/peak.py)
MARGIN = 0.10  # of the predicted bytes, for the allocator's fragmentation and buffers not modelled


def peak_per_rank(cfg: Config, plan: Plan) -> tuple[dict[str, Any], dict[str, int]]:
    """The rank that peaks highest (peak.py) among every pipeline rank's dp rank 0 (FSDP's uneven shards give it the
    most rows) and, under ZeRO-1, the dp rank its greedy placement gives the most (memory.max_model_states' ranks):
    its peak, phase, activations and pp rank; and each model-state component at its largest over those ranks."""
    zero, n = cfg.parallel.zero_stage, plan.layout.dp
    best: dict[str, Any] = {}
    every = []
    for pp_rank in range(plan.layout.pp):
        dp_ranks = {0}
        if zero == 1 and n > 1:
            local = {k: tp_local(k, s, plan.layout.tp) for k, s in stage_shapes(plan, pp_rank).items()}
            sizes = zero1_partition(local, n)
            dp_ranks.add(sizes.index(max(sizes)))
        for dp_rank in dp_ranks:
            states = model_states(plan, zero, cfg.train.precision, Coords(pp_rank, dp_rank), cfg.parallel.offload)
            every.append(states)
            out = peak(cfg, plan, states, pp_rank)
            if not best or out["peak"] > best["peak"]:
                best = out | {"pp_rank": pp_rank}
    most = {k: max(s[k] for s in every) for k in ("params", "grads", "optimizer")}
    return best, most | {"total": max(sum(s.values()) for s in every)}


def time_estimate(cfg: Config, plan: Plan, hw: Hardware, host: bool = True,
                  peak_per_rank: bool = False) -> timing.TimeEstimate:
    """hpctrain's own layouts: separate q/k/v and gate/up projections under tensor parallel unless
    model.fused_projections; FSDP accumulates whole gradients and reduce-scatters once per step
    (parallel/data.py); ZeRO-1 all-reduces and broadcasts. A measured (calibrated CPU) profile is one host that
    runs every rank of the job (a local run, or the local Slurm cluster's nodes): its GEMM rate is the host's,
    shared by the ranks, and more ranks than cores slow the host's own work as much, unless peak_per_rank (a
    rate each rank measured with the others computing, one rank per core). A profile calibrated with several ranks
    at once (Hardware.ranks_per_host) holds one rank's figures at that crowding: they stand as they are for a job
    as crowded (ranks per core), and scale with the ratio of the crowdings otherwise. It takes the calibrated efficiency
    and, unless host=False, the host's per-block and per-step work (Hardware.host_*_s)."""
    p, t, lay = cfg.parallel, cfg.train, plan.layout
    cpu = {"block": 0.0, "tp_block": 0.0, "step": 0.0, "token": 0.0}
    if hw.measured and host:
        if lay.tp > 1 and hw.host_tp_block_s is None:
            raise ValueError(f"{hw.name}: the host's work per tensor-parallel block is not calibrated (tp = "
                             f"{lay.tp}): calibrate with the job's ranks at once (`hpctrain plan CONFIG --calibrate "
                             f"--ranks N`), give --hw host_tp_block_s=SECONDS, or plan with tp = 1")
        cpu = {"block": hw.host_block_s or 0.0, "tp_block": hw.host_tp_block_s or 0.0, "step": hw.host_step_s or 0.0,
               "token": hw.host_tp_token_s or 0.0}
    if hw.measured and not peak_per_rank:
        crowd = max(1.0, lay.world_size / hw.gpus_per_node)  # ranks per core (gpus_per_node: the host's cores)
        if hw.ranks_per_host is None:  # the host's whole GEMM rate, shared by the ranks
            share = lay.world_size
        else:  # one rank's figures with ranks_per_host ranks at once: as crowded as they were, or scaled to this
            share = crowd / max(1.0, hw.ranks_per_host / hw.gpus_per_node)
            crowd = share
        hw = hw.with_overrides(**{f"peak_{d}": v / share for d, v in hw.peak_tflops.items()})
        cpu = {k: v * crowd for k, v in cpu.items()}  # host work is CPU time too
    return timing.estimate(timing.Shape.of(plan.dims), hw, seq_len=cfg.data.seq_len, global_batch=plan.global_batch,
                           micro_batch=plan.micro_batch, tp=lay.tp, pp=lay.pp, dp=lay.data, cp=lay.cp,
                           virtual_stages=p.pp_virtual_stages, schedule=p.pp_schedule,
                           # under pipeline parallel hpctrain's ZeRO-3 gathers once per step and keeps the stage
                           # whole (the plan's note): ZeRO-2's traffic
                           zero_stage=2 if p.zero_stage == 3 and lay.pp > 1 else p.zero_stage,
                           accumulate_unsharded=True, zero1_broadcast=True,
                           offload=p.offload if hw.name != CPU else "none",  # on a CPU the host is the device
                           dp_replicate=p.dp_replicate,
                           # DDP reduces ZeRO-0/1 without tp or pp (parallel.data.gradient_sync)
                           ddp_bucket_mb=p.ddp_bucket_mb if lay.tp == 1 and lay.pp == 1 else None,
                           float8_gather=t.fp8_all_gather,
                           sequence_parallel=p.sequence_parallel, recompute=t.ac, ac_every=t.ac_every,
                           precision=t.precision, reduce_dtype=t.reduce_dtype, efficiency=hw.efficiency,
                           tp_projections="fused" if plan.dims.fused_projections else "separate",
                           host_block_s=cpu["tp_block" if lay.tp > 1 else "block"], host_step_s=cpu["step"],
                           host_token_s=cpu["token"] if lay.tp > 1 else 0.0)


def evaluate(cfg: Config, hw: Hardware, storage_gbps: float, node_mtbf_h: float = NODE_MTBF_H,
             plan: Plan | None = None) -> dict[str, Any]:
    """The prediction for cfg's own layout on hw: of `plan` when the caller has made it (a submission), else of
    the plan made here (ValueError for a layout that cannot run, as a submission)."""
    if plan is None:
        plan = make_plan(cfg, mesh.block_placement(cfg.job.nodes, cfg.job.tasks_per_node), training=True)
    worst, states = peak_per_rank(cfg, plan)  # states: as memory.max_model_states, from the same ranks
    acts = worst["activations"]
    total = worst["peak"] * (1 + MARGIN)
    est = time_estimate(cfg, plan, hw)
    ckpt = checkpoint_cost(checkpoint_bytes(plan.dims, cfg.world_size), storage_gbps, cfg.job.nodes, node_mtbf_h,
                           cfg.job.signal_delay_s)
    notes = list(plan.notes)
    if cfg.parallel.pp > 1 and cfg.parallel.pp_schedule not in MEASURED_SCHEDULES:
        notes.append(f"parallel.pp_schedule = {cfg.parallel.pp_schedule!r}: the micro-batches it keeps in flight are "
                     f"not measured (the memory model counts {', '.join(MEASURED_SCHEDULES)}'s; zbv was seen 24% "
                     f"above it): take the memory prediction as a lower bound")
    fits = total <= hw.memory_gib * GIB
    # host memory per node under CPU offload: each rank's offloaded states (its rank with the most: dp rank 0's
    # padded shards), times the ranks a node runs; in GiB, as Slurm counts job.mem_gb (--mem=NG)
    host, host_fits = 0.0, True
    offload = cfg.parallel.offload
    if offload != "none":
        host = max(host_states(plan, Coords(p, 0), cfg.parallel.zero_stage, offload)
                   for p in range(plan.layout.pp)) * cfg.job.tasks_per_node / GIB
        mem = cfg.job.mem_gb
        what = "shards, gradients and AdamW state" if offload == "all" else "AdamW state and fp32 masters"
        notes.append(f"parallel.offload = {offload!r}: {host:.1f} GiB of host memory per node for the offloaded "
                     f"{what} of its {cfg.job.tasks_per_node} ranks (pinned on GPUs), besides what the processes "
                     f"need otherwise" + (f"; job.mem_gb = {mem:g}" if mem else
                                          "; job.mem_gb unset: check it against the nodes' memory"))
        if hw.host_memory_gbps is None and hw.name != CPU:
            notes.append("the optimizer's step on the host is not in the step time: give the nodes' memory "
                         "bandwidth with --hw host_memory_gbps=GB/s (e.g. from a STREAM run) to time it")
        if mem and host > mem:
            fits = host_fits = False
            notes.append(f"does not fit in host memory: {host:.1f} GiB per node predicted for the offloaded states, "
                         f"job.mem_gb = {mem:g}: raise job.mem_gb (up to the nodes' memory), or spread the model "
                         f"over more nodes")
    t = cfg.train
    am = ActivationModel(mode_of(t.precision, cfg.parallel.zero_stage, plan.layout.dp), plan.layout.tp,
                         cfg.parallel.sequence_parallel)
    tokens = plan.micro_batch * cfg.data.seq_len // plan.layout.cp  # a cp rank holds its share of each sequence
    recomputed = {"none": None, "full": am.input_bytes, "every": am.input_bytes}.get(
        t.ac, lambda d, n: am.partial_block_bytes(d, n, t.ac))
    per_layer = {  # one layer, one micro-batch, in bytes: kept whole, and as train.ac keeps a recomputed layer
        "kept": am.block_bytes(plan.dims, tokens) - am.weight_copy_bytes(plan.dims, 1),
        "recomputed": None if recomputed is None else recomputed(plan.dims, tokens)}
    if not fits:
        notes.append(f"does not fit: {total / GIB:.1f} GiB per GPU predicted (peak {worst['peak'] / GIB:.1f} GiB at "
                     f"the {worst['phase']} of pipeline rank {worst['pp_rank']}: model states "
                     f"{states['total'] / GIB:.1f} GiB, activations {acts / GIB:.1f} GiB; +{MARGIN:.0%}), "
                     f"{hw.name} has {hw.memory_gib:g} GiB")
    if ckpt["fits_warning"] is False:
        notes.append(f"a checkpoint save takes about {ckpt['save_s']:.0f} s at {storage_gbps:g} GB/s, longer than "
                     f"job.signal_delay_s = {cfg.job.signal_delay_s}: a preemption or the time limit would end the "
                     f"job before its save commits; raise job.signal_delay_s or save less (ZeRO does not shrink it)")
    return {
        "gpu": hw.name, "layout": {"pp": plan.layout.pp, "dp": plan.layout.data, "tp": plan.layout.tp,
                                          "cp": plan.layout.cp, "zero_stage": cfg.parallel.zero_stage} | (
            {"dp_replicate": plan.layout.replicate} if plan.layout.replicate > 1 else {}),
        "world_size": cfg.world_size, "num_params": plan.dims.num_params(),
        "micro_batch": plan.micro_batch, "global_batch": plan.global_batch, "precision": cfg.train.precision,
        "memory_gib_per_gpu": total / GIB, "model_states_gib": {k: v / GIB for k, v in states.items()},
        "host_memory_gb_per_node": host, "host_fits": host_fits,
        "activations_gib": acts / GIB, "activation_bytes_per_layer": per_layer, "peak_gib": worst["peak"] / GIB,
        "peak_phase": worst["phase"],
        "peak_pp_rank": worst["pp_rank"], "memory_margin": MARGIN, "gpu_memory_gib": hw.memory_gib, "fits": fits,
        "step_time_s": est.step_time_s, "tokens_per_s": est.tokens_per_s,
        "model_tflops_per_gpu": est.model_tflops_per_gpu, "hardware_tflops_per_gpu": est.hardware_tflops_per_gpu,
        "mfu": est.mfu, "hfu": est.hfu, "time_terms": est.terms, "time_basis": est.basis,
        "checkpoint": ckpt | {"storage_gbps": storage_gbps}, "notes": notes,
    }


def describe(out: dict[str, Any]) -> str:
    """A few lines for a terminal."""
    lay, st, ck = out["layout"], out["model_states_gib"], out["checkpoint"]
    device = "ranks (one host)" if out["gpu"] == "cpu" else "GPUs"  # a CPU calibration's name
    cp = f" cp={lay['cp']}" if lay.get("cp", 1) > 1 else ""
    cp += f" (hsdp: {lay['dp_replicate']} replicas)" if lay.get("dp_replicate", 1) > 1 else ""
    lines = [f"layout pp={lay['pp']} dp={lay['dp']}{cp} tp={lay['tp']} zero {lay['zero_stage']} on {out['world_size']} "
             f"{out['gpu']} {device}; {out['num_params'] / 1e9:.3f} B parameters, {out['precision']}, global batch "
             f"{out['global_batch']} (micro {out['micro_batch']})",
             f"memory per GPU: {out['memory_gib_per_gpu']:.2f} GiB of {out['gpu_memory_gib']:g} GiB (GiB: parameters "
             f"{st['params']:.2f}, gradients {st['grads']:.2f}, AdamW {st['optimizer']:.2f}, activations "
             f"{out['activations_gib']:.2f}; peak {out['peak_gib']:.2f} at the {out['peak_phase']}, "
             f"+{out['memory_margin']:.0%}) -> "
             f"{'fits' if out['fits'] else 'DOES NOT FIT'}",
             f"step {out['step_time_s']:.3g} s: {out['tokens_per_s']:,.0f} tokens/s, "
             f"{out['model_tflops_per_gpu']:.3g} TFLOP/s per GPU (MFU {out['mfu']:.1%}, HFU {out['hfu']:.1%})",
             f"checkpoint {ck['size_gb']:.2f} GB: save/load {ck['save_s']:.1f} s at {ck['storage_gbps']:g} GB/s; "
             f"job MTBF {ck['job_mtbf_h']:.1f} h -> save every {ck['young_daly_interval_s'] / 60:.1f} min "
             f"(Young/Daly)"]
    lines += [f"note: {n}" for n in out["notes"]]
    return "\n".join(lines)
