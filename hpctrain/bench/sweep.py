"""Pure helpers of the benchmark: size sweeps, how the ranks' times make the reported one, bandwidth arithmetic
and the nccl-tests table layout.

    sizes = size_sweep(parse_size("8"), parse_size("128M"), factor=2)
    t = combine_times(per_rank_seconds, average=1)          # -a: 0 rank 0, 1 mean, 2 min, 3 max
    algbw = size_bytes / t / 1e9; busbw = algbw * bus_factor("all_reduce", nranks)

As nccl-tests (src/common.cu, NVIDIA/nccl-tests a0b82b2): each rank's time per call is combined over every rank
of the job by -a (its Allreduce of deltaSec: rank 0's own value, the sum over ranks divided by their number, the
minimum or the maximum), and algbw and busbw are derived from that one combined time (getBw). Bus bandwidth
factors are nccl-tests' (see its PERFORMANCE.md): they turn algorithm bandwidth into the bandwidth a single link
sees, so numbers compare across rank counts.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Sequence

_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3}

BUS_FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "alltoall": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "sendrecv": lambda n: 1.0,
}


def parse_size(text: str) -> int:
    """'8', '64K', '1M', '2G' (binary units, like nccl-tests) -> bytes."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMGkmg]?)[Bb]?\s*", str(text))
    if not m:
        raise ValueError(f"size {text!r} must be a whole number of bytes with an optional K, M or G suffix")
    return int(m.group(1)) * _UNITS[m.group(2).upper()]


def size_sweep(min_bytes: int, max_bytes: int, factor: int = 2, step: int = 0) -> list[int]:
    """min, min*factor, ... up to max (or min, min+step, ... when step is given)."""
    if min_bytes <= 0 or max_bytes < min_bytes:
        raise ValueError(f"size sweep -b {min_bytes} -e {max_bytes}: need 0 < min <= max")
    if step < 0:
        raise ValueError(f"-i {step}: the step must be positive")
    if step:
        return list(range(min_bytes, max_bytes + 1, step))
    if factor < 2:
        raise ValueError(f"-f {factor}: the multiplication factor must be >= 2 (or give -i STEP)")
    sizes = []
    size = min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= factor
    return sizes


# -a values, nccl-tests' numbering: the word the table header and the docs use for each
AVERAGES = {0: "rank 0", 1: "mean", 2: "min", 3: "max"}
# -z values: 0 launches every timed call back to back and waits once at the end; 1 waits for each call and
# passes a barrier before the next (nccl-tests' -z 1: its stream sync, then Barrier, inside the timed loop)
BLOCKING = {0: "back-to-back launches, one wait", 1: "wait and barrier after each call"}


def combine_times(per_rank: Sequence[float], average: int) -> float:
    """The reported time from every rank's time per call (indexed by global rank), as nccl-tests' -a combines
    them: 0 rank 0's, 1 the mean, 2 the minimum, 3 the maximum."""
    if average == 0:
        return per_rank[0]
    if average == 1:
        return sum(per_rank) / len(per_rank)
    if average == 2:
        return min(per_rank)
    if average == 3:
        return max(per_rank)
    raise ValueError(f"-a {average}: valid values are " + ", ".join(f"{k} ({v})" for k, v in AVERAGES.items()))


def timing_note(average: int, blocking: int) -> str:
    """What the time columns mean, for the table header."""
    return (f"time: {AVERAGES[average]} over ranks (-a {average}), {BLOCKING[blocking]} (-z {blocking}); "
            f"bandwidths from that time")


def bus_factor(coll: str, nranks: int) -> float:
    return BUS_FACTORS[coll](nranks)


def bandwidths(size_bytes: int, time_s: float, coll: str, nranks: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (1e9 bytes per second, as nccl-tests)."""
    algbw = size_bytes / time_s / 1e9 if time_s > 0 else 0.0
    return algbw, algbw * bus_factor(coll, nranks)


@dataclass
class Row:
    """One size of one collective: timings per placement ('out' and 'in'; None when not offered)."""
    coll: str
    size: int  # bytes of the whole buffer
    count: int  # elements per rank chunk (the whole buffer for all_reduce, broadcast, reduce, sendrecv)
    dtype: str
    op: str
    root: int
    nranks: int
    group: str
    backend: str
    algo: str
    average: int = 1  # -a: how the ranks' times were combined (AVERAGES)
    blocking: int = 0  # -z: how the timed calls were issued (BLOCKING)
    out: dict[str, Any] | None = None  # {"time_us", "algbw", "busbw", "wrong"}
    inp: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in ("coll", "size", "count", "dtype", "op", "root", "nranks", "group",
                                              "backend", "algo", "average", "blocking")}
        for tag, res in (("oop", self.out), ("ip", self.inp)):
            for key in ("time_us", "algbw", "busbw", "wrong"):
                d[f"{tag}_{key}"] = None if res is None else res[key]
        return d


def table_header(rows_title: str, average: int = 1, blocking: int = 0) -> list[str]:
    return [
        f"# {rows_title}",
        f"# {timing_note(average, blocking)}",
        "#" + " " * 46 + f"{'out-of-place':^33}{'in-place':^33}".rstrip(),
        f"#{'size':>11} {'count':>12} {'type':>8} {'redop':>6} {'root':>5}"
        f" {'time':>9} {'algbw':>7} {'busbw':>7} {'#wrong':>6}"
        f" {'time':>9} {'algbw':>7} {'busbw':>7} {'#wrong':>6}",
        f"#{'(B)':>11} {'(elements)':>12} {'':>8} {'':>6} {'':>5}"
        f" {'(us)':>9} {'(GB/s)':>7} {'(GB/s)':>7} {'':>6}"
        f" {'(us)':>9} {'(GB/s)':>7} {'(GB/s)':>7}",
    ]


def _cells(res: dict[str, Any] | None) -> str:
    if res is None:
        return f" {'N/A':>9} {'N/A':>7} {'N/A':>7} {'N/A':>6}"
    wrong = "N/A" if res["wrong"] is None else str(res["wrong"])
    return f" {res['time_us']:>9.1f} {res['algbw']:>7.2f} {res['busbw']:>7.2f} {wrong:>6}"


def format_row(row: Row) -> str:
    op = row.op if row.coll in ("all_reduce", "reduce_scatter", "reduce") else "none"
    root = str(row.root) if row.coll in ("broadcast", "reduce") else "-1"
    return (f" {row.size:>11} {row.count:>12} {row.dtype:>8} {op:>6} {root:>5}" + _cells(row.out)
            + _cells(row.inp))


def summary_lines(rows: Sequence[Row], min_bytes_for_avg: int = 0) -> list[str]:
    """nccl-tests' closing lines: wrong-value count and the average bus bandwidth over all placements."""
    wrong = sum(res["wrong"] or 0 for r in rows for res in (r.out, r.inp) if res is not None)
    bws = [res["busbw"] for r in rows for res in (r.out, r.inp) if res is not None and r.size >= min_bytes_for_avg]
    avg = sum(bws) / len(bws) if bws else 0.0
    return [f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}",
            f"# Avg bus bandwidth    : {avg:.4g}", "#"]
