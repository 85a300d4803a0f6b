"""`hpctrain doctor`'s verdicts, from what the ranks measured (hpctrain/doctor/measure.py): pure, no processes, no
torch.

    report = analyse(measured, Rules.for_device("cuda"), expected_figures("h100-sxm"))
    print(render(report))               # the table, the failed nodes and the ready --exclude= line
    report["ok"], report["failed_nodes"], report["exclude"]

`measured` is the JSON doctor.py gathers: "job" (world size, nodes, device type, hardware profile, checkpoint
size and directory), "ranks" (device and GEMM rate per rank), "groups" (all-reduce bus bandwidth per communicator
instance at two sizes) and "nodes" (storage, clock offset and environment, one rank per node).

A value fails when it is below its peers' median by more than the margin (ranks for GEMM and CPUs, the instances of
one axis at one size for bandwidth, the nodes for storage), or below expected_fraction of the planner's figure for
a known GPU (job.gpu). Each failure is blamed on the node(s) it can be pinned to; one that cannot (a slow group
spanning nodes that all also sit in healthy groups, environments split evenly) fails the run without a node.
"""
from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

from hpctrain.job.hostlist import compress
from hpctrain.planner import hardware


@dataclass(frozen=True)
class Rules:
    """When a value fails. margin: below (1 - margin) x the median of its peers (GEMM, CPUs, bandwidth);
    storage_margin the same for write and read rates; expected_fraction: below this share of the planner's figure
    for job.gpu (a bound for a broken part, not a performance target: a throttled GPU or a network fallen back to
    TCP lands far below the datasheet, a healthy one is expected well above 0.4); max_skew_ms: a node's clock
    further than this from rank 0's, round trip allowed for (NTP keeps nodes within milliseconds). These are policy
    defaults, each replaced by its `hpctrain doctor` option (--margin, --storage-margin, --expected-fraction,
    --max-skew-ms)."""
    margin: float
    storage_margin: float = 0.5
    expected_fraction: float = 0.4
    max_skew_ms: float = 100.0
    # the latency-bound all-reduce judged against its peers too (GPUs); on CPUs it is shown, not judged: gloo's
    # latency follows the scheduler of cores that ranks share with each other and the system, not the node
    judge_latency: bool = True

    def __post_init__(self) -> None:
        for name in ("margin", "storage_margin", "expected_fraction"):
            value = getattr(self, name)
            if not 0 < value < 1:
                raise ValueError(f"--{name.replace('_', '-')} {value}: must be between 0 and 1")
        if not self.max_skew_ms > 0:
            raise ValueError(f"--max-skew-ms {self.max_skew_ms}: must be > 0")

    @staticmethod
    def for_device(device_type: str, **given: float | None) -> "Rules":
        """Defaults per device (policy), any of them replaced by a value given (None: default). GPUs of one model
        run at fixed clocks with nothing shared, so a rank 20% below its peers is taken as a sick GPU. CPU ranks
        share cores with each other and with the system, which moves their rates by large factors without any
        fault, so there a value fails only below 0.4 x the median (--margin sets it for a site's own nodes)."""
        rules = {"margin": 0.2 if device_type == "cuda" else 0.6, "judge_latency": device_type == "cuda"} | {
            k: v for k, v in given.items() if v is not None}
        return Rules(**rules)


def expected_figures(profile: str, calibrated: str = "") -> dict[str, Any] | None:
    """The planner's figures for a datasheet profile (job.gpu); None for a CPU, which has no datasheet, and for a
    job with a calibrated profile (job.hw_profile, read and checked here): a calibration is one machine measured
    once, so the job's own peers, through the median, are the better reference. ValueError for an unknown name or
    a bad profile file."""
    if calibrated:
        hardware.load_profile(calibrated)
        return None
    if profile == hardware.CPU:
        return None
    hw = hardware.profile(profile)
    dtype = "bf16" if "bf16" in hw.peak_tflops else max(hw.peak_tflops, key=hw.peak_tflops.get)
    return {"profile": hw.name, "gemm_tflops": hw.peak(dtype), "gemm_dtype": dtype,
            "intra_gbps": hw.intra_node_gbps, "inter_gbps": hw.inter_node_gbps}


def size_label(nbytes: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return f"{nbytes}B"


def _ranks_text(members: list[int]) -> str:
    return "[" + (",".join(map(str, members)) if len(members) <= 6 else
                  f"{members[0]},{members[1]},..,{members[-1]}") + "]"


def _check(check: str, subject: str, nodes: list[str], value: float | None, unit: str, text: str = "",
           blame: list[str] | None = None) -> dict[str, Any]:
    """One row of the report; `blame`: the nodes a failure of this row is pinned to (default: where it ran)."""
    return {"check": check, "subject": subject, "nodes": nodes, "value": value, "unit": unit,
            "text": text or (f"{value:.3g} {unit}" if value is not None else "-"), "median": None,
            "expected": None, "ok": True, "why": [], "blame": nodes if blame is None else blame}


def _fail(row: dict[str, Any], why: str) -> None:
    row["ok"] = False
    row["why"].append(why)


def _against_median(rows: list[dict[str, Any]], margin: float, what: str) -> None:
    """Each row against the median of all rows' values (a peer set needs two at least)."""
    values = [r["value"] for r in rows if r["value"] is not None]
    if len(values) < 2:
        return
    median = statistics.median(values)
    for r in rows:
        r["median"] = median
        if r["value"] is not None and median > 0 and r["value"] < (1 - margin) * median:
            _fail(r, f"{what} {r['value'] / median:.2f} x the median {median:.3g} {r['unit']}")


def _against_expected(row: dict[str, Any], expected: float, fraction: float, what: str) -> None:
    row["expected"] = expected
    if row["value"] is not None and row["value"] < fraction * expected:
        _fail(row, f"{what} {row['value'] / expected:.2f} x the expected {expected:.3g} {row['unit']}")


def _majority(rows: list[dict[str, Any]], key: str, what: str) -> None:
    """Rows whose row[key] differs from a strict majority's fail; with no strict majority every row fails, blamed
    on no node (which side is wrong cannot be told)."""
    counts = Counter(r[key] for r in rows)
    if len(counts) < 2:
        return
    common, n = counts.most_common(1)[0]
    for r in rows:
        if n * 2 > len(rows) and r[key] != common:
            _fail(r, f"{what} differs from {n} of {len(rows)}: {r[key]} vs {common}")
        elif n * 2 <= len(rows):
            _fail(r, f"{what} split with no majority: {dict(counts)}")
            r["blame"] = []


def _device_rows(job: dict[str, Any], ranks: list[dict[str, Any]], rules: Rules) -> list[dict[str, Any]]:
    rows = []
    for r in ranks:
        d = r["device"]
        if d["type"] == "cuda":
            text = f"cuda:{d['index']} {d['name']} ({d['count']} visible)"
        else:
            text = f"cpu: {d['cpus']} usable CPU(s), {d['threads']} thread(s)"
        row = _check("device", f"rank {r['rank']}", [r["node"]], d["cpus"] if d["type"] == "cpu" else None, "CPUs",
                     text)
        row["name"], row["uuid"] = d.get("name"), (r["host"], d.get("uuid"))
        if job["gpu_job"] and d["type"] != "cuda":
            _fail(row, "the job asks for GPUs but this rank sees no CUDA device")
        if d["type"] == "cuda" and d["count"] > 1 and r["local_rank"] >= d["count"]:
            _fail(row, f"local rank {r['local_rank']} but only {d['count']} GPU(s) visible: ranks would share one")
        rows.append(row)
    cuda = [row for row in rows if row["name"]]
    for uuid, n in Counter(row["uuid"] for row in cuda if row["uuid"][1]).items():
        if n > 1:
            for row in cuda:
                if row["uuid"] == uuid:
                    _fail(row, f"{n} ranks of {uuid[0]} use the same GPU {uuid[1]}")
    _majority(cuda, "name", "GPU model")
    _against_median([row for row in rows if row["value"] is not None], rules.margin, "usable CPUs")
    return rows


def _group_rows(groups: list[dict[str, Any]], sizes: list[int], rules: Rules,
                expected: dict[str, Any] | None) -> list[dict[str, Any]]:
    rows = []
    by_axis: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for g in groups:
        label = "=".join([g["axis"], *g["aliases"]])
        for size in sizes:
            bw = g["busbw"].get(str(size))
            row = _check("allreduce", f"{label} {_ranks_text(g['members'])} {size_label(size)}", g["nodes"], bw,
                         "GB/s")
            row["members"], row["axis"], row["size"] = g["members"], g["axis"], size
            if g.get("wrong"):
                _fail(row, f"{g['wrong']} wrong element(s) in the all-reduce results")
            one_per_node = len(g["nodes"]) == len(g["members"]) > 1
            kind = "intra" if len(g["nodes"]) == 1 else "inter" if one_per_node else None
            if expected and kind and size == max(sizes):
                _against_expected(row, expected[f"{kind}_gbps"], rules.expected_fraction, "busbw")
            by_axis.setdefault((g["axis"], size), []).append(row)
            rows.append(row)
    for (_, size), peers in by_axis.items():
        if not rules.judge_latency and size != max(sizes):
            _against_median(peers, 1.0, "busbw")  # the median shown; nothing is below 0 x it
            continue
        _against_median(peers, rules.margin, "busbw")
        healthy = {n for r in peers if r["ok"] for n in r["nodes"]}
        for r in peers:  # a group spanning nodes: only nodes seen in no healthy peer can be blamed
            if not r["ok"] and len(r["nodes"]) > 1:
                r["blame"] = [n for n in r["nodes"] if n not in healthy]
    return rows


def _node_rows(job: dict[str, Any], nodes: list[dict[str, Any]], rules: Rules) -> list[dict[str, Any]]:
    writes, reads, rows = [], [], []
    for n in nodes:
        where, st = [n["node"]], n["storage"]
        if "error" in st:
            row = _check("storage", n["node"], where, None, "GB/s", "cannot test")
            _fail(row, st["error"])
            rows.append(row)
        else:
            writes.append(_check("write", n["node"], where, st["write_gbps"], "GB/s"))
            reads.append(_check("read", n["node"], where, st["read_gbps"], "GB/s"))
            free = _check("free", n["node"], where, st["free_gb"], "GB", f"{st['free_gb']:.3g} GB, {st['fs']}, "
                          f"{st['striping']}")
            need = job["checkpoint_bytes"] / 1e9
            if need and st["free_gb"] < need:
                _fail(free, f"room for less than one checkpoint ({need:.3g} GB) in {st['dir']}")
            rows.append(free)
        c = n["clock"]
        clock = _check("clock", n["node"], where, c["offset_ms"], "ms",
                       f"{c['offset_ms']:+.3g} ms +- {c['rtt_ms'] / 2:.2g}")
        if abs(c["offset_ms"]) - c["rtt_ms"] / 2 > rules.max_skew_ms:
            _fail(clock, f"clock {c['offset_ms']:+.0f} ms from rank 0's (limit {rules.max_skew_ms:g} ms)")
        e = n["env"]
        env = _check("env", n["node"], where, None, "", f"torch {e['torch']}, CUDA {e['cuda'] or '-'}, NCCL "
                     f"{e['nccl'] or '-'}, MPI {e['mpi'] or '-'}, {len(e['vars'])} variable(s)")
        env["signature"] = repr(sorted((k, v) for k, v in e.items() if k != "shown"))  # "shown" may differ
        rows += [clock, env]
    _against_median(writes, rules.storage_margin, "write")
    _against_median(reads, rules.storage_margin, "read")
    _majority([r for r in rows if r["check"] == "env"], "signature", "environment")
    return writes + reads + rows


def analyse(measured: dict[str, Any], rules: Rules, expected: dict[str, Any] | None) -> dict[str, Any]:
    """The report: measured, plus the rules, every check's row, the failed nodes and the --exclude= line."""
    job = measured["job"]
    gemm = []
    for r in measured["ranks"]:
        row = _check("gemm", f"rank {r['rank']}", [r["node"]], r["gemm"]["tflops"], "TFLOP/s")
        if expected:
            _against_expected(row, expected["gemm_tflops"], rules.expected_fraction, "GEMM")
        gemm.append(row)
    _against_median(gemm, rules.margin, "GEMM")
    checks = (_device_rows(job, measured["ranks"], rules) + gemm + _group_rows(measured["groups"], job["sizes"],
              rules, expected) + _node_rows(job, measured["nodes"], rules))
    for row in checks:  # keep the JSON plain: drop the helper keys the rules used
        for key in ("name", "uuid", "signature"):
            row.pop(key, None)
    failed = [r for r in checks if not r["ok"]]
    blamed = {n for r in failed for n in r["blame"]}
    order = [n["node"] for n in measured["nodes"]] + sorted(blamed)  # the job's node order
    failed_nodes = [n for n in dict.fromkeys(order) if n in blamed]
    return measured | {
        "rules": asdict(rules), "expected": expected, "checks": checks, "ok": not failed,
        "failed_nodes": failed_nodes,
        "unattributed": [f"{r['check']} {r['subject']}" for r in failed if not r["blame"]],
        "exclude": f"--exclude={compress(failed_nodes)}" if failed_nodes else None,
    }


MAX_ROWS = 16  # per check: a larger job's table shows the failures and a one-line summary of the rest


def _cells(row: dict[str, Any]) -> list[str]:
    ratio = f"{row['value'] / row['median']:.2f}x" if row["median"] and row["value"] is not None else "-"
    return [row["check"], row["subject"], compress(row["nodes"]), row["text"], ratio,
            f"{row['expected']:.3g}" if row["expected"] else "-", "ok" if row["ok"] else "FAIL"]


def _summary_cells(check: str, rows: list[dict[str, Any]]) -> list[str]:
    values = sorted(r["value"] for r in rows if r["value"] is not None)
    spread = f"min {values[0]:.3g} median {statistics.median(values):.3g} max {values[-1]:.3g}" if values else ""
    return [check, f"{len(rows)} more", "-", spread, "-", "-", "ok"]


def render(report: dict[str, Any]) -> str:
    """The table, each failure's reason, the verdict and the --exclude= line."""
    job, rules, exp = report["job"], report["rules"], report["expected"]
    against = (f", or below {rules['expected_fraction']:g} x the {exp['profile']} figure ({exp['gemm_dtype']} GEMM, "
               f"links at the large size)" if exp else "")
    lines = [f"hpctrain doctor: {job['world_size']} rank(s) on {job['num_nodes']} node(s), {job['device']}, job "
             f"{job['job_id']}; a value fails below {1 - rules['margin']:.2f} x its peers' median (storage "
             f"{1 - rules['storage_margin']:.2f} x){against}; clocks within {rules['max_skew_ms']:g} ms of rank 0"
             + ("" if rules.get("judge_latency", True) else "; all-reduce judged at the large size only")]
    table = [["check", "subject", "node", "value", "/median", "expected", "verdict"]]
    kinds = list(dict.fromkeys(r["check"] for r in report["checks"]))
    for kind in kinds:
        rows = [r for r in report["checks"] if r["check"] == kind]
        if len(rows) <= MAX_ROWS:
            table += [_cells(r) for r in rows]
            continue
        table += [_cells(r) for r in rows if not r["ok"]]
        table.append(_summary_cells(kind, [r for r in rows if r["ok"]]))
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in table]
    envs = {n["node"]: n["env"]["vars"] for n in report["nodes"]}
    if len({repr(v) for v in envs.values()}) <= 1:  # alike everywhere: said once
        common = next(iter(envs.values()), {})
        lines.append(f"communication variables (every node): "
                     f"{', '.join(f'{k}={v}' for k, v in common.items()) or 'none set'}")
    else:
        lines += [f"communication variables on {node}: {', '.join(f'{k}={v}' for k, v in vs.items()) or 'none'}"
                  for node, vs in envs.items()]
    lines += [f"storage on {n['node']}: {n['storage']['shrunk']}" for n in report["nodes"]
              if (n["storage"] or {}).get("shrunk")]  # a probe bounded by the free space measures less
    for r in report["checks"]:
        if not r["ok"]:
            lines.append(f"FAIL {r['check']} {r['subject']} on {compress(r['nodes'])}: {'; '.join(r['why'])}")
    if report["ok"]:
        lines.append("PASSED: every check is within bounds")
        return "\n".join(lines)
    if report["failed_nodes"]:
        lines.append(f"FAILED nodes: {', '.join(report['failed_nodes'])}")
    if report["unattributed"]:
        lines.append(f"FAILED, not attributable to one node: {', '.join(report['unattributed'])}")
    if report["exclude"]:
        lines.append(f"exclude them: {report['exclude']}    (hpctrain: --set "
                     f"'job.sbatch_extra=[\"{report['exclude']}\"]')")
    return "\n".join(lines)
