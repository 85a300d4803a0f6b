"""A dataset built by `hpctrain data build --tokenizer` (the CLI in this process) trains, with its validation split
(the build itself: tests/pure/data/test_tokenized.py).

    PATH=$PWD/.venv/bin:$PATH .venv/bin/python -m pytest -q tests/multiproc/data/test_tokenized_training.py
"""
from __future__ import annotations

import math

from click.testing import CliRunner

from helpers.training import SMALL
from hpctrain.cli.main import main as cli
from hpctrain.config import load_config
from hpctrain.data.tokenfiles import ArraySource
from hpctrain.job import session
from hpctrain.train.trainer import Trainer


def test_cli_builds_and_the_dataset_trains(bpe, inputs, tmp_path) -> None:
    out = tmp_path / "data" / "corpus.bin"
    res = CliRunner().invoke(cli, ["data", "build", str(out), str(inputs["texts"]), str(inputs["root"] / "more.jsonl"),
                                   "--tokenizer", str(bpe), "--field", "body", "--val-fraction", "0.2",
                                   "--workers", "1"])
    assert res.exit_code == 0, res.output
    assert "documents" in res.output and "validation" in res.output
    bad = CliRunner().invoke(cli, ["data", "build", str(tmp_path / "b.bin"), str(inputs["texts"]), "--val-fraction",
                                   "0.1"])
    assert bad.exit_code == 2 and "--val-fraction need --tokenizer" in bad.output
    vocab = ArraySource(out).record["vocab_size"]
    cfg = load_config(None, SMALL + [f"model.vocab_size={vocab}", "data.source=bin", f"data.path={out}",
                                     "train.steps=3", "train.eval_every=3", "train.eval_batches=2",
                                     f"job.run_root={tmp_path / 'runs'}", f"checkpoint.dir={tmp_path / 'ck'}"])
    with session.start(cfg) as s:
        res = Trainer(cfg, s).fit()
    assert all(math.isfinite(v) for v in res["losses"]) and res["losses"][0] < math.log(vocab) + 0.5
    assert res["val_losses"][0][0] == 3 and math.isfinite(res["val_loss"])
