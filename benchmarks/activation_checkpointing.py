"""Peak activation memory over forward + backward and step time with train.ac = none, full and every (k=2), one
process, fp32 on CPU.

    python benchmarks/activation_checkpointing.py [--rounds 12] [--steps 2]

Memory (bytes counted, deterministic): one forward (and the loss) of each mode's Trainer model runs under
torch.autograd.graph.saved_tensors_hooks; every tensor autograd packs is recorded by its storage (deduplicated,
so views and the same tensor saved twice count once). Inside a checkpointed block torch's checkpoint installs
its own hooks and saves nothing; what it keeps for the recompute are the block's inputs, recorded by a forward
pre-hook on each checkpoint wrapper. Parameters and buffers (rope tables) are not activations and are left out.
That sum is what forward leaves alive for backward. Backward then frees saved tensors as it goes, and under
checkpointing recomputes one block at a time, which saves again exactly what that block saved in the 'none'
forward (the same ops on the same input; measured there per block). The peak over forward + backward is
therefore: 'none': the saved bytes at the end of forward; checkpointed modes: the saved bytes at the end of
forward + the largest recomputed block's saved bytes (an upper bound: by the time a block recomputes, the loss
and output layer have freed theirs). Headline (benchmarks/README.md's rule, one round since bytes are counted):
1 - peak(full) / peak(none), target >= 50% less peak activation memory. Printed beside it (raw data): the
saved bytes at the end of forward alone (the old headline), and the CPU allocator's peak over one forward +
backward above what was allocated before it (torch.profiler, profile_memory), which also counts parameter
gradients and temporaries.

Time: the three Trainers (same init, same data) run --rounds rounds of --steps steps each, the order reversed
every other round (_verdict.balanced); their losses must match step for step. Second verdict: the step time of
full checkpointing over 'none', paired per round, median; target, fixed before the run: no more than FLOP
counting predicts (1 + one more forward of every block / the step's FLOPs).
Writes benchmarks/results/activation_checkpointing.json.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from _verdict import balanced
from _verdict import verdict as rule_verdict

from _launch import write_results
from hpctrain.config import load_config
from hpctrain.job import session
from hpctrain.train.trainer import Trainer

RESULTS = Path(__file__).resolve().parent / "results"
TARGET = 0.50  # full AC: peak activation memory over forward + backward at least 50% below 'none'
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


def allocator_peak(tr: Trainer, x: torch.Tensor, y: torch.Tensor) -> dict:
    """The CPU allocator's bytes over one forward + loss + backward (torch.profiler's memory events, in order):
    the peak and the end, above what was allocated before; gradients set to None before and after."""
    from torch.profiler import ProfilerActivity, profile
    model = tr.model
    model.zero_grad(set_to_none=True)
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        loss.backward()
        del logits, loss
    model.zero_grad(set_to_none=True)
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    cur = peak = 0
    for e in events:
        cur += e.nbytes()
        peak = max(peak, cur)
    return {"peak_bytes": peak, "end_bytes": cur, "events": len(events)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--steps", type=int, default=2, help="steps per round")
    ap.add_argument("--warmup", type=int, default=2)
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
        for m, tr in trainers.items():
            memory[m]["allocator"] = allocator_peak(tr, x, y)
        losses: dict[str, list[float]] = {m: [] for m in MODES}
        times: dict[str, list[float]] = {m: [] for m in MODES}
        for _ in range(args.warmup):
            for m, tr in trainers.items():
                losses[m].append(tr.train_step()["loss"])
        for r in range(args.rounds):
            for m in balanced(r, MODES):
                tr = trainers[m]
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    losses[m].append(tr.train_step()["loss"])
                times[m].append(time.perf_counter() - t0)
        report(args, cfg, trainers["none"].pm.dims, memory, losses, times, s.summary.get("cpu_threads_per_rank"))


def report(args, cfg, dims, memory: dict, losses: dict, times: dict, threads) -> None:
    none = memory["none"]["total"]
    blocks = {k: v for k, v in memory["none"]["per_region"].items() if k.startswith("block")}
    # forward FLOPs per token of one block: 2 per matmul weight plus attention's 4 * dim * seq_len
    block_fwd = (2 * (dims.num_params(embeddings=False) - (2 * dims.n_layers + 1) * dims.dim) / dims.n_layers
                 + 4 * dims.dim * cfg.data.seq_len)
    keys = sorted(blocks, key=lambda k: int(k.split()[1]))
    checkpointed = {"none": [], "full": keys, "every": keys[::cfg.train.ac_every]}  # recompute.apply_ac's choice
    rows = {}
    for m in MODES:
        recompute = max((blocks[k] for k in checkpointed[m]), default=0)  # one block recomputed at a time
        alloc = memory[m]["allocator"]
        rows[m] = {"peak_bytes": memory[m]["total"] + recompute, "saved_bytes": memory[m]["total"],
                   "largest_recomputed_block_bytes": recompute,
                   "checkpoint_input_bytes": memory[m]["checkpoint_inputs"],
                   "allocator_peak_bytes": alloc["peak_bytes"], "allocator_end_bytes": alloc["end_bytes"],
                   "time_vs_none_flops": 1 + len(checkpointed[m]) * block_fwd / dims.flops_per_token(cfg.data.seq_len),
                   "step_s_median": statistics.median(times[m]) / args.steps, "per_region": memory[m]["per_region"]}
    for m in MODES:
        r = rows[m]
        r["peak_vs_none"] = r["peak_bytes"] / rows["none"]["peak_bytes"]
        r["saved_vs_none"] = r["saved_bytes"] / none
        r["allocator_peak_vs_none"] = r["allocator_peak_bytes"] / rows["none"]["allocator_peak_bytes"]
        # each round against the 'none' round of the same round
        r["time_vs_none_per_round"] = [t / n for t, n in zip(times[m], times["none"])]
        r["time_vs_none_median"] = statistics.median(r["time_vs_none_per_round"])
    loss_diff = {m: max(abs(a - b) for a, b in zip(losses[m], losses["none"])) for m in ("full", "every")}
    checks_ok = all(d <= LOSS_TOL for d in loss_diff.values())
    print(f"# activation checkpointing, 1 rank, {threads} threads, fp32, {dims.num_params() / 1e6:.2f}M params, "
          f"{dims.n_layers} blocks, batch {cfg.train.micro_batch_size} x {cfg.data.seq_len}; "
          f"{len(times['none'])} rounds of {args.steps} steps, order alternating; MB = 1e6 bytes")
    print(f"# {'ac':<6} {'peak MB':>8} {'vs none':>7} {'saved MB':>9} {'vs none':>7} {'ckpt in MB':>10} "
          f"{'alloc pk MB':>11} {'vs none':>7} {'step s med':>10} {'x pair':>6} {'x FLOP':>6}")
    for m, r in rows.items():
        print(f"  {m:<6} {r['peak_bytes'] / 1e6:>8.2f} {r['peak_vs_none']:>7.3f} {r['saved_bytes'] / 1e6:>9.2f} "
              f"{r['saved_vs_none']:>7.3f} {r['checkpoint_input_bytes'] / 1e6:>10.2f} "
              f"{r['allocator_peak_bytes'] / 1e6:>11.2f} {r['allocator_peak_vs_none']:>7.3f} "
              f"{r['step_s_median']:>10.4f} {r['time_vs_none_median']:>6.3f} {r['time_vs_none_flops']:>6.3f}")
    outside = memory["none"]["per_region"].get("outside blocks", 0)
    big = max(blocks.values())
    print(f"# peak = saved at the end of forward + the largest recomputed block ('none': {big / 1e6:.2f} MB a block,"
          f" outside blocks {outside / 1e6:.2f} MB); alloc pk = the CPU allocator's peak over forward + "
          f"backward above its start (gradients and temporaries included)")
    print(f"# checks: max |loss - loss(none)| full {loss_diff['full']:.2e}, every {loss_diff['every']:.2e} "
          f"(tol {LOSS_TOL:g}, {len(losses['none'])} steps)")
    full = rows["full"]
    verdicts = [
        rule_verdict("activation_checkpointing", "full AC: peak activation memory (fwd+bwd) cut vs none",
                     [1 - full["peak_vs_none"]], TARGET, better="higher", unit="fraction",
                     note=f"saved tensors at the end of forward + the largest recomputed block, {dims.n_layers} "
                          f"blocks, batch {cfg.train.micro_batch_size}x{cfg.data.seq_len}; bytes counted, "
                          f"deterministic"),
        rule_verdict("activation_checkpointing", "full AC: step time / none", full["time_vs_none_per_round"],
                     full["time_vs_none_flops"], better="lower",
                     note=f"{args.steps} steps per mode a round; target: the FLOP-count prediction (one more forward "
                          f"of every block)"),
    ]
    print(f"# every-{cfg.train.ac_every} (raw data): peak x{rows['every']['peak_vs_none']:.3f} of none, step time "
          f"x{rows['every']['time_vs_none_median']:.3f} (FLOPs predict x{rows['every']['time_vs_none_flops']:.3f}); "
          f"full: saved at the end of forward alone x{full['saved_vs_none']:.3f}, allocator peak "
          f"x{full['allocator_peak_vs_none']:.3f}")
    write_results("activation_checkpointing.json", {
        "verdicts": verdicts, "target": TARGET, "rows": rows, "loss_diff": loss_diff,
        "loss_tol": LOSS_TOL, "times_s": times, "steps_per_round": args.steps, "threads": threads,
        "params": dims.num_params(), "batch": cfg.train.micro_batch_size, "seq_len": cfg.data.seq_len,
        "torch": torch.__version__, "when": time.strftime("%Y-%m-%dT%H:%M:%S")})
    if not checks_ok:
        sys.exit("check failed: the compared loops do not train the same model on the same data")


if __name__ == "__main__":
    main()
