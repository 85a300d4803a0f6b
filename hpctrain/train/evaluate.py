"""Validation loss (train.eval_every, train.eval_batches): the same batches of the validation split at every
evaluation, forward only, on every rank of any layout.

    ev = Evaluator(cfg, vocab_size, mesh, micro_batch, device)    # mesh: hpctrain.parallel.mesh.Mesh (its dp axis)
    if ev.due(step, total_steps):
        row = ev.run(step, batch_loss, chunk)   # {"step", "val_loss", "val_tokens", "eval_s"}

`batch_loss(batches)` is the trainer's (forward_loss over its model or pipeline): the sum of the per-micro-batch
mean cross-entropies of `chunk` micro-batches (one pipeline schedule's worth under pp, where it runs the schedule's
forward-only eval; else one at a time), the same loss definition training reports, as a device scalar on every
rank. Every micro-batch holds the same number of tokens, so the mean over micro-batches and dp ranks is the mean
over every validation token. Training's data position is untouched: evaluation has its own loader.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hpctrain.config import Config
from hpctrain.data import loader as data
from hpctrain.parallel import context


class Evaluator:
    def __init__(self, cfg: Config, vocab_size: int, mesh, micro_batch: int, device: torch.device) -> None:
        lay = mesh.layout  # the dp group's ranks each add their mean (cp ranks: over their share of the tokens)
        self.every, self.device, self.dp_group, self.dp_size = cfg.train.eval_every, device, mesh.group("dp"), lay.dp
        source = data.open_val_source(cfg.data, vocab_size, seed=cfg.train.seed)
        self.loader = data.EvalLoader(source, cfg.data.seq_len, micro_batch, mesh.data_rank, lay.data,
                                      cfg.train.eval_batches)
        if lay.cp > 1:
            self.loader = context.ShardedLoader(self.loader, context.positions(cfg.data.seq_len, lay.cp,
                                                                               mesh.cp_rank))
        self.tokens = self.loader.num_batches * self.loader.global_batch * cfg.data.seq_len
        self.done: list[tuple[int, float]] = []  # (step, val_loss) of every evaluation of this run

    def due(self, step: int, total_steps: int) -> bool:
        """Every eval_every steps and after the last step."""
        return step % self.every == 0 or step == total_steps

    def run(self, step: int, batch_loss: Callable[[list], torch.Tensor], chunk: int = 1) -> dict[str, Any]:
        # the step's kernels still queued are training time: TrainLog takes eval_s out of the step's throughput
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        batches = list(self.loader.batches())
        batches = batches[:len(batches) - len(batches) % chunk]  # a pipeline schedule takes whole groups
        if not batches:
            raise ValueError(f"the validation split gives {self.loader.num_batches} global micro-batches, fewer than "
                             f"the {chunk} one pipelined evaluation takes (train.grad_accum): set train.eval_batches "
                             f"to a multiple of it, or give more validation data")
        total = torch.zeros((), device=self.device, dtype=torch.float64)
        with torch.no_grad():
            for i in range(0, len(batches), chunk):
                total += batch_loss(batches[i:i + chunk]).double()
        dist.all_reduce(total, group=self.dp_group)
        loss = total.item() / (len(batches) * self.dp_size)
        self.done.append((step, loss))
        return {"step": step, "val_loss": loss, "val_tokens": self.tokens * len(batches) // self.loader.num_batches,
                "eval_s": time.perf_counter() - t0}


def forward_loss(pm, pipe, scale: float, device: torch.device, batches: list) -> torch.Tensor:
    """The sum of the mean losses of `batches` (forward only), as training computes its loss: through the pipeline
    schedule's forward-only eval when `pipe` is given, else through `pm` (a compose.ParallelModel) one micro-batch at
    a time. `scale`: the loss scale the pipeline's schedule divides out."""
    if pipe is not None:
        return pipe.eval_loss(batches, pm.step_context(True, autocast=True), scale)
    total = torch.zeros((), device=device)
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        with pm.step_context(True, autocast=True):
            loss = F.cross_entropy(pm.model(x).flatten(0, 1).float(), y.flatten())
        total += (loss.full_tensor() if hasattr(loss, "full_tensor") else loss).detach()
    return total
