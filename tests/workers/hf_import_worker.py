"""One rank of tests/multiproc/hf/test_hf_import_layouts.py: for each case (a layout), starts a Trainer
whose train.init_from names the test's HF directory, lets Trainer.start import it, and records the whole weights
(gathered over every shard and stage) and whether every rank's output projection is its embedding (tied);
with "save", also saves the imported weights as a checkpoint (step 0),
which the test exports back to Hugging Face."""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers
from helpers.launch import each_case  # noqa: E402
from helpers.training import full_weights  # noqa: E402
from hpctrain.config import load_config  # noqa: E402
from hpctrain.job import session
from hpctrain.model.transformer import clean_name  # noqa: E402
from hpctrain.train import resume  # noqa: E402
from hpctrain.train.trainer import Trainer  # noqa: E402


def main(out: str, cases_json: str, base_port: int) -> None:
    def case(c: dict) -> None:
        cfg = load_config(None, c["overrides"] + [f"job.run_root={out}/{c['name']}-runs",
                                                  f"checkpoint.dir={out}/{c['name']}-ck"])
        with session.start(cfg) as s:
            trainer = Trainer(cfg, s)
            with resume.checkpointer(trainer) as ckpt:
                resumed = resume.start(trainer, ckpt)
                if c.get("save"):
                    ckpt.maybe_save(0, force=True)
            weights = full_weights(trainer.pm.model)
            params = {clean_name(n): q for n, q in trainer.pm.model.named_parameters(remove_duplicate=False)}
            tied = params.get("output.weight") is params.get("tok_embeddings.weight") is not None
            every: list = [None] * dist.get_world_size()
            dist.all_gather_object(every, tied)
            if s.rank == 0:
                torch.save({"weights": weights, "resumed": resumed, "dims": trainer.pm.dims.__dict__,
                            "tied": all(every)}, Path(out) / f"{c['name']}.pt")
    each_case(out, cases_json, base_port, case)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
