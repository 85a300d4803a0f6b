"""Pure tier: how parallel/data.py builds DDP on the installed torch, in this process over a one-rank gloo group:
no deprecation warning from every rank of every job, and no buffer broadcast at every forward.

    .venv/bin/python -m pytest tests/pure/parallel/test_ddp_build.py -q
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from hpctrain.parallel import data


class WithBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("table", torch.arange(4.0), persistent=False)  # like the RoPE tables

    def forward(self, x):
        return self.lin(x) + self.table


def test_ddp_is_built_without_the_broadcast_buffers_deprecation() -> None:
    if dist.is_initialized():
        pytest.skip("a process group is already running in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ddp, sync = data.gradient_sync(WithBuffer(), 0, False, 1, dist.group.WORLD, torch.device("cpu"),
                                           compress_bf16=False)
        assert isinstance(ddp, DDP)
        assert not [str(w.message) for w in caught if "broadcast_buffers" in str(w.message)]
        # no broadcast of buffers at each forward (torch 2.13's attribute; before it, broadcast_buffers)
        assert getattr(ddp, "forward_sync_buffers", None) is False or ddp.broadcast_buffers is False
        with sync(True):
            ddp(torch.ones(2, 4)).sum().backward()
        assert ddp.module.lin.weight.grad is not None
        # DDP goes while the group is still registered: a Reducer that holds a gloo group's last reference destroys
        # it holding the GIL, and right after a backward gloo's worker thread still needs the GIL to let go of the
        # all-reduce it ran, so the two wait for each other (torch's pybind binding of the Reducer; seen as a hang
        # of a later test in this process when the garbage collector freed it: CI-16). Freed here, before
        # destroy_process_group, the group's own Python object destroys it with the GIL released.
        del ddp, sync
    finally:
        dist.destroy_process_group()


def test_the_keyword_follows_the_installed_torch() -> None:
    class DDPBefore213:  # torch 2.9-2.12: no forward_sync_buffers
        def __init__(self, module, device_ids=None, broadcast_buffers=True, process_group=None) -> None:
            pass
    assert data.no_forward_buffer_sync(DDPBefore213) == {"broadcast_buffers": False}
    assert data.no_forward_buffer_sync(DDP) == {"forward_sync_buffers": False}  # torch 2.13, tested here
