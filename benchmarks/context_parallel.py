"""Context parallelism on CPU: activation bytes per rank against sequence length for cp = 1, 2, 4, and the step time
of cp = 2 against cp = 1 at the same global tokens on the same two ranks.

    python benchmarks/context_parallel.py [--rounds 8] [--steps 4]     # driver: every part, then the verdicts
    mpiexec -n 2 python benchmarks/context_parallel.py --memory        # one world size's memory rows

Memory (bytes counted, deterministic, one round): at cp = world (1, 2, 4 ranks) one forward and the loss of the
Trainer's model on one sequence per rank group run under torch.autograd.graph.saved_tensors_hooks; every tensor
autograd packs is recorded once by its storage, parameters and buffers left out: what the forward leaves alive
for backward on rank 0, its peak of activations. Beside it the planner's figure (planner.activations for the
rank's share of the tokens). Target, fixed before the run (issue 29): at the longest length, cp = 4 holds at most
0.3 of cp = 1's bytes.

Time: two ranks train the same model and global batch (2 sequences per step) as cp = 2 (both ranks split each
sequence, micro-batch 2) and as cp = 1 (data parallel: a sequence each, micro-batch 1): the same tokens per rank
and the same attention work per rank. Each round launches both sides (mpiexec -n 2, order reversed every other
round: _verdict.balanced), each timing --steps steps after one warm-up step; the verdict is the median of the
per-round ratios cp2 / cp1 of the mean step time. Target, fixed before the run: at most 1.20 (the ring's hops and
the split attention blocks cost at most a fifth of a step here).
Writes benchmarks/results/context_parallel.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from _verdict import balanced
from _verdict import verdict as rule_verdict

from _launch import HERE, mpiexec, run_worlds, write_results

MEMORY_TARGET, TIME_TARGET = 0.3, 1.20
SEQS = (512, 1024, 2048)
SHAPE = ["model.dim=256", "model.n_layers=4", "model.n_heads=8", "model.n_kv_heads=2", "model.vocab_size=512",
         "data.source=synthetic", "train.peak_tflops=1", "checkpoint.at_end=false", "parallel.pp=1",
         "parallel.tp=1", "train.log_every=1000", "job.name=bench-cp"]
TIME_SEQ = 1024
SIDES = {"cp2": ["parallel.cp=2", "train.micro_batch_size=2"], "cp1": ["parallel.cp=1", "train.micro_batch_size=1"]}


def world_size() -> int:
    return int(os.environ.get("PMI_SIZE") or os.environ.get("WORLD_SIZE") or 1)


def measure_memory(run_root: str) -> list[dict]:
    """Rank 0's saved activation bytes after one forward + loss, for each sequence length, at cp = world size."""
    import torch
    import torch.nn.functional as F

    from hpctrain.config import load_config
    from hpctrain.job import session
    from hpctrain.planner.activations import ActivationModel
    from hpctrain.train.trainer import Trainer

    cp, rows = world_size(), []
    for seq in SEQS:
        cfg = load_config(None, SHAPE + [f"parallel.cp={cp}", f"data.seq_len={seq}", f"model.max_seq_len={seq}",
                                         "train.micro_batch_size=1", "train.steps=1", f"job.run_root={run_root}"])
        with session.start(cfg) as s:
            tr = Trainer(cfg, s)
            model = tr.model
            skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
            skip |= {b.untyped_storage().data_ptr() for b in model.buffers()}
            found: dict[int, int] = {}

            def record(t):
                st = t.untyped_storage()
                if st.data_ptr() not in skip:
                    found.setdefault(st.data_ptr(), st.nbytes())
                return t

            x, y = tr.loader.next_batch()
            with torch.autograd.graph.saved_tensors_hooks(record, lambda t: t), tr.pm.step_context(True):
                loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
            del loss
            planned = ActivationModel("fp32").micro_batch_bytes(tr.pm.dims, seq // cp, cfg.model.n_layers)
            rows.append({"cp": cp, "seq": seq, "tokens_per_rank": x.numel(), "bytes": sum(found.values()),
                         "planner_bytes": planned})
    return rows


def time_side(side: str, steps: int, run_root: str) -> dict:
    """Mean step time of `steps` steps after one warm-up step, rank 0's clock; losses for the record."""
    import torch.distributed as dist

    from hpctrain.config import load_config
    from hpctrain.job import session
    from hpctrain.train.metrics import host_values
    from hpctrain.train.trainer import Trainer

    cfg = load_config(None, SHAPE + SIDES[side] + [f"data.seq_len={TIME_SEQ}", f"model.max_seq_len={TIME_SEQ}",
                                                   f"train.steps={steps + 1}", f"job.run_root={run_root}"])
    with session.start(cfg) as s:
        tr = Trainer(cfg, s)
        losses = [host_values(tr.train_step(sync=True))["loss"]]
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(steps):
            losses.append(host_values(tr.train_step(sync=True))["loss"])
        dist.barrier()
        return {"side": side, "step_s": (time.perf_counter() - t0) / steps, "losses": losses,
                "tokens_per_rank": tr.micro_batch * TIME_SEQ // cfg.parallel.cp}


def driver(args) -> None:
    worlds = run_worlds(__file__, "context_parallel", [1, 2, 4], ["--memory", "--run-root", args.run_root])
    mem = [r for w in sorted(worlds) for r in worlds[w]["rows"]]
    print("# saved activation bytes per rank after forward (rank 0), fp32, dim 256, 4 blocks, micro-batch 1")
    print(f"# {'cp':>3} {'seq':>6} {'MB':>9} {'planner MB':>11} {'x cp1':>7}")
    base = {r["seq"]: r["bytes"] for r in mem if r["cp"] == 1}
    for r in mem:
        print(f"  {r['cp']:>3} {r['seq']:>6} {r['bytes'] / 1e6:>9.2f} {r['planner_bytes'] / 1e6:>11.2f} "
              f"{r['bytes'] / base[r['seq']]:>7.3f}")
    longest = max(SEQS)
    share = next(r["bytes"] for r in mem if r["cp"] == 4 and r["seq"] == longest) / base[longest]
    verdicts = [rule_verdict("context_parallel", f"activation bytes per rank, cp 4 / cp 1 at seq {longest}", [share],
                             MEMORY_TARGET, better="lower",
                             note="rank 0's saved tensors after one forward, fp32; bytes counted, deterministic")]
    rounds = []
    for i in range(args.rounds):
        got = {}
        for side in balanced(i, list(SIDES)):
            out = Path(args.run_root) / f"time-{i}-{side}.json"
            cmd = [mpiexec(), "-n", "2", sys.executable, str(Path(__file__).resolve()), "--time-side", side,
                   "--steps", str(args.steps), "--run-root", args.run_root, "--out", str(out)]
            if subprocess.call(cmd, cwd=HERE.parent, stdout=subprocess.DEVNULL):
                sys.exit(f"the {side} side failed in round {i}")
            got[side] = json.loads(out.read_text())
        rounds.append({"cp2_s": got["cp2"]["step_s"], "cp1_s": got["cp1"]["step_s"],
                       "ratio": got["cp2"]["step_s"] / got["cp1"]["step_s"],
                       "losses": {k: v["losses"] for k, v in got.items()}})
        print(f"  round {i}: cp2 {rounds[-1]['cp2_s']:.3f} s, cp1 {rounds[-1]['cp1_s']:.3f} s, "
              f"ratio {rounds[-1]['ratio']:.3f}", flush=True)
    verdicts.append(rule_verdict(
        "context_parallel", "step time, cp 2 / cp 1 (data parallel) at the same global tokens",
        [r["ratio"] for r in rounds], TIME_TARGET, better="lower",
        note=f"2 ranks on this CPU, seq {TIME_SEQ}, 2 sequences per step, {args.steps} steps per side per round"))
    write_results("context_parallel.json", {"verdicts": verdicts, "memory": mem, "rounds": rounds,
                                            "shape": SHAPE, "seqs": list(SEQS), "time_seq": TIME_SEQ})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--memory", action="store_true", help="this world size's memory rows (under mpiexec)")
    ap.add_argument("--time-side", choices=list(SIDES), help="time one side (under mpiexec -n 2)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--run-root", default="/tmp/hpctrain-bench-runs")
    ap.add_argument("--out", default=None, help="--time-side: the JSON file; --memory: the folder (else results/)")
    args = ap.parse_args()
    if args.memory:
        rows = measure_memory(args.run_root)
        if int(os.environ.get("PMI_RANK", 0)) == 0:
            write_results(f"context_parallel-{world_size()}ranks.json", {"world": world_size(), "rows": rows},
                          args.out)
    elif args.time_side:
        res = time_side(args.time_side, args.steps, args.run_root)
        if int(os.environ.get("PMI_RANK", 0)) == 0:
            Path(args.out).write_text(json.dumps(res))
    else:
        driver(args)


if __name__ == "__main__":
    main()
