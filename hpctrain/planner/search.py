"""`hpctrain plan --search`: every layout of the config's nodes x GPUs per node for its model and global batch,
evaluated like the config's own (report.evaluate: the same plan checks, memory, time), ranked by predicted
throughput among those that fit, and the others counted by why they were refused.

Enumerated: tp and pp among the divisors of the world (the plan's checks refuse tp across nodes, heads or layers
that do not divide, ...), dp the rest; ZeRO stages 0-3; recomputation none, full and every other block; micro-batch
sizes that divide the per-replica batch (grad_accum follows: global = micro x accum x dp); sequence parallel on and
off with tp > 1; with pp > 1 the schedules of SCHEDULES (1F1B, GPipe, interleaved 1F1B with 2 and 4 virtual stages);
context parallel 2, 4, 8, ... where every rank keeps at least MIN_CP_SHARE tokens of a sequence (shorter shares
leave the ring's hops longer than the attention blocks they hide behind); ZeRO-2 and ZeRO-3 with CPU offload when
nothing fits without it. Everything else is the config's. Zero-bubble schedules are not searched: their in-flight
activations (deferred weight gradients) are not in the memory model.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Iterator

from hpctrain.planner.report import evaluate

if TYPE_CHECKING:
    from hpctrain.config import Config
    from hpctrain.planner.hardware import Hardware


# (schedule, virtual stages per rank) tried with pipeline parallel
SCHEDULES = [("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 4)]
MIN_CP_SHARE = 4096  # tokens of a sequence each context-parallel rank keeps, at least
# (ZeRO stage, parallel.offload): every stage; FSDP's stages with their shards in host memory only as a last resort
ZERO_OPTIONS = [(0, "none"), (1, "none"), (2, "none"), (3, "none")]
OFFLOAD_OPTIONS = [(2, "all"), (3, "all")]


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(cfg: Config, global_batch: int, zero_options=ZERO_OPTIONS) -> Iterator[Config]:
    """Every variant of cfg the search evaluates (the config's own global batch, nodes and GPUs per node), with the
    (ZeRO stage, offload) pairs of zero_options."""
    world, seq = cfg.world_size, cfg.data.seq_len
    cps = [c for c in (1, 2, 4, 8, 16, 32, 64) if c == 1 or (seq % (2 * c) == 0 and seq // c >= MIN_CP_SHARE)]
    shapes = [(t, p, c) for t in divisors(world) for p in divisors(world // t) for c in cps if world % (t * p * c) == 0]
    for tp, pp, cp in shapes:
        dp = world // (tp * pp * cp)
        if global_batch % dp:
            continue
        schedules = SCHEDULES if pp > 1 else [("1f1b", 1)]
        for (schedule, virtual), sp, (zero, offload), ac, micro in (
                (s, q, z, a, m) for s in schedules for q in ((False, True) if tp > 1 else (False,))
                for z in zero_options for a in ("none", "full", "every") for m in divisors(global_batch // dp)):
            accum = global_batch // (dp * micro)
            if pp > 1 and accum < pp:  # the schedule needs at least pp micro-batches
                continue
            try:
                parallel = dataclasses.replace(cfg.parallel, tp=tp, pp=pp, dp=dp, cp=cp, zero_stage=zero,
                                               offload=offload, pp_schedule=schedule, pp_virtual_stages=virtual,
                                               sequence_parallel=sp)
                train = dataclasses.replace(cfg.train, ac=ac, ac_every=2, micro_batch_size=micro, grad_accum=accum,
                                            global_batch_size=0)
                variant = dataclasses.replace(cfg, parallel=parallel, train=train)
            except ValueError:
                continue  # a combination the config itself refuses
            yield variant


def search(cfg: Config, hw: Hardware, storage_gbps: float, node_mtbf_h: float,
           global_batch: int) -> tuple[list[dict[str, Any]], dict[str, list[float]]]:
    """(fitting layouts, best first by tokens/s; why the others were refused: reason -> [count, and for running
    out of memory the least and most GiB over the GPU's]). CPU offload is searched only when no layout fits without
    it: its step on the host is timed only where the profile has the host's memory bandwidth (planner.timing), and
    its cost otherwise would look smaller than it is."""
    fit: list[dict[str, Any]] = []
    why: dict[str, list[float]] = {}
    _evaluate_all(candidates(cfg, global_batch), hw, storage_gbps, node_mtbf_h, fit, why)
    if not fit:
        _evaluate_all(candidates(cfg, global_batch, OFFLOAD_OPTIONS), hw, storage_gbps, node_mtbf_h, fit, why)
    fit.sort(key=lambda o: -o["tokens_per_s"])
    return fit, why


def _evaluate_all(variants, hw: Hardware, storage_gbps: float, node_mtbf_h: float, fit: list, why: dict) -> None:
    for variant in variants:
        try:
            out = evaluate(variant, hw, storage_gbps, node_mtbf_h)
        except ValueError as e:
            why.setdefault(str(e).split(";")[0][:160], [0])[0] += 1
            continue
        out["layout"] |= {"micro_batch": variant.train.micro_batch_size, "grad_accum": variant.train.grad_accum,
                          "offload": variant.parallel.offload,
                          "ac": variant.train.ac, "schedule": variant.parallel.pp_schedule,
                          "sequence_parallel": variant.parallel.sequence_parallel,
                          "virtual_stages": variant.parallel.pp_virtual_stages}
        if out["fits"]:
            fit.append(out)
        else:
            over = out["memory_gib_per_gpu"] - hw.memory_gib
            entry = why.setdefault(f"out of memory on {hw.name} ({hw.memory_gib:g} GiB)", [0, over, over])
            entry[0] += 1
            entry[1], entry[2] = min(entry[1], over), max(entry[2], over)


def describe(fit: list[dict[str, Any]], why: dict[str, list[float]], top: int = 15) -> str:
    lines = [f"{len(fit)} layouts fit; the {min(top, len(fit))} fastest predicted:",
             f"  {'tp':>3} {'sp':>3} {'pp':>3} {'cp':>3} {'dp':>5} {'zero':>6} {'ac':>5} {'micro':>5} {'accum':>5} "
             f"{'schedule':>17} "
             f"{'GiB/GPU':>7} {'step s':>8} {'tokens/s':>11} {'MFU':>6}"]
    for o in fit[:top]:
        lay = o["layout"]
        sp = "yes" if lay["sequence_parallel"] else "no"
        schedule = lay["schedule"] + (f" v{lay['virtual_stages']}" if lay["virtual_stages"] > 1 else "")
        zero = f"{lay['zero_stage']}{'+off' if lay['offload'] == 'all' else ''}"
        lines.append(f"  {lay['tp']:>3} {sp:>3} {lay['pp']:>3} {lay['cp']:>3} {lay['dp']:>5} {zero:>6} "
                     f"{lay['ac']:>5} {lay['micro_batch']:>5} {lay['grad_accum']:>5} {schedule:>17} "
                     f"{o['memory_gib_per_gpu']:>7.1f} {o['step_time_s']:>8.3g} {o['tokens_per_s']:>11,.0f} "
                     f"{o['mfu']:>6.1%}")
    if why:
        lines.append(f"{sum(e[0] for e in why.values())} refused:")
        for reason, entry in sorted(why.items(), key=lambda kv: -kv[1][0])[:10]:
            by = f": by {entry[1]:.1f} to {entry[2]:.1f} GiB" if len(entry) == 3 else ""
            lines.append(f"  {int(entry[0]):>5} x {reason}{by}")
    return "\n".join(lines)
