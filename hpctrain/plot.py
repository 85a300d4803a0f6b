"""`hpctrain plot RUN_DIR`: loss (and validation loss), learning rate and throughput curves from a run's
metrics.jsonl, to PNG; with the straggler report's rows, each rank's compute time per step (the slow ones marked)."""
from __future__ import annotations

import json
from pathlib import Path


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{run_dir} has no metrics.jsonl (is it a training run directory?)")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{path} is empty: the run logged no step yet")
    return rows


def per_rank_step_times(rows: list[dict]) -> tuple[list[int], list[list[float]], list[tuple[int, int]]]:
    """From the logged rows with the straggler report: (steps, per rank its compute seconds per step over the
    interval ending at each of those steps, (step, rank) of every rank reported slow)."""
    steps, series, slow = [], [], []
    previous = 0
    for r in rows:
        if "rank_compute_s" not in r:
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
