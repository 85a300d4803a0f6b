"""`hpctrain diagnose RUN_DIR`: what happened to a hung or failed run, in a few lines, from what its ranks left.

    report = diagnose(run_dir)     # {"kind": "hang" | "failed" | "finished" | "running", "lines": [...], ...}
    print(format_report(report))

Inputs, none of them trusted (read with hpctrain.untrusted: sizes bounded, JSON depth bounded, every field's type
checked, never unpickled, no link followed, neither a file's nor a directory's; damaged ones are named as
problems and left out):
    heartbeat/rankNNNNN.hb      each rank's last step and phase and its fixed facts (host, node, mesh coordinates);
                                hang/heartbeat/ holds them as the hang left them, when the first rank kept them
    hang/request                which rank's watchdog saw the hang first, and why
    hang/rankNNNNN.txt          each live rank's stacks at the hang
    hang/rankNNNNN.fr.json      each live rank's flight recorder: its collectives in flight, per group
    hang/acks.json              the answers that reached the first rank through the job's store: each a dump's
                                header, main-thread frames and flight recorder summary; stands in for a rank's
                                dump files where they are missing (a shared file system shows them late)
    logs/rankNNNNN.log          ERROR lines
    metrics.jsonl               the straggler report of every log step (rank 0's rows): a crawling run's slow ranks
Every loop and every list is sized by the files the directory holds, never by a number read from one: a rank is
below the config's limit (MAX_WORLD_SIZE), and the world group is the ranks present.

A hang is a wait-for graph: a rank in flight in collective #k of group G waits for the members of G whose flight
recorder never reached #k, or who left no dump at all (stopped, or stuck where Python cannot run). Following the
waits from every waiting rank ends at the culprits: ranks that wait for nobody. Works alike on runs from local
processes, mpiexec and Slurm (the run directory is the same).
"""
from __future__ import annotations

import math
import os
import re
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpctrain.config.sections import MAX_WORLD_SIZE
from hpctrain.hang import heartbeat, stragglers
from hpctrain.hang.watchdog import ACKS, REQUEST, flight_summary, read_request
from hpctrain.untrusted import Untrusted, parse_json, read_bytes

MAX_DUMP_BYTES = 64 << 20  # a flight recorder of 20000 entries is a few MB; anything bigger is not ours
MAX_LOG_BYTES = 256 << 20
MAX_FRAMES = 64  # of the main thread's stack: the report shows three
AXES = ("pp", "dp", "tp")
# errors a rank raises because a peer went away, not for a fault of its own
PEER_ERRORS = re.compile(r"Connection closed by peer|Connection reset|Broken pipe|Timed out|timed out|"
                         r"recvBytes|sendBytes|NCCL communicator was aborted|ProcessGroup.*abort|Socket Timeout",
                         re.IGNORECASE)
DUMP_MARK = "# hpctrain hang dump "
# the dump header's fields (watchdog.dump_stacks) and their types; "number": an int or a finite float
HEADER_TYPES: dict[str, tuple[Any, ...]] = {
    "rank": (int,), "host": (str,), "node": (str, type(None)), "pid": (int,), "step": (int,), "phase": (str,),
    "detail": (str,), "idle_s": ("number",), "frozen_s": ("number",), "reason": (str,), "wall": ("number",),
    "threads": (dict,)}


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
    via_store: bool = False  # its dump is known from its answer through the store only (hang/acks.json)

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


def printable(text: str) -> str:
    """A line from what files said, safe for a terminal: control characters (a forged newline, an escape
    sequence) become '?'."""
    return "".join(c if c.isprintable() else "?" for c in text)


def _is_number(v: Any) -> bool:
    return type(v) in (int, float) and math.isfinite(v)


def _subdir(run_dir: Path, rel: str, problems: list[str]) -> Path | None:
    """RUN_DIR/rel when it is a directory of its own; a link (or anything else by that name) is named in problems
    and not followed; None then, and when there is none."""
    path = run_dir / rel
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    except OSError as e:
        problems.append(f"{rel}/: {e.strerror}")
        return None
    if not stat.S_ISDIR(mode):
        problems.append(f"{rel}/: {'a symbolic link' if stat.S_ISLNK(mode) else 'not a directory'}, not followed")
        return None
    return path


def _read_text(path: Path, problems: list[str], limit: int = MAX_DUMP_BYTES) -> str | None:
    """A regular file, not a link, at most `limit` bytes, as text; None (and the reason in problems) otherwise."""
    try:
        return read_bytes(path, limit).decode("utf-8", errors="replace")
    except Untrusted as e:
        problems.append(str(e))
        return None


def check_header(header: Any, where: str) -> dict[str, Any]:
    """A hang dump's header (watchdog.dump_stacks), returned when it is a JSON object whose fields are of their
    types; Untrusted naming the field otherwise."""
    if not isinstance(header, dict):
        raise Untrusted(f"{where}: its header is not a JSON object")
    for key, types in HEADER_TYPES.items():
        v = header.get(key)
        ok = any(_is_number(v) if t == "number" else isinstance(v, t) and not isinstance(v, bool) for t in types)
        if key in header and not ok:
            raise Untrusted(f"{where}: its header's {key} is a {type(v).__name__}")
    return header


def parse_dump(text: str, where: str = "hang dump") -> tuple[dict[str, Any], list[str]]:
    """A hang/rankNNNNN.txt: (its header, the main thread's frames innermost first as 'file:line in func').
    Raises Untrusted for a dump whose header is missing, not JSON or holds a field of the wrong type."""
    first, _, rest = text.partition("\n")
    if not first.startswith(DUMP_MARK):
        raise Untrusted(f"{where}: no hpctrain hang dump header")
    header = check_header(parse_json(first[len(DUMP_MARK):], where), where)
    threads = header.get("threads", {})
    if not all(isinstance(v, str) for v in threads.values()):
        raise Untrusted(f"{where}: its header's threads do not map ids to names")
    main_ids = {k for k, v in threads.items() if v == "MainThread"}
    frames: list[str] = []
    current = None
    for line in rest.splitlines():
        m = re.match(r"(?:Current thread|Thread) (0x[0-9a-f]+)", line)
        if m:
            current = m.group(1)
            continue
        f = re.match(r'\s+File "(.+)", line (\d+) in (\S+)', line)
        if f and current in main_ids and len(frames) < MAX_FRAMES:
            frames.append(f"{Path(f.group(1)).name}:{f.group(2)} in {f.group(3)}")
    return header, frames


def parse_flight_recorder(text: str, where: str = "flight recorder") -> tuple[dict[str, Any] | None, dict[str, int]]:
    """A hang/rankNNNNN.fr.json: (the earliest collective in flight, {group description: highest seq seen}).
    Entries of the wrong shape are skipped; raises Untrusted for a file that is not a flight recorder's JSON."""
    data = parse_json(text, where)
    if not isinstance(data, dict):
        raise Untrusted(f"{where}: not a JSON object")
    return flight_summary(data)


def _seq(v: Any) -> bool:
    return type(v) is int and v >= 0


def parse_ack(ack: Any, where: str) -> tuple[int, dict[str, Any], list[str], dict[str, Any] | None]:
    """One answer of hang/acks.json (watchdog.answer): (rank, dump header, main-thread frames, flight recorder
    summary {"in_flight", "last_seq"} or None), every field checked for its type; Untrusted otherwise."""
    if not isinstance(ack, dict):
        raise Untrusted(f"{where}: not a JSON object")
    rank = ack.get("rank")
    if type(rank) is not int or not 0 <= rank < MAX_WORLD_SIZE:
        raise Untrusted(f"{where}: names no rank in [0, {MAX_WORLD_SIZE})")
    header = check_header(ack.get("header"), where)
    if header.get("rank") != rank:
        raise Untrusted(f"{where}: its header names another rank than {rank}")
    frames = ack.get("stack", [])
    if not isinstance(frames, list) or not all(isinstance(f, str) for f in frames):
        raise Untrusted(f"{where}: its stack is not a list of frames")
    flight = ack.get("flight")
    if flight is not None:
        f, last = (flight.get("in_flight"), flight.get("last_seq")) if isinstance(flight, dict) else (None, None)
        if not isinstance(last, dict) or not all(isinstance(k, str) and _seq(v) for k, v in last.items()) or (
                f is not None and not (isinstance(f, dict) and all(isinstance(f.get(k), str) for k in
                                                                   ("group", "key", "op"))
                                       and _seq(f.get("seq")) and isinstance(f.get("p2p"), bool))):
            raise Untrusted(f"{where}: its flight recorder summary is not one")
        flight = {"in_flight": None if f is None else {k: f[k] for k in ("group", "key", "op", "seq", "p2p")},
                  "last_seq": last}
    return rank, header, [x[:300] for x in frames[:MAX_FRAMES]], flight


def axis_of(desc: str) -> str:
    """A flight recorder group description -> our name for it ('mesh_dp' -> 'dp', 'default_pg' -> 'world')."""
    if desc == "default_pg":
        return "world"
    return desc.removeprefix("mesh_")


class Groups:
    """Who shares which group with whom, from the heartbeats' mesh coordinates: indexed once, asked per waiting
    rank. The world is the ranks the directory holds a file of (never a number read from one)."""

    def __init__(self, by_rank: dict[int, Rank]) -> None:
        self.world = sorted(by_rank)
        self.index: dict[tuple[str, tuple[Any, ...]], list[int]] = {}
        for r in self.world:
            c = by_rank[r].beat.get("coords")
            if isinstance(c, dict):
                for axis in AXES:
                    self.index.setdefault((axis, tuple(c.get(a) for a in AXES if a != axis)), []).append(r)

    def key(self, rank: int, axis: str, by_rank: dict[int, Rank]) -> tuple[str, tuple[Any, ...]] | None:
        """The group of `rank` along `axis` (hashable), None when unknown."""
        if axis == "world":
            return ("world", ())
        mine = by_rank[rank].beat.get("coords")
        if axis not in AXES or not isinstance(mine, dict):
            return None
        return (axis, tuple(mine.get(a) for a in AXES if a != axis))

    def members(self, key: tuple[str, tuple[Any, ...]] | None) -> list[int]:
        return self.world if key == ("world", ()) else self.index.get(key, []) if key else []


def _dirs(run_dir: Path, problems: list[str]) -> dict[str, Any]:
    """The run directory's parts that are directories of their own (None when absent or a link): hang/, the
    heartbeats (hang/heartbeat/ as the hang left them when the first rank kept them, else heartbeat/), logs/."""
    hang = _subdir(run_dir, "hang", problems)
    kept = _subdir(run_dir, "hang/heartbeat", problems) if hang is not None else None
    beats_rel = "hang/heartbeat" if kept is not None else "heartbeat"
    return {"hang": hang, "beats": kept if kept is not None else _subdir(run_dir, "heartbeat", problems),
            "beats_rel": beats_rel, "logs": _subdir(run_dir, "logs", problems)}


def load(run_dir: Path, dirs: dict[str, Any], problems: list[str]) -> dict[int, Rank]:
    """Every rank's heartbeat, hang dump, flight recorder and first log error; the problems met reading them go
    to `problems`."""
    by_rank: dict[int, Rank] = {}
    for path in sorted(dirs["beats"].glob("rank*.hb")) if dirs["beats"] is not None else []:
        beat = heartbeat.read(path)
        if "error" in beat:
            problems.append(f"{dirs['beats_rel']}/{beat['error']}")
        elif path.name != heartbeat.heartbeat_path("", beat["rank"]).name:
            problems.append(f"{dirs['beats_rel']}/{path.name}: named for another rank than its rank {beat['rank']}")
        else:
            by_rank[beat["rank"]] = Rank(beat["rank"], beat)
    hang = dirs["hang"]
    for path in sorted(hang.glob("rank*.txt")) if hang is not None else []:
        m = re.fullmatch(r"rank(\d{5})\.txt", path.name)
        text = _read_text(path, problems) if m else None
        if text is None:
            continue
        r = by_rank.setdefault(int(m.group(1)), Rank(int(m.group(1))))
        try:
            header, frames = parse_dump(text, f"hang/{path.name}")  # faulthandler lists the innermost frame first
            if header.get("rank", r.rank) != r.rank:
                raise Untrusted(f"hang/{path.name}: its header names rank {header['rank']}")
            r.dump, r.main_stack = header, frames
        except Untrusted as e:
            problems.append(str(e))
        fr = hang / f"rank{r.rank:05d}.fr.json"
        text = _read_text(fr, problems) if os.path.lexists(fr) else None
        if text is not None:
            try:
                r.in_flight, r.last_seq = parse_flight_recorder(text, f"hang/{fr.name}")
                r.has_fr = True
            except Untrusted as e:
                problems.append(str(e))
    if hang is not None and os.path.lexists(hang / ACKS):
        _load_acks(hang / ACKS, by_rank, problems)
    for path in sorted(dirs["logs"].glob("rank*.log")) if dirs["logs"] is not None else []:
        m = re.fullmatch(r"rank(\d{5})\.log", path.name)
        text = _read_text(path, problems, MAX_LOG_BYTES) if m else None
        if text is None:
            continue
        err = next((line for line in text.splitlines() if " ERROR " in line), "")
        if err:
            by_rank.setdefault(int(m.group(1)), Rank(int(m.group(1)))).log_error = err.split(" ERROR ", 1)[1][:300]
    return by_rank


def _load_acks(path: Path, by_rank: dict[int, Rank], problems: list[str]) -> None:
    """The answers the first rank got through the store stand in for the dump files of ranks whose files are not
    here (not visible yet on a shared file system, or lost): such a rank did dump in time."""
    text = _read_text(path, problems)
    if text is None:
        return
    try:
        data = parse_json(text, f"hang/{ACKS}")
        if not isinstance(data, dict) or not isinstance(data.get("acks"), list):
            raise Untrusted(f"hang/{ACKS}: not a list of answers")
    except Untrusted as e:
        problems.append(str(e))
        return
    for i, ack in enumerate(data["acks"]):
        try:
            rank, header, frames, flight = parse_ack(ack, f"hang/{ACKS} answer {i + 1}")
        except Untrusted as e:
            problems.append(str(e))
            continue
        r = by_rank.setdefault(rank, Rank(rank))
        if r.dump is None:
            r.dump, r.main_stack, r.via_store = header, frames, True
        if not r.has_fr and flight is not None:
            r.in_flight, r.last_seq, r.has_fr, r.via_store = flight["in_flight"], flight["last_seq"], True, True


def _when(wall: Any) -> str:
    try:
        return time.strftime("%H:%M:%S", time.localtime(wall)) if _is_number(wall) else "?"
    except (OverflowError, OSError, ValueError):  # a time no calendar holds
        return "?"


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
    if run_dir.is_symlink():  # a hang-<time>/ planted as a link into another tree, say
        raise ValueError(f"{run_dir} is a symbolic link: give the run directory itself ({os.path.realpath(run_dir)}"
                         f" if you trust it)")
    if not run_dir.is_dir():
        raise ValueError(f"{run_dir} is not a run directory")
    problems: list[str] = []
    dirs = _dirs(run_dir, problems)
    by_rank = load(run_dir, dirs, problems)
    request = None
    if dirs["hang"] is not None and os.path.lexists(dirs["hang"] / REQUEST):
        try:
            request = read_request(dirs["hang"] / REQUEST)
        except Untrusted as e:
            problems.append(str(e))
            request = {}  # a request there, unreadable: still a hang, its first witness unknown
        if request.get("damaged"):
            problems.append(f"hang/request: {', '.join(request['damaged'])} of the wrong type")
        _drop_late_dumps(by_rank, request)
    if not by_rank:
        out = {"kind": "unknown", "lines": [f"{run_dir} holds no heartbeats, hang dumps or logs of ranks"],
               "culprits": [], "files": []}
    elif request is not None:
        out = _hang(run_dir, dirs, by_rank, request)
    else:
        out = _ended(dirs, by_rank)
    out["problems"] = problems
    out["stragglers"] = stragglers.from_metrics(run_dir) if history and by_rank else None  # a crawl: who was slow
    if out["stragglers"] is not None:
        out["lines"].append(stragglers.history_line(out["stragglers"]))
    for key in ("lines", "files", "problems"):  # what files said, safe for a terminal
        out[key] = [printable(x) for x in out[key]]
    return out


LATE_MARGIN_S = 0.5  # past the request's grace, when its maker stops waiting (clocks of hosts differ a little)


def _drop_late_dumps(by_rank: dict[int, Rank], request: dict[str, Any]) -> None:
    """A rank whose dump came after the others had to answer, or whose watchdog had been frozen just before it,
    was not answering then: stopped (Slurm's SIGCONT at the end or requeue of the job woke it) or stuck. Its dump
    does not count as one made in time."""
    if "wall" not in request:
        return
    deadline = request["wall"] + request.get("grace_s", 0.0) + LATE_MARGIN_S
    for r in by_rank.values():
        wall, frozen = (r.dump or {}).get("wall"), (r.dump or {}).get("frozen_s")  # numbers: parse_dump checked
        late = wall is not None and wall > deadline
        if late or (frozen is not None and frozen > 0):
            r.late_s = max(wall - deadline + LATE_MARGIN_S if late else 0.0, frozen or 0.0)
            r.dump, r.main_stack, r.in_flight, r.last_seq, r.has_fr, r.via_store = None, [], None, {}, False, False


def _hang(run_dir: Path, dirs: dict[str, Any], by_rank: dict[int, Rank], first: dict[str, Any]) -> dict[str, Any]:
    lines = [f"hang: first seen by rank {first.get('rank', '?')}'s watchdog at {_when(first.get('wall'))} "
             f"({first.get('reason', '?')})"]
    groups = Groups(by_rank)
    absent_of: dict[tuple[Any, str, int], frozenset[int]] = {}  # (group, collective, seq) -> who never got there
    waits: dict[int, frozenset[int]] = {}
    waiting_on: dict[int, tuple[str, str, int]] = {}  # rank -> (op, axis, seq)
    for r in by_rank.values():
        f = r.in_flight
        if r.dump is None or f is None:
            continue
        axis = axis_of(f["group"])
        key = groups.key(r.rank, axis, by_rank)
        memo = (key, f["key"], f["seq"])
        if memo not in absent_of:  # one pass per distinct collective, not per waiting rank: the world's is long
            absent_of[memo] = frozenset(m for m in groups.members(key) if not (
                by_rank[m].has_fr and by_rank[m].last_seq.get(f["key"], 0) >= f["seq"]))
        waits[r.rank] = absent_of[memo]  # never r itself: its own flight recorder reached its collective
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
    grouped: dict[tuple[str, str], list[int]] = {}
    for rank, (op, axis, _) in waiting_on.items():
        grouped.setdefault((op, axis), []).append(rank)
    for (op, axis), ranks in sorted(grouped.items(), key=lambda kv: min(kv[1])):
        target = sorted(set().union(*(waits[r] for r in ranks)))
        doing = sorted({_doing(by_rank[r].beat) for r in ranks if by_rank[r].beat})
        what = f"in {op} on the {axis} group" if axis != "world" else f"in {op} on the world"
        ctx = f" ({'; '.join(doing)})" if doing else ""
        lines.append(f"{who(ranks, by_rank)} waited {what}{ctx}" +
                     (f" for {who(target, by_rank)}" if target else ""))
    told = sorted(r.rank for r in by_rank.values() if r.via_store)
    if told:
        lines.append(f"{who(told, by_rank)} answered in time through the job's store (hang/{ACKS}); some of their "
                     f"dump files were not here when this was read (a shared file system may show them late)")
    if "store" in first:
        lines.append(f"the job's store did not carry the request ({first['store']}): the ranks were asked through "
                     f"hang/request alone, which a shared file system may show late; a missing dump may be a late one")
    try:
        files = [f"hang/{e.name}" for e in sorted(os.scandir(dirs["hang"]), key=lambda e: e.name)
                 if e.is_file(follow_symlinks=False)]
    except OSError as e:  # unreadable or changing under us: the files are a pointer, the diagnosis stands
        files = [f"hang/ ({e.strerror})"]
    files += [f"{dirs['beats_rel']}/rank{c:05d}.hb" for c in sorted(culprits)]
    files += [f"logs/rank{c:05d}.log" for c in sorted(culprits) if dirs["logs"] is not None
              and os.path.lexists(dirs["logs"] / f"rank{c:05d}.log")]
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


def _ended(dirs: dict[str, Any], by_rank: dict[int, Rank]) -> dict[str, Any]:
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
    files = [f"logs/rank{c:05d}.log" for c in sorted(culprits) if dirs["logs"] is not None
             and os.path.lexists(dirs["logs"] / f"rank{c:05d}.log")]
    return {"kind": "failed", "lines": ["failed:"] + lines, "culprits": _culprit_rows(culprits, by_rank),
            "files": files + [f"{dirs['beats_rel']}/rank{c:05d}.hb" for c in sorted(culprits)]}


def format_report(report: dict[str, Any], run_dir: str | Path) -> str:
    lines = list(report["lines"])
    if report.get("files"):
        lines.append(f"files (in {run_dir}): " + ", ".join(report["files"]))
    for p in report.get("problems", []):
        lines.append(f"unreadable: {p}")
    return "\n".join(lines)
