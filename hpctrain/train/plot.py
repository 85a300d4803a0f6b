"""`hpctrain plot RUN_DIR`: loss (and validation loss), learning rate and throughput curves from a run's
metrics.jsonl, to PNG; with the straggler report's rows, each rank's compute time per step (the slow ones marked).

metrics.jsonl is not trusted: its last MAX_METRICS_BYTES are read (not through a link), and rows that are torn, not
JSON, or of the wrong shapes are left out.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from hpctrain.untrusted import Untrusted, parse_json, read_bytes

MAX_METRICS_BYTES = 64 << 20  # the end of a long run's metrics.jsonl: about 100000 rows
TRAIN_FIELDS = ("loss", "lr", "tokens_per_s", "mfu")


def _number(v: Any) -> bool:
    return type(v) in (int, float)


def _row_ok(row: Any) -> bool:
    """A row as metrics.py writes it: an int step; a training step's numbers (NaN is a loss too), an evaluation's
    val_loss; the straggler report's per-rank seconds and slow ranks among them."""
    if not isinstance(row, dict) or type(row.get("step")) is not int:
        return False
    if "loss" in row and not all(_number(row.get(k)) for k in TRAIN_FIELDS):
        return False
    if "val_loss" in row and not _number(row["val_loss"]):
        return False
    compute = row.get("rank_compute_s")
    if compute is not None and not (isinstance(compute, list) and compute and all(map(_number, compute))):
        return False
    slow = row.get("stragglers", [])
    return isinstance(slow, list) and all(isinstance(s, dict) and type(s.get("rank")) is int and compute is not None
                                          and 0 <= s["rank"] < len(compute) for s in slow)


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not os.path.lexists(path):
        raise ValueError(f"{run_dir} has no metrics.jsonl (is it a training run directory?)")
    raw = read_bytes(path, MAX_METRICS_BYTES, tail=True)  # Untrusted, a ValueError, names a link or a FIFO
    lines = raw.split(b"\n")
    if os.lstat(path).st_size > MAX_METRICS_BYTES:
        lines = lines[1:]  # a cut file's first line is a piece of one
    rows = []
    for i, line in enumerate(lines):
        try:
            row = parse_json(line, f"{path} line {i + 1}") if line.strip() else None
        except Untrusted:
            continue
        if _row_ok(row):
            rows.append(row)
    if not rows:
        raise ValueError(f"{path} holds no step yet (or none that is readable)")
    return rows


def per_rank_step_times(rows: list[dict]) -> tuple[list[int], list[list[float]], list[tuple[int, int]]]:
    """From the logged rows with the straggler report: (steps, per rank its compute seconds per step over the
    interval ending at each of those steps, (step, rank) of every rank reported slow). Rows of another world size
    than the first (a damaged row) are left out."""
    steps, series, slow = [], [], []
    previous = 0
    for r in rows:
        if "rank_compute_s" not in r or (series and len(r["rank_compute_s"]) != len(series)):
            continue
        n = max(1, r["step"] - previous)
        previous = r["step"]
        steps.append(r["step"])
        for rank, c in enumerate(r["rank_compute_s"]):
            if rank == len(series):
                series.append([])
            series[rank].append(c / n)
        slow += [(r["step"], s["rank"]) for s in r.get("stragglers", [])]
    return steps, series, slow


def plot_training(run_dir: Path, out: Path | None = None) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    every = read_metrics(run_dir)
    rows = [r for r in every if "loss" in r]  # training steps; evaluations are rows of their own
    evals = [r for r in every if "val_loss" in r]
    if not rows:
        raise ValueError(f"{run_dir}/metrics.jsonl holds no training step yet")
    steps = [r["step"] for r in rows]
    rank_steps, per_rank, slow = per_rank_step_times(rows)
    fig, axes = plt.subplots(1, 4 if rank_steps else 3, figsize=(19 if rank_steps else 14, 4))
    axes[0].plot(steps, [r["loss"] for r in rows], marker=".", label="train")
    if evals:
        axes[0].plot([r["step"] for r in evals], [r["val_loss"] for r in evals], "o-", label="validation")
        axes[0].legend()
    axes[0].set(title="loss", xlabel="step")
    axes[1].plot(steps, [r["lr"] for r in rows])
    axes[1].set(title="learning rate", xlabel="step")
    axes[2].plot(steps, [r["tokens_per_s"] for r in rows], label="tokens/s")
    axes[2].set(title="throughput (tokens/s)", xlabel="step")
    mfu = axes[2].twinx()
    mfu.plot(steps, [100 * r["mfu"] for r in rows], color="tab:orange", label="MFU %")
    mfu.set_ylabel("MFU %")
    if rank_steps:
        for rank, times in enumerate(per_rank):
            axes[3].plot(rank_steps, times, lw=0.8, alpha=0.7, label=f"rank {rank}" if len(per_rank) <= 8 else None)
        for step, rank in slow:
            axes[3].plot(step, per_rank[rank][rank_steps.index(step)], "x", color="red")
        axes[3].set(title="compute per step and rank (x: straggler)", xlabel="step", ylabel="s")
        if len(per_rank) <= 8:
            axes[3].legend(fontsize=7)
    for ax in axes:
        ax.grid(True, alpha=0.3)
    fig.suptitle(str(Path(run_dir).name))
    fig.tight_layout()
    out = Path(out) if out else Path(run_dir) / "training.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
