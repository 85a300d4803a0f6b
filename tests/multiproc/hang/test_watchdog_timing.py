"""The hang watchdog in real time, in this process: it does not trip on a long phase within its limit, answers another
rank's request (not an earlier incarnation's), ends the job even when a log handler fails, hears a peer on a skewed
clock, writes no dump through a link. Its polls and limits are seconds of wall clock (about 16 s in all), so these
run beside the multi-process tests and keep tests/pure under a minute; the rest of the heartbeat and watchdog
(its trip on a stale phase, whose dump must show test_heartbeat.py's frame): tests/pure/hang/test_heartbeat.py,
tests/multiproc/hang/test_heartbeat_processes.py.

    PATH=$PWD/.venv/bin:$PATH .venv/bin/python -m pytest -q tests/multiproc/hang/test_watchdog_timing.py
"""
from __future__ import annotations

import json
import os
import threading
import time

import pytest
from faults import record

from helpers.hang import a_watchdog, until_ended
from hpctrain.hang import heartbeat, watchdog
from hpctrain.hang.heartbeat import Heartbeat


def test_a_broken_log_handler_does_not_keep_the_job_alive(tmp_path, monkeypatch) -> None:
    """Seen in the pure tier: a handler whose stream was closed raised in the hang path and the watchdog thread
    died without ending the job. Whatever fails while dumping, the job still ends."""
    import logging

    class Gone:  # a captured stdout closed under the handler, as pytest's was
        def write(self, text: str) -> None:
            raise ValueError("I/O operation on closed file.")

        def flush(self) -> None:
            raise ValueError("I/O operation on closed file.")

    handler = logging.StreamHandler(Gone())
    logging.getLogger().addHandler(handler)
    try:
        dog, hb, ended = a_watchdog(tmp_path, monkeypatch, watchdog.Limits(step_s=0.3, long_s=30), "forward")
        until_ended(ended, "a failing handler kept the job alive")
        dog.stop()
    finally:
        logging.getLogger().removeHandler(handler)


def test_requests_of_an_earlier_incarnation(tmp_path, monkeypatch) -> None:
    """A requeued job finds the last hang's request: not a request to it. Its rank 0 moves the last hang's files
    aside, and only the first rank to trip writes the request."""
    (tmp_path / "hang").mkdir()
    (tmp_path / "hang" / "request").write_text(json.dumps({"rank": 1, "wall": time.time() - 600}))
    (tmp_path / "hang" / "rank00001.txt").write_text("old dump")
    dog, hb, ended = a_watchdog(tmp_path, monkeypatch, watchdog.Limits(step_s=3, long_s=60), "forward")  # polls: 0.3 s
    try:
        time.sleep(1.5)
        assert not ended and not watchdog.hang_path(tmp_path, 2).exists()
    finally:
        dog.stop()
    kept = watchdog.keep_earlier_hang(tmp_path)  # with the heartbeats it goes with: a run directory of its own
    assert kept.name.startswith("hang-") and (kept / "hang" / "rank00001.txt").read_text() == "old dump"
    assert heartbeat.read(kept / "heartbeat" / "rank00002.hb")["step"] == 5
    assert not (tmp_path / "hang").exists() and watchdog.keep_earlier_hang(tmp_path) is None
    (tmp_path / "hang").mkdir()
    assert watchdog.write_request(tmp_path, 3, "first") and not watchdog.write_request(tmp_path, 0, "second")
    assert json.loads((tmp_path / "hang" / "request").read_text())["rank"] == 3


def test_long_phases_and_the_first_step_get_the_long_limit(tmp_path, monkeypatch) -> None:
    limits = watchdog.Limits(step_s=0.3, long_s=60)
    dog, hb, ended = a_watchdog(tmp_path, monkeypatch, limits, "checkpoint")
    try:
        assert dog.limit() == (60, "parallel.startup_timeout_s")
        hb.begin_training(4)  # a resume from step 4: step 5 is the first after the start (compile, NCCL set-up)
        hb.begin_step(5)
        hb.enter("forward")
        assert dog.limit()[0] == 60
        hb.begin_step(6)
        assert dog.limit() == (0.3, "parallel.hang_timeout_s")
        hb.enter("eval")
        assert dog.limit()[0] == 60
        time.sleep(1.5)  # well past the step limit, in a long phase
        assert not ended
    finally:
        dog.stop()


def test_watchdog_answers_another_ranks_request(tmp_path, monkeypatch) -> None:
    """A rank that is not stale itself dumps when another rank's watchdog asks."""
    dog, hb, ended = a_watchdog(tmp_path, monkeypatch, watchdog.Limits(step_s=5, long_s=60), "forward")  # polls: 0.5 s
    dog.on_end = lambda: pytest.fail("only the rank that asked requeues")
    (tmp_path / "hang").mkdir(exist_ok=True)
    (tmp_path / "hang" / "request").write_text(json.dumps({"rank": 0, "wall": time.time()}) + "\n")
    t0 = time.monotonic()
    while not ended:
        assert time.monotonic() - t0 < 30, "the request was never answered"
        time.sleep(0.05)
    dog.stop()
    assert "asked by another rank" in ended[0]
    assert watchdog.hang_path(tmp_path, 2).exists()


def test_a_peer_on_a_skewed_clock_is_not_silent(tmp_path, monkeypatch) -> None:
    """Peers' ticks are their own node's clock: a live peer whose clock is 1000 s behind keeps ticking, and only
    whether its tick changes counts (an absolute comparison called it silent and ended a healthy job)."""
    import zlib
    peer = Heartbeat(tmp_path, 3, {"node": "n2"})
    peer.begin_step(1)
    peer.enter("collective", "all_reduce")
    stop = threading.Event()

    def skewed_ticks() -> None:
        while not stop.is_set():
            body = b"%.3f" % (time.time() - 1000)
            line = b"WD %s %08x" % (body, zlib.crc32(body))
            peer._mm[heartbeat.TICK_AT:] = line.ljust(heartbeat.FILE_BYTES - heartbeat.TICK_AT - 1) + b"\n"
            time.sleep(0.1)
    ticker = threading.Thread(target=skewed_ticks, daemon=True)
    ticker.start()
    try:
        dog, hb, ended = a_watchdog(tmp_path, monkeypatch, watchdog.Limits(step_s=1, long_s=60), "collective", step=1)
        me = watchdog.Peer.me(2)
        dog.peers = [me, watchdog.Peer(3, me.host, os.getpid(), watchdog.process_start(os.getpid()))]
        time.sleep(3)  # idle past the step limit in the first step; the peer's tick changes, 1000 s in the past
        assert not ended, ended
        stop.set()
        ticker.join()
        until_ended(ended, "a peer whose tick stopped changing was not noticed")  # silent by this rank's clock
        dog.stop()
    finally:
        stop.set()
    assert "rank 3" in ended[0] and "silent" in ended[0], ended[0]


@pytest.mark.faults
def test_hang_dumps_are_not_written_through_links(tmp_path, monkeypatch) -> None:
    """A run directory holding hang/rank00002.txt (and .fr.json) as links to files elsewhere: the dump must not
    overwrite them; a hang/ that is a link gets no dumps at all. The job still ends."""
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    run = tmp_path / "run"
    (run / "hang").mkdir(parents=True)
    watchdog.hang_path(run, 2).symlink_to(victim)
    watchdog.hang_path(run, 2, ".fr.json").symlink_to(victim)
    dog, hb, ended = a_watchdog(run, monkeypatch, watchdog.Limits(step_s=0.3, long_s=30), "forward")
    until_ended(ended, "the watchdog never tripped")
    dog.stop()
    assert victim.read_text() == "precious\n"
    other = tmp_path / "other"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    other.mkdir()
    (other / "hang").symlink_to(elsewhere)
    dog, hb, ended = a_watchdog(other, monkeypatch, watchdog.Limits(step_s=0.3, long_s=30), "forward")
    until_ended(ended, "the watchdog never tripped")
    dog.stop()
    assert list(elsewhere.iterdir()) == [], list(elsewhere.iterdir())
    record("hang/rank00002.txt and .fr.json linked to a file elsewhere; hang/ linked to a directory elsewhere",
           "the watchdog writes through neither link and still ends the job", tier="unit")
