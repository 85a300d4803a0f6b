"""Activation memory per transformer block, counted exactly on CPU, for every mode hpctrain trains in, beside the
published-style accounting for our block (benchmarks/README.md, "Activation memory per block") and the planner's
prediction (hpctrain.planner.activations).

    python benchmarks/activation_memory.py                 # driver: 1 rank, then mpiexec -n 2 and -n 4
    mpiexec -n 2 python benchmarks/activation_memory.py --world   # one world size's rows

Each row builds the Trainer of one mode (its real wrapping: tensor and sequence parallel, FSDP's mixed precision,
activation checkpointing) and runs one forward and the loss of one micro-batch under
torch.autograd.graph.saved_tensors_hooks. Every tensor autograd packs is recorded once by its storage (a DTensor's
local shard), in the block it was first saved in; parameters are left out. A low-precision saved tensor with a
weight's shape (1-D: a norm's) is a weight copy (autocast's low-precision copy, or the low-precision weight FSDP's
mixed precision gathers), counted apart from the activations. A checkpointed
block saves nothing through the hooks; what it keeps for its recompute is its input, recorded by a forward pre-hook.
The figure per row is the bytes of block 0 per element of s*b*h (the micro-batch's tokens s*b, global, times
model.dim h), comparable to Korthikanti et al.'s per-layer coefficients (34/t with tensor and sequence parallel and
selective recompute). Bytes are counted: one round, deterministic.

Rows: 1 rank: fp32 and bf16 autocast, GQA (2 KV heads of 8) and MHA, train.ac none and full (GQA also selective and
op). 2 ranks: tp=2 with and without sequence parallel, fp32 and bf16 autocast, ac none and full, bf16 with ac
selective and op, GPT's GeLU MLP (bf16, sequence parallel, ac none, selective, op), fused projections (bf16, ac none
with and without sequence parallel, op with it); bf16 parameters (FSDP's mixed
precision, ZeRO-2, tp=1 dp=2). 4 ranks: the same at tp=4, and bf16 parameters with tp=2 dp=2. A selectively
checkpointed block keeps its input and the outputs its policy caches (read from the policy's cache after the
forward); under sequence parallel the attention's and MLP's own saved-tensor hooks (parallel.tensor.SequenceGather)
hand ours what they keep: the shard in place of the gathered input.

Targets (issue 28), one verdict each, fixed before any run: bf16 with sequence parallel (tp 2, 4), ac none: at
most the formula + 5%; ac full: at most the sharded block input in bf16, 2/t, + 5%; bf16 with ac selective and op:
at most their documented count (formula(); benchmarks/README.md) + 5%. Writes
benchmarks/results/activation_memory-<n>ranks.json; the driver benchmarks/results/activation_memory.json.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from _verdict import verdict as rule_verdict

from _launch import run_worlds, write_results

HERE = Path(__file__).resolve().parent
TOL = 0.05
DIM, HEADS, KV, FFN, SEQ, BATCH = 256, 8, 2, 896, 256, 2  # Llama-3-like ratios: ffn 3.5 x dim, 4 query heads per KV
SHAPE = [f"model.dim={DIM}", f"model.n_heads={HEADS}", f"model.ffn_dim={FFN}", "model.n_layers=2",
         "model.vocab_size=384", f"model.max_seq_len={SEQ}", f"data.seq_len={SEQ}", f"train.micro_batch_size={BATCH}",
         "data.source=synthetic", "train.steps=1", "train.peak_tflops=1", "checkpoint.at_end=false",
         "parallel.pp=1", "job.name=bench-activation-memory"]


def rows_for(world: int) -> list[dict]:
    """The modes one world size measures: name, --set items, and the formula's inputs (bytes per element e,
    tp t, sequence parallel, checkpointing)."""
    rows = []
    if world == 1:
        for prec in ("fp32", "bf16"):
            for kv in (KV, HEADS):
                for ac in ("none", "full", "selective", "op") if kv < HEADS else ("none", "full"):
                    rows.append({"name": f"tp1 {prec} {'gqa' if kv < HEADS else 'mha'} ac={ac}", "tp": 1, "sp": False,
                                 "precision": prec, "ac": ac, "kv": kv, "sets": [
                                     "parallel.tp=1", f"train.precision={prec}", f"model.n_kv_heads={kv}",
                                     f"train.ac={ac}"]})
        return rows
    for prec in ("fp32", "bf16"):
        for sp in (False, True):
            for ac in ("none", "full"):
                rows.append({"name": f"tp{world} {prec}{' sp' if sp else ''} ac={ac}", "tp": world, "sp": sp,
                             "precision": prec, "ac": ac, "kv": max(KV, world), "sets": [
                                 f"parallel.tp={world}", f"parallel.sequence_parallel={str(sp).lower()}",
                                 f"train.precision={prec}", f"model.n_kv_heads={max(KV, world)}", f"train.ac={ac}"]})
    for sp in (False, True):
        for ac in ("selective", "op"):
            rows.append({"name": f"tp{world} bf16{' sp' if sp else ''} ac={ac}", "tp": world, "sp": sp,
                         "precision": "bf16", "ac": ac, "kv": max(KV, world), "sets": [
                             f"parallel.tp={world}", f"parallel.sequence_parallel={str(sp).lower()}",
                             "train.precision=bf16", f"model.n_kv_heads={max(KV, world)}", f"train.ac={ac}"]})
    if world == 2:  # GPT's two-matrix GeLU MLP (model.mlp = "gelu", ffn 4 x dim)
        for ac in ("none", "selective", "op"):
            rows.append({"name": f"tp2 bf16 sp gelu ac={ac}", "tp": 2, "sp": True, "precision": "bf16", "ac": ac,
                         "kv": KV, "mlp": "gelu", "sets": [
                             "parallel.tp=2", "parallel.sequence_parallel=true", "train.precision=bf16",
                             f"model.n_kv_heads={KV}", f"train.ac={ac}", "model.mlp=gelu",
                             f"model.ffn_dim={4 * DIM}"]})
    if world == 2:  # fused projections (model.fused_projections): q/k/v and gate/up one matmul each
        for sp, ac in ((False, "none"), (True, "none"), (True, "op")):
            rows.append({"name": f"tp2 bf16{' sp' if sp else ''} fused ac={ac}", "tp": 2, "sp": sp, "precision": "bf16",
                         "ac": ac, "kv": KV, "fused": True, "sets": [
                             "parallel.tp=2", f"parallel.sequence_parallel={str(sp).lower()}", "train.precision=bf16",
                             f"model.n_kv_heads={KV}", f"train.ac={ac}", "model.fused_projections=true"]})
    tp = world // 2
    rows.append({"name": f"tp{tp} dp2 bf16 params (zero2)", "tp": tp, "sp": False, "precision": "bf16-params",
                 "ac": "none", "kv": max(KV, tp), "sets": [
                     f"parallel.tp={tp}", "parallel.zero_stage=2", "train.precision=bf16",
                     f"model.n_kv_heads={max(KV, tp)}", "train.ac=none"]})
    return rows


def formula(row: dict) -> float:
    """Bytes per element of s*b*h of one block, the published-style accounting for our block (benchmarks/README.md):
    e (6 + 2g + 3f) / t + 4 / head_dim / t with sequence parallel (e = 2 in bf16, 4 in fp32; g = KV heads / heads;
    f = ffn / dim; the last term the attention kernel's fp32 log-sum-exp; a GeLU MLP keeps 2f, its input and
    output, in place of SwiGLU's 3f); without sequence parallel the norms' input and output (4e) stay whole; full
    recompute keeps only the block input, e / t (e / 1 without sp)."""
    e = 4 if row["precision"] == "fp32" else 2
    t, sp = row["tp"], row["sp"] or row["tp"] == 1
    if row["ac"] == "full":
        return e / (t if sp else 1)
    gelu = row.get("mlp") == "gelu"
    g, f = row["kv"] / HEADS, (4 * DIM if gelu else FFN) / DIM
    if row["ac"] in ("selective", "op"):  # the block's input, the kept matmuls' outputs (the o and down
        # projections' whole under tp), the attention output and log-sum-exp, the reductions' results under tp;
        # op: the odd-numbered matmuls, q, v, gate, down (GeLU, six matmuls: q, v, up; fused projections, four
        # matmuls: q/k/v and gate/up)
        if row["ac"] == "selective":
            mm = (1 + 2 * g + (1 if gelu else 2) * f) / t + 2
        elif row.get("fused"):  # four matmuls (q/k/v, o, gate/up, down): the 1st and 3rd
            mm = (1 + 2 * g + (1 if gelu else 2) * f) / t
        else:
            mm = (1 + g + f) / t + (0 if gelu else 1)
        reductions = 2 / (t if sp else 1) if t > 1 else 0
        return e * (1 / (t if sp else 1) + mm + 1 / t + reductions) + 4 / (DIM // HEADS) / t
    sharded = (2 + 2 * g + (2 if gelu else 3) * f) * e + 4 / (DIM // HEADS)
    norms = 4 * e
    return sharded / t + norms / (t if sp else 1)


def measure(row: dict, run_root: str) -> dict:
    import torch
    import torch.nn.functional as F
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    from hpctrain.config import load_config
    from hpctrain.job import session
    from hpctrain.model.dims import ModelDims
    from hpctrain.planner.activations import ActivationModel, mode_of
    from hpctrain.train.trainer import Trainer

    def local(t):
        t = getattr(t, "_local_tensor", t)
        return getattr(t, "elem", t)

    from hpctrain.parallel import recompute

    cfg = load_config(None, SHAPE + row["sets"] + [f"job.run_root={run_root}"])
    caches: list = []  # (block, the selective checkpoint's cache) of each partially recomputed block's forward
    real_contexts = recompute.sac_contexts

    def capturing(mode: str):
        contexts = real_contexts(mode)
        caches.append((where[0], contexts[0].storage))
        return contexts

    recompute.sac_contexts = capturing
    where = ["outside"]
    with session.start(cfg) as s:
        tr = Trainer(cfg, s)
        model = tr.pm.model
        params = {local(p).untyped_storage().data_ptr() for p in model.parameters()}
        params |= {local(b).untyped_storage().data_ptr() for b in model.buffers()}
        shapes = {tuple(local(p).shape) for p in model.parameters() if p.dim() == 2}
        for p in model.parameters():  # FSDP's gathered weights: the whole weight, or its tp shard (norms: 1-D)
            if p.dim() == 2:
                shapes |= {tuple(p.shape), (p.shape[0] // row["tp"], p.shape[1]), (p.shape[0], p.shape[1] // row["tp"])}
            elif p.dim() == 1:
                shapes.add(tuple(p.shape))
        shapes |= {sh[::-1] for sh in shapes}
        found: dict[int, tuple[int, str, str]] = {}
        keep: list = []

        def record(t, how: str) -> None:
            t = local(t)
            st = t.untyped_storage()
            if st.data_ptr() in params or st.data_ptr() in found:
                return
            copy = how == "saved" and tuple(t.shape) in shapes and t.dtype != torch.float32
            kind = "weight copy" if copy else how
            found[st.data_ptr()] = (st.nbytes(), where[0], kind)
            keep.append(st)

        hooks = []
        for key, block in model.layers.items():
            hooks.append(block.register_forward_pre_hook(lambda m, a, key=key: where.__setitem__(0, key)))
            hooks.append(block.register_forward_hook(lambda m, a, o: where.__setitem__(0, "outside")))
            if isinstance(block, CheckpointWrapper):
                hooks.append(block.register_forward_pre_hook(
                    lambda m, args: [record(a, "checkpoint input") for a in args if isinstance(a, torch.Tensor)]
                    and None))
        x, y = tr.loader.next_batch()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: (record(t, "saved"), t)[1], lambda t: t), \
                tr.pm.step_context(True):  # as the trainer runs a micro-batch (loss parallel with tp)
            with tr.pm.autocast():
                logits = model(x.to(tr.device))
            loss = F.cross_entropy(logits.flatten(0, 1).float(), y.to(tr.device).flatten())
        for h in hooks:
            h.remove()
        recompute.sac_contexts = real_contexts
        for block, storage in caches:  # what selective checkpointing keeps: the outputs of the ops it saves
            where[0] = block
            for outputs in storage.values():
                for value in outputs.values():
                    for t in torch.utils._pytree.tree_leaves(value):
                        t = getattr(t, "val", t)
                        if isinstance(t, torch.Tensor):
                            record(t, "kept by selective checkpointing")
        del loss, logits
        block0 = [v for v in found.values() if v[1] == "0"]
        act = sum(n for n, _, k in block0 if k != "weight copy")
        copies = sum(n for n, _, k in block0 if k == "weight copy")
        dims = ModelDims.from_config(cfg.model, row["tp"])
        mode = mode_of(cfg.train.precision, cfg.parallel.zero_stage, tr.plan.layout.dp)
        am = ActivationModel(mode, row["tp"], cfg.parallel.sequence_parallel)
        tokens = SEQ * BATCH
        planned = {"full": am.input_bytes(dims, tokens), "none": am.block_bytes(dims, tokens)}.get(
            row["ac"]) or am.partial_block_bytes(dims, tokens, row["ac"])
        planned_copies = am.weight_copy_bytes(dims, 1) if row["ac"] == "none" else 0.0
        sbh = tokens * DIM
        return {"name": row["name"], "activation_bytes": act, "weight_copy_bytes": copies,
                "planner_weight_copy_bytes": planned_copies,
                "per_sbh": act / sbh, "formula_per_sbh": formula(row),
                "planner_per_sbh": (planned - planned_copies) / sbh, "tensors": len(block0),
                "kinds": sorted({k for _, _, k in block0})}


def world_main(run_root: str, out_dir: str | None = None) -> None:
    import torch.distributed as dist
    world = int(os.environ.get("PMI_SIZE") or os.environ.get("WORLD_SIZE") or 1)
    out = [measure(r, run_root) for r in rows_for(world)]
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("PMI_RANK", 0))
    if rank == 0:
        write_results(f"activation_memory-{world}ranks.json", {"world": world, "rows": out}, out_dir)


def driver(args) -> None:
    worlds = run_worlds(__file__, "activation_memory", [1, 2, 4], ["--world", "--run-root", args.run_root])
    rows = [r for w in sorted(worlds) for r in worlds[w]["rows"]]
    print(f"# activation memory of block 0, bytes per element of s*b*h (s={SEQ}, b={BATCH}, h={DIM}, {HEADS} heads,"
          f" ffn {FFN}); formula: benchmarks/README.md; planner: hpctrain.planner.activations")
    print(f"# {'mode':<34} {'measured':>9} {'formula':>8} {'x':>6} {'planner':>8} {'x':>6} {'wcopy MB':>8}")
    for r in rows:
        print(f"  {r['name']:<34} {r['per_sbh']:>9.2f} {r['formula_per_sbh']:>8.2f} "
              f"{r['per_sbh'] / r['formula_per_sbh']:>6.3f} {r['planner_per_sbh']:>8.2f} "
              f"{r['per_sbh'] / r['planner_per_sbh']:>6.3f} {r['weight_copy_bytes'] / 1e6:>8.2f}")
    verdicts = []
    for r in rows:
        if " bf16 sp " in f" {r['name']} " or (" bf16 " in r["name"] and r["name"].endswith(("=selective", "=op"))):
            verdicts.append(rule_verdict(
                "activation_memory", f"{r['name']}: saved bytes per s*b*h / formula", [r["per_sbh"] /
                                                                                    r["formula_per_sbh"]],
                1 + TOL, better="lower",
                note=f"block 0, s={SEQ} b={BATCH} h={DIM}; formula {r['formula_per_sbh']:.2f} (benchmarks/README.md);"
                     f" bytes counted, deterministic"))
    write_results("activation_memory.json", {"verdicts": verdicts, "rows": rows, "tolerance": TOL,
                                             "shape": {"dim": DIM, "heads": HEADS, "kv_heads": KV, "ffn": FFN,
                                                       "seq": SEQ, "batch": BATCH}})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", action="store_true", help="measure this world size's rows (under mpiexec)")
    ap.add_argument("--run-root", default="/tmp/hpctrain-bench-runs")
    ap.add_argument("--out", default=None, help="with --world: write the rows here, not in benchmarks/results")
    args = ap.parse_args()
    world_main(args.run_root, args.out) if args.world else driver(args)


if __name__ == "__main__":
    main()
