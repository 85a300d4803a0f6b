"""`hpctrain diagnose` run as a command on run directories written here the way ranks write them (the diagnosis in
the test process: tests/pure/hang/test_diagnose.py).

    PATH=$PWD/.venv/bin:$PATH .venv/bin/python -m pytest -q tests/multiproc/hang/test_diagnose_cli.py
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from faults import record

from helpers.hang import beat, dump, entry, log_row, metrics, request, stopped_rank_1
from helpers.launch import hpctrain
from hpctrain.hang import diagnose, watchdog


def test_a_stopped_rank_is_found_through_the_waits(tmp_path) -> None:
    stopped_rank_1(tmp_path)
    report = diagnose.diagnose(tmp_path)
    assert report["kind"] == "hang" and [c["rank"] for c in report["culprits"]] == [1], report
    lines = report["lines"]
    assert lines[1].startswith("rank 1 (n1) last seen in forward of step 812") and "left no hang dump" in lines[1]
    assert "rank 0 (n1) waited in all_reduce on the tp group (forward of step 812) for rank 1 (n1)" in lines
    assert ("ranks 2-3 (n2) waited in all_reduce on the dp group (gradient reduction on dp, step 812) for ranks "
            "0-1 (n1)") in lines
    assert report["waiting"]["2"] == {"op": "all_reduce", "group": "dp", "seq": 10, "for": [0]}
    assert "hang/rank00000.txt" in report["files"] and "heartbeat/rank00001.hb" in report["files"]
    out = hpctrain("diagnose", str(tmp_path))
    assert out.returncode == 1 and "rank 1 (n1) last seen in forward of step 812" in out.stdout, out.stdout


def test_finished_and_running_runs(tmp_path) -> None:
    beats = [beat(tmp_path, r, 100, "forward") for r in range(4)]
    assert diagnose.diagnose(tmp_path)["kind"] == "running"
    for hb in beats:
        hb.close("done")
    report = diagnose.diagnose(tmp_path)
    assert report["kind"] == "finished" and report["lines"] == ["finished: every rank done (step 100)"]
    assert hpctrain("diagnose", str(tmp_path)).returncode == 0


def test_a_crawling_run_names_its_stragglers_and_their_hosts(tmp_path) -> None:
    """A slowed job does not hang: diagnose names the ranks the report found slow, log interval after log interval,
    from metrics.jsonl, beside whatever else it says (finished, hang, failed)."""
    for hb in [beat(tmp_path, r, 12, "forward") for r in range(4)]:
        hb.close("done")
    metrics(tmp_path, [log_row(1, []), log_row(4, [(3, "n2", 2.4)]), {"step": 4, "val_loss": 3.1},
                        log_row(8, [(3, "n2", 12.45), (0, "n1", 0.37)]), log_row(12, [(3, "n2", 3.0)])])
    report = diagnose.diagnose(tmp_path)
    assert report["kind"] == "finished", report
    assert report["lines"][-1] == ("stragglers over 4 log intervals to step 12: rank 3 (n2) slow in 3 (worst "
                                   "+1245%), rank 0 (n1) slow in 1 (worst +37%); hosts: n2 (3), n1 (1)"), report
    assert [(r["rank"], r["host"], r["intervals"]) for r in report["stragglers"]["ranks"]] == [(3, "n2", 3),
                                                                                              (0, "n1", 1)]
    out = hpctrain("diagnose", str(tmp_path))
    assert out.returncode == 0 and "rank 3 (n2) slow in 3" in out.stdout, out.stdout

    hung = tmp_path / "hung"
    stopped_rank_1(hung)
    metrics(hung, [log_row(800, [(1, "n1", 0.5)]), log_row(810, [])])
    report = diagnose.diagnose(hung)
    assert report["kind"] == "hang" and [c["rank"] for c in report["culprits"]] == [1]
    assert report["lines"][-1].startswith("stragglers over 2 log intervals to step 810: rank 1 (n1) slow in 1")

    calm = tmp_path / "calm"
    for hb in [beat(calm, r, 8, "forward") for r in range(4)]:
        hb.close("done")
    assert diagnose.diagnose(calm)["stragglers"] is None  # no report logged: no line
    metrics(calm, [log_row(4, []), log_row(8, [])])
    assert diagnose.diagnose(calm)["lines"][-1] == ("stragglers: none over 2 log intervals to step 8 "
                                                    "(train.straggler_margin)")


def _forge_facts(path: Path, new_path: Path, facts: dict) -> None:
    """A heartbeat file whose facts region holds `facts` (the live line and its crc stay valid), written to
    new_path."""
    raw = bytearray(path.read_bytes())
    end = raw.index(b"\n", 256)  # the facts region's end, wherever this version puts it
    text = json.dumps(facts).encode()
    assert len(text) <= end - 256
    raw[256:end] = text.ljust(end - 256)
    new_path.write_bytes(bytes(raw))


def _cap_memory() -> None:
    """The child may map at most 3 GiB: code that sizes a list by a rank read from a file fails there, not in
    the machine's OOM killer."""
    import resource
    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))


@pytest.mark.faults
def test_a_heartbeat_naming_a_huge_rank_is_damaged(tmp_path) -> None:
    """A heartbeat naming rank 10^9 (in a file named for it) sized the world group by it: range(world) (a
    MemoryError, in the job's own hang path too). Ranks come from what the directory holds, bounded by the config's
    limit: the file is named damaged and the hang found as before."""
    beat(tmp_path, 1, 30, "forward")  # stopped in step 30's forward: no dump
    for r in (0, 2, 3):  # the others wait in a world collective (the preemption poll) it never joined
        hb = beat(tmp_path, r, 30, "collective", "preemption poll on the world")
        dump(tmp_path, hb, [entry(k, "default_pg", t=k) for k in range(1, 7)]
              + [entry(7, "default_pg", retired=False, t=7)])
    request(tmp_path, 0)
    huge = 10 ** 9
    _forge_facts(tmp_path / "heartbeat" / "rank00003.hb", tmp_path / "heartbeat" / f"rank{huge}.hb",
                 {"rank": huge, "pid": 1, "node": "n9", "coords": {"pp": 0, "dp": 0, "tp": 0}})
    out = hpctrain("diagnose", str(tmp_path), "--json", preexec_fn=_cap_memory, timeout=120)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    report = json.loads(out.stdout)
    assert [c["rank"] for c in report["culprits"]] == [1], report["lines"]
    assert report["waiting"]["0"] == {"op": "all_reduce", "group": "world", "seq": 7, "for": [1]}, report
    assert any(f"rank{huge}.hb" in p and "rank" in p for p in report["problems"]), report["problems"]
    record("a heartbeat naming rank 10^9 (file and facts) beside a world collective in flight",
           "diagnose (memory capped at 3 GiB) names the file damaged and still finds the stopped rank",
           tier="multiproc")


@pytest.mark.faults
def test_wrong_types_in_hang_files_are_damaged_input(tmp_path) -> None:
    """Every field read from a dump header, a flight recorder, a heartbeat's facts and hang/request is checked for
    its type: a dump header whose threads is a list, a request that is a JSON list, entries of the wrong shapes.
    Damaged input is skipped and named; the rest still gives the diagnosis."""
    stopped_rank_1(tmp_path)
    path = watchdog.hang_path(tmp_path, 3)
    first, rest = path.read_text().split("\n", 1)
    header = json.loads(first.removeprefix("# hpctrain hang dump "))
    path.write_text("# hpctrain hang dump " + json.dumps(header | {"threads": ["MainThread"]})
                    + "\n" + rest)
    fr = watchdog.hang_path(tmp_path, 2, ".fr.json")
    data = json.loads(fr.read_text())
    data["fr"]["entries"] += [{"collective_seq_id": True, "process_group": [1, "mesh_dp"], "retired": False},
                              {"collective_seq_id": 99, "process_group": "mesh_dp", "retired": False},
                              {"collective_seq_id": 99, "process_group": ["1", ["mesh_dp"]], "retired": False},
                              {"collective_seq_id": 99, "process_group": ["1", "mesh_dp"], "retired": "no",
                               "profiling_name": ["gloo"]}, [], "entry"]
    fr.write_text(json.dumps(data))
    _forge_facts(tmp_path / "heartbeat" / "rank00002.hb", tmp_path / "heartbeat" / "rank00002.hb",
                 {"rank": 2, "pid": 1, "node": ["n2"], "coords": {"pp": 0, "dp": 1, "tp": 0}})
    report = diagnose.diagnose(tmp_path)
    assert [c["rank"] for c in report["culprits"]] == [1], report["lines"]
    problems = " | ".join(report["problems"])
    assert "hang/rank00003.txt" in problems and "threads" in problems, problems
    assert "rank00002.hb" in problems and "node" in problems, problems
    assert report["waiting"]["2"]["seq"] == 10, report["waiting"]  # the damaged entries were skipped
    (tmp_path / "hang" / "request").write_text('[{"rank": 2}]')
    report = diagnose.diagnose(tmp_path)
    assert report["lines"][0].startswith("hang: first seen by rank ?'s watchdog"), report["lines"]
    assert any("hang/request" in p for p in report["problems"]), report["problems"]
    (tmp_path / "hang" / "request").write_text(json.dumps({"rank": "2", "wall": [1], "grace_s": "x",
                                                           "reason": {"a": 1}}))
    report = diagnose.diagnose(tmp_path)
    assert [c["rank"] for c in report["culprits"]] == [1] and "rank ?" in report["lines"][0], report["lines"]
    assert hpctrain("diagnose", str(tmp_path)).returncode == 1
    record("a hang dump header whose threads is a list; a request that is a JSON list; wrong-typed flight "
           "recorder entries and heartbeat facts", "diagnose names each file damaged, skips it and still names "
           "the stopped rank", tier="multiproc")


@pytest.mark.faults
def test_links_are_not_followed_out_of_the_run_directory(tmp_path) -> None:
    """hang/, hang/heartbeat/ and heartbeat/ as links to another run's hang, a hang-<time>/ that is a link: none is
    followed (each is named), and a run directory that is itself a link is refused."""
    elsewhere = tmp_path / "elsewhere"
    stopped_rank_1(elsewhere)
    run = tmp_path / "run"
    for hb in [beat(run, r, 9, "forward") for r in range(4)]:
        hb.close("done")
    (run / "hang").symlink_to(elsewhere / "hang")
    report = diagnose.diagnose(run)
    assert report["kind"] == "finished", report["lines"]
    assert any(p.startswith("hang/") and "link" in p for p in report["problems"]), report["problems"]
    (run / "hang").unlink()
    (run / "hang").mkdir()
    (run / "hang" / "heartbeat").symlink_to(elsewhere / "heartbeat")
    assert diagnose.diagnose(run)["kind"] == "finished"
    other = tmp_path / "other"
    other.mkdir()
    (other / "heartbeat").symlink_to(elsewhere / "heartbeat")
    (other / "hang").symlink_to(elsewhere / "hang")
    report = diagnose.diagnose(other)
    assert report["kind"] == "unknown" and any("heartbeat" in p for p in report["problems"]), report
    (run / "hang-20261125-162530").symlink_to(elsewhere)
    with pytest.raises(ValueError, match="link"):
        diagnose.diagnose(run / "hang-20261125-162530")
    out = hpctrain("diagnose", str(run / "hang-20261125-162530"))
    assert out.returncode == 2 and "link" in out.stderr, out.stderr
    record("hang/, hang/heartbeat/ and heartbeat/ linked to another run's hang; a hang-<time>/ that is a link",
           "diagnose follows none of them (each named); the linked hang-<time>/ is refused with exit 2",
           tier="multiproc")


@pytest.mark.faults
def test_lone_surrogates_and_deep_nesting_in_run_files(tmp_path) -> None:
    """A flight recorder with a lone surrogate (it would reach the report and fail its printing) or nesting deeper
    than json's recursion; metrics.jsonl rows likewise: named or skipped, no traceback."""
    stopped_rank_1(tmp_path)
    fr = watchdog.hang_path(tmp_path, 2, ".fr.json")
    fr.write_text(fr.read_text().replace('"mesh_dp"', '"mesh_\\ud800"'))
    watchdog.hang_path(tmp_path, 3, ".fr.json").write_text('{"fr": ' + "[" * 100000 + "]" * 100000 + "}")
    metrics(tmp_path, [log_row(800, [(1, "n1", 0.5)])])
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 805, "stragglers": [{"rank": 2, "host": "n\\udc00", "excess": 1.0}]}\n')
        f.write('{"step": 806, "stragglers": ' + "[" * 100000 + "]" * 100000 + "}\n")
    report = diagnose.diagnose(tmp_path)
    problems = " | ".join(report["problems"])
    assert "rank00002.fr.json" in problems and "surrogate" in problems, problems
    assert "rank00003.fr.json" in problems and "nested" in problems, problems
    assert report["stragglers"]["log_intervals"] == 1, report["stragglers"]
    assert [c["rank"] for c in report["culprits"]] == [1], report["lines"]
    out = hpctrain("diagnose", str(tmp_path))
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert json.loads(hpctrain("diagnose", str(tmp_path), "--json").stdout)["kind"] == "hang"
    record("a lone surrogate and 10^5-deep nesting in flight recorders and metrics.jsonl rows",
           "diagnose names the flight recorders damaged, skips the rows, prints its report (text and --json)",
           tier="multiproc")
