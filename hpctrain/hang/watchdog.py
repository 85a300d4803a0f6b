"""The hang watchdog: a thread per rank that watches the rank's heartbeat. When the rank makes no progress (no phase
change) for longer than its phase allows, it writes what it knows into RUN_DIR/hang/ and ends the whole job.

    channel = StoreChannel(PrefixStore("hpctrain-hang/", store.clone()), world_size)  # session.start does it
    dog = Watchdog(hb, run_dir, Limits(step_s=180, long_s=1200, storage_bps=0.5e9), peers, channel,
                   on_end=lambda: requeue.after_hang(run_dir, 1, num_nodes))  # a thread; session.start makes it
    hb.begin_training(resumed)   # the payload says where it starts: the first step (resumed + 1) has the long limit
    dog.stop()

Limits: step phases (data, forward, backward, optimizer, collective) get parallel.hang_timeout_s; start-up,
checkpoints, evaluation and the first step (Heartbeat.first_step: the step after the one training goes on from)
get parallel.startup_timeout_s. Both are shorter than the collective timeout (parallel.timeout_s), so the
watchdog speaks first, while every rank is still alive to be asked. A checkpoint's read or write gets more: the
time its bytes (the whole job's, as the checkpoint code announces them) take at checkpoint.storage_gbps, and its
idle time runs from the last dataset read or written (Heartbeat.advance), so a resume that takes an hour on slow
storage but moves bytes is no hang, and one whose read stops still is.

The first step's long limit is for work (compiling, NCCL's set-up), not for silence: every look of the thread is
also a tick in the rank's heartbeat, and a rank idle past half the step limit in its first step reads the ticks of
the next PEERS_WATCHED ranks. A peer whose tick has not changed for the step limit (by this rank's clock: nodes'
clocks are never compared) while this rank is idle past the step limit is stopped, dead or stuck where
Python cannot run, and nothing it could be compiling: the hang is called then, not after the long limit. (Every
start's first step, so the first step after a hang requeue too; a stretch of stopped ranks always follows a live
rank, which watches the first of them.)

What a hang leaves, per live rank:
    hang/rank00003.txt      every thread's Python stack (faulthandler: works while the main thread holds the GIL)
                            under a header: rank, host, step, phase, why
    hang/rank00003.fr.json  torch's flight recorder (parallel.flight_recorder entries; gloo and NCCL): the
                            collectives in flight, per group, with their sequence numbers
    hang/request            written by the first rank to trip: who, why, when, how long the others had to answer
    hang/acks.json          written by the first rank to trip: the answers that reached it through the store
    hang/ended              written by the first rank to trip when its diagnosis and requeue are done

How the ranks tell each other. The first rank to trip asks every other rank to dump through the job's store (the
rendezvous TCPStore: a key set once, compare_set, so one rank is first), and each rank that dumped says so there
(a line appended with its dump's header, main-thread stack and flight recorder summary, and a counter). Every
other rank's watchdog sees the request at its next poll and dumps too (it may still be computing, or waiting in a
collective a stopped peer never joins). The first rank waits until the count says every rank answered, or a grace
period passed, diagnoses and runs its on_end (the requeue without the silent ranks' nodes), then says it is done
(the store's "ended" key and hang/ended). The others wait out the grace, then for that word, at most END_WAIT_S
more: their aborts end the whole launch (MPI_Abort), and one that came while the first rank was between
`scontrol requeue` and the ExcNodeList update, or before it recorded the requeue, left the job requeued onto the
same node with no record of it (seen on the local cluster, CI-32). Then each ends itself through the launch's
abort path: submitit's error result, MPI_Abort (every rank of an MPI launch), else
the peers on its own host that never dumped (stopped, or stuck in the kernel) are killed and the rank exits 1 (srun
--kill-on-bad-exit ends the rest). The first rank writes the answers it got into hang/acks.json before it
diagnoses, so the diagnosis (and the requeue that excludes nodes by it) counts every rank that answered in time,
even where a shared file system shows the other ranks' dump files a minute late (NFS attribute and lookup caches
hold 30-60 s against a grace of seconds). `hpctrain diagnose RUN_DIR` reads it all.

The files stay the record, and the way left when the store does not answer. Its server is a thread of rank 0's
process: a stopped rank 0 takes it along, and a TCPStore client then waits without end (check, add, compare_set
and get were seen blocking past the client's own timeout; set returns at once). Every store operation therefore
runs in a helper thread and the watchdog waits for it at most STORE_WAIT_S; while one is stuck the next fail at
once. The request then goes through hang/request alone (it is always written there too, and every watchdog looks
for it at each poll), which says the store did not answer, so diagnose can say why dumps may be missing.

Why a thread of our own: gloo's collective timeout covers c10d calls, but a DTensor functional collective was seen
waiting past it when a peer was stopped, and a collective timeout names nobody.
"""
from __future__ import annotations

import faulthandler
import json
import logging
import math
import os
import signal
import socket
import stat
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from hpctrain.config.sections import MAX_WORLD_SIZE
from hpctrain.hang import ending, heartbeat
from hpctrain.hang.heartbeat import Heartbeat
from hpctrain.untrusted import Untrusted, parse_json, read_bytes, read_json

log = logging.getLogger(__name__)

LONG_PHASES = frozenset({"startup", "checkpoint", "eval"})
REQUEST = "request"
REQUEST_BYTES = 64 << 10  # ours is one short line
STALE_REQUEST_S = 2.0  # a request older than this rank's start by more than this (clock skew) is the last job's
# peers whose ticks a rank idle in its first step reads: the next ranks around the ring. One would find any stopped
# stretch (a live rank precedes it); more, so that a neighbour's damaged file does not blind the look, and few, so
# that a big job's ranks do not read the world's files every few seconds from a shared file system
PEERS_WATCHED = 8
ACKS = "acks.json"
# the longest one store operation may hold the watchdog: a stopped rank 0 never answers, and a poll is 0.2-5 s
STORE_WAIT_S = 1.0
# at stop, how long a store operation still in flight is waited for. A helper thread inside a store call when the
# process exits aborts it ("terminate called without an active exception"): the call returns, often because rank 0
# exited and its store went with it, while Python is finalising, and the thread is ended inside C++ that may not
# unwind. Finished or failed, the call ends before the process does.
STORE_EXIT_WAIT_S = 10.0
# How long, after the grace, the other ranks wait for the first rank's on_end: it reads the dumps and asks scontrol
# three or four times (each well under a second on a healthy controller); past this they end the job anyway
END_WAIT_S = 30.0
ENDED = "ended"
MAX_ACK_BYTES = 16 << 10  # one rank's answer: a dump's header, a short stack, a flight recorder summary
ACK_FRAMES = 16  # of the main thread's stack, innermost first: diagnose shows three


@dataclass(frozen=True)
class Limits:
    step_s: float  # parallel.hang_timeout_s: no phase change within a step for this long is a hang
    long_s: float  # parallel.startup_timeout_s: start-up, the first step, checkpoints, evaluation
    storage_bps: float = 0.0  # checkpoint.storage_gbps in bytes/s: a checkpoint's bytes at this rate add to long_s

    @property
    def poll_s(self) -> float:
        """How often the thread looks: a tenth of the step limit, between 0.2 and 5 s (on a shared file system
        each look is one stat of hang/request per rank)."""
        return min(5.0, max(0.2, self.step_s / 10))

    @property
    def flush_s(self) -> float:
        """How often the heartbeat's page goes to the file system for readers on other nodes: 5 s, or half the step
        limit when that is shorter (a live peer's tick, as another node sees it, is never a step limit old)."""
        return min(5.0, self.step_s / 2)

    @property
    def grace_s(self) -> float:
        """How long a rank that dumped waits for the others' dumps before ending itself: two polls and 3 s (less
        for limits under 3 s, as tests use)."""
        return 2 * self.poll_s + min(3.0, self.step_s)


@dataclass(frozen=True)
class Peer:
    """A rank of the job as its own process saw itself at start: enough to end it safely from its host."""
    rank: int
    host: str
    pid: int
    start_ticks: int  # /proc/<pid>/stat field 22: a reused pid has another

    @staticmethod
    def me(rank: int) -> Peer:
        return Peer(rank, socket.gethostname(), os.getpid(), process_start(os.getpid()) or 0)


def process_start(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, None when it is gone."""
    try:
        line = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(line.rsplit(")", 1)[1].split()[19])


def hang_path(run_dir: Path, rank: int, suffix: str = ".txt") -> Path:
    return Path(run_dir) / "hang" / f"rank{rank:05d}{suffix}"


class Watchdog:
    def __init__(self, hb: Heartbeat, run_dir: str | Path, limits: Limits, peers: list[Peer] | None = None,
                 channel: StoreChannel | None = None, on_end: Callable[[], str] | None = None) -> None:
        self.hb, self.limits = hb, limits
        self.run_dir = Path(run_dir)
        self.peers = peers or []
        self.channel = channel  # None: files only (one rank, or no store)
        # called by the first rank to trip once every live rank has dumped, before the job ends (a training job's:
        # job.requeue.after_hang); returns one line to log
        self.on_end = on_end
        self._watched: tuple[list[Peer] | None, list[Peer]] = (None, [])  # (of which peers list, the ones watched)
        # rank -> (its last tick read, this rank's monotonic time when it changed)
        self._ticks: dict[int, tuple[float, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="hpctrain-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Ends the thread and waits for it, and for a store operation it left in flight (StoreChannel.close)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(self.limits.poll_s + 2 * STORE_WAIT_S)
        if self.channel is not None:
            self.channel.close()

    def limit(self) -> tuple[float, str]:
        """The current phase's limit and the setting it comes from. A checkpoint's read or write gets the time the
        whole job's bytes take at checkpoint.storage_gbps on top of the long limit: a rank that finished its own
        share waits in the commit (or the load's next collective) for the slowest rank's."""
        hb = self.hb
        if hb.phase == "checkpoint" and hb.io_total and self.limits.storage_bps:
            io_s = hb.io_total / self.limits.storage_bps
            return (self.limits.long_s + io_s, f"parallel.startup_timeout_s + {io_s:.0f} s for the checkpoint's "
                    f"{hb.io_total / 1e9:.3g} GB at checkpoint.storage_gbps = {self.limits.storage_bps / 1e9:g}")
        if hb.phase in LONG_PHASES or hb.step <= hb.first_step:
            return self.limits.long_s, "parallel.startup_timeout_s"
        return self.limits.step_s, "parallel.hang_timeout_s"

    def idle(self, now: float) -> float:
        """Seconds without progress: since the phase began, or in a checkpoint phase since bytes last moved."""
        hb = self.hb
        return now - (max(hb.since, hb.progressed) if hb.phase == "checkpoint" else hb.since)

    def in_first_step(self) -> bool:
        """A step phase that has the long limit only because the step is the first since the start."""
        return self.hb.phase not in LONG_PHASES and self.hb.step <= self.hb.first_step

    def _watch(self) -> None:
        request = self.run_dir / "hang" / REQUEST
        flushed = last = time.monotonic()
        while not self._stop.wait(self.limits.poll_s):
            now = time.monotonic()
            # this thread could not run for a while: the process was stopped (SIGSTOP, until Slurm's SIGCONT) or
            # something held the GIL; a hang seen right after is not this rank's answer in time. Between two looks
            # (frozen) or during this one (frozen_since: the look's own store call waits at most STORE_WAIT_S; a
            # stop that lands after `now` is over by the time the request is seen, CI-22)
            frozen = now - last - self.limits.poll_s if now - last > 3 * self.limits.poll_s + 1 else 0.0
            last = now

            def frozen_since(start: float = now, before: float = frozen) -> float:
                body = time.monotonic() - start
                return max(before, body - STORE_WAIT_S) if body > 3 * self.limits.poll_s + 1 + STORE_WAIT_S \
                    else before
            self.hb.tick()
            if now - flushed >= self.limits.flush_s:
                try:
                    self.hb.flush()
                except OSError as e:  # a file system gone for a moment: the next flush tries again
                    log.warning("heartbeat not flushed: %s", e)
                flushed = now
            limit, setting = self.limit()
            idle = self.idle(now)
            if idle > limit:
                self._hang(f"no progress for {idle:.0f} s in {self.hb.phase} (limit {limit:.4g} s: {setting})", True,
                           frozen_since())
            elif (asked := self._asked_now(request)) is not None:
                self._hang(f"asked by another rank's watchdog ({asked})", False, frozen_since())
            elif idle > self.limits.step_s / 2 and self.in_first_step():
                silent = self.silent_peers()  # at most PEERS_WATCHED small reads a poll, in this window only
                if silent and idle > self.limits.step_s:
                    who = ", ".join(f"rank {r} ({age:.0f} s)" for r, age in silent)
                    self._hang(f"no progress for {idle:.0f} s in {self.hb.phase} of the first step while the "
                               f"watchdog of {who} was silent: stopped, dead or stuck (limit "
                               f"{self.limits.step_s:g} s: parallel.hang_timeout_s; the first step's long limit "
                               f"holds while every rank is alive)", True, frozen_since())

    def silent_peers(self) -> list[tuple[int, float]]:
        """(rank, seconds) of the next PEERS_WATCHED ranks whose tick has not changed for longer than the step limit
        by this rank's clock (read from half the step limit on, so a verdict comes by 1.5 step limits). A heartbeat
        that is unreadable, another process's, or of a rank that ended is no evidence: skipped; so is a peer in a
        long phase (loading a checkpoint, h5py may hold the GIL for long: its own limit holds)."""
        if self._watched[0] is not self.peers:  # the session sets the peers once, after the rendezvous
            peers = sorted(self.peers, key=lambda p: p.rank)
            ranks = [p.rank for p in peers]
            me = ranks.index(self.hb.rank) if self.hb.rank in ranks else 0
            self._watched = (self.peers, [peers[(me + k) % len(peers)] for k in
                                          range(1, min(len(peers), PEERS_WATCHED + 1))] if self.hb.rank in ranks
                             else [])
        now, silent = time.monotonic(), []
        for peer in self._watched[1]:
            beat = heartbeat.read(heartbeat.heartbeat_path(self.run_dir, peer.rank))
            tick = beat.get("alive")
            if "error" in beat or beat.get("pid") != peer.pid or tick is None \
                    or beat.get("phase") in LONG_PHASES | {"done", "failed"}:
                self._ticks.pop(peer.rank, None)
                continue
            # the peer's tick is its own node's clock: only whether it changes is compared, over this rank's clock,
            # so skew between nodes never makes a live peer look silent
            seen = self._ticks.get(peer.rank)
            if seen is None or seen[0] != tick:
                self._ticks[peer.rank] = (tick, now)
            elif now - seen[1] > self.limits.step_s:
                silent.append((peer.rank, now - seen[1]))
        return silent

    def _hang(self, reason: str, first: bool, frozen_s: float = 0.0) -> None:
        """Dumps what this rank knows, answers through the store, waits for the others' answers, then ends the job,
        whatever fails on the way (a full file system, a log handler whose stream is gone, a store that does not
        answer): the ending is in a finally."""
        t0 = time.monotonic()
        initiator = False
        ending.ENDING.set()  # from here this thread ends the job; the main thread's failures wait for it
        hb = self.hb
        where = f"step {hb.step}, phase {hb.phase}" + (f" ({hb.described})" if hb.described else "")
        message = (f"hang on rank {hb.rank}: {reason} at {where}; see {self.run_dir / 'hang'} and run "
                   f"`hpctrain diagnose {self.run_dir}`")
        try:
            log.error("hang: %s at %s; stacks and the flight recorder go to %s, then the job ends", reason, where,
                      self.run_dir / "hang")
            hang_dir(self.run_dir)
            initiator = first and self._claim(reason)
            header = dump_stacks(hang_path(self.run_dir, hb.rank), hb, reason, self.idle(time.monotonic()),
                                 frozen_s)
            fr = dump_flight_recorder(hang_path(self.run_dir, hb.rank, ".fr.json"))
            hb.flush()
            for h in logging.getLogger().handlers:
                h.flush()
            if self.channel is not None:
                self.channel.ack(answer(header, fr))
        except Unreachable as e:
            print(f"hpctrain: rank {hb.rank} could not answer through the job's store ({e}): its dump files are the "
                  f"answer", file=sys.stderr, flush=True)
        except Exception as e:  # noqa: BLE001 - nothing may keep a hung job alive
            print(f"hpctrain: hang dump of rank {hb.rank} failed: {type(e).__name__}: {e}", file=sys.stderr,
                  flush=True)
        finally:
            # not stop(): the job is ending. The others wait out the whole grace, then for the first rank's word
            # that its diagnosis and requeue are done: their aborts end every rank of the launch, the first too
            if initiator:
                self._wait_for_answers(t0 + self.limits.grace_s)
                self._keep_answers()
                snapshot_heartbeats(self.run_dir)
                if self.on_end is not None:
                    try:
                        said = self.on_end()
                        message += f"; {said}"
                        print(f"hpctrain: after the hang: {said}", file=sys.stderr, flush=True)
                    except Exception as e:  # noqa: BLE001
                        print(f"hpctrain: after the hang: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                self._say_ended()
            else:
                time.sleep(max(0.0, self.limits.grace_s - (time.monotonic() - t0)))
                self._wait_for_first(time.monotonic() + END_WAIT_S)
            end_job(self.peers, self.run_dir, message)

    def _say_ended(self) -> None:
        """The first rank: its on_end is done, the others may end the job (the store, and hang/ended for a store
        that does not answer)."""
        if self.channel is not None:
            try:
                self.channel.end()
            except Unreachable:
                pass
        try:
            os.close(os.open(self.run_dir / "hang" / ENDED, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                             0o644))
        except OSError as e:
            print(f"hpctrain: cannot write {self.run_dir / 'hang' / ENDED}: {e.strerror}", file=sys.stderr,
                  flush=True)

    def _wait_for_first(self, deadline: float) -> None:
        """The other ranks: until the first rank said its on_end is done, or the deadline."""
        channel = self.channel
        path = self.run_dir / "hang" / ENDED
        while time.monotonic() < deadline:
            if channel is not None:
                try:
                    if channel.ended():
                        return
                except Unreachable:
                    channel = None  # the file alone from here
            if os.path.lexists(path):
                return
            time.sleep(min(0.1, self.limits.poll_s))
        print(f"hpctrain: rank {self.hb.rank}: the first rank to call the hang did not say it was done within "
              f"{END_WAIT_S:g} s of the grace; ending the job", file=sys.stderr, flush=True)

    def _claim(self, reason: str) -> bool:
        """Whether this rank is the first to trip, the one that keeps the heartbeats and runs on_end. The store
        decides when it answers (one compare_set wins, and every rank sees the request at its next poll); the
        winner writes hang/request as the record. When the store does not answer, the file decides (O_EXCL), and
        says so."""
        won, unreachable = None, None
        if self.channel is not None:
            try:
                won = self.channel.request(self.hb.rank, reason, self.limits.grace_s)
            except Unreachable as e:
                unreachable = str(e)
                print(f"hpctrain: rank {self.hb.rank}: {e}; the other ranks are asked through {self.run_dir / 'hang'}"
                      f" alone", file=sys.stderr, flush=True)
        if won is False:
            return False
        path = self.run_dir / "hang" / REQUEST
        try:
            if write_request(self.run_dir, self.hb.rank, reason, self.limits.grace_s, unreachable):
                return True
        except OSError as e:  # the record is lost; the store's word stands
            print(f"hpctrain: {path} not written: {e}", file=sys.stderr, flush=True)
            return bool(won)
        # a file there already: a rank that could not reach the store decided by it (it is the first), or the
        # last incarnation's that was not moved aside
        return bool(won) and not self._asked(path)

    def _wait_for_answers(self, deadline: float) -> None:
        """The first rank: until every rank answered through the store, or the grace period ends (a stopped rank
        never answers)."""
        channel = self.channel
        while channel is not None and time.monotonic() < deadline:
            try:
                if channel.acked() >= channel.world_size:
                    return
            except Unreachable:
                break
            time.sleep(min(0.1, self.limits.poll_s))
        time.sleep(max(0.0, deadline - time.monotonic()))

    def _keep_answers(self) -> None:
        """The answers that reached the first rank through the store, into hang/acks.json: what diagnose counts as
        dumped in time where the dump files themselves are not visible yet."""
        if self.channel is None:
            return
        try:
            acks = self.channel.acks()
            with _create(self.run_dir / "hang" / ACKS) as f:
                f.write(json.dumps({"acks": acks}) + "\n")
        except (Unreachable, OSError) as e:
            print(f"hpctrain: the answers through the store were not kept: {e}", file=sys.stderr, flush=True)

    def _asked_now(self, request: Path) -> str | None:
        """Where another rank's request came from (the store, else the file), None when there is none."""
        if self.channel is not None:
            try:
                if self.channel.asked():
                    return "through the job's store"
            except Unreachable:
                pass  # rank 0 stopped, say: the file is the way left
        if request.exists() and self._asked(request):
            return str(request)
        return None

    def _asked(self, request: Path) -> bool:
        """Another rank's request of this incarnation of the job (a requeued job finds the last one's)."""
        try:
            wall = read_request(request).get("wall")
        except Untrusted:
            return True  # unreadable (damaged, a link, a FIFO): better one dump too many
        return wall is None or wall >= self.hb.facts.get("started", 0) - STALE_REQUEST_S


class Unreachable(Exception):
    """The job's store did not answer within STORE_WAIT_S, or failed."""


class StoreChannel:
    """Hang requests and answers through the job's store (keys under a prefix of its own: a requeued job has a new
    store, so nothing of the last incarnation's is there). `store` is a client of the watchdog's own
    (Store.clone(): the main thread's may be inside a long blocking wait, and torch makes a client safe for one
    thread at a time). Every operation runs in a helper thread, waited for at most `wait_s` (module docstring);
    each raises Unreachable when the store did not answer in time or failed."""

    def __init__(self, store: Any, world_size: int, wait_s: float = STORE_WAIT_S) -> None:
        self.store, self.world_size, self.wait_s = store, world_size, wait_s
        self._stuck: threading.Thread | None = None
        self._closed = False

    def close(self, wait_s: float = STORE_EXIT_WAIT_S) -> bool:
        """No operation starts from now on; waits up to wait_s for one still in flight (see STORE_EXIT_WAIT_S).
        False when one is still in the store after that (logged: the process may abort as it exits)."""
        self._closed = True
        stuck = self._stuck
        if stuck is None:
            return True
        stuck.join(wait_s)
        if stuck.is_alive():
            log.warning("the watchdog's store call (%s) has not returned after %.0f s; if it returns while this "
                        "process exits, the process aborts", stuck.name.rsplit(" ", 1)[-1], wait_s)
            return False
        return True

    def _call(self, name: str, *args: Any) -> Any:
        if self._closed:
            raise Unreachable("the watchdog has stopped")
        if self._stuck is not None and self._stuck.is_alive():
            raise Unreachable(f"the job's store has not answered an earlier {self._stuck.name.rsplit(' ', 1)[-1]}")
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["value"] = getattr(self.store, name)(*args)
            except Exception as e:  # noqa: BLE001 - a closed connection, a timeout: the store is not there
                box["error"] = e

        t = threading.Thread(target=run, name=f"hpctrain-hang-store {name}", daemon=True)
        self._stuck = t  # in flight; close() waits for it
        t.start()
        t.join(self.wait_s)
        if t.is_alive():
            raise Unreachable(f"the job's store (rank 0's process) did not answer {name} within {self.wait_s:g} s")
        if "error" in box:
            raise Unreachable(f"the job's store failed {name}: {type(box['error']).__name__}: {box['error']}")
        return box["value"]

    def request(self, rank: int, reason: str, grace_s: float) -> bool:
        """Asks every rank to dump; True when this rank's request is the one set (the first), False when another's
        was there."""
        mine = json.dumps({"rank": rank, "reason": reason, "wall": time.time(), "grace_s": grace_s})
        return bytes(self._call("compare_set", REQUEST, "", mine)) == mine.encode()

    def asked(self) -> bool:
        """Whether a rank has asked."""
        return bool(self._call("check", [REQUEST]))

    def ack(self, record: dict[str, Any]) -> None:
        """This rank dumped: its answer (one line; a short one when the full one is too long) and a count."""
        line = json.dumps(record)
        if len(line) > MAX_ACK_BYTES:
            line = json.dumps({"rank": record["rank"], "header": record["header"]})[:MAX_ACK_BYTES]
        self._call("append", "acks", line + "\n")
        self._call("add", "acked", 1)

    def end(self) -> None:
        """The first rank: its diagnosis and on_end are done."""
        self._call("set", ENDED, "1")

    def ended(self) -> bool:
        """Whether the first rank said it is done."""
        return bool(self._call("check", [ENDED]))

    def acked(self) -> int:
        """How many ranks have answered."""
        return int(self._call("add", "acked", 0))

    def acks(self) -> list[Any]:
        """The answers so far, as parsed JSON; lines that do not parse are left out (diagnose checks the rest)."""
        if not self._call("check", ["acks"]):
            return []
        out = []
        for line in bytes(self._call("get", "acks")).splitlines():
            try:
                out.append(parse_json(line, "an answer"))
            except Untrusted:
                continue
        return out


def answer(header: dict[str, Any], fr: dict[str, Any] | None) -> dict[str, Any]:
    """A rank's answer to a hang request: what diagnose reads from its dump files, in small. The header as the dump
    has it (without the thread table), the main thread's innermost frames, the flight recorder's collective in
    flight and highest sequence number per group."""
    flight = None
    if fr is not None:
        in_flight, last_seq = flight_summary(fr)
        flight = {"in_flight": in_flight, "last_seq": last_seq}
    return {"rank": header["rank"], "header": {k: v for k, v in header.items() if k != "threads"},
            "stack": main_frames()[:ACK_FRAMES], "flight": flight}


def main_frames() -> list[str]:
    """The main thread's stack as 'file:line in func', innermost first (as diagnose reads a dump's)."""
    frame = sys._current_frames().get(threading.main_thread().ident or 0)
    if frame is None:
        return []
    return [f"{Path(f.filename).name}:{f.lineno} in {f.name}" for f in reversed(traceback.extract_stack(frame))]


def _entry_ok(e: Any) -> bool:
    """A flight recorder entry with the fields read below, each of its type."""
    if not isinstance(e, dict):
        return False
    pg = e.get("process_group")
    p2p = e.get("is_p2p", False)
    seq = e.get("p2p_seq_id" if p2p else "collective_seq_id")
    return (isinstance(pg, list) and len(pg) == 2 and all(isinstance(x, str) for x in pg)
            and isinstance(p2p, bool) and type(seq) is int and seq >= 0
            and isinstance(e.get("profiling_name", ""), str) and isinstance(e.get("retired", True), bool)
            and type(e.get("time_created_ns", 0)) is int)


def flight_summary(data: dict[str, Any]) -> tuple[dict[str, Any] | None, dict[str, int]]:
    """A flight recorder dump (as dump_flight_recorder writes it, parsed): (the earliest collective in flight,
    {group key: highest sequence number seen}). Entries of the wrong shape are skipped."""
    entries: list[dict[str, Any]] = []
    for part in ("nccl", "fr"):
        block = data.get(part)
        if isinstance(block, dict) and isinstance(block.get("entries"), list):
            entries += [e for e in block["entries"] if _entry_ok(e)]
    last: dict[str, int] = {}
    flight = None
    for e in sorted(entries, key=lambda e: e.get("time_created_ns", 0)):
        desc = e["process_group"][1]
        p2p = e.get("is_p2p", False)
        seq = e["p2p_seq_id" if p2p else "collective_seq_id"]
        # a group of an NCCL job has two backends (gloo for host tensors), each counting its own collectives
        backend, _, op = e.get("profiling_name", "?:?").partition(":")
        key = f"{backend}:{desc}" + (" p2p" if p2p else "")
        last[key] = max(last.get(key, 0), seq)
        if flight is None and e.get("retired") is False:
            sizes, state = e.get("input_sizes"), e.get("state")
            flight = {"group": desc, "key": key, "op": op, "seq": seq, "p2p": p2p,
                      "sizes": sizes if isinstance(sizes, list) else None,
                      "state": state if isinstance(state, str) else None}
    return flight, last

def hang_dir(run_dir: Path) -> Path:
    """RUN_DIR/hang, made if missing; OSError when it is anything but a directory of its own (a planted link would
    take the dumps out of the run directory)."""
    path = Path(run_dir) / "hang"
    path.mkdir(exist_ok=True)
    if not stat.S_ISDIR(os.lstat(path).st_mode):
        raise OSError(f"{path} is not a directory (a symbolic link?): nothing is written through it")
    return path


def _create(path: Path, mode: str = "w"):
    """A file opened for writing, made or truncated, never through a symbolic link (OSError then)."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644),
                     mode)


def _number(v: Any) -> float | None:
    return float(v) if type(v) in (int, float) and math.isfinite(v) else None


def read_request(path: Path) -> dict[str, Any]:
    """hang/request, as write_request made it: {"rank", "reason", "wall", "grace_s"} and "store" (why the job's
    store did not carry it, when it did not) with only the fields of the right type; "damaged" lists the others.
    Raises Untrusted for a file that is not one (a link, a FIFO, too large, not a JSON object)."""
    data = read_json(path, REQUEST_BYTES)
    if not isinstance(data, dict):
        raise Untrusted(f"{str(path)!r}: not a JSON object")
    rank, reason, store = data.get("rank"), data.get("reason"), data.get("store")
    grace = _number(data.get("grace_s"))
    fields = {"rank": rank if type(rank) is int and 0 <= rank < MAX_WORLD_SIZE else None,
              "reason": reason if isinstance(reason, str) else None, "wall": _number(data.get("wall")),
              "grace_s": grace if grace is not None and grace >= 0 else None,
              "store": store if isinstance(store, str) else None}
    damaged = sorted(k for k, v in fields.items() if v is None and k in data)
    return {k: v for k, v in fields.items() if v is not None} | ({"damaged": damaged} if damaged else {})


def write_request(run_dir: Path, rank: int, reason: str, grace_s: float = 0.0, store: str | None = None) -> bool:
    """hang/request, made by the first rank to trip only (O_EXCL); False when another rank's is there. It says
    how long the ranks have to answer (grace_s): a dump made much later came from a rank that was stopped then
    (Slurm sends SIGCONT when it ends or requeues a job), and diagnose does not count it. `store`: why the job's
    store did not carry the request (the other ranks then see it only through this file)."""
    try:
        fd = os.open(Path(run_dir) / "hang" / REQUEST, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    except FileExistsError:
        return False
    record = {"rank": rank, "reason": reason, "wall": time.time(), "grace_s": grace_s}
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(record | ({"store": store} if store else {})) + "\n")
    return True


def snapshot_heartbeats(run_dir: Path) -> None:
    """Every rank's heartbeat as the hang left it, into hang/heartbeat/ (the first rank to trip, once the others
    had their time to dump): what a woken rank or a requeued job writes later does not blur it."""
    target = Path(run_dir) / "hang" / "heartbeat"
    try:
        target.mkdir(exist_ok=True)
        if not stat.S_ISDIR(os.lstat(target).st_mode):
            raise OSError(f"{target} is not a directory (a symbolic link?)")
        for path in (Path(run_dir) / "heartbeat").glob("rank*.hb"):
            try:
                raw = read_bytes(path, heartbeat.FILE_BYTES)
            except Untrusted:
                continue  # not a heartbeat (a link, a FIFO, too large): diagnose names it in heartbeat/
            with _create(target / path.name, "wb") as f:
                f.write(raw)
    except OSError as e:
        print(f"hpctrain: heartbeats not kept with the hang: {e}", file=sys.stderr, flush=True)


def keep_earlier_hang(run_dir: Path) -> Path | None:
    """At the start of a job that runs again in its run directory (a requeue), before any rank opens its heartbeat:
    the earlier hang's files and the heartbeats they go with move to hang-<time of its request>/ (hang/,
    heartbeat/), which `hpctrain diagnose` reads as a run directory of its own; this incarnation's are its own.
    Rank 0 only."""
    run_dir = Path(run_dir)
    hang = run_dir / "hang"
    if not hang.is_dir() or hang.is_symlink():
        return None
    try:
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(os.lstat(hang / REQUEST).st_mtime))
    except (OSError, OverflowError, ValueError):  # no request, or a time stamp no calendar holds
        stamp = time.strftime("%Y%m%d-%H%M%S")
    target = run_dir / f"hang-{stamp}"
    n = 1
    while target.exists():
        n += 1
        target = run_dir / f"hang-{stamp}-{n}"
    target.mkdir()
    hang.rename(target / "hang")
    beats = run_dir / "heartbeat"
    if beats.is_dir() and not beats.is_symlink():
        beats.rename(target / "heartbeat")
    return target


def dump_stacks(path: Path, hb: Heartbeat, reason: str, idle_s: float, frozen_s: float = 0.0) -> dict[str, Any]:
    """Every thread's stack into `path`, under a header a reader (hpctrain diagnose) can parse; returns the
    header."""
    names = {t.ident: t.name for t in threading.enumerate()}
    with _create(path) as f:
        header = {"rank": hb.rank, "host": socket.gethostname(), "node": hb.facts.get("node"), "pid": os.getpid(),
                  "step": hb.step, "phase": hb.phase, "detail": hb.described, "idle_s": round(idle_s, 1),
                  "frozen_s": round(frozen_s, 1), "reason": reason, "wall": round(time.time(), 3),
                  "threads": {f"0x{k:016x}": v for k, v in names.items() if k}}
        f.write("# hpctrain hang dump " + json.dumps(header) + "\n")
        f.flush()
        faulthandler.dump_traceback(file=f, all_threads=True)
    return header


def dump_flight_recorder(path: Path) -> dict[str, Any] | None:
    """torch's flight recorder as JSON into `path` ({"fr": gloo and other host-side groups, "nccl": NCCL's}), and
    returned; None when this torch has none or it was off (parallel.flight_recorder = 0)."""
    try:
        import torch._C._distributed_c10d as c10d
    except ImportError:
        return None
    out: dict[str, Any] = {}
    for key, name in (("fr", "_dump_fr_trace_json"), ("nccl", "_dump_nccl_trace_json")):
        fn = getattr(c10d, name, None)  # NCCL's exists in CUDA builds only
        if fn is None:
            continue
        try:
            out[key] = json.loads(fn(True, False))
        except Exception as e:  # noqa: BLE001 - a failed dump must never stop the rest of the hang path
            out[key] = {"error": f"{type(e).__name__}: {e}"}
    if not out:
        return None
    with _create(path) as f:
        f.write(json.dumps(out) + "\n")
    return out


def end_job(peers: list[Peer], run_dir: Path, message: str) -> None:
    """The abort path of a hang, as of any failed rank: submitit's error result (`submit --wait` reports it), then
    MPI_Abort under MPI (returns without MPI), else the same-host peers that left no dump are killed (a stopped
    rank would otherwise outlive the job where no launcher ends it), then exit 1."""
    print(f"hpctrain: {message}", file=sys.stderr, flush=True)
    ending.leave_task_error(message)
    ending.abort_launch(1)
    host, me = socket.gethostname(), os.getpid()
    for p in peers:
        if p.host == host and p.pid != me and not hang_path(run_dir, p.rank).exists() \
                and process_start(p.pid) == p.start_ticks:
            try:
                os.kill(p.pid, signal.SIGKILL)
                log.error("killed rank %d (pid %d), which left no hang dump", p.rank, p.pid)
            except OSError:
                pass
    logging.shutdown()
    os._exit(1)
