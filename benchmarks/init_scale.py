"""Initialisation of one rank of the 70B example (slurm/examples/llama-70b.toml: tp 8 x dp 16, ZeRO-3, 128 ranks),
simulated on CPU: time and peak host memory of filling the rank's shards, against the rank's shard bytes.

    python benchmarks/init_scale.py [--rank 9] [--rounds 3] [--small-dim 1024 --small-layers 4]

One process joins torch's fake process group as rank R of 128 (its collectives do nothing: it only gives the
rank's mesh coordinates, hence its shard shapes and offsets; correctness is
tests/multiproc/model/test_init_scale_shards.py's, on real gloo ranks). The model is built as the trainer builds it
(meta
device, TP plan, checkpointing, FSDP2), then:
  alloc+fill  parallel.materialize.materialize: the shards allocated (to_empty) and filled tile by tile (init_weights);
  memory      the resident-set high-water mark (VmHWM, reset through /proc/self/clear_refs just before) minus
              the resident set before: it counts the shards' pages themselves (untouched until filled) plus every
              temporary of the fill; no device here, so host memory is the whole story on CPU;
  drawn       elements drawn by the generators per parameter (model.init_tile instrumented): no sharded
              parameter may be drawn whole.
Targets, each its own verdict under benchmarks/README.md's rule: no full unsharded tensor of a sharded parameter
on the rank (the count of sharded parameters drawn whole <= 0; counted, deterministic: one round), and memory
within 10% of its shard bytes (peak RSS rise / shard bytes <= 1.10, the median over --rounds fills of the 70B
rank, all counted, each in a fresh process: in one process a second fill reuses the pages the first one freed and
shows no rise at all).
Beside it, for comparison only, the old path (every full parameter drawn on the host, then sliced) on the same
layout with a smaller model (--small-dim, --small-layers): the old path at 70B would draw 70 billion values.
The small model's shards are a few MiB, so its memory figures are noise beside the old path's full tensors.
Writes benchmarks/results/init_scale.json.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from _verdict import verdict as rule_verdict

from _launch import write_results
from hpctrain.config import load_config
from hpctrain.model import transformer as model_mod
from hpctrain.parallel import compose, materialize
from hpctrain.parallel import mesh as mesh_mod

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

EXAMPLE = REPO / "slurm" / "examples" / "llama-70b.toml"
TARGET = 0.10
GiB = 2 ** 30


def rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # Linux: VmHWM back to the current resident set


def old_fill(model, dims, seed: int) -> None:
    """The previous materialize: each full parameter drawn on the host from one generator, then sliced."""
    import zlib

    from torch.distributed.tensor import DTensor, distribute_tensor
    with torch.no_grad():
        for name, p in model.named_parameters():
            name = model_mod.clean_name(name)
            std = model_mod.init_std(name, dims)
            if std is None:
                full = torch.ones(p.shape)
            else:
                g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
                full = torch.randn(p.shape, generator=g) * std
            if isinstance(p, DTensor):
                p.to_local().copy_(distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local())
            else:
                p.copy_(full)


def measure(cfg, mesh, old: bool) -> dict:
    """Builds the rank's model unfilled on the meta device, then times allocation + fill with the peak memory."""
    drawn: dict[str, int] = {}
    real = model_mod.init_tile

    def counted(name, *args):
        tile = real(name, *args)
        drawn[name] = drawn.get(name, 0) + tile.numel()
        return tile
    model_mod.init_tile = counted
    meta = compose.materialize
    compose.materialize = lambda *a, **k: None  # build leaves the model on the meta device; timed below
    try:
        pm = compose.build(cfg, mesh, torch.device("cpu"), fill=False)
    finally:
        compose.materialize = meta
    gc.collect()
    base = rss_kib("VmRSS")
    reset_peak()
    t0 = time.perf_counter()
    materialize.materialize(pm.model, pm.dims, cfg.train.seed, torch.device("cpu"), pm.parts or None, fill=not old)
    if old:
        old_fill(pm.model, pm.dims, cfg.train.seed)
    seconds = time.perf_counter() - t0
    peak = (rss_kib("VmHWM") - base) * 1024
    model_mod.init_tile = real
    shard_bytes, storage, whole, params = 0, set(), [], 0
    for name, p in pm.model.named_parameters():
        offset, local_shape = materialize.shard_box(p)
        local = p.to_local() if hasattr(p, "to_local") else p
        shard_bytes += math.prod(local_shape) * local.element_size()
        storage.add((local.untyped_storage().data_ptr(), local.untyped_storage().nbytes()))
        params += 1
        name = model_mod.clean_name(name)
        if math.prod(local_shape) < p.numel() and drawn.get(name, 0) >= p.numel():
            whole.append(name)  # a sharded parameter drawn whole
    shard_elems = shard_bytes // 4
    out = {"path": "old (full tensor, then slice)" if old else "tiles (shard only)", "dims": pm.dims.__dict__,
           "params": params, "seconds": seconds, "peak_rss_delta_bytes": peak, "shard_bytes": shard_bytes,
           "storage_bytes": sum(n for _, n in storage), "drawn_elements": sum(drawn.values()) if not old else None,
           "drawn_over_shard": sum(drawn.values()) / shard_elems if not old else None,
           "full_model_elements": pm.dims.num_params(), "sharded_params_drawn_whole": whole if not old else None,
           "memory_over_shard": peak / shard_bytes}
    del pm
    gc.collect()
    return out


def line(r: dict) -> str:
    drawn = f", drew {r['drawn_over_shard']:.3f}x the shard" if r["drawn_over_shard"] is not None else ""
    return (f"{r['path']:32s} {r['seconds']:8.2f} s  peak RSS +{r['peak_rss_delta_bytes'] / GiB:7.3f} GiB  shard "
            f"{r['shard_bytes'] / GiB:7.3f} GiB (storage {r['storage_bytes'] / GiB:.3f})  memory/shard "
            f"{r['memory_over_shard']:.3f}{drawn}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=str(EXAMPLE))
    ap.add_argument("--rank", type=int, default=9, help="the simulated rank (9: tp rank 1 of dp rank 1)")
    ap.add_argument("--small-dim", type=int, default=1024, help="the old path's comparison model: dim")
    ap.add_argument("--small-layers", type=int, default=4, help="... and layers (0: skip the comparison)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a rank's host share; randn is serial)")
    ap.add_argument("--rounds", type=int, default=3, help="fills of the 70B rank, a process each (~15 s here)")
    ap.add_argument("--one-fill", default="", help=argparse.SUPPRESS)  # a round's process: its JSON goes here
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from torch.testing._internal.distributed.fake_pg import FakeStore
    cfg = load_config(args.config)
    world = cfg.job.nodes * cfg.job.tasks_per_node
    p = cfg.parallel
    layout = mesh_mod.resolve_layout(p.pp, p.dp, p.tp, world)
    free = int(Path("/proc/meminfo").read_text().split("MemAvailable:")[1].split()[0]) * 1024
    dist.init_process_group("fake", store=FakeStore(), rank=args.rank, world_size=world)
    mesh = mesh_mod.build_mesh(layout, mesh_mod.block_placement(cfg.job.nodes, cfg.job.tasks_per_node), "cpu")
    print(f"# {args.config}: layout {layout}, rank {args.rank} of {world} {layout.coords(args.rank)}, "
          f"{torch.get_num_threads()} torch thread(s), {free / GiB:.1f} GiB available", flush=True)
    need = model_mod.ModelDims.from_config(cfg.model, layout.tp).num_params() * 4 / world  # fp32 shards
    if need * (1 + TARGET) > free:
        sys.exit(f"about {need / GiB:.1f} GiB needed for the rank's fp32 shards, {free / GiB:.1f} GiB available")
    if args.one_fill:
        Path(args.one_fill).write_text(json.dumps(measure(cfg, mesh, old=False)))
        dist.destroy_process_group()
        return
    rows = []
    if args.small_layers:  # first: the old path's full tensors are freed (unmapped) before the big run starts
        small = load_config(args.config, [f"model.dim={args.small_dim}", f"model.n_layers={args.small_layers}",
                                          f"model.ffn_dim={args.small_dim * 7 // 2}"])
        for old in (False, True):
            rows.append(measure(small, mesh, old=old))
            print(f"small: {line(rows[-1])}", flush=True)
    bigs = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            out = Path(tmp) / f"round-{r}.json"
            subprocess.run([sys.executable, __file__, "--config", args.config, "--rank", str(args.rank),
                            "--threads", str(args.threads), "--one-fill", str(out)], check=True)
            bigs.append(json.loads(out.read_text()))
            print(f"70B, round {r}: {line(bigs[-1])}", flush=True)
    rows = bigs + rows
    whole = [len(b["sharded_params_drawn_whole"]) for b in bigs]
    assert len(set(whole)) == 1, f"the draw is deterministic, yet rounds differ: {whole}"
    dist.destroy_process_group()
    verdicts = [
        rule_verdict("init_scale", "70B rank init: sharded params drawn whole", whole[:1], 0, better="lower",
                     unit="params", note=f"rank {args.rank} of {world} ({layout}), model.init_tile counted; "
                                         f"deterministic"),
        rule_verdict("init_scale", "70B rank init: peak RSS rise / shard bytes", [b["memory_over_shard"] for b in bigs],
                     1 + TARGET, better="lower",
                     note=f"rank {args.rank} of {world}, VmHWM after clear_refs minus VmRSS before, fp32 shards "
                          f"{bigs[0]['shard_bytes'] / GiB:.2f} GiB; one fill per round"),
    ]
    b = bigs[0]
    print(f"# {b['drawn_over_shard']:.3f}x the shard drawn, {b['drawn_elements'] / 1e9:.3f}e9 of the model's "
          f"{b['full_model_elements'] / 1e9:.1f}e9 values", flush=True)
    write_results("init_scale.json", {"verdicts": verdicts,
                                      "config": str(Path(args.config).resolve().relative_to(REPO)), "rank": args.rank,
                                      "world_size": world, "layout": str(layout), "threads": torch.get_num_threads(),
                                      "memory_measure": "VmHWM after clear_refs minus VmRSS before, bytes",
                                      "rounds": args.rounds, "runs": rows,
                                      "torch": torch.__version__, "when": time.strftime("%Y-%m-%dT%H:%M:%S")})


if __name__ == "__main__":
    main()
