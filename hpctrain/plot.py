"""`hpctrain plot RUN_DIR`: loss (and validation loss), learning rate and throughput curves from a run's
metrics.jsonl, to PNG."""
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
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
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
    for ax in axes:
        ax.grid(True, alpha=0.3)
    fig.suptitle(str(Path(run_dir).name))
    fig.tight_layout()
    out = Path(out) if out else Path(run_dir) / "training.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
