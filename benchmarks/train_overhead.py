"""hpctrain's Trainer.train_step on one rank vs a plain PyTorch loop: same model, init, data, batch, fp32.

    python benchmarks/train_overhead.py [--rounds 15] [--steps 2] [--budget-s 90]

The plain loop is what a user would write around the same hpctrain.model.Transformer: init_value weights,
torch.optim.AdamW (weight decay on matrices only, as ours), F.cross_entropy, backward, clip_grad_norm_, step,
batches from its own hpctrain.data.TokenLoader with the same seed, so step i of both sees the same tokens and
their losses must agree (checked). After warmup the two alternate (plain, ours, plain, ours, ...) in rounds of
a few steps, and a GEMM probe runs beside them in every round, so drift on this shared machine hits all alike;
rounds stop at --rounds or once --budget-s has passed (at least 3). tokens/s ratio ours/plain from the best
rounds, from the median rounds, and the median of each round's ratio to its neighbour (paired); target >= 0.95
on the best rounds. MFU of both is against the best measured fp32 GEMM rate. hpctrain builds AdamW with
foreach=True; torch's CPU default for the plain loop is the single-tensor loop (--plain-foreach on compares
like with like). Writes benchmarks/results/train_overhead.json.
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
from hpctrain import data, session
from hpctrain.bench.gemm import measure_gemm
from hpctrain.config import load_config
from hpctrain.model import ModelDims, Transformer, init_value
from hpctrain.train import Trainer

RESULTS = Path(__file__).resolve().parent / "results"
TARGET = 0.95
LOSS_TOL = 1e-3  # fp32, absolute, per step: foreach vs single-tensor kernels round differently
# ~10.8M parameters; a step of 4 x 128 tokens takes ~0.2-0.4 s on this machine's 2 cores
CASE = ["model.vocab_size=256", "model.dim=384", "model.n_layers=6", "model.n_heads=6", "model.max_seq_len=128",
        "data.source=synthetic", "data.seq_len=128", "train.micro_batch_size=4", "train.lr=3e-4",
        "train.warmup_steps=0", "train.min_lr_ratio=1.0",  # constant lr: the plain loop has no schedule
        "train.peak_tflops=1", "parallel.pp=1", "parallel.tp=1", "parallel.dp=-1", "job.name=bench-overhead",
        "train.prefetch=0"]  # the plain loop loads synchronously: like with like (loader_prefetch.py measures that)


class Plain:
    """The loop a user would write; nothing from hpctrain but the model, its init and the loader."""

    def __init__(self, cfg, foreach: bool) -> None:
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
        # torch's default on CPU is the single-tensor loop (foreach kernels default on only for GPUs)
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                                      {"params": keep, "weight_decay": 0.0}],
                                     lr=t.lr, betas=(t.beta1, t.beta2), eps=1e-8, foreach=foreach)
        source = data.open_source(cfg.data, self.dims.true_vocab_size)  # as the Trainer opens it
        self.loader = data.TokenLoader(source, cfg.data.seq_len, t.micro_batch_size, 0, 1, t.seed)
        self.clip = t.grad_clip

    def train_step(self) -> dict:
        self.opt.zero_grad(set_to_none=True)
        x, y = self.loader.next_batch()
        logits = self.model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()
        return {"loss": loss.item()}


def timed(fn, steps: int, losses: list[float]) -> float:
    t0 = time.perf_counter()
    for _ in range(steps):
        losses.append(fn()["loss"])
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=2, help="steps per round")
    ap.add_argument("--budget-s", type=float, default=90.0, help="stop adding rounds after this (>= 3 rounds)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--gemm-n", type=int, default=1024)
    ap.add_argument("--plain-foreach", choices=("default", "on"), default="default",
                    help="plain AdamW with torch's CPU default (single-tensor) or foreach=True like ours")
    ap.add_argument("--run-root", default="/tmp/hpctrain-bench-runs")
    args = ap.parse_args()
    cfg = load_config(None, CASE + [f"job.run_root={args.run_root}"])
    with session.start(cfg) as s:
        ours = Trainer(cfg, s)
        plain = Plain(cfg, foreach=True if args.plain_foreach == "on" else None)
        ref = {n: p.detach().clone() for n, p in plain.model.named_parameters()}
        same_init = all(torch.equal(ref[n], p.detach()) for n, p in ours.model.named_parameters())
        losses: dict[str, list[float]] = {"plain": [], "ours": []}
        for _ in range(args.warmup):
            losses["plain"].append(plain.train_step()["loss"])
            losses["ours"].append(ours.train_step()["loss"])
        times: dict[str, list[float]] = {"plain": [], "ours": [], "gemm_tflops": []}
        t_start = time.perf_counter()
        for r in range(args.rounds):
            if r >= 3 and time.perf_counter() - t_start > args.budget_s:
                break
            times["gemm_tflops"].append(measure_gemm(torch.float32, args.gemm_n, s.device, min_time_s=0.3)["tflops"])
            times["plain"].append(timed(plain.train_step, args.steps, losses["plain"]))
            times["ours"].append(timed(ours.train_step, args.steps, losses["ours"]))
        tokens = args.steps * cfg.train.micro_batch_size * cfg.data.seq_len
        report(args, cfg, plain.dims, s.summary.get("cpu_threads_per_rank"), same_init, losses, times, tokens)


def report(args, cfg, dims: ModelDims, threads, same_init: bool, losses, times, tokens: int) -> None:
    peak = max(times["gemm_tflops"])
    fpt = dims.flops_per_token(cfg.data.seq_len)
    rows = {}
    for side in ("plain", "ours"):
        best, med = min(times[side]), statistics.median(times[side])
        rows[side] = {"step_s_best": best / args.steps, "step_s_median": med / args.steps,
                      "tokens_per_s_best": tokens / best, "tokens_per_s_median": tokens / med,
                      "mfu_best": tokens / best * fpt / 1e12 / peak, "mfu_median": tokens / med * fpt / 1e12 / peak}
    ratio = rows["ours"]["tokens_per_s_best"] / rows["plain"]["tokens_per_s_best"]
    median_ratio = rows["ours"]["tokens_per_s_median"] / rows["plain"]["tokens_per_s_median"]
    # each round against its neighbour: cancels drift slower than a round
    paired = statistics.median(p / o for p, o in zip(times["plain"], times["ours"]))
    loss_diff = max(abs(a - b) for a, b in zip(losses["plain"], losses["ours"]))
    checks_ok = same_init and loss_diff <= LOSS_TOL
    verdict = "MET" if ratio >= TARGET and checks_ok else "NOT MET"
    print(f"# Trainer.train_step vs plain PyTorch loop, 1 rank, {threads} threads, fp32, "
          f"{dims.num_params() / 1e6:.2f}M params, batch {cfg.train.micro_batch_size} x {cfg.data.seq_len} tokens, "
          f"{len(times['ours'])} alternating rounds of {args.steps} steps (plain AdamW foreach: {args.plain_foreach})")
    print(f"# {'loop':<6} {'step s best':>11} {'step s med':>10} {'tok/s best':>10} {'tok/s med':>9} "
          f"{'MFU best':>8} {'MFU med':>8}")
    for side, r in rows.items():
        print(f"  {side:<6} {r['step_s_best']:>11.4f} {r['step_s_median']:>10.4f} {r['tokens_per_s_best']:>10.0f} "
              f"{r['tokens_per_s_median']:>9.0f} {r['mfu_best']:>8.1%} {r['mfu_median']:>8.1%}")
    print(f"# fp32 GEMM n={args.gemm_n}: best {peak * 1e3:.1f} GFLOP/s, median "
          f"{statistics.median(times['gemm_tflops']) * 1e3:.1f} (MFU is against the best); "
          f"{fpt / 1e6:.1f} MFLOP per token")
    print(f"# checks: same initial weights {same_init}; {len(losses['ours'])} steps, max |loss ours - loss plain| "
          f"{loss_diff:.2e} (tol {LOSS_TOL:g})")
    print(f"# tokens/s ours/plain: best {ratio:.3f}, median {median_ratio:.3f}, paired {paired:.3f} "
          f"(target >= {TARGET} on best: {verdict})")
    write_results("train_overhead.json", {
        "ratio_best": ratio, "ratio_median": median_ratio, "ratio_paired_median": paired, "target": TARGET,
        "verdict": verdict,
        "params": dims.num_params(), "batch": cfg.train.micro_batch_size, "seq_len": cfg.data.seq_len,
        "threads": threads, "plain_foreach": args.plain_foreach, "gemm_n": args.gemm_n, "gemm_tflops_best": peak,
        "flops_per_token": fpt, "same_init": same_init, "max_loss_diff": loss_diff, "loss_tol": LOSS_TOL,
        "rows": rows, "times_s": times, "steps_per_round": args.steps, "losses": losses,
        "torch": torch.__version__, "when": time.strftime("%Y-%m-%dT%H:%M:%S")})
    if not checks_ok:
        sys.exit("check failed: the compared loops do not train the same model on the same data")


if __name__ == "__main__":
    main()
