"""hpctrain's Trainer.train_step on one rank vs a plain PyTorch loop: same model, init, data, batch, fp32, optimizer.

    python benchmarks/train_overhead.py [--rounds 24] [--steps 3]

The plain loop is what a user would write around the same hpctrain.model.transformer.Transformer: init_value weights,
torch.optim.AdamW(fused=True) with ours' settings (lr, betas, eps, weight decay on matrices only),
F.cross_entropy, backward, clip_grad_norm_(foreach=True), step, batches from its own hpctrain.data.loader.TokenLoader
with the same seed, so step i of both sees the same tokens and their losses must agree (checked). Ours builds
AdamW with fused=True (hpctrain.train.optim, since issue 30; foreach before), so both sides run the same optimizer
kernels.

Rule (benchmarks/README.md, _verdict.py): after --warmup untimed steps of each, --rounds rounds; in each round
both loops run --steps steps back to back, which goes first alternating (_verdict.balanced); a round's ratio is
plain time / our time = our tokens/s / plain tokens/s; every round counts; the verdict is the median of the
per-round ratios with its 95% interval, target >= 0.95. A GEMM probe runs at the start of every round; MFU of
both sides is against the best measured fp32 GEMM rate (a side table, not the verdict).
Writes benchmarks/results/train_overhead.json.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from _verdict import balanced, verdict

from _launch import write_results
from hpctrain.bench.gemm import measure_gemm
from hpctrain.config import load_config
from hpctrain.data import loader as data
from hpctrain.data.sources import open_source
from hpctrain.job import session
from hpctrain.model.transformer import ModelDims, Transformer, init_value
from hpctrain.train.trainer import Trainer

RESULTS = Path(__file__).resolve().parent / "results"
TARGET = 0.95
LOSS_TOL = 1e-3  # fp32, absolute, per step (the same kernels on both sides: expected 0)
# ~10.8M parameters; a step of 4 x 128 tokens takes ~0.2-0.4 s on this machine's 2 cores
CASE = ["model.vocab_size=256", "model.dim=384", "model.n_layers=6", "model.n_heads=6", "model.max_seq_len=128",
        "data.source=synthetic", "data.seq_len=128", "train.micro_batch_size=4", "train.lr=3e-4",
        "train.warmup_steps=0", "train.min_lr_ratio=1.0",  # constant lr: the plain loop has no schedule
        "train.peak_tflops=1", "parallel.pp=1", "parallel.tp=1", "parallel.dp=-1", "job.name=bench-overhead",
        "train.prefetch=0"]  # the plain loop loads synchronously: like with like (loader_prefetch.py measures that)


class Plain:
    """The loop a user would write; nothing from hpctrain but the model, its init and the loader."""

    def __init__(self, cfg) -> None:
        t = cfg.train
        self.dims = ModelDims.from_config(cfg.model)
        torch.manual_seed(t.seed)
        self.model = Transformer(self.dims)
        self.model.init_buffers()
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(init_value(name, p.shape, self.dims, t.seed))
        decay = [p for p in self.model.parameters() if p.ndim >= 2]
        keep = [p for p in self.model.parameters() if p.ndim < 2]
        # fused=True as hpctrain.train.optim builds it (torch's CPU default would be the single-tensor loop)
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                                      {"params": keep, "weight_decay": 0.0}],
                                     lr=t.lr, betas=(t.beta1, t.beta2), eps=1e-8, fused=True)
        source = open_source(cfg.data, self.dims.true_vocab_size)  # as the Trainer opens it
        self.loader = data.TokenLoader(source, cfg.data.seq_len, t.micro_batch_size, 0, 1, t.seed)
        self.clip = t.grad_clip

    def train_step(self) -> dict:
        self.opt.zero_grad(set_to_none=True)
        x, y = self.loader.next_batch()
        logits = self.model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip, foreach=True)
        self.opt.step()
        return {"loss": loss.item()}


def timed(fn, steps: int, losses: list[float]) -> float:
    t0 = time.perf_counter()
    for _ in range(steps):
        losses.append(fn()["loss"])
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=24)
    ap.add_argument("--steps", type=int, default=3, help="steps per side per round")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--gemm-n", type=int, default=1024)
    ap.add_argument("--run-root", default="/tmp/hpctrain-bench-runs")
    args = ap.parse_args()
    cfg = load_config(None, CASE + [f"job.run_root={args.run_root}"])
    t_start = time.perf_counter()
    with session.start(cfg) as s:
        ours = Trainer(cfg, s)
        plain = Plain(cfg)
        ref = {n: p.detach().clone() for n, p in plain.model.named_parameters()}
        same_init = all(torch.equal(ref[n], p.detach()) for n, p in ours.model.named_parameters())
        sides = {"plain": plain, "ours": ours}
        losses: dict[str, list[float]] = {"plain": [], "ours": []}
        for _ in range(args.warmup):
            for side, loop in sides.items():
                losses[side].append(loop.train_step()["loss"])
        times: dict[str, list[float]] = {"plain": [], "ours": [], "gemm_tflops": []}
        for r in range(args.rounds):
            times["gemm_tflops"].append(measure_gemm(torch.float32, args.gemm_n, s.device, min_time_s=0.3)["tflops"])
            for side in balanced(r, ("plain", "ours")):
                times[side].append(timed(sides[side].train_step, args.steps, losses[side]))
        tokens = args.steps * cfg.train.micro_batch_size * cfg.data.seq_len
        report(args, cfg, plain.dims, s.summary.get("cpu_threads_per_rank"), same_init, losses, times, tokens,
               time.perf_counter() - t_start)


def report(args, cfg, dims: ModelDims, threads, same_init: bool, losses, times, tokens: int, elapsed: float) -> None:
    peak = max(times["gemm_tflops"])
    fpt = dims.flops_per_token(cfg.data.seq_len)
    rows = {}
    for side in ("plain", "ours"):
        med = statistics.median(times[side])
        rows[side] = {"step_s_median": med / args.steps, "tokens_per_s_median": tokens / med,
                      "mfu_median": tokens / med * fpt / 1e12 / peak}
    ratios = [p / o for p, o in zip(times["plain"], times["ours"])]  # = tokens/s ours / plain, per round
    loss_diff = max(abs(a - b) for a, b in zip(losses["plain"], losses["ours"]))
    checks_ok = same_init and loss_diff <= LOSS_TOL
    print(f"# Trainer.train_step vs plain PyTorch loop, 1 rank, {threads} threads, fp32, "
          f"{dims.num_params() / 1e6:.2f}M params, batch {cfg.train.micro_batch_size} x {cfg.data.seq_len} tokens, "
          f"{args.rounds} rounds of {args.steps} steps per side, order alternating, fused AdamW on both sides")
    print(f"# {'loop':<6} {'step s med':>10} {'tok/s med':>9} {'MFU med':>8}")
    for side, r in rows.items():
        print(f"  {side:<6} {r['step_s_median']:>10.4f} {r['tokens_per_s_median']:>9.0f} {r['mfu_median']:>8.1%}")
    print(f"# fp32 GEMM n={args.gemm_n}: best {peak * 1e3:.1f} GFLOP/s, median "
          f"{statistics.median(times['gemm_tflops']) * 1e3:.1f} (MFU is against the best); "
          f"{fpt / 1e6:.1f} MFLOP per token")
    print(f"# checks: same initial weights {same_init}; {len(losses['ours'])} steps, max |loss ours - loss plain| "
          f"{loss_diff:.2e} (tol {LOSS_TOL:g})")
    rec = verdict("train_overhead", f"tokens/s ours / plain loop, 1 rank, {dims.num_params() / 1e6:.1f}M params",
                  ratios, TARGET, note=f"fused AdamW both sides, fp32, {threads} threads")
    print(f"# {elapsed:.0f} s")
    write_results("train_overhead.json", {
        "verdicts": [rec], "target": TARGET, "seconds": elapsed,
        "params": dims.num_params(), "batch": cfg.train.micro_batch_size, "seq_len": cfg.data.seq_len,
        "threads": threads, "optimizer": "torch.optim.AdamW(fused=True) both sides", "gemm_n": args.gemm_n,
        "gemm_tflops_best": peak, "flops_per_token": fpt, "same_init": same_init, "max_loss_diff": loss_diff,
        "loss_tol": LOSS_TOL, "rows": rows, "rounds": args.rounds, "steps_per_round": args.steps,
        "round_ratios": ratios, "times_s": times, "losses": losses,
        "torch": torch.__version__, "when": time.strftime("%Y-%m-%dT%H:%M:%S")})
    if not checks_ok:
        sys.exit("check failed: the compared loops do not train the same model on the same data")


if __name__ == "__main__":
    main()
