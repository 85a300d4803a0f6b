"""hpctrain against a plain PyTorch loop of the same model on one GPU, in four modes (issue 30's proof on a GPU):
eager, compiled blocks, compiled + selective recompute, compiled + float8; a Llama-3.1-8B-shaped model (dim 4096,
32 heads, 8 KV heads, ffn 14336, vocab 128256, seq 8192, bf16) with --layers blocks.

    python benchmarks/gpu_perf.py [--layers N] [--rounds 6] [--steps 3] [--modes eager,compiled,...] [--gpu PROFILE]
    python benchmarks/gpu_perf.py --tiny          # the same script on this CPU: a tiny fp32 model, eager and compiled
    bash tests/device/gpu_perf.sh                 # on a lent GPU: this script, its results under $OUT

Both sides are resident at once (each round runs them back to back), so --layers defaults to the most blocks
whose two sides the planner fits within 90% of the GPU's memory (with the embeddings' 1 B parameters, 16 bytes of
states a parameter: 1 block on an 80 GB H100, where 2 come to 72 of the 71 GiB allowed), at most 4 (9 would fit an
H200, but each mode builds and fills both sides, and the device script has about 9 minutes for all four modes).
The plain side starts from ours' weights (the same seeded init, copied). A mode that fails (out of memory, a compile
error) is recorded and the others run; the results file is rewritten after each mode ("complete": false until the
end) and the time limit's SIGTERM ends the run.
The plain loop is what a user writes around hpctrain.model.transformer.Transformer: the same init and data, bf16
autocast, AdamW(fused) with the same groups, F.cross_entropy, clip_grad_norm_, and for each mode torch's own API:
torch.compile of each block, torch.utils.checkpoint with a selective policy that keeps matmul and attention outputs,
torchao's convert_to_float8_training on the blocks' linears. Ours is Trainer.train_step with train.compile,
train.ac = "selective" and train.precision = "fp8".

Rule (benchmarks/README.md, _verdict.py), written before any GPU run: per mode, after --warmup untimed steps of
each side, --rounds rounds; in each round both sides run --steps steps back to back, which goes first alternating;
every round counts; verdicts on the median of paired per-round ratios with the 95% interval where rounds allow:
ours / plain tokens/s >= 0.97 in each mode; ours compiled / ours eager >= 1.10 (round i of compiled against round i
of eager); the planner's tokens/s for the eager config (`hpctrain plan`'s model on --gpu) / ours measured, within
1 +- 0.15 (the planner does not model compilation; its figure for the other modes is reported beside, not judged).
Reported beside: tokens/s, model TFLOP/s, MFU against the datasheet, peak memory of both sides, the largest loss
difference between the sides (a sanity check: the same model, init and data). Writes
benchmarks/results/gpu_perf-<device>.json naming the device, torch and CUDA versions.
"""
from __future__ import annotations

import argparse
import gc
import re
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from _verdict import balanced, verdict

from _launch import write_results
from hpctrain.config import load_config
from hpctrain.data import loader as data
from hpctrain.data.sources import open_source
from hpctrain.job import session
from hpctrain.model.transformer import ModelDims, Transformer, clean_name
from hpctrain.train.trainer import Trainer

LLAMA_8B = ["model.vocab_size=128256", "model.dim=4096", "model.n_heads=32", "model.n_kv_heads=8",
            "model.ffn_dim=14336", "model.max_seq_len=8192", "data.seq_len=8192", "train.micro_batch_size=1",
            "train.precision=bf16"]
TINY = ["model.vocab_size=256", "model.dim=128", "model.n_heads=4", "model.max_seq_len=128", "data.seq_len=128",
        "train.micro_batch_size=4", "train.precision=fp32"]
COMMON = ["data.source=synthetic", "train.lr=3e-4", "train.warmup_steps=0", "train.min_lr_ratio=1.0", "parallel.pp=1",
          "parallel.tp=1", "parallel.dp=-1", "job.name=gpu-perf", "train.prefetch=0", "checkpoint.every_steps=0",
          "checkpoint.at_end=false"]
MODES = {"eager": [], "compiled": ["train.compile=true"],
         "compiled_selective": ["train.compile=true", "train.ac=selective"],
         "compiled_fp8": ["train.compile=true", "train.precision=fp8"]}
TARGETS = {"ours_vs_plain": 0.97, "compiled_vs_eager": 1.10, "planner": 0.15}


def keep_matmuls():
    """The plain loop's selective recompute: keep what matmuls and attention produced, recompute the rest."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
    aten = torch.ops.aten
    kept = {aten.mm.default, aten.addmm.default, aten.bmm.default,
            aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_cudnn_attention.default}

    def policy(ctx, func, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if func in kept else CheckpointPolicy.PREFER_RECOMPUTE
    return lambda: create_selective_checkpoint_contexts(policy)


class Checkpointed(torch.nn.Module):
    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.block, self.context = block, keep_matmuls()

    def forward(self, *args):
        from torch.utils.checkpoint import checkpoint
        return checkpoint(self.block, *args, use_reentrant=False, context_fn=self.context)


class Plain:
    """The loop a user writes around the same model, for one mode (module docstring)."""

    def __init__(self, cfg, device: torch.device, mode: str, weights: dict[str, torch.Tensor]) -> None:
        t = cfg.train
        self.dims, self.device = ModelDims.from_config(cfg.model), device
        with torch.device("meta"):
            model = Transformer(self.dims)
        model.to_empty(device=device)
        with torch.no_grad():  # ours' seeded init (init_value), copied: filling it again took ~10 s per 1.3 B params
            for name, p in model.named_parameters():
                p.copy_(weights[name])
        model.init_buffers(device)
        if mode == "compiled_fp8":
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training
            convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(t.fp8_scaling),
                                       module_filter_fn=lambda module, fqn: fqn.startswith("layers."))
        for name, block in list(model.layers.items()):
            if mode == "compiled_selective":
                block = Checkpointed(block)
            if mode != "eager":
                block = torch.compile(block)
            model.layers[name] = block
        self.model = model
        decay = [p for p in model.parameters() if p.ndim >= 2]
        keep = [p for p in model.parameters() if p.ndim < 2]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                                      {"params": keep, "weight_decay": 0.0}],
                                     lr=t.lr, betas=(t.beta1, t.beta2), eps=1e-8, fused=True)
        self.loader = data.TokenLoader(open_source(cfg.data, self.dims.true_vocab_size), cfg.data.seq_len,
                                       t.micro_batch_size, 0, 1, t.seed)
        self.clip, self.dtype = t.grad_clip, (torch.bfloat16 if t.compute in ("bf16", "fp8") else None)

    def train_step(self) -> torch.Tensor:
        self.opt.zero_grad(set_to_none=True)
        x, y = (b.to(self.device, non_blocking=True) for b in self.loader.next_batch())
        with torch.autocast(self.device.type, dtype=self.dtype or torch.float32, enabled=self.dtype is not None):
            logits = self.model(x)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip, foreach=True)
        self.opt.step()
        return loss.detach()


def timed(step, steps: int, device: torch.device) -> tuple[float, float]:
    """(seconds for `steps` steps, the last loss), the device drained before and after."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step()
    sync()
    return time.perf_counter() - t0, float(loss)


def run_mode(s, base: list[str], mode: str, args) -> dict:
    cfg = load_config(None, base + MODES[mode] + [f"job.run_root={args.run_root}"])
    ours = Trainer(cfg, s)
    plain = Plain(cfg, s.device, mode, {clean_name(n): p.detach() for n, p in ours.model.named_parameters()})
    sides = {"ours": lambda trainer=ours: trainer.train_step(sync=False)["loss"], "plain": plain.train_step}
    losses: dict[str, list[float]] = {"ours": [], "plain": []}
    for _ in range(args.warmup):  # compiles, allocates
        for side, step in sides.items():
            losses[side].append(timed(step, 1, s.device)[1])
    times: dict[str, list[float]] = {"ours": [], "plain": []}
    for r in range(args.rounds):
        for side in balanced(r, ("ours", "plain")):
            seconds, loss = timed(sides[side], args.steps, s.device)
            times[side].append(seconds)
            losses[side].append(loss)
    peak_gib = torch.cuda.max_memory_allocated() / 2**30 if s.device.type == "cuda" else None
    del ours, plain, sides
    step = None  # the warmup's last side (a bound method holding its model)
    gc.collect()
    if s.device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return {"cfg": cfg, "times": times, "losses": losses, "peak_gib_both_sides": peak_gib}


def planner_tokens_per_s(cfg, gpu: str) -> float | None:
    from hpctrain.planner import hardware, report
    if cfg.job.gpus_per_node == 0:
        return None
    return report.evaluate(cfg, hardware.profile(gpu), 5.0)["tokens_per_s"]


def modes_of(args) -> list[str]:
    return args.modes.split(",")


def fitting_layers(base: list[str], modes: list[str], gpu: str, share: float = 0.9, most: int = 4) -> int:
    """The most blocks (up to `most`: each mode builds and fills both sides, and the device script has ~9 minutes for
    four modes) whose two resident sides the planner puts within `share` of this GPU's memory, in
    the hungriest of the modes (its memory model is held within 1% of what ranks allocate): one side's whole
    prediction and the other's states (one side computes at a time; its activations are gone between steps)."""
    from hpctrain.planner import hardware, report
    total = torch.cuda.get_device_properties(0).total_memory / 2**30
    best = 1
    for layers in range(1, most + 1):
        need = 0.0
        for m in modes:
            if m in MODES:
                got = report.evaluate(load_config(None, base + MODES[m] + [f"model.n_layers={layers}"]),
                                      hardware.profile(gpu, {"memory_gib": total}), 5.0)
                need = max(need, 2 * got["memory_gib_per_gpu"] - got["activations_gib"])
        if need > share * total:
            break
        best = layers
    return best


def profile_of(name: str, total_bytes: int) -> str:
    """The planner's profile for a device name (the product's own matching: hpctrain.train.metrics), h100-sxm when
    none matches (said in the results' header line)."""
    from hpctrain.train.metrics import datasheet_part
    part = datasheet_part(name)
    if "H100" in name and "PCIe" in name:
        return "h100-pcie"
    return {"NVIDIA H100 SXM": "h100-sxm", "NVIDIA H200": "h200", "NVIDIA B200": "b200",
            "NVIDIA A100 SXM": "a100-80g" if total_bytes > 60 * 2**30 else "a100-40g"}.get(part or "", "h100-sxm")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=0, help="blocks (default: as many as fit twice, by the planner)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--modes", default="eager,compiled,compiled_selective,compiled_fp8")
    ap.add_argument("--gpu", default="", help="the planner's profile for MFU and predictions (default: the one "
                    "this device's name matches, else h100-sxm)")
    ap.add_argument("--tiny", action="store_true", help="a tiny fp32 model on this machine's CPU (eager, compiled)")
    ap.add_argument("--run-root", default="/tmp/hpctrain-gpu-perf-runs")
    ap.add_argument("--results", default=None, help="where the JSON goes (default benchmarks/results/)")
    args = ap.parse_args()
    if not args.tiny and not torch.cuda.is_available():
        print(f"gpu_perf: this torch ({torch.__version__}) sees no CUDA device; --tiny runs the script on a CPU",
              file=sys.stderr)
        return 2
    cuda = not args.tiny
    args.gpu = args.gpu or (profile_of(torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory)
                            if cuda else "h100-sxm")
    gpu = ["job.gpus_per_node=1", f"job.gpu={args.gpu}", "parallel.backend=nccl"] if cuda else []
    if args.layers <= 0:
        args.layers = fitting_layers(LLAMA_8B + COMMON + gpu, modes_of(args), args.gpu) if cuda else 2
    base = (LLAMA_8B if cuda else TINY) + COMMON + [f"model.n_layers={args.layers}"] + gpu
    modes = [m for m in modes_of(args) if cuda or m in ("eager", "compiled")]
    device_name = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"# {device_name}, torch {torch.__version__}, CUDA {torch.version.cuda}; modes {', '.join(modes)}; "
          f"{args.layers} layers, {args.rounds} rounds of {args.steps} steps per side; planner profile {args.gpu}",
          flush=True)
    got, verdicts, rows, errors = {}, [], {}, {}
    slug = re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")
    head = {"device": device_name, "torch": torch.__version__, "cuda": torch.version.cuda, "layers": args.layers,
            "profile": args.gpu, "modes": modes, "rounds": args.rounds, "steps_per_round": args.steps}
    with session.start(load_config(None, base + [f"job.run_root={args.run_root}"])) as s:
        s.preempt.end_on_signal(True)  # the device script's time limit (SIGTERM) ends the run, not a flag
        for mode in modes:
            t0 = time.perf_counter()
            try:
                got[mode] = run_mode(s, base, mode, args)
            except Exception as e:  # noqa: BLE001 - an OOM or a compile error: said, and the other modes run
                errors[mode] = f"{type(e).__name__}: {e}"[:2000]
                print(f"# {mode} FAILED: {errors[mode]}", flush=True)
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
            print(f"# {mode}: {time.perf_counter() - t0:.0f} s", flush=True)
            # what is measured so far, in case the run is cut short: no verdicts until every mode ran
            write_results(f"gpu_perf-{slug}.json", head | {
                "complete": False, "errors": errors, "times_s": {m: g["times"] for m, g in got.items()},
                "losses": {m: g["losses"] for m, g in got.items()}, "when": time.strftime("%Y-%m-%dT%H:%M:%S")},
                args.results)
    if not got:
        return 1
    modes = [m for m in modes if m in got]
    cfg0 = got[modes[0]]["cfg"]
    dims = ModelDims.from_config(cfg0.model)
    tokens = args.steps * cfg0.train.micro_batch_size * cfg0.data.seq_len
    fpt = dims.flops_per_token(cfg0.data.seq_len)
    from hpctrain.planner import hardware
    for mode in modes:
        g = got[mode]
        hw = hardware.profile(args.gpu)  # fp8: the blocks' linears at its fp8 peak, the rest at bf16's
        peak = (None if not cuda else hw.float8_peak(dims.float8_flops_per_token() / fpt) if mode == "compiled_fp8"
                else hw.peak("bf16"))
        for side in ("ours", "plain"):
            med = statistics.median(g["times"][side])
            rows[f"{mode}/{side}"] = {"tokens_per_s": tokens / med, "model_tflops": tokens / med * fpt / 1e12,
                                      "mfu": tokens / med * fpt / 1e12 / peak if peak else None}
        ratios = [p / o for p, o in zip(g["times"]["plain"], g["times"]["ours"])]
        verdicts.append(verdict("gpu_perf", f"{mode}: tokens/s ours / plain loop", ratios,
                                TARGETS["ours_vs_plain"], note=device_name))
        predicted = planner_tokens_per_s(g["cfg"], args.gpu)
        if predicted is not None and mode == "eager":
            measured = [tokens / t for t in g["times"]["ours"]]
            verdicts.append(verdict("gpu_perf", f"{mode}: planner tokens/s / ours measured",
                                    [predicted / m for m in measured], TARGETS["planner"], better="within",
                                    center=1.0, note=f"hpctrain plan on {args.gpu}"))
        rows[f"{mode}/ours"]["planner_tokens_per_s"] = predicted
        rows[f"{mode}/ours"]["peak_gib_both_sides"] = g["peak_gib_both_sides"]
        drift = max(abs(a - b) for a, b in zip(g["losses"]["ours"], g["losses"]["plain"]))
        rows[f"{mode}/ours"]["max_loss_diff_vs_plain"] = drift
    if "eager" in got and "compiled" in got:
        speedup = [e / c for e, c in zip(got["eager"]["times"]["ours"], got["compiled"]["times"]["ours"])]
        verdicts.append(verdict("gpu_perf", "ours compiled / ours eager tokens/s", speedup,
                                TARGETS["compiled_vs_eager"], note=device_name))
    for name, row in rows.items():
        mfu = f", MFU {row['mfu']:.1%}" if row.get("mfu") else ""
        print(f"  {name:<28} {row['tokens_per_s']:>10,.0f} tokens/s, {row['model_tflops']:.1f} model TFLOP/s{mfu}")
    write_results(f"gpu_perf-{slug}.json", head | {
        "complete": not errors, "errors": errors, "tokens_per_round_side": tokens,
        "flops_per_token": fpt, "params": dims.num_params(), "rows": rows, "verdicts": verdicts,
        "times_s": {m: g["times"] for m, g in got.items()}, "losses": {m: g["losses"] for m, g in got.items()},
        "when": time.strftime("%Y-%m-%dT%H:%M:%S")}, args.results)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
