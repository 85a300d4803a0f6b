"""Activation memory saved for backward and step time with train.ac = none, full and every (k=2), one process.

    python benchmarks/activation_checkpointing.py [--rounds 12] [--steps 2] [--budget-s 100]

Memory: one forward (and the loss) of each mode's Trainer model runs under
torch.autograd.graph.saved_tensors_hooks; every tensor autograd packs is recorded by its storage (deduplicated,
so views and the same tensor saved twice count once). Inside a checkpointed block torch's checkpoint installs
its own hooks and saves nothing; what it keeps for the recompute are the block's inputs, recorded by a forward
pre-hook on each checkpoint wrapper. Parameters and buffers (rope tables) are not activations and are left out.
The sum is what the forward leaves alive for backward: the peak of saved activations, reached when forward
ends. Under checkpointing backward adds one recomputed block at a time on top (estimated from the largest block
of the 'none' run and printed beside it).

Time: the three Trainers (same init, same data) alternate rounds of a few steps (none, full, every, ...); step
time ratios to 'none' from the best rounds, the median rounds, and the median of each round's ratio to the 'none'
round beside it (paired); their losses must match step for step. Target: full checkpointing cuts saved
activation memory by >= 50%; the extra step time is reported as a ratio to 'none', beside the ratio that FLOP
counting predicts (one more forward of the checkpointed blocks per step).
Writes benchmarks/results/activation_checkpointing.json.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from _launch import write_results
from hpctrain import session
from hpctrain.config import load_config
from hpctrain.train import Trainer

RESULTS = Path(__file__).resolve().parent / "results"
TARGET = 0.50
LOSS_TOL = 1e-4  # fp32, absolute: recomputation repeats the same kernels on the same inputs
MODES = ("none", "full", "every")
# the overhead benchmark's model and batch: ~10.8M parameters, 6 blocks, 4 x 128 tokens
CASE = ["model.vocab_size=256", "model.dim=384", "model.n_layers=6", "model.n_heads=6", "model.max_seq_len=128",
        "data.source=synthetic", "data.seq_len=128", "train.micro_batch_size=4", "train.ac_every=2",
        "train.peak_tflops=1", "parallel.pp=1", "parallel.tp=1", "parallel.dp=-1", "job.name=bench-ac"]


def saved_activations(tr: Trainer, x: torch.Tensor, y: torch.Tensor) -> dict:
    """Bytes autograd keeps for backward after one forward + loss, and per block (first seen inside it)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    model = tr.model
    state = {p.untyped_storage().data_ptr() for p in model.parameters()}
    state |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    found: dict[int, tuple[int, str, str]] = {}  # storage -> (bytes, where, how)
    keep: list = []  # holds every recorded storage so no address is reused while we count
    where = ["outside blocks"]

    def record(t: torch.Tensor, how: str) -> None:
        st = t.untyped_storage()
        if st.data_ptr() not in state and st.data_ptr() not in found:
            found[st.data_ptr()] = (st.nbytes(), where[0], how)
            keep.append(st)

    def pack(t: torch.Tensor) -> torch.Tensor:
        record(t, "saved")
        return t

    def inputs_kept(module, args) -> None:  # returns None: a pre-hook's return value would replace the args
        for a in args:
            if isinstance(a, torch.Tensor):
                record(a, "checkpoint input")

    hooks = []
    for key, block in model.layers.items():
        hooks.append(block.register_forward_pre_hook(lambda m, a, key=key: where.__setitem__(0, f"block {key}")))
        hooks.append(block.register_forward_hook(lambda m, a, o: where.__setitem__(0, "outside blocks")))
        if isinstance(block, CheckpointWrapper):  # its inputs stay alive for the recompute in backward
            hooks.append(block.register_forward_pre_hook(inputs_kept))  # after `where` is set
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
    for h in hooks:
        h.remove()
    per_block: dict[str, int] = {}
    for nbytes, at, _ in found.values():
        per_block[at] = per_block.get(at, 0) + nbytes
    out = {"total": sum(v[0] for v in found.values()), "num_storages": len(found), "per_region": per_block,
           "checkpoint_inputs": sum(v[0] for v in found.values() if v[2] == "checkpoint input"),
           "loss": loss.item()}
    return out  # the graph (loss) and `keep` go here, freeing what was saved


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--steps", type=int, default=2, help="steps per round")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--budget-s", type=float, default=100.0, help="stop adding rounds after this (>= 3 rounds)")
    ap.add_argument("--run-root", default="/tmp/hpctrain-bench-runs")
    args = ap.parse_args()
    base = CASE + [f"job.run_root={args.run_root}"]
    with session.start(load_config(None, base)) as s:
        trainers = {m: Trainer(load_config(None, base + [f"train.ac={m}"]), s) for m in MODES}
        cfg = trainers["none"].cfg
        x, y = trainers["none"].loader.next_batch()
        trainers["none"].loader.load_state_dict({"epoch": 0, "sample_index": 0, "seed": cfg.train.seed,
                                                  "samples_seen": 0})
        memory = {m: saved_activations(tr, x, y) for m, tr in trainers.items()}
        losses: dict[str, list[float]] = {m: [] for m in MODES}
        times: dict[str, list[float]] = {m: [] for m in MODES}
        for _ in range(args.warmup):
            for m, tr in trainers.items():
                losses[m].append(tr.train_step()["loss"])
        t_start = time.perf_counter()
        for r in range(args.rounds):
            if r >= 3 and time.perf_counter() - t_start > args.budget_s:
                break
            for m, tr in trainers.items():
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    losses[m].append(tr.train_step()["loss"])
                times[m].append(time.perf_counter() - t0)
        report(args, cfg, trainers["none"].pm.dims, memory, losses, times, s.summary.get("cpu_threads_per_rank"))


def report(args, cfg, dims, memory: dict, losses: dict, times: dict, threads) -> None:
    none = memory["none"]["total"]
    blocks = {k: v for k, v in memory["none"]["per_region"].items() if k.startswith("block")}
    largest_block = max(blocks.values())
    # forward FLOPs per token of one block: 2 per matmul weight plus attention's 4 * dim * seq_len
    block_fwd = (2 * (dims.num_params(embeddings=False) - (2 * dims.n_layers + 1) * dims.dim) / dims.n_layers
                 + 4 * dims.dim * cfg.data.seq_len)
    recomputed = {"none": 0, "full": dims.n_layers, "every": len(range(0, dims.n_layers, cfg.train.ac_every))}
    rows = {}
    for m in MODES:
        best, med = min(times[m]) / args.steps, statistics.median(times[m]) / args.steps
        rows[m] = {"saved_bytes": memory[m]["total"], "checkpoint_input_bytes": memory[m]["checkpoint_inputs"],
                   "saved_vs_none": memory[m]["total"] / none,
                   "backward_peak_est_bytes": memory[m]["total"] + (largest_block if m != "none" else 0),
                   "time_vs_none_flops": 1 + recomputed[m] * block_fwd / dims.flops_per_token(cfg.data.seq_len),
                   "step_s_best": best, "step_s_median": med, "per_region": memory[m]["per_region"]}
    for m in MODES:
        rows[m]["time_vs_none_best"] = rows[m]["step_s_best"] / rows["none"]["step_s_best"]
        rows[m]["time_vs_none_median"] = rows[m]["step_s_median"] / rows["none"]["step_s_median"]
        # each round against the 'none' round beside it: cancels drift slower than a round
        rows[m]["time_vs_none_paired"] = statistics.median(t / n for t, n in zip(times[m], times["none"]))
    loss_diff = {m: max(abs(a - b) for a, b in zip(losses[m], losses["none"])) for m in ("full", "every")}
    checks_ok = all(d <= LOSS_TOL for d in loss_diff.values())
    cut = 1 - rows["full"]["saved_vs_none"]
    verdict = "MET" if cut >= TARGET and checks_ok else "NOT MET"
    print(f"# activation checkpointing, 1 rank, {threads} threads, fp32, {dims.num_params() / 1e6:.2f}M params, "
          f"{dims.n_layers} blocks, batch {cfg.train.micro_batch_size} x {cfg.data.seq_len}; "
          f"{len(times['none'])} alternating rounds of {args.steps} steps; MB = 1e6 bytes")
    print(f"# {'ac':<6} {'saved MB':>9} {'vs none':>7} {'ckpt inputs MB':>14} {'bwd peak est MB':>15} "
          f"{'step s best':>11} {'step s med':>10} {'x best':>6} {'x med':>6} {'x pair':>6} {'x FLOP':>6}")
    for m, r in rows.items():
        print(f"  {m:<6} {r['saved_bytes'] / 1e6:>9.2f} {r['saved_vs_none']:>7.3f} "
              f"{r['checkpoint_input_bytes'] / 1e6:>14.2f} {r['backward_peak_est_bytes'] / 1e6:>15.2f} "
              f"{r['step_s_best']:>11.4f} {r['step_s_median']:>10.4f} {r['time_vs_none_best']:>6.3f} "
              f"{r['time_vs_none_median']:>6.3f} {r['time_vs_none_paired']:>6.3f} {r['time_vs_none_flops']:>6.3f}")
    outside = memory["none"]["per_region"].get("outside blocks", 0)
    print(f"# 'none': largest block saves {largest_block / 1e6:.2f} MB, outside blocks {outside / 1e6:.2f} MB "
          f"(embedding, final norm, logits, loss); bwd peak est = saved + one recomputed block")
    print(f"# checks: max |loss - loss(none)| full {loss_diff['full']:.2e}, every {loss_diff['every']:.2e} "
          f"(tol {LOSS_TOL:g}, {len(losses['none'])} steps)")
    x = {m: f"x{rows[m]['time_vs_none_best']:.3f} best, x{rows[m]['time_vs_none_median']:.3f} median, "
            f"x{rows[m]['time_vs_none_paired']:.3f} paired" for m in ("full", "every")}
    print(f"# full checkpointing cuts saved activations by {cut:.1%} (target >= {TARGET:.0%}: {verdict}); "
          f"step time {x['full']} (FLOPs predict x{rows['full']['time_vs_none_flops']:.3f}); every-2 cuts "
          f"{1 - rows['every']['saved_vs_none']:.1%} for {x['every']}")
    write_results("activation_checkpointing.json", {
        "cut_full": cut, "target": TARGET, "verdict": verdict, "rows": rows, "loss_diff": loss_diff,
        "loss_tol": LOSS_TOL, "times_s": times, "steps_per_round": args.steps, "threads": threads,
        "params": dims.num_params(), "batch": cfg.train.micro_batch_size, "seq_len": cfg.data.seq_len,
        "torch": torch.__version__, "when": time.strftime("%Y-%m-%dT%H:%M:%S")})
    if not checks_ok:
        sys.exit("check failed: the compared loops do not train the same model on the same data")


if __name__ == "__main__":
    main()
