"""`hpctrain doctor`'s verdicts with no processes: the median and datasheet rules, which node a failure is pinned
to, the --exclude= line in Slurm's host-list form, the table and JSON, the preflight's requeue decision and the
Slurm calls it makes (a stand-in scontrol), and the refusals of bad rules and config values.

    PATH=$PWD/.venv/bin:$PATH .venv/bin/python -m pytest -q tests/pure/doctor/test_doctor_report.py
"""
from __future__ import annotations

import copy
import json

import pytest
import seams
from click.testing import CliRunner

from helpers.launch import EXAMPLE
from helpers.refusals import refused
from hpctrain.config import load_config
from hpctrain.doctor import measure as doctor
from hpctrain.doctor.report import Rules, analyse, expected_figures, render
from hpctrain.job import hostlist, preempt
from hpctrain.job.requeue import plan_requeue

CPU = Rules.for_device("cpu")
GPU = Rules.for_device("cuda")


def measured(nodes=("n1", "n2"), per_node=2, device="cpu", gemm=1.0, slow=None, factor=10.0) -> dict:
    """What doctor.measure gathers for a healthy tp=per_node x dp=len(nodes) job, one node slowed if asked."""
    ranks, world = [], len(nodes) * per_node
    for r in range(world):
        node = nodes[r // per_node]
        d = {"type": device, "index": r % per_node if device == "cuda" else None, "count": per_node if device ==
             "cuda" else 0, "name": "NVIDIA H100 80GB HBM3" if device == "cuda" else None,
             "uuid": f"GPU-{r}" if device == "cuda" else None, "cpus": 2, "threads": 1}
        rate = gemm / factor if node == slow else gemm * (1 + 0.03 * (r % 3))  # a little spread, as measured
        ranks.append({"rank": r, "node": node, "host": "h", "local_rank": r % per_node, "device": d,
                      "gemm": {"tflops": rate, "n": 1024, "dtype": "float32"}})
    groups = []
    for i, node in enumerate(nodes):
        groups.append({"axis": "tp", "aliases": ["intra"], "members": list(range(i * per_node, (i + 1) * per_node)),
                       "nodes": [node], "busbw": {"65536": 0.1, "4194304": 1.0}, "wrong": 0})
    for j in range(per_node):
        members = list(range(j, world, per_node))
        groups.append({"axis": "dp", "aliases": ["inter"], "members": members, "nodes": list(nodes),
                       "busbw": {"65536": 0.05, "4194304": 0.9}, "wrong": 0})
    storage = {"dir": "/ckpt", "write_gbps": 0.8, "read_gbps": 1.1, "bytes": 1 << 27, "free_gb": 80.0,
               "fs": "ext4", "striping": "not Lustre (ext4)"}
    env = {"python": "3.11.7", "torch": "2.13.0", "cuda": None, "nccl": None, "mpi": "MPICH Version: 5.0.2",
           "vars": {"NCCL_IB_HCA": "=mlx5_0"}, "shown": {}}
    node_rows = []
    for node in nodes:
        st = dict(storage)
        if node == slow:
            st["write_gbps"] /= factor
        node_rows.append({"node": node, "host": "h", "storage": st, "env": copy.deepcopy(env),
                          "clock": {"offset_ms": 0.2, "rtt_ms": 1.0}})
    job = {"job_id": "42", "launcher": "mpi", "world_size": world, "num_nodes": len(nodes), "device": device,
           "gpu_job": device == "cuda", "profile": None, "layout": {"pp": 1, "dp": len(nodes), "tp": per_node},
           "checkpoint_dir": "/ckpt", "checkpoint_bytes": 13_000_000, "sizes": [65536, 4194304], "elapsed_s": 3.0}
    return {"job": job, "ranks": ranks, "groups": groups, "nodes": node_rows}


def failed(report: dict) -> list[tuple[str, str]]:
    return [(r["check"], r["subject"]) for r in report["checks"] if not r["ok"]]


def test_healthy_job_passes_with_no_exclude_line():
    report = analyse(measured(), CPU, None)
    assert report["ok"] and failed(report) == [] and report["exclude"] is None
    text = render(report)
    assert "PASSED" in text and "--exclude" not in text
    assert "communication variables (every node): NCCL_IB_HCA==mlx5_0" in text


@pytest.mark.parametrize("nodes, slow, exclude", [
    (("n1", "n2"), "n2", "--exclude=n2"),
    (("n1", "n2", "n3", "n4"), "n3", "--exclude=n3"),
    (("gpu001", "gpu002", "gpu003"), "gpu001", "--exclude=gpu001"),
])
def test_a_slowed_node_fails_by_the_median_with_its_exclude_line(nodes, slow, exclude):
    """The median rule alone (no datasheet): the slowed node's ranks and its write rate fail, no other node."""
    report = analyse(measured(nodes, slow=slow), CPU, None)
    assert not report["ok"] and report["failed_nodes"] == [slow] and report["exclude"] == exclude
    slow_ranks = [r["rank"] for r in measured(nodes)["ranks"] if r["node"] == slow]
    assert set(failed(report)) == {("gemm", f"rank {r}") for r in slow_ranks} | {("write", slow)}
    text = render(report)
    assert f"FAILED nodes: {slow}" in text and exclude in text
    assert f"'job.sbatch_extra=[\"{exclude}\"]'" in text
    assert "GEMM 0.1" in text or "GEMM 0.2" in text  # the ratio to the median is named


def test_latency_bound_all_reduce_is_judged_on_gpus_only():
    """Two healthy tp groups of one host measured 0.066 and 0.27 GB/s at 64 KiB on gloo (their 4 MiB figures within
    15%): on CPUs the small size is shown with its median, not judged; the large size and GPUs' small size are."""
    m = measured(("n1", "n2", "n3"))
    m["groups"][0]["busbw"]["65536"] = 0.025  # tp on n1: 0.25 x the median at 64 KiB
    report = analyse(m, CPU, None)
    assert report["ok"], failed(report)
    row = next(r for r in report["checks"] if r["subject"] == "tp=intra [0,1] 64K")
    assert row["median"] == pytest.approx(0.1) and row["ok"]
    assert "all-reduce judged at the large size only" in render(report)
    m["groups"][0]["busbw"]["4194304"] = 0.25  # and at 4 MiB: fails, pinned to n1
    report = analyse(m, CPU, None)
    assert failed(report) == [("allreduce", "tp=intra [0,1] 4M")] and report["failed_nodes"] == ["n1"]
    m = measured(("n1", "n2", "n3"), device="cuda")
    m["groups"][0]["busbw"]["65536"] = 0.025
    report = analyse(m, GPU, None)
    assert failed(report) == [("allreduce", "tp=intra [0,1] 64K")] and report["failed_nodes"] == ["n1"]
    assert "judged at the large size only" not in render(report)


def test_two_failed_nodes_give_one_host_list():
    m = measured(("n1", "n2", "n3", "n4", "n5"))
    for r in m["ranks"]:
        if r["node"] in ("n3", "n4"):
            r["gemm"]["tflops"] /= 10
    report = analyse(m, CPU, None)
    assert report["failed_nodes"] == ["n3", "n4"] and report["exclude"] == "--exclude=n[3-4]"


def test_margin_decides():
    """0.55 x the median fails under the GPU default (20%) and passes under the CPU one (40% of the median)."""
    m = measured(("n1", "n2", "n3"))
    for r in m["ranks"]:
        if r["node"] == "n2":
            r["gemm"]["tflops"] *= 0.55
    assert analyse(m, CPU, None)["ok"]
    assert analyse(m, GPU, None)["failed_nodes"] == ["n2"]
    assert analyse(m, Rules.for_device("cpu", margin=0.3), None)["failed_nodes"] == ["n2"]


def test_expected_figures_fail_every_slow_gpu_even_when_the_median_agrees():
    """All GPUs at 0.3 of the H100's bf16 datasheet peak: the median sees nothing, the datasheet rule fails all."""
    exp = expected_figures("h100-sxm")
    assert exp["gemm_tflops"] == pytest.approx(989.5) and exp["intra_gbps"] == 450 and exp["inter_gbps"] == 50
    m = measured(device="cuda", gemm=0.3 * 989.5)
    report = analyse(m, GPU, exp)
    assert report["failed_nodes"] == ["n1", "n2"] and all(c == "gemm" for c, _ in failed(report)[:4])
    assert "0.30 x the expected 990 TFLOP/s" in render(report)
    # links: tp groups against NVLink, dp groups (one rank per node) against the NIC, at the large size only
    rows = {r["subject"]: r for r in report["checks"] if r["check"] == "allreduce"}
    assert rows["tp=intra [0,1] 4M"]["expected"] == 450 and rows["dp=inter [0,2] 4M"]["expected"] == 50
    assert rows["tp=intra [0,1] 64K"]["expected"] is None
    healthy = analyse(measured(device="cuda", gemm=0.7 * 989.5), GPU, exp)
    assert [c for c, _ in failed(healthy)] == ["allreduce"] * 4  # 1 GB/s on NVLink: every group below 0.4 x
    assert expected_figures("cpu") is None  # measured on a shared machine: only the median judges there


def test_a_slow_group_is_blamed_on_its_node_when_it_can_be():
    m = measured(("n1", "n2", "n3"))
    m["groups"][1]["busbw"]["4194304"] = 0.1  # tp group of n2
    report = analyse(m, CPU, None)
    assert report["failed_nodes"] == ["n2"] and failed(report) == [("allreduce", "tp=intra [2,3] 4M")]
    # a dp group spanning every node: each node also sits in the healthy dp group, so no node can be blamed
    m = measured(("n1", "n2", "n3"))
    m["groups"][3]["busbw"]["4194304"] = 0.1
    m["groups"].append(copy.deepcopy(m["groups"][4]) | {"members": [9, 10, 11]})  # three dp groups: a median of 3
    report = analyse(m, CPU, None)
    assert not report["ok"] and report["failed_nodes"] == [] and report["exclude"] is None
    assert report["unattributed"] == ["allreduce dp=inter [0,2,4] 4M"]
    assert "not attributable to one node: allreduce dp=inter [0,2,4] 4M" in render(report)


def test_a_node_seen_only_in_slow_groups_is_blamed():
    """4 nodes, groups of 2 nodes each: the two groups holding n4 are slow; n4 is in no healthy group."""
    m = measured(("n1", "n2", "n3", "n4"), per_node=1)
    dp = [[0, 1], [1, 2], [0, 2], [2, 3], [1, 3]]
    names = ["n1", "n2", "n3", "n4"]
    m["groups"] = [{"axis": "dp", "aliases": [], "members": g, "nodes": [names[r] for r in g],
                    "busbw": {"65536": 0.05, "4194304": 0.1 if 3 in g else 1.0}, "wrong": 0} for g in dp]
    report = analyse(m, CPU, None)
    assert report["failed_nodes"] == ["n4"] and report["unattributed"] == []


def test_wrong_results_fail_the_group():
    m = measured()
    m["groups"][0]["wrong"] = 3
    report = analyse(m, CPU, None)
    assert report["failed_nodes"] == ["n1"] and "3 wrong element(s)" in render(report)


def test_storage_free_space_clock_and_environment():
    m = measured(("n1", "n2", "n3"))
    m["nodes"][0]["storage"] = {"dir": "/ckpt", "error": "cannot write and read back /ckpt/x: Permission denied"}
    m["nodes"][1]["storage"]["free_gb"] = 0.005  # room for less than one 13 MB checkpoint
    m["nodes"][2]["clock"] = {"offset_ms": 450.0, "rtt_ms": 2.0}
    report = analyse(m, CPU, None)
    assert report["failed_nodes"] == ["n1", "n2", "n3"]
    assert set(failed(report)) == {("storage", "n1"), ("free", "n2"), ("clock", "n3")}
    text = render(report)
    assert "Permission denied" in text and "room for less than one checkpoint" in text and "+450 ms" in text
    within = measured()
    within["nodes"][1]["clock"] = {"offset_ms": 140.0, "rtt_ms": 90.0}  # 140 - 45 is within 100 ms
    assert analyse(within, CPU, None)["ok"]
    env = measured(("n1", "n2", "n3"))
    env["nodes"][2]["env"]["torch"] = "2.12.0"
    report = analyse(env, CPU, None)
    assert report["failed_nodes"] == ["n3"] and "2.12.0" in render(report)
    split = measured()
    split["nodes"][1]["env"]["vars"] = {}  # one node of two lost NCCL_IB_HCA: which one is wrong?
    report = analyse(split, CPU, None)
    assert report["failed_nodes"] == [] and report["unattributed"] == ["env n1", "env n2"]
    assert "communication variables on n1: NCCL_IB_HCA==mlx5_0" in render(report)


def test_a_shrunk_storage_probe_is_said_under_the_table():
    m = measured()
    m["nodes"][1]["storage"] |= {"asked": 1 << 34, "shrunk": "probe shrunk from 16384 to 12 MiB: at most 10% of the "
                                 "0.126 GB free, shared by 1 node(s) writing at once"}
    assert "storage on n2: probe shrunk from 16384 to 12 MiB" in render(analyse(m, CPU, None))
    assert "probe shrunk" not in render(analyse(measured(), CPU, None))


def test_device_visibility():
    gpu_job_on_cpu = measured()
    gpu_job_on_cpu["job"]["gpu_job"] = True
    report = analyse(gpu_job_on_cpu, CPU, None)
    assert {c for c, _ in failed(report)} == {"device"} and report["failed_nodes"] == ["n1", "n2"]
    assert "sees no CUDA device" in render(report)
    m = measured(("n1", "n2", "n3"), device="cuda")
    m["ranks"][3]["device"]["uuid"] = "GPU-2"  # ranks 2 and 3 of n2 bound to one GPU
    m["ranks"][5]["device"]["name"] = "NVIDIA A100-SXM4-80GB"  # a different model on n3
    report = analyse(m, GPU, None)
    assert report["failed_nodes"] == ["n2", "n3"]
    assert "2 ranks of h use the same GPU GPU-2" in render(report) and "GPU model differs" in render(report)
    few = measured(("n1", "n2"), per_node=4, device="cuda")
    few["ranks"][3]["device"]["count"] = 2  # local rank 3 sees 2 GPUs
    assert "local rank 3 but only 2 GPU(s)" in render(analyse(few, GPU, None))


def test_table_and_json_agree_and_large_jobs_are_summarised():
    report = analyse(measured(tuple(f"n{i}" for i in range(1, 41)), slow="n7"), CPU, None)
    again = json.loads(json.dumps(report))  # the CLI renders what doctor.json holds
    assert render(again) == render(report)
    text = render(report)
    gemm_lines = [line for line in text.splitlines() if line.startswith("gemm ")]
    assert len(gemm_lines) == 3  # ranks 12 and 13 of n7 failed, the other 78 in one summary line
    assert "78 more" in gemm_lines[-1] and report["exclude"] == "--exclude=n7"
    assert all(ch.isascii() for ch in text)


def test_rules_refused_with_the_value():
    refused(Rules.for_device, "cpu", margin=1.5, fragments=["--margin 1.5", "between 0 and 1"])
    refused(Rules.for_device, "cuda", expected_fraction=0.0, fragments=["--expected-fraction 0.0"])
    refused(Rules.for_device, "cpu", max_skew_ms=-1.0, fragments=["--max-skew-ms -1.0"])
    refused(expected_figures, "h100", fragments=["unknown hardware profile 'h100'"])
    assert Rules.for_device("cpu").margin == 0.6 and Rules.for_device("cuda").margin == 0.2
    assert Rules.for_device("cuda", margin=None, storage_margin=0.3).storage_margin == 0.3


def test_cli_refuses_bad_rules_and_profiles_before_submitting(tmp_path):
    from hpctrain.cli.main import main

    root = ["--set", f"job.run_root={tmp_path}"]
    out = CliRunner().invoke(main, ["doctor", str(EXAMPLE), "--margin", "1.5", *root])
    assert out.exit_code == 2 and "--margin 1.5: must be between 0 and 1" in out.output
    out = CliRunner().invoke(main, ["doctor", str(EXAMPLE), "--set", "job.gpu=h100", *root])
    assert out.exit_code == 2 and "job.gpu = 'h100': unknown hardware profile" in out.output
    assert list(tmp_path.iterdir()) == []  # nothing submitted, no run directory


def test_preflight_config_key():
    assert load_config(None).job.preflight is False
    assert load_config(None, ["job.preflight=true"]).job.preflight is True
    refused(load_config, None, ["job.preflight='yes'"], fragments=["job.preflight = 'yes' must be bool"])
    refused(load_config, None, ["job.prefligth=true"], fragments=["did you mean 'preflight'"])


def test_requeue_plan():
    usable = ["n1", "n2", "n3"]
    assert plan_requeue(["n1"], [], usable, 2, 0, 2) == (["n1"], "requeued without n1")
    assert plan_requeue(["n3"], ["n1"], usable + ["n4"], 2, 1, 2) == (["n1", "n3"], "requeued without n[1,3]")
    exclude, why = plan_requeue(["n2"], ["n1"], usable, 2, 1, 2)
    assert exclude is None and "would leave 1 usable node(s) of the partition (n3) for a 2-node job" in why
    exclude, why = plan_requeue([], [], usable, 2, 0, 2)
    assert exclude is None and "names a node" in why
    exclude, why = plan_requeue(["n3"], [], usable + ["n4", "n5"], 2, 2, 2)
    assert exclude is None and "job.node_requeues = 2, and this job was requeued without bad nodes 2 time(s)" in why
    assert plan_requeue(["n3"], [], usable, 2, 0, 0)[0] is None  # 0: no requeue at all


def _fake_scontrol(tmp_path, monkeypatch, fail_update=False):
    """A stand-in scontrol that logs each call with whether SIGTERM reached it ignored (bit 15 of SigIgn)."""
    calls = tmp_path / "calls"
    fake = tmp_path / "scontrol"
    fake.write_text(f"#!/bin/sh\nign=$(awk '/^SigIgn/ {{print $2}}' /proc/$$/status)\n"
                    f"echo \"$* [ign=$ign]\" >> {calls}\n"
                    "[ \"$1\" = show ] && echo 'JobId=77 JobName=x JobState=RUNNING Reason=None ExcNodeList=n[5-6]'\n"
                    + ("[ \"$1\" = update ] && echo 'Job is no longer pending execution' >&2 && exit 1\n" * fail_update)
                    + "exit 0\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    return calls


def _asked(calls) -> list[tuple[str, bool]]:
    """(arguments, SIGTERM ignored) of each call."""
    out = []
    for line in calls.read_text().splitlines():
        args, mask = line.rsplit(" [ign=", 1)
        out.append((args, bool(int(mask.rstrip("]"), 16) & (1 << 14))))
    return out


def test_requeue_excluding_requeues_then_updates_with_sigterm_ignored(tmp_path, monkeypatch):
    """Slurm 22.05 refuses ExcNodeList on a running job and takes it right after the requeue; the job's processes
    get SIGTERM at the requeue, so the commands run with it ignored (else the update dies with the job)."""
    import signal

    calls = _fake_scontrol(tmp_path, monkeypatch)
    assert preempt.excluded_nodes("77") == ["n5", "n6"]
    before = signal.getsignal(signal.SIGTERM)
    done, msg = preempt.requeue_excluding(["n5", "n6", "n2"])
    assert done and msg == "requeued job 77 without n[2,5-6] (ExcNodeList=n[2,5-6])"
    assert _asked(calls) == [("show job -o 77", False), ("show job -o 77", True), ("requeue 77", True),
                             ("update JobId=77 ExcNodeList=n[2,5-6]", True)]
    assert signal.getsignal(signal.SIGTERM) is before  # given back
    calls.unlink()
    calls = _fake_scontrol(tmp_path, monkeypatch, fail_update=True)
    done, msg = preempt.requeue_excluding(["n2"])
    assert done and "but scontrol update ExcNodeList=n2 failed: Job is no longer pending execution" in msg


def test_hostlist_round_trips_and_refusals():
    assert hostlist.expand("gpu[001-003],login1") == ["gpu001", "gpu002", "gpu003", "login1"]
    assert hostlist.expand("n[8-10],n3") == ["n8", "n9", "n10", "n3"]
    assert hostlist.expand("(null)") == [] and hostlist.expand("") == []
    for text in ("n[1,3-4,10]", "a1,b[2-3]", "gpu[007-012],n5", "login"):
        assert hostlist.compress(hostlist.expand(text)) == text
    assert hostlist.expand("x[1-2]y") == ["x1y", "x2y"] and hostlist.compress(["x1y", "x2y"]) == "x1y,x2y"
    assert hostlist.compress(["n3", "n1", "n2", "n1"]) == "n[1-3]"
    refused(hostlist.expand, "n[1-3", fragments=["'n[1-3'", "unbalanced"])
    refused(hostlist.expand, "n[3-1]", fragments=["runs backwards"])
    refused(hostlist.expand, "n[a]", fragments=["'a' is not a number"])


def test_turns_and_the_slow_switch():
    # CPU ranks of one host take turns; units on different hosts share a turn; GPUs all at once
    assert doctor._turns([{"h"}, {"h"}, {"g"}, {"h", "g"}], share=True) == [0, 1, 0, 2]
    assert doctor._turns([{"h"}, {"h"}], share=False) == [0, 0]
    # the test seam that slows a node (tests/plugins/seams.py): SEAM_DOCTOR_SLOW=<node>[:factor]
    assert seams.slow_factor("n2:5", "n2") == 5.0 and seams.slow_factor("n2:5", "n1") == 1.0
    assert seams.slow_factor("n2", "n2") == 10.0
    assert seams.slow_factor("", "n2") == 1.0
