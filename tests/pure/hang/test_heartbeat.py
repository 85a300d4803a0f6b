"""Heartbeats, the hang watchdog in one process, and the straggler arithmetic (issue 17).

    PATH=$PWD/.venv/bin:$PATH .venv/bin/python -m pytest -q tests/pure/hang/test_heartbeat.py

The heartbeat must say where a rank was even when the rank cannot speak: a process that stops itself (SIGSTOP) or is
killed (SIGKILL) inside a phase leaves that phase readable. The watchdog must trip on a stale phase (and not on a
long phase within its long limit), dump stacks that `diagnose` can parse, and answer another rank's request. Real
processes killed, stopped and woken: tests/multiproc/hang/test_heartbeat_processes.py; the watchdog in real time (its
limits are seconds): tests/multiproc/hang/test_watchdog_timing.py. The multi-rank and launcher cases are in
tests/multiproc/hang/test_hang_local.py and tests/cluster/hang/test_hang.py.
"""
from __future__ import annotations

import json
import os
import threading
import time

import pytest
from faults import record

from helpers.hang import a_watchdog, until_ended
from hpctrain.config import load_config
from hpctrain.hang import diagnose, heartbeat, stragglers, watchdog
from hpctrain.hang.heartbeat import FILE_BYTES, Heartbeat


def test_round_trip_and_facts(tmp_path) -> None:
    hb = Heartbeat(tmp_path, 5, {"host": "h1", "node": "n2"})
    hb.begin_step(812)
    hb.enter("forward", "micro-batch 2/4")
    hb.set_facts(coords={"pp": 0, "dp": 1, "tp": 1})
    got = heartbeat.read(heartbeat.heartbeat_path(tmp_path, 5))
    assert got["rank"] == 5 and got["node"] == "n2" and got["pid"] == os.getpid()
    assert (got["step"], got["phase"], got["detail"]) == (812, "forward", "micro-batch 2/4")
    assert got["coords"] == {"pp": 0, "dp": 1, "tp": 1} and abs(got["wall"] - time.time()) < 5
    hb.close("failed")
    assert heartbeat.read(hb.path)["phase"] == "failed"


def test_damaged_files_are_refused(tmp_path) -> None:
    hb = Heartbeat(tmp_path, 0, {"node": "n1"})
    hb.enter("backward", "x")
    path = hb.path
    raw = bytearray(path.read_bytes())
    i = raw.index(b".") + 1  # a digit of the wall time changed: the line still parses, its crc does not match
    raw[i] = ord("9") if raw[i] != ord("9") else ord("8")
    path.write_bytes(bytes(raw))
    assert "torn or damaged" in heartbeat.read(path)["error"]
    path.write_bytes(b"x" * (FILE_BYTES + 1))
    assert "more than the 1024" in heartbeat.read(path)["error"]
    link = tmp_path / "heartbeat" / "rank00001.hb"
    link.symlink_to(path)
    assert "error" in heartbeat.read(link)
    long = Heartbeat(tmp_path / "b", 2, {"node": "n"})
    long.set_facts(failure="E" * 5000)  # a long error message is shortened, not refused
    assert heartbeat.read(long.path)["failure"].startswith("EEE")




def test_compute_and_wait_times(monkeypatch) -> None:
    clock = [100.0]
    monkeypatch.setattr(heartbeat.time, "monotonic", lambda: clock[0])
    hb = Heartbeat(None, 0)
    for phase, seconds in [("forward", 2.0), ("backward", 3.0), ("collective", 4.0), ("optimizer", 1.0)]:
        hb.enter(phase)
        clock[0] += seconds
    assert hb.take_times() == (6.0, 4.0)  # the startup phase before forward took no time
    clock[0] += 0.5  # still in optimizer
    hb.enter("collective")
    clock[0] += 2.0
    assert hb.take_times() == (0.5, 2.0)
















def test_config_limits() -> None:
    cfg = load_config(None, ["parallel.timeout_s=300"])
    assert cfg.parallel.hang_limits_s == (150, 1200)
    assert load_config(None, ["parallel.timeout_s=3600"]).parallel.hang_limits_s == (300, 1200)
    assert load_config(None, ["parallel.hang_timeout_s=0"]).parallel.hang_limits_s is None
    assert load_config(None, ["parallel.hang_timeout_s=20", "parallel.startup_timeout_s=0"]
                       ).parallel.hang_limits_s == (20, 20)
    for bad, words in [(["parallel.timeout_s=60", "parallel.hang_timeout_s=60"], "shorter than parallel.timeout_s"),
                       (["parallel.hang_timeout_s=-2"], "hang_timeout_s = -2"),
                       (["parallel.hang_timeout_s=100", "parallel.startup_timeout_s=50"], "startup_timeout_s = 50"),
                       (["parallel.flight_recorder=-1"], "flight_recorder"),
                       (["train.straggler_margin=0"], "straggler_margin")]:
        with pytest.raises(ValueError, match=words):
            load_config(None, bad)


def test_find_stragglers_per_stage() -> None:
    # ranks 0-3 stage 0, 4-7 stage 1 (the last stage computes more by design: not a straggler)
    compute = [1.0, 1.02, 1.9, 0.98, 1.5, 1.52, 1.49, 1.51]
    times = [(c, 2.0 - c) for c in compute]
    hosts = ["n1"] * 4 + ["n2"] * 4
    rep = stragglers.find_stragglers(times, hosts, [0] * 4 + [1] * 4, margin=0.2)
    assert [r["rank"] for r in rep["slow"]] == [2] and rep["hosts"] == ["n1"]
    assert rep["slow"][0]["excess"] == pytest.approx(1.9 / 1.01 - 1, abs=1e-3)
    assert stragglers.describe(rep) == "slow: rank 2 (n1) +88%"
    # the last stage computes more: against one median for all it would be named, against its own it is not
    uneven = [(1.0, 0.5)] * 6 + [(1.5, 0.0)] * 2
    assert {r["rank"] for r in stragglers.find_stragglers(uneven, hosts, [0] * 8, 0.2)["slow"]} == {6, 7}
    assert stragglers.find_stragglers(uneven, hosts, [0] * 6 + [1] * 2, 0.2)["slow"] == []
    assert stragglers.find_stragglers([(1.0, 0.0)], ["n1"], [0], 0.2)["slow"] == []
    tally = stragglers.Tally()
    tally.add(rep)
    tally.add(rep)
    tally.add(stragglers.find_stragglers([(1.0, 0)] * 8, hosts, [0] * 8, 0.2))
    s = tally.summary()
    assert s["log_intervals"] == 3 and s["ranks"][0]["rank"] == 2 and s["ranks"][0]["intervals"] == 2
    assert s["hosts"] == [{"host": "n1", "intervals": 2}]


def test_plot_per_rank_step_times(tmp_path) -> None:
    from hpctrain.train.plot import per_rank_step_times, plot_training
    rows = [{"step": 1, "loss": 5.0, "lr": 1e-4, "tokens_per_s": 100.0, "mfu": 0.1, "rank_compute_s": [1.0, 2.0],
             "rank_wait_s": [1.0, 0.0], "stragglers": [{"rank": 1}]},
            {"step": 5, "loss": 4.0, "lr": 1e-4, "tokens_per_s": 100.0, "mfu": 0.1, "rank_compute_s": [4.0, 4.4],
             "rank_wait_s": [0.4, 0.0], "stragglers": []}]
    steps, series, slow = per_rank_step_times(rows)
    assert steps == [1, 5] and series == [[1.0, 1.0], [2.0, 1.1]] and slow == [(1, 1)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert plot_training(tmp_path).stat().st_size > 10000




# --- issue 25 -------------------------------------------------------------------------------------------------------







@pytest.mark.faults
def test_a_stop_during_a_look_is_a_freeze(tmp_path, monkeypatch) -> None:
    """CI-22: a rank stopped (SIGSTOP) while its watchdog was in the middle of a look, not between two, woke at the
    job's requeue (SIGCONT), finished that look, found the hang request and dumped with frozen_s 0: diagnose
    counted the stopped rank as one that answered in time. The look itself stalling past its bounded store wait is
    a freeze too (here the look's request check blocks for 4 s, as a stopped process would)."""
    dog, hb, ended = a_watchdog(tmp_path, monkeypatch, watchdog.Limits(step_s=2, long_s=60), "forward", step=1)
    hb.begin_training(0)  # the first step: the long limit holds, so only the request ends it

    def stopped_then_asked(request):
        time.sleep(4)
        return "another rank's request"
    monkeypatch.setattr(dog, "_asked_now", stopped_then_asked)
    until_ended(ended, "the watchdog never answered the request")
    header, _ = diagnose.parse_dump(watchdog.hang_path(tmp_path, 2).read_text())
    assert header["reason"].startswith("asked by another rank's watchdog") and header["frozen_s"] >= 2, header


def test_the_watchdog_reads_hang_request_bounded(tmp_path, monkeypatch) -> None:
    """hang/request nested past json's recursion killed the watchdog thread (RecursionError); a FIFO there blocked
    it for good. Both are unreadable requests now: answered with a dump (one too many rather than none)."""
    dog, hb, ended = a_watchdog(tmp_path, monkeypatch, watchdog.Limits(step_s=30, long_s=60), "forward")
    dog.stop()
    (tmp_path / "hang").mkdir()
    request = tmp_path / "hang" / "request"
    answers: list[bool] = []
    for make in (lambda: request.write_text("[" * 100000 + "]" * 100000), lambda: os.mkfifo(request)):
        request.unlink(missing_ok=True)
        make()
        t = threading.Thread(target=lambda: answers.append(dog._asked(request)), daemon=True)
        t.start()
        t.join(10)
        assert not t.is_alive(), "the watchdog blocked reading hang/request"
    assert answers == [True, True], answers
    request.unlink()
    request.write_text(json.dumps({"rank": 0, "wall": time.time() - 600}))  # an earlier incarnation's
    assert dog._asked(request) is False
    record("hang/request nested 10^5 deep, or a FIFO", "the watchdog neither dies nor blocks: it answers with a "
           "dump", tier="unit")




@pytest.mark.faults
def test_heartbeat_reads_are_bounded_and_typed(tmp_path) -> None:
    """A FIFO named as a heartbeat never blocks the reader; facts of the wrong types or out of range are damaged;
    the file is not opened through a link when written either."""
    (tmp_path / "heartbeat").mkdir()
    os.mkfifo(heartbeat.heartbeat_path(tmp_path, 4))
    assert "error" in heartbeat.read(heartbeat.heartbeat_path(tmp_path, 4))
    hb = Heartbeat(tmp_path, 1, {"node": "n1"})
    hb.enter("forward")
    raw = bytearray(hb.path.read_bytes())
    end = raw.index(b"\n", 256)
    for facts, words in [({"rank": 1, "pid": "1"}, "pid"), ({"rank": True}, "rank"), ({"rank": -1}, "rank"),
                         ({"rank": 1 << 20}, "rank"), ({"rank": 1, "coords": {"dp": "0"}}, "coords"),
                         ({"rank": 1, "started": "now"}, "started"), ({"rank": 1, "failure": 3}, "failure")]:
        raw[256:end] = json.dumps(facts).encode().ljust(end - 256)
        hb.path.write_bytes(bytes(raw))
        got = heartbeat.read(hb.path)
        assert words in got.get("error", ""), (facts, got)
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (tmp_path / "heartbeat" / "rank00007.hb").symlink_to(victim)
    with pytest.raises(OSError):
        Heartbeat(tmp_path, 7, {"node": "n1"})
    assert victim.read_text() == "precious\n"
    record("a heartbeat that is a FIFO, facts of the wrong types or out of range, a heartbeat path linked to a file "
           "elsewhere", "read() says error without blocking; the writer refuses the link", tier="pure")


@pytest.mark.faults
def test_plot_skips_damaged_rows(tmp_path) -> None:
    """metrics.jsonl with a torn line, a lone surrogate, deep nesting, rows of the wrong shapes (a straggler rank
    past the ranks logged): plot draws the good rows (it used to raise on the first)."""
    from hpctrain.train.plot import plot_training, read_metrics
    good = [{"step": s, "loss": 5.0 - s / 10, "lr": 1e-4, "tokens_per_s": 100.0, "mfu": 0.1,
             "rank_compute_s": [1.0, 2.0], "rank_wait_s": [1.0, 0.0], "stragglers": [{"rank": 1}]} for s in (1, 2)]
    bad = ['{"step": 3, "loss": "x", "lr": 1e-4, "tokens_per_s": 1, "mfu": 0.1}',
           '{"step": 4, "loss": 1.0, "lr": 1e-4, "tokens_per_s": 1, "mfu": 0.1, "rank_compute_s": [1.0, 2.0], '
           '"stragglers": [{"rank": 9}]}', '{"step": "5", "val_loss": 1.0}', '{"note": "\\ud800"}',
           "[" * 100000 + "]" * 100000, '{"step": 6, "loss": 1.0, "lr"']
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in good) + "\n".join(bad) + "\n")
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    assert plot_training(tmp_path).stat().st_size > 10000
    (tmp_path / "metrics.jsonl").unlink()
    (tmp_path / "metrics.jsonl").symlink_to(tmp_path / "training.png")
    with pytest.raises(ValueError, match="link"):
        read_metrics(tmp_path)
    record("metrics.jsonl with a torn line, a lone surrogate, 10^5-deep nesting and rows of the wrong shapes; a "
           "linked metrics.jsonl", "plot draws the good rows; the link is refused", tier="pure")


def test_watchdog_trips_on_a_stale_phase(tmp_path, monkeypatch) -> None:
    dog, hb, ended = a_watchdog(tmp_path, monkeypatch, watchdog.Limits(step_s=0.5, long_s=30), "collective")
    dog.on_end = lambda: "requeued job 77 without n9"  # the first rank to trip runs it (hangrequeue.after_hang)
    until_ended(ended, "the watchdog never tripped")
    dog.stop()
    assert "hang on rank 2: no progress" in ended[0] and "parallel.hang_timeout_s" in ended[0]
    assert ended[0].endswith("; requeued job 77 without n9"), ended[0]
    request = json.loads((tmp_path / "hang" / "request").read_text())
    assert request["rank"] == 2 and "no progress" in request["reason"]
    header, frames = diagnose.parse_dump(watchdog.hang_path(tmp_path, 2).read_text())
    assert (header["step"], header["phase"], header["node"]) == (5, "collective", "n1")
    assert header["threads"] and any("test_heartbeat.py" in f for f in frames), frames  # the main thread's stack
