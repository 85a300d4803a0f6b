"""The straggler report: which ranks (and hosts) the others wait for.

Every rank's heartbeat splits its time into compute and wait (time in the collective phase: explicit collectives,
and the gradient reduction DDP or FSDP finish after the backward's compute). In a synchronous job all ranks take
the same time per step, so the slow one is the rank that computes longest while the others wait for it. At log
steps only (no extra collective in the other steps) the ranks all-gather their (compute, wait) since the previous
log step; rank 0 compares each rank's compute with the median of the ranks doing the same work (the same pipeline
stage: stages differ by design) and names those beyond train.straggler_margin.

    times = gather_times(hb, device)                   # collective, log steps: [(compute_s, wait_s)] by rank
    report = find_stragglers(times, hosts, stage_of_rank, margin=0.2)
    line = describe(report)                             # "slow: rank 2 (n1) +240%"

    rep = Reporter(hb, device, hosts, layout, margin=0.2)  # a training rank's: the two above, tallied
    report = rep.report()                               # collective, log steps; rep.summary() for the run

Where a collective sits inside the forward (tensor parallel, ZeRO-3's all-gathers, pipeline sends), a rank's
waits there count as compute: a slow rank then drags its tp group (one host) or its pipeline neighbours with it,
and the report names them all. On GPUs the clock is CUDA events (CudaClock), since the host runs ahead.
"""
from __future__ import annotations

import math
import os
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from hpctrain.config.sections import MAX_WORLD_SIZE
from hpctrain.hang.heartbeat import Heartbeat
from hpctrain.untrusted import Untrusted, parse_json, read_bytes

if TYPE_CHECKING:
    import torch

MAX_METRICS_BYTES = 64 << 20  # from_metrics reads at most this much of metrics.jsonl's end


class CudaClock:
    """Compute and wait as the device did them: an event on the current stream at every change between computing
    and waiting (Heartbeat.device_clock); take() reads them once the device is past them (a log step syncs)."""

    def __init__(self) -> None:
        self.events: list[tuple[Any, bool]] = [(self._record(), False)]

    @staticmethod
    def _record():
        import torch  # here, not at the top: hpctrain diagnose reads the report's history without torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def mark(self, waiting: bool) -> None:
        self.events.append((self._record(), waiting))

    def take(self) -> tuple[float, float]:
        end = self._record()
        end.synchronize()
        times = [0.0, 0.0]
        for (a, waiting), (b, _) in zip(self.events, self.events[1:] + [(end, False)]):
            times[waiting] += a.elapsed_time(b) / 1e3
        self.events = [(end, self.events[-1][1])]
        return times[0], times[1]


def gather_times(hb: Heartbeat, device: torch.device) -> list[tuple[float, float]]:
    """Every rank's (compute_s, wait_s) since the previous call. Collective over the world, on the device (an NCCL
    group serves only device tensors): call it at log steps only."""
    import torch
    import torch.distributed as dist

    compute, wait = hb.take_times()
    mine = torch.tensor([compute, wait], dtype=torch.float64, device=device)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [(compute, wait)]
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [(float(c), float(w)) for c, w in torch.stack(every).tolist()]


def find_stragglers(times: Sequence[tuple[float, float]], hosts: Sequence[str], stage_of_rank: Sequence[int],
                    margin: float) -> dict[str, Any]:
    """Pure. {"compute_s": [...], "wait_s": [...], "median_s": {stage: s}, "slow": [{"rank", "host",
    "compute_s", "median_s", "excess"}], "hosts": [hosts of slow ranks]}: ranks whose compute exceeds their
    stage's median by more than `margin` (a fraction), slowest first."""
    compute = [c for c, _ in times]
    medians: dict[int, float] = {}
    for stage in sorted(set(stage_of_rank)):
        medians[stage] = statistics.median(c for c, s in zip(compute, stage_of_rank) if s == stage)
    slow = []
    for rank, c in enumerate(compute):
        med = medians[stage_of_rank[rank]]
        if med > 0 and c > med * (1 + margin):
            slow.append({"rank": rank, "host": hosts[rank], "compute_s": round(c, 4), "median_s": round(med, 4),
                         "excess": round(c / med - 1, 3)})
    slow.sort(key=lambda r: -r["excess"])
    return {"compute_s": [round(c, 4) for c in compute], "wait_s": [round(w, 4) for _, w in times],
            "median_s": {str(k): round(v, 4) for k, v in medians.items()}, "slow": slow,
            "hosts": sorted({r["host"] for r in slow})}


def describe(report: dict[str, Any], most: int = 4) -> str:
    """'slow: rank 2 (n1) +240%, rank 3 (n1) +31%', or '' when nobody is slow."""
    slow = report["slow"]
    if not slow:
        return ""
    parts = [f"rank {r['rank']} ({r['host']}) +{r['excess']:.0%}" for r in slow[:most]]
    more = f" and {len(slow) - most} more" if len(slow) > most else ""
    return "slow: " + ", ".join(parts) + more


class Tally:
    """The run's stragglers over all log intervals, for the summary: per rank the intervals it was slow in and
    its worst excess; per host the same."""

    def __init__(self) -> None:
        self.intervals = 0
        self.ranks: dict[int, dict[str, Any]] = {}

    def add(self, report: dict[str, Any]) -> None:
        self.intervals += 1
        for r in report["slow"]:
            entry = self.ranks.setdefault(r["rank"], {"rank": r["rank"], "host": r["host"], "intervals": 0,
                                                      "worst_excess": 0.0})
            entry["intervals"] += 1
            entry["worst_excess"] = max(entry["worst_excess"], r["excess"])

    def summary(self) -> dict[str, Any]:
        ranks = sorted(self.ranks.values(), key=lambda e: (-e["intervals"], -e["worst_excess"]))
        hosts: dict[str, int] = {}
        for e in ranks:
            hosts[e["host"]] = max(hosts.get(e["host"], 0), e["intervals"])
        return {"log_intervals": self.intervals, "ranks": ranks,
                "hosts": [{"host": h, "intervals": n} for h, n in sorted(hosts.items(), key=lambda kv: -kv[1])]}


class Reporter:
    """One training rank's part in the straggler report: the rank's compute and wait as its heartbeat counts them
    (on CUDA as the device did them: CudaClock), the report of every log interval (report(), collective) and the
    run's tally of them (summary()).

    With mark_gradient_reduction(model), the gradient reduction DDP or FSDP (or the coalesced all-reduce) finish
    after the backward's compute counts as wait: on the last micro-batch (last_micro_batch set by the trainer), the
    backward reaching the embedding's output ends this rank's backward compute, and what follows is the wait for
    the slowest dp peer."""

    def __init__(self, hb: Heartbeat, device: torch.device, hosts: Sequence[str], layout: Any, margin: float) -> None:
        """layout: the job's hpctrain.parallel.mesh.Layout (ranks compare their compute within a pipeline stage)."""
        self.hb, self.device, self.hosts, self.margin = hb, device, hosts, margin
        self.stage_of_rank = [layout.coords(r)["pp"] for r in range(layout.world_size)]
        if device.type == "cuda":
            hb.device_clock = CudaClock()
        self.tally = Tally()
        self.last_micro_batch = False

    def mark_gradient_reduction(self, model: Any) -> None:
        embedding = next((m for name, m in model.named_modules() if name.endswith("tok_embeddings")), None)
        if embedding is None:
            return

        def on_forward(module, inputs, out) -> None:
            if self.last_micro_batch and out.requires_grad:
                out.register_hook(lambda grad: self.hb.enter("collective", "gradient reduction on dp"))
        embedding.register_forward_hook(on_forward)

    def report(self) -> dict[str, Any]:
        """The straggler report of the steps since the previous call (collective: every rank, log steps)."""
        self.hb.enter("collective", "straggler report on the world")
        times = gather_times(self.hb, self.device)
        report = find_stragglers(times, self.hosts or ["?"] * len(times), self.stage_of_rank, self.margin)
        self.tally.add(report)
        return report

    def summary(self) -> dict[str, Any]:
        return self.tally.summary()


def _slow_entry(e: Any) -> bool:
    """A straggler report's entry as find_stragglers makes it: a rank in range, its host, a finite excess."""
    return (isinstance(e, dict) and type(e.get("rank")) is int and 0 <= e["rank"] < MAX_WORLD_SIZE
            and isinstance(e.get("host"), str) and type(e.get("excess")) in (int, float)
            and math.isfinite(e["excess"]))


def from_metrics(run_dir: str | Path) -> dict[str, Any] | None:
    """The straggler report's history from a run's metrics.jsonl (rank 0's log-step rows): Tally.summary() plus
    "last_step" and "truncated"; None when the run logged no report. For `hpctrain diagnose`, so nothing is trusted:
    a regular file, not a link, only its last MAX_METRICS_BYTES, rows and entries of the wrong shape skipped."""
    path = Path(run_dir) / "metrics.jsonl"
    try:
        raw = read_bytes(path, MAX_METRICS_BYTES, tail=True)
        truncated = os.lstat(path).st_size > MAX_METRICS_BYTES
    except (Untrusted, OSError):  # missing, a link, a FIFO: no history
        return None
    lines = raw.split(b"\n")
    tally, last = Tally(), None
    for i, line in enumerate(lines[1:] if truncated else lines):  # a cut file's first line is a piece of one
        try:
            row = parse_json(line, f"metrics.jsonl line {i + 1}")
        except Untrusted:
            continue
        if not isinstance(row, dict) or not isinstance(row.get("stragglers"), list):
            continue
        tally.add({"slow": [e for e in row["stragglers"] if _slow_entry(e)]})
        last = row.get("step") if type(row.get("step")) is int else last
    if not tally.intervals:
        return None
    return tally.summary() | {"last_step": last, "truncated": truncated}


def history_line(history: dict[str, Any], most: int = 4) -> str:
    """One line for `hpctrain diagnose`: 'stragglers over 4 log intervals to step 12: rank 2 (n1) slow in 4
    (worst +1245%); hosts: n1'."""
    n = history["log_intervals"]
    span = f"{'the last ' if history['truncated'] else ''}{n} log interval{'s' * (n != 1)}" + (
        f" to step {history['last_step']}" if history["last_step"] is not None else "")
    ranks = history["ranks"]
    if not ranks:
        return f"stragglers: none over {span} (train.straggler_margin)"
    parts = [f"rank {r['rank']} ({r['host']}) slow in {r['intervals']} (worst +{r['worst_excess']:.0%})"
             for r in ranks[:most]]
    more = f" and {len(ranks) - most} more rank(s)" if len(ranks) > most else ""
    hosts = ", ".join(f"{h['host']} ({h['intervals']})" for h in history["hosts"][:most])
    return f"stragglers over {span}: {', '.join(parts)}{more}; hosts: {hosts}"
