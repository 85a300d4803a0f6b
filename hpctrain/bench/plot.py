"""Bus bandwidth against message size, one line per collective, placement and group, to PNG."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence


def plot_busbw(rows: Sequence[dict[str, Any]], path: str | Path, title: str = "") -> Path:
    """rows: the benchmark's JSON rows (sweep.Row.to_json())."""
    import matplotlib
    matplotlib.use("Agg")  # no display on compute or CI nodes
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    series: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        for tag, name in (("oop", "out-of-place"), ("ip", "in-place")):
            if r[f"{tag}_busbw"] is not None:
                label = f"{r['coll']}{'/hier' if r['algo'] == 'hier' else ''} {name} [{r['group']}, {r['backend']}]"
                series.setdefault(label, []).append((r["size"], r[f"{tag}_busbw"]))
    for label, points in sorted(series.items()):
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=3, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(title or "hpctrain bench")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
