"""A rendezvous address the other ranks reach, with two real ranks as two Slurm "nodes" on this host (no MPI, file
rendezvous): rank 0's store is published on a non-loopback address of this host and gloo (and NCCL's variable)
follow the chosen interface. The choice itself is tests/pure/job/test_rendezvous_reach.py's.

    .venv/bin/python -m pytest tests/multiproc/job/test_rendezvous_two_nodes.py -q
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers.launch import REPO, env_with_venv
from hpctrain.job import netaddr

WORKER = r"""
import json, sys
from pathlib import Path
import torch
import torch.distributed as dist
from hpctrain.job import rendezvous

ident = rendezvous.identify("auto")
rendezvous.init_distributed(ident, "gloo", 60, "", Path(sys.argv[1]), interface=sys.argv[2], connect_timeout_s=20)
t = torch.ones(1)
dist.all_reduce(t)
store = dist.distributed_c10d._get_default_store()
while hasattr(store, "underlying_store"):
    store = store.underlying_store
import os
print("REACH " + json.dumps({"sum": t.item(), "store": store.host, "gloo": os.environ.get("GLOO_SOCKET_IFNAME"),
                             "nccl": os.environ.get("NCCL_SOCKET_IFNAME")}), flush=True)
dist.destroy_process_group()
"""


@pytest.mark.parametrize("interface", ["", "configured"])
def test_two_nodes_publish_a_reachable_address(tmp_path, interface):
    """Two Slurm "nodes" (no MPI, file rendezvous): the store is published on this host's non-loopback address,
    from the configured interface or, without one, the fallback; gloo follows the same interface."""
    usable = {n: a for n, a in netaddr.host_interfaces().items() if not netaddr.is_loopback(a)}
    if not usable:
        pytest.skip("no interface besides loopback on this host")
    name, addr = next(iter(usable.items()))
    ifname = name if interface else ""
    resolved = netaddr.resolve_host()[1]
    if not interface and resolved and not netaddr.is_loopback(resolved):
        addr = resolved  # this host's name resolves to a routable address: that one is published
    procs = []
    for rank in range(2):
        env = env_with_venv() | {"SLURM_PROCID": str(rank), "SLURM_NTASKS": "2", "SLURM_LOCALID": "0",
                                 "SLURM_NODEID": str(rank), "SLURM_NNODES": "2", "SLURM_JOB_ID": "reach"}
        for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            env.pop(var, None)
        procs.append(subprocess.Popen([sys.executable, "-c", WORKER, str(tmp_path), ifname], env=env, cwd=REPO,
                                      text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outs)
    got = [json.loads(o.split("REACH ", 1)[1].splitlines()[0]) for o in outs]
    assert all(g["sum"] == 2.0 and g["store"] == addr for g in got), (addr, got)
    if interface:
        assert all(g["gloo"] == name and g["nccl"] == name for g in got), got
    elif resolved is None or netaddr.is_loopback(resolved):
        assert all(g["gloo"] == name and g["nccl"] is None for g in got), got
