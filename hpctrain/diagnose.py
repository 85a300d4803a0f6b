"""`hpctrain diagnose RUN_DIR`: what happened to a hung or failed run, in a few lines, from what its ranks left.

    report = diagnose(run_dir)     # {"kind": "hang" | "failed" | "finished" | "running", "lines": [...], ...}
    print(format_report(report))

Inputs, none of them trusted (sizes checked, never unpickled, nothing followed out of RUN_DIR):
    heartbeat/rankNNNNN.hb      each rank's last step and phase and its fixed facts (host, node, mesh coordinates);
                                hang/heartbeat/ holds them as the hang left them, when the first rank kept them
    hang/request                which rank's watchdog saw the hang first, and why
    hang/rankNNNNN.txt          each live rank's stacks at the hang
    hang/rankNNNNN.fr.json      each live rank's flight recorder: its collectives in flight, per group
    logs/rankNNNNN.log          ERROR lines
    metrics.jsonl               the straggler report of every log step (rank 0's rows): a crawling run's slow ranks

A hang is a wait-for graph: a rank in flight in collective #k of group G waits for the members of G whose flight
recorder never reached #k, or who left no dump at all (stopped, or stuck where Python cannot run). Following the
waits from every waiting rank ends at the culprits: ranks that wait for nobody. Works alike on runs from local
processes, mpiexec and Slurm (the run directory is the same).
"""
from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpctrain import heartbeat, stragglers
from hpctrain.watchdog import REQUEST, hang_path

MAX_DUMP_BYTES = 64 << 20  # a flight recorder of 20000 entries is a few MB; anything bigger is not ours
AXES = ("pp", "dp", "tp")
# errors a rank raises because a peer went away, not for a fault of its own
PEER_ERRORS = re.compile(r"Connection closed by peer|Connection reset|Broken pipe|Timed out|timed out|"
                         r"recvBytes|sendBytes|NCCL communicator was aborted|ProcessGroup.*abort|Socket Timeout",
                         re.IGNORECASE)


@dataclass
class Rank:
    rank: int
    beat: dict[str, Any] = field(default_factory=dict)  # the heartbeat ({} when none)
    dump: dict[str, Any] | None = None  # the hang dump's header
    main_stack: list[str] = field(default_factory=list)  # the main thread's frames, innermost first
    in_flight: dict[str, Any] | None = None  # the earliest unfinished collective of the flight recorder
    last_seq: dict[str, int] = field(default_factory=dict)  # group description -> highest sequence number seen
    has_fr: bool = False
    log_error: str = ""
    late_s: float | None = None  # a dump made this long after the ranks had to answer: not counted

    @property
    def node(self) -> str:
        return str(self.beat.get("node") or self.beat.get("host") or "?")


def ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 4, 6, 7] -> '0-2, 4, 6-7'."""
    out, rs = [], sorted(set(ranks))
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        out.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    return ", ".join(out)


def who(ranks: list[int], by_rank: dict[int, Rank]) -> str:
    """'rank 5 (n2)' or 'ranks 0-4, 6-7 (n1, n2)'."""
    nodes = sorted({by_rank[r].node for r in ranks if r in by_rank})
    return f"rank{'s' if len(set(ranks)) > 1 else ''} {ranges(ranks)}" + (f" ({', '.join(nodes)})" if nodes else "")


def _read_text(path: Path, limit: int = MAX_DUMP_BYTES) -> str | None:
    """A regular file inside the run directory, not a link, at most `limit` bytes; None otherwise."""
    try:
        if path.is_symlink() or not path.is_file() or path.stat().st_size > limit:
            return None
        return path.read_text(errors="replace")
    except OSError:
        return None


def parse_dump(text: str) -> tuple[dict[str, Any] | None, list[str]]:
    """A hang/rankNNNNN.txt: (its header, the main thread's frames innermost first as 'file:line in func')."""
    lines = text.splitlines()
    header = None
    if lines and lines[0].startswith("# hpctrain hang dump "):
        try:
            header = json.loads(lines[0][len("# hpctrain hang dump "):])
        except ValueError:
            header = None
    main_ids = {k for k, v in (header or {}).get("threads", {}).items() if v == "MainThread"}
    frames: list[str] = []
    current = None
    for line in lines[1:]:
        m = re.match(r"(?:Current thread|Thread) (0x[0-9a-f]+)", line)
        if m:
            current = m.group(1)
            continue
        f = re.match(r'\s+File "(.+)", line (\d+) in (\S+)', line)
        if f and current in main_ids:
            frames.append(f"{Path(f.group(1)).name}:{f.group(2)} in {f.group(3)}")
    return header, frames


def parse_flight_recorder(text: str) -> tuple[dict[str, Any] | None, dict[str, int]]:
    """A hang/rankNNNNN.fr.json: (the earliest collective in flight, {group description: highest seq seen})."""
    try:
        data = json.loads(text)
    except ValueError:
        return None, {}
    entries: list[dict[str, Any]] = []
    for part in ("nccl", "fr"):
        block = data.get(part) if isinstance(data, dict) else None
        if isinstance(block, dict) and isinstance(block.get("entries"), list):
            entries += [e for e in block["entries"] if isinstance(e, dict)]
    last: dict[str, int] = {}
    flight = None
    for e in sorted(entries, key=lambda e: e.get("time_created_ns", 0) if isinstance(e.get("time_created_ns"), int)
                    else 0):
        pg = e.get("process_group")
        desc = str(pg[1]) if isinstance(pg, list) and len(pg) == 2 else "?"
        p2p = bool(e.get("is_p2p"))
        seq = e.get("p2p_seq_id" if p2p else "collective_seq_id")
        if not isinstance(seq, int):
            continue
        # a group of an NCCL job has two backends (gloo for host tensors), each counting its own collectives
        backend, _, op = str(e.get("profiling_name", "?:?")).partition(":")
        key = f"{backend}:{desc}" + (" p2p" if p2p else "")
        last[key] = max(last.get(key, 0), seq)
        if flight is None and e.get("retired") is False:
            flight = {"group": desc, "key": key, "op": op, "seq": seq, "p2p": p2p,
                      "sizes": e.get("input_sizes"), "state": e.get("state")}
    return flight, last


def axis_of(desc: str) -> str:
    """A flight recorder group description -> our name for it ('mesh_dp' -> 'dp', 'default_pg' -> 'world')."""
    if desc == "default_pg":
        return "world"
    return desc.removeprefix("mesh_")


def members(rank: int, axis: str, by_rank: dict[int, Rank], world: int) -> list[int] | None:
    """The ranks of `rank`'s group along `axis`, from the mesh coordinates in the heartbeats; None if unknown."""
    if axis == "world":
        return list(range(world))
    mine = by_rank[rank].beat.get("coords")
    if axis not in AXES or not isinstance(mine, dict):
        return None
    out = []
    for r, info in by_rank.items():
        c = info.beat.get("coords")
        if isinstance(c, dict) and all(c.get(a) == mine.get(a) for a in AXES if a != axis):
            out.append(r)
    return sorted(out)


def load(run_dir: Path) -> tuple[dict[int, Rank], list[str]]:
    """Every rank's heartbeat, hang dump, flight recorder and first log error; and the problems met reading them."""
    problems: list[str] = []
    by_rank: dict[int, Rank] = {}
    kept = run_dir / "hang" / "heartbeat"  # the heartbeats as the hang left them, when the first rank kept them
    beats = kept if kept.is_dir() and not kept.is_symlink() else run_dir / "heartbeat"
    for path in sorted(beats.glob("rank*.hb")):
        beat = heartbeat.read(path)
        if "error" in beat or path.name != heartbeat.heartbeat_path("", beat.get("rank", -1)).name:
            problems.append(f"heartbeat/{path.name}: {beat.get('error', 'named for another rank')}")
            continue
        by_rank[beat["rank"]] = Rank(beat["rank"], beat)
    for path in sorted((run_dir / "hang").glob("rank*.txt")):
        m = re.fullmatch(r"rank(\d{5})\.txt", path.name)
        text = _read_text(path)
        if m is None or text is None:
            continue
        r = by_rank.setdefault(int(m.group(1)), Rank(int(m.group(1))))
        r.dump, r.main_stack = parse_dump(text)  # faulthandler lists the innermost frame first
        fr = _read_text(hang_path(run_dir, r.rank, ".fr.json"))
        if fr is not None:
            r.in_flight, r.last_seq = parse_flight_recorder(fr)
            r.has_fr = True
    for path in sorted((run_dir / "logs").glob("rank*.log")):
        m = re.fullmatch(r"rank(\d{5})\.log", path.name)
        text = _read_text(path, 256 << 20)
        if m is None or text is None:
            continue
        err = next((line for line in text.splitlines() if " ERROR " in line), "")
        if err:
            by_rank.setdefault(int(m.group(1)), Rank(int(m.group(1)))).log_error = err.split(" ERROR ", 1)[1][:300]
    return by_rank, problems


def _when(wall: Any) -> str:
    return time.strftime("%H:%M:%S", time.localtime(wall)) if isinstance(wall, (int, float)) else "?"


def _doing(beat: dict[str, Any]) -> str:
    """'forward of step 5', 'gradient reduction on dp, step 5', 'checkpoint (save of step 5)'."""
    if beat.get("phase") == "collective" and beat.get("detail"):
        return f"{beat['detail']}, step {beat['step']}"
    if beat.get("phase") in ("data", "forward", "backward", "optimizer"):
        return f"{beat['phase']} of step {beat['step']}"
    detail = f" ({beat['detail']})" if beat.get("detail") else ""
    return f"{beat.get('phase')}{detail} at step {beat.get('step')}"


def _position(r: Rank) -> str:
    if not r.beat:
        return "no heartbeat (it never got past the rendezvous?)"
    return f"{_doing(r.beat)}, since {_when(r.beat.get('wall'))}"


def diagnose(run_dir: str | Path, history: bool = True) -> dict[str, Any]:
    """history=False leaves out the straggler history (a read of metrics.jsonl the hang path does not need)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"{run_dir} is not a run directory")
    by_rank, problems = load(run_dir)
    world = max([*by_rank, -1]) + 1
    request = _read_text(run_dir / "hang" / REQUEST, 4096)
    if request is not None:
        _drop_late_dumps(by_rank, request)
    if not by_rank:
        return {"kind": "unknown", "lines": [f"{run_dir} holds no heartbeats, hang dumps or logs of ranks"],
                "culprits": [], "files": [], "problems": problems}
    if request is not None:
        out = _hang(run_dir, by_rank, world, request)
    else:
        out = _ended(run_dir, by_rank)
    out["problems"] = problems
    out["stragglers"] = stragglers.from_metrics(run_dir) if history else None  # a crawl: whom the others waited for
    if out["stragglers"] is not None:
        out["lines"].append(stragglers.history_line(out["stragglers"]))
    return out


LATE_MARGIN_S = 0.5  # past the request's grace, when its maker stops waiting (clocks of hosts differ a little)


def _drop_late_dumps(by_rank: dict[int, Rank], request: str) -> None:
    """A rank whose dump came after the others had to answer, or whose watchdog had been frozen just before it,
    was not answering then: stopped (Slurm's SIGCONT at the end or requeue of the job woke it) or stuck. Its dump
    does not count as one made in time."""
    try:
        req = json.loads(request)
        deadline = float(req["wall"]) + float(req.get("grace_s", 0)) + LATE_MARGIN_S
    except (ValueError, KeyError, TypeError):
        return
    for r in by_rank.values():
        wall, frozen = (r.dump or {}).get("wall"), (r.dump or {}).get("frozen_s")
        late = isinstance(wall, (int, float)) and wall > deadline
        if late or (isinstance(frozen, (int, float)) and frozen > 0):
            r.late_s = max(wall - deadline + LATE_MARGIN_S if late else 0.0, frozen or 0.0)
            r.dump, r.main_stack, r.in_flight, r.last_seq, r.has_fr = None, [], None, {}, False


def _hang(run_dir: Path, by_rank: dict[int, Rank], world: int, request: str) -> dict[str, Any]:
    try:
        first = json.loads(request)
    except ValueError:
        first = {}
    lines = [f"hang: first seen by rank {first.get('rank', '?')}'s watchdog at {_when(first.get('wall'))} "
             f"({first.get('reason', '?')})"]
    waits: dict[int, set[int]] = {}
    waiting_on: dict[int, tuple[str, str, int]] = {}  # rank -> (op, axis, seq)
    for r in by_rank.values():
        f = r.in_flight
        if r.dump is None or f is None:
            continue
        axis = axis_of(f["group"])
        group = members(r.rank, axis, by_rank, world) or []
        absent = {m for m in group if m != r.rank and not (
            by_rank.get(m) and by_rank[m].has_fr and by_rank[m].last_seq.get(f["key"], 0) >= f["seq"])}
        waits[r.rank] = absent
        waiting_on[r.rank] = (f["op"] + (" (p2p)" if f["p2p"] else ""), axis, f["seq"])
    # follow the waits: the culprits are the ranks waited for that wait for nobody themselves
    culprits, seen = set(), set()
    todo = [m for absent in waits.values() for m in absent]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        if m in waits and waits[m]:
            todo += list(waits[m])
        elif m not in waits:
            culprits.add(m)
    if not waits:  # no flight recorder (parallel.flight_recorder = 0): ranks that left no dump, else busy ones
        culprits = {r.rank for r in by_rank.values() if r.dump is None} or {
            r.rank for r in by_rank.values() if r.beat.get("phase") != "collective"}
    for c in sorted(culprits):
        r = by_rank.get(c) or Rank(c)
        if r.dump is None:
            late = (f" in time (its watchdog could not run for {r.late_s:.0f} s: it was woken afterwards)"
                    if r.late_s else "")
            lines.append(f"{who([c], by_rank)} last seen in {_position(r)}; it left no hang dump{late}: stopped, "
                         f"dead, or stuck where Python cannot run")
        else:
            where = " < ".join(r.main_stack[:3]) or "?"
            lines.append(f"{who([c], by_rank)} was busy in {_position(r)}, in no collective (main thread: {where})")
    groups: dict[tuple[str, str], list[int]] = {}
    for rank, (op, axis, _) in waiting_on.items():
        groups.setdefault((op, axis), []).append(rank)
    for (op, axis), ranks in sorted(groups.items(), key=lambda kv: min(kv[1])):
        target = sorted(set().union(*(waits[r] for r in ranks)))
        doing = sorted({_doing(by_rank[r].beat) for r in ranks if by_rank[r].beat})
        what = f"in {op} on the {axis} group" if axis != "world" else f"in {op} on the world"
        ctx = f" ({'; '.join(doing)})" if doing else ""
        lines.append(f"{who(ranks, by_rank)} waited {what}{ctx}" +
                     (f" for {who(target, by_rank)}" if target else ""))
    files = [str(p.relative_to(run_dir)) for p in sorted((run_dir / "hang").iterdir()) if p.is_file()]
    beats = "hang/heartbeat" if (run_dir / "hang" / "heartbeat").is_dir() else "heartbeat"
    files += [f"{beats}/rank{c:05d}.hb" for c in sorted(culprits)]
    files += [f"logs/rank{c:05d}.log" for c in sorted(culprits) if (run_dir / "logs" / f"rank{c:05d}.log").exists()]
    return {"kind": "hang", "lines": lines, "culprits": _culprit_rows(culprits, by_rank), "files": files,
            "waiting": {str(r): {"op": op, "group": axis, "seq": seq, "for": sorted(waits[r])}
                        for r, (op, axis, seq) in waiting_on.items()}}


def _culprit_rows(culprits: set[int], by_rank: dict[int, Rank]) -> list[dict[str, Any]]:
    rows = []
    for c in sorted(culprits):
        b = (by_rank.get(c) or Rank(c)).beat
        rows.append({"rank": c, "node": b.get("node"), "host": b.get("host"), "step": b.get("step"),
                     "phase": b.get("phase"), "detail": b.get("detail"), "dumped": (by_rank.get(c) or Rank(c)).dump
                     is not None})
    return rows


def _ended(run_dir: Path, by_rank: dict[int, Rank]) -> dict[str, Any]:
    """No hang: a run that failed, finished, or is still going."""
    phase = {r: info.beat.get("phase") for r, info in by_rank.items()}
    if phase and all(p == "done" for p in phase.values()):
        steps = sorted({info.beat.get("step") for info in by_rank.values()})
        return {"kind": "finished", "lines": [f"finished: every rank done (step {', '.join(map(str, steps))})"],
                "culprits": [], "files": []}
    failed = {r for r, p in phase.items() if p == "failed"}
    error = {r: str(by_rank[r].beat.get("failure") or by_rank[r].log_error) for r in by_rank}
    own = {r for r in failed if error[r] and not PEER_ERRORS.search(error[r])}
    silent = {r for r, p in phase.items() if p not in ("done", "failed")}
    newest = max((info.beat.get("wall", 0) for info in by_rank.values()), default=0)
    if not failed and silent and time.time() - newest < 120:
        return {"kind": "running", "lines": [f"no hang or failure recorded; {who(sorted(silent), by_rank)} changed "
                                             f"phase within the last {time.time() - newest:.0f} s (still running?)"],
                "culprits": [], "files": []}
    lines: list[str] = []
    culprits = own or (silent if failed else set()) or failed or silent
    for c in sorted(culprits):
        r = by_rank[c]
        if c in failed:
            lines.append(f"{who([c], by_rank)} failed in {_position(r)}: {error[c]}")
        else:
            lines.append(f"{who([c], by_rank)} ended in {_position(r)}, without an error of its own: killed "
                         f"(SIGKILL, the OOM killer, a node failure) or still running")
    others = sorted(failed - culprits)
    if others:
        kinds = sorted({error[r][:80] for r in others})
        lines.append(f"then {who(others, by_rank)} failed: {'; '.join(kinds)}")
    files = [f"logs/rank{c:05d}.log" for c in sorted(culprits) if (run_dir / "logs" / f"rank{c:05d}.log").exists()]
    return {"kind": "failed", "lines": ["failed:"] + lines, "culprits": _culprit_rows(culprits, by_rank),
            "files": files + [f"heartbeat/rank{c:05d}.hb" for c in sorted(culprits)]}


def format_report(report: dict[str, Any], run_dir: str | Path) -> str:
    lines = list(report["lines"])
    if report.get("files"):
        lines.append(f"files (in {run_dir}): " + ", ".join(report["files"]))
    for p in report.get("problems", []):
        lines.append(f"unreadable: {p}")
    return "\n".join(lines)
