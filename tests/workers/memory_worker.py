"""One rank of tests/multiproc/test_planner_memory.py: builds the Trainer of each case in turn, runs one step,
and records the model-state bytes this rank holds, counted from the real tensors (distinct storages; a DTensor's
local shard): parameters at their fullest (after each forward: gathered ones under ZeRO-2 and under pipeline
parallel, plus FSDP2's sharded copy beside them), gradients and AdamW's exp_avg/exp_avg_sq after the step.

    python tests/workers/memory_worker.py OUT CASES_JSON BASE_PORT      # one rank of a torchrun-style spawn
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers
from helpers import SMALL  # noqa: E402
from hpctrain import session  # noqa: E402
from hpctrain.config import load_config  # noqa: E402
from hpctrain.train import Trainer  # noqa: E402


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


def activations(tr: Trainer) -> int:
    """Bytes autograd keeps from one micro-batch's forward (and loss) for backward: distinct storages of the saved
    tensors (a DTensor's local shard), parameters left out; then the backward runs, so the model's state stays as
    a step leaves it."""
    import torch
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor
    model = tr.model
    seen: dict[int, int] = {}

    def pack(t):
        local = t.to_local() if isinstance(t, DTensor) else t
        local = getattr(local, "elem", local)  # a functional collective's result wraps its tensor
        params = {(p.to_local() if isinstance(p, DTensor) else p).untyped_storage().data_ptr()
                  for p in model.parameters()}  # FSDP swaps in its unsharded parameters during forward
        st = local.untyped_storage()
        if st.data_ptr() not in params:
            seen.setdefault(st.data_ptr(), st.nbytes())
        return t

    x, y = tr.loader.next_batch()
    with tr._context(True):  # loss parallel's backward must run inside it too
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with tr._autocast():
                logits = model(x)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        loss.backward()
    tr.optimizer.zero_grad(set_to_none=True)
    return sum(seen.values())


def main(out: str, cases_json: str, base_port: int) -> None:
    rank = int(os.environ["RANK"])
    results, errors = {}, {}
    for i, case in enumerate(json.loads(cases_json)):
        os.environ["MASTER_PORT"] = str(base_port + i)
        cfg = load_config(None, SMALL + case["overrides"] + [f"job.run_root={out}/{case['name']}-runs"])
        try:
            with session.start(cfg) as s:
                tr = Trainer(cfg, s)
                got = measure(tr) | {"pp_rank": s.mesh.pp_rank, "dp_rank": s.mesh.dp_rank, "tp_rank": s.mesh.tp_rank}
                if tr.pipe is None:
                    got["activations"] = activations(tr)
                results[case["name"]] = got
        except Exception as e:  # recorded so the test names the case that failed
            errors[case["name"]] = f"{type(e).__name__}: {e}"
    Path(out, f"rank{rank}.json").write_text(json.dumps({"results": results, "errors": errors}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
