"""What a training run says about itself: the model line it logs when built, and the run's summary, which
Trainer.fit returns and the session writes into summary.json (under "train"):

    summary.log_model(trainer)                    # parameters, vocabulary, ZeRO, precision, batch, lr
    out = summary.of_run(trainer, tlog, resumed, preempted, committed)  # {"steps", "losses", "stragglers", ...}

A preempted run's summary also says what it left behind and its requeue.
"""
from __future__ import annotations

import logging
from typing import Any

from hpctrain.job import preempt
from hpctrain.train.metrics import TrainLog

log = logging.getLogger(__name__)


def log_model(trainer) -> None:
    """The line a rank logs once `trainer` (a Trainer) is built."""
    t, dims = trainer, trainer.pm.dims
    log.info("model %.2fM parameters (vocab %d, padded %d), zero %d, precision %s, ac %s, global batch %d "
             "(micro %d x accum %d x dp %d), lr %.3g", dims.num_params() / 1e6, dims.true_vocab_size,
             dims.vocab_size, t.cfg.parallel.zero_stage, t.cfg.train.precision, t.cfg.train.ac, t.global_batch,
             t.micro_batch, t.cfg.train.grad_accum, t.plan.layout.data, t.lr)


def of_run(trainer, tlog: TrainLog, resumed: int | None, preempted: bool, committed: int | None) -> dict[str, Any]:
    """The run's summary once `trainer`'s fit() has closed its log `tlog`: `resumed`, the step it resumed from
    (None for a fresh start); `committed`, the step a preemption's checkpoint committed (None when it committed
    none). Rank 0 of a preempted run requeues the job here (preempt.requeue) and logs what the preemption left."""
    t, losses = trainer, tlog.losses
    out = {"steps": t.step, "first_loss": losses[0] if losses else None, "final": tlog.last,
           "peak_tflops": tlog.peak.tflops, "peak_source": tlog.peak.source, "gemm": tlog.gemm, "tf32": t.tf32,
           "memory": tlog.memory, "tokens_seen": t.tokens_seen, "resumed_from": resumed, "preempted": preempted,
           "losses": losses, "stragglers": t.stragglers.summary()}
    if t.evaluator is not None:
        out["val_losses"] = t.evaluator.done
        out["val_loss"] = t.evaluator.done[-1][1] if t.evaluator.done else None
    if t.pipe is not None:
        out["pipeline"] = t.pipe.summary(t.cfg.train.grad_accum)
        if t.s.rank == 0:
            log.info("pipeline %s", out["pipeline"]["line"])
    if preempted:
        out["preempt_checkpoint"] = committed  # the step this attempt committed on the way out, or None
    if preempted and t.s.rank == 0:
        out["requeue"] = preempt.requeue()
        log.info("preempted at step %d: %s; %s", t.step, preempt_saved(t.step, resumed, committed), out["requeue"])
    return out


def preempt_saved(step: int, resumed: int | None, committed: int | None) -> str:
    """What a preemption at `step` left behind, as the log says it: the checkpoint it committed, or why none."""
    if committed is not None:
        return f"checkpoint of step {committed} committed"
    if step == (resumed or 0):
        return ("no checkpoint written: nothing was trained" if resumed is None else
                f"no checkpoint written: nothing trained since the resume, step {resumed}'s checkpoint stays "
                f"the newest")
    return ("no checkpoint written: every step of this attempt was non-finite (nothing trained)"
            + ("" if resumed is None else f", step {resumed}'s checkpoint stays the newest"))
