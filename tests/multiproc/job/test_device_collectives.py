"""Device-correct collectives, on CPU: the NCCL code path with its device served by gloo.

An NCCL-only process group serves only CUDA tensors; every host-tensor collective on it raises "No backend type
associated with device type cpu". rendezvous.init_distributed therefore gives NCCL jobs a default group with gloo
beside it ("cpu:gloo,cuda:nccl"), and every group made from it inherits both. No GPU here, so the test seam
emulate_nccl (tests/plugins/seams.py, patched in by the worker) runs that path with each NCCL entry served by gloo
for the same device types only: an NCCL-only group becomes "cuda:gloo", which refuses host tensors with NCCL's
own error.

Two real ranks (Slurm's variables, file rendezvous) run tests/workers/device_collectives_worker.py, in one process
each:
  1. the fault, injected: the default group NCCL alone would give (our init path, the CPU entry removed); the
     control collectives on host tensors must fail with NCCL's message, or this emulation proves nothing;
  2. the real control paths (RNG table, checkpoint size all-reduce, rank-0 verdicts, any-rank flags,
     preemption poll) on our default group, and the gradient norm of a pipeline rank without gradients (its
     zero must be made on the rank's device, not on torch's default one);
  3. training with periodic asynchronous and final saves, then a resume, through session.start; every process
     group alive at the end (mesh axes, FSDP, the async checkpoint group, ...) must serve host tensors through
     gloo, connecting lazily (rendezvous.lazy_gloo): no host tensor can reach a group without gloo, and an axis
     whose collectives all run on the device pays only gloo's idle transport (tests/multiproc/job/test_open_files.py
     counts the sockets).

    .venv/bin/python -m pytest tests/multiproc/job/test_device_collectives.py -q
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from helpers.launch import REPO, WORKERS, env_with_venv

NCCL_ERROR = "No backend type associated with device type cpu"


# --- pure: the backend string ----------------------------------------------------------------------------------

def test_nccl_gets_gloo_beside_it():
    from seams import emulated_device_backend
    from torch.distributed import Backend
    from torch.distributed.distributed_c10d import BackendConfig

    from hpctrain.job.rendezvous import backend_config

    assert backend_config("nccl") == "cpu:gloo,cuda:nccl"
    assert backend_config("gloo") == "gloo"
    # as torch reads it: host tensors to gloo, CUDA tensors to NCCL
    assert BackendConfig(Backend(backend_config("nccl"))).get_device_backend_map() == {"cpu": "gloo", "cuda": "nccl"}
    # the emulation keeps each entry's device types
    assert emulated_device_backend("nccl") == "cuda:gloo"
    assert emulated_device_backend(backend_config("nccl")) == "cpu:gloo,cuda:gloo"


@pytest.mark.faults
def test_grad_norm_without_gradients_reduces_on_the_parameters_device(monkeypatch):
    """A pp rank with no gradient hands the pp all-reduce a zero on its parameters' device (meta stands in for a
    GPU); a host zero would go to the gloo half of a "cpu:gloo,cuda:nccl" group while its peers wait in NCCL."""
    import torch
    import torch.distributed as dist
    from faults import record

    from hpctrain.train import optim

    handed = []
    monkeypatch.setattr(dist, "all_reduce", lambda t, group=None, **kw: handed.append((t.device.type, group)))
    params = [torch.nn.Parameter(torch.ones(4, device="meta")) for _ in range(2)]  # no .grad: nothing computed
    norm = optim.grad_norm(params, pp_group="pp")
    assert handed == [("meta", "pp")] and norm.device.type == "meta"
    record("a pipeline rank with parameters but no gradient joins the gradient-norm all-reduce (stand-in device)",
           "the zero it hands the pp group is on its parameters' device, not the host", None, "unit")


# --- two ranks -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("devcoll")
    procs = []
    for rank in range(2):
        env = env_with_venv() | {"SLURM_PROCID": str(rank), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(rank),
                                 "SLURM_NODEID": "0", "SLURM_NNODES": "1", "SLURM_JOB_ID": f"devcoll{os.getpid()}"}
        cmd = [sys.executable, str(WORKERS / "device_collectives_worker.py"), str(out)]
        procs.append(subprocess.Popen(cmd, env=env, cwd=REPO, text=True, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT))
    t0 = time.monotonic()
    logs = [p.communicate(timeout=400)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(log[-4000:] for log in logs)
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for r in results:
        r["seconds"] = time.monotonic() - t0
    return results


@pytest.mark.faults
def test_device_only_group_refuses_host_tensors(ranks):
    """The injected fault: without gloo beside NCCL each control collective on a host tensor fails."""
    from faults import record

    for r in ranks:
        assert r["device_only_backend"] == "cuda:gloo", r
        for name, outcome in r["device_only"].items():
            assert NCCL_ERROR in outcome, (name, outcome)
    record("host-tensor control collectives on an NCCL-only default group (emulated: gloo serving only 'cuda')",
           f"RNG table, checkpoint size all-reduce, any-rank flag and preemption poll each raise '{NCCL_ERROR}'; "
           "with our 'cpu:gloo,cuda:nccl' group all pass and training saves and resumes", None, "unit")


def test_control_paths_on_our_default_group(ranks):
    for rank, r in enumerate(ranks):
        assert r["backend"] == "cpu:gloo,cuda:gloo", r
        assert r["control"] == {"rng_table": "ok", "need_bytes": "ok", "agree": "ok", "gather": "ok",
                                "any_rank": "ok", "preempt_poll": "ok"}, (rank, r["control"])


@pytest.mark.faults
def test_pipeline_rank_without_gradients_reduces_on_the_device(ranks):
    """A pp rank with parameters but no gradient joins the gradient-norm all-reduce with a zero on its parameters'
    device; a zero made on the default device (the host, on a GPU job) left its peer waiting out the timeout."""
    from faults import record

    for rank, r in enumerate(ranks):
        assert r["no_grad_pp_rank"] == {"norm": 3.0, "device": "cpu"}, (rank, r["no_grad_pp_rank"])
    record("a pipeline rank with no gradients in the gradient-norm all-reduce, its default device not the rank's "
           "(emulated: default device meta, rank device cpu)",
           "both ranks get the peer's norm (3.0) on the rank's device; no rank waits out the group timeout",
           None, "multi-process")


def test_training_saves_and_resumes_with_every_group_serving_host_tensors(ranks):
    for r in ranks:
        groups = r["train"].pop("groups", [])
        assert r["train"].pop("lazy_gloo", None) == "1", r["train"]
        r.get("resume", {}).pop("groups", None)
        r.get("resume", {}).pop("lazy_gloo", None)
        assert r["train"] == {"steps": 4, "resumed_from": None}, r["train"]
        assert r.get("resume") == {"steps": 6, "resumed_from": 4}, r["resume"]
        # the world, the mesh's own pp and tp groups (its dp group of 2 is the world) and the async checkpoint group
        assert {"default_pg", "mesh_pp", "mesh_tp"} <= {g["desc"] for g in groups} and len(groups) >= 4, groups
        assert not [g for g in groups if "cpu" not in g["devices"] or g["cpu_backend"] != "gloo"], groups
        # no per-node groups: training never uses them, and each NCCL communicator costs device memory
        assert not [g for g in groups if g["desc"] in ("mesh_intra", "mesh_inter")], groups
