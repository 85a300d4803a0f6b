"""One rank of tests/multiproc/planner/test_planner_memory.py: builds the Trainer of each case in turn and runs two
steps.
The first records the model-state bytes this rank holds, counted from the real tensors (distinct storages; a
DTensor's local shard): parameters at their fullest (after each forward: gathered ones under ZeRO-2 and under
pipeline parallel, plus FSDP2's sharded copy beside them), gradients and AdamW's exp_avg/exp_avg_sq after the step.
The second, with the optimizer state in place as in every later step, records
- "saved": the most bytes autograd's saved tensors held at once (SavedBytes): one micro-batch's activations
  without pipeline parallel, the micro-batches in flight on this rank's stages with it;
- "peak": the most bytes of live CPU tensors at any moment of the step (forward, backward, gradient sync,
  clipping, optimizer step), everything included: the profiler's allocator events from the start of the case
  (torch.profiler, profile_memory), each allocation until its free. The profiler sees only the frees of the
  thread it profiles; gloo's worker threads free the buffers of the collectives whose work they held last, so
  such a free is taken from a finalizer on the storage (FreeTimes), or from the address being handed out again.

    python tests/workers/memory_worker.py OUT CASES_JSON BASE_PORT      # one rank of a torchrun-style spawn
"""
from __future__ import annotations

import json
import os
import sys
import weakref
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers
from helpers.training import SMALL  # noqa: E402
from hpctrain.config import load_config  # noqa: E402
from hpctrain.job import session
from hpctrain.train.trainer import Trainer  # noqa: E402


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (DTensors: their local shard)."""
    from torch.distributed.tensor import DTensor
    seen: dict[int, int] = {}
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        st = local.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def fsdp_shards(modules) -> list:
    """FSDP2's padded fp32 shards (FSDPParam._sharded_param_data, a private name: an empty list if it moves)."""
    from torch.distributed.fsdp import FSDPModule
    out = []
    for root in modules:
        for m in root.modules():
            if isinstance(m, FSDPModule):
                group = m._get_fsdp_state()._fsdp_param_group
                out += [getattr(fp, "_sharded_param_data", None) for fp in (group.fsdp_params if group else [])]
    return [d for d in out if d is not None]


def measure(tr: Trainer) -> dict[str, int]:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    roots = tr.pm.parts or [tr.pm.model]
    params = [0]

    def after_forward(module, args, output):
        held = [p for r in roots for p in r.parameters()]
        params[0] = max(params[0], storage_bytes(held + fsdp_shards(roots)))

    hooks = [r.register_forward_hook(after_forward) for r in roots]
    tr.train_step()
    for h in hooks:
        h.remove()
    opt = tr.optimizer.optim if isinstance(tr.optimizer, ZeroRedundancyOptimizer) else tr.optimizer
    model_params = [p for r in roots for p in r.parameters()]
    return {"params": params[0],
            "grads": storage_bytes(p.grad for p in model_params if p.grad is not None),
            "optimizer": storage_bytes(st[k] for st in opt.state.values() for k in ("exp_avg", "exp_avg_sq"))}


class SavedBytes:
    """The most bytes autograd's saved tensors held at once: each distinct storage (a DTensor's local shard; the
    model's parameters left out) counts from the first time a forward saves it until the storage is freed (a
    weakref finalizer on the storage object, which torch keeps alive as long as the storage)."""

    def __init__(self, roots) -> None:
        self.roots = roots
        self.live: dict[int, int] = {}
        self.now = self.peak = 0

    def pack(self, t):
        st = local(t).untyped_storage()
        key = st.data_ptr()
        # FSDP swaps its gathered parameters in and out: the parameters as they are now
        params = {local(p).untyped_storage().data_ptr() for r in self.roots for p in r.parameters()}
        if key not in self.live and key not in params:
            self.live[key] = st.nbytes()
            self.now += st.nbytes()
            self.peak = max(self.peak, self.now)
            weakref.finalize(st, self._freed, key)
        return t

    def _freed(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)


def local(t):
    """The plain tensor holding t's bytes: a DTensor's local shard, a functional collective result's tensor."""
    t = getattr(t, "_local_tensor", t)
    return getattr(t, "elem", t)


def free_times():
    """A dispatch mode noting when each operator output's storage is freed: data_ptr -> [time.time_ns()], from a
    weakref finalizer that runs in whatever thread frees it."""
    import time

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class FreeTimes(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.freed: dict[int, list[int]] = {}
            self.watched: set[int] = set()

        def _free(self, ptr: int) -> None:
            self.watched.discard(ptr)
            self.freed.setdefault(ptr, []).append(time.time_ns())

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    try:
                        st = local(t).untyped_storage()
                        ptr = st.data_ptr()
                    except RuntimeError:  # a wrapper subclass with no storage of its own
                        continue
                    if ptr and ptr not in self.watched:
                        self.watched.add(ptr)
                        weakref.finalize(st, self._free, ptr)
            return out
    return FreeTimes()


def live_peak(prof, freed: dict[int, list[int]]) -> dict:
    """Live tensor bytes from the profiler's allocator events: at the start of the "peak_step" region, their
    maximum inside it (and the operators running at that moment), at the end of the profile."""
    def walk(nodes):
        for n in nodes:
            yield n
            yield from walk(n.children)
    nodes = list(walk(prof.profiler.kineto_results.experimental_event_tree()))
    region = next(n for n in nodes if n.name == "peak_step")
    t0, t1 = region.start_time_ns, region.end_time_ns
    mem = [(n.start_time_ns, n.extra_fields.alloc_size, n.extra_fields.ptr) for n in nodes if n.name == "[memory]"]
    mem.sort()
    owner, missed = {}, []  # an allocation whose free the profiler did not see: freed by another thread
    for ts, nbytes, ptr in mem:
        if nbytes > 0:
            if ptr in owner:  # its address came back: freed by now, at the finalizer's time if one saw it
                a = owner[ptr]
                missed.append((min((f for f in freed.get(ptr, []) if a[0] < f <= ts), default=ts), -a[1], ptr))
            owner[ptr] = (ts, nbytes)
        else:
            owner.pop(ptr, None)
    for ptr, a in owner.items():
        when = min((f for f in freed.get(ptr, []) if a[0] < f), default=None)
        if when is not None:
            missed.append((when, -a[1], ptr))
    live, start, peak, at = 0, None, 0, t0
    for ts, nbytes, _ in sorted(mem + missed):
        if start is None and ts >= t0:
            start = peak = live
        live += nbytes
        if t0 <= ts <= t1 and live > peak:
            peak, at = live, ts
    ops = [n.name for n in nodes if n.name != "[memory]" and t0 <= n.start_time_ns <= at <= n.end_time_ns]
    return {"live_start": start, "peak": peak, "peak_at": ops[1:4], "live_end": live}


def measured_step(tr: Trainer) -> int:
    """One train step inside the "peak_step" profiler region; returns SavedBytes' peak."""
    import torch
    from torch.profiler import record_function
    saved = SavedBytes(tr.pm.parts or [tr.pm.model])
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t), record_function("peak_step"):
        tr.train_step()
    return saved.peak


def main(out: str, cases_json: str, base_port: int) -> None:
    import gc

    from torch.profiler import ProfilerActivity, profile
    rank = int(os.environ["RANK"])
    results, errors = {}, {}
    for i, case in enumerate(json.loads(cases_json)):
        os.environ["MASTER_PORT"] = str(base_port + i)
        # No read-ahead thread: with it, one rank of dp4_zero1_skewed now and then showed 0.97 MB more at the loss
        # backward (2 of 5 runs; 0 of 3 without it). Its allocations and frees cross threads, which this
        # reconstruction from profiler events attributes badly; a loader's few batches are not what is predicted.
        cfg = load_config(None, SMALL + case["overrides"] + ["train.prefetch=0",
                                                             f"job.run_root={out}/{case['name']}-runs"])
        try:
            gc.collect()  # the last case's tensors freed before this profile begins, not inside it
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                with session.start(cfg) as s:
                    tr = Trainer(cfg, s)
                    with free_times() as ft:  # from here: the steps' collectives
                        got = measure(tr) | {"pp_rank": s.mesh.pp_rank, "dp_rank": s.mesh.dp_rank,
                                             "tp_rank": s.mesh.tp_rank}
                        got["saved"] = measured_step(tr)
                        del tr  # freed in this profile: the next one must not see its frees
            results[case["name"]] = got | live_peak(prof, ft.freed)
        except Exception as e:  # recorded so the test names the case that failed
            errors[case["name"]] = f"{type(e).__name__}: {e}"
    Path(out, f"rank{rank}.json").write_text(json.dumps({"results": results, "errors": errors}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
