"""The whole Hugging Face story in one process, as docs/hf.md tells it: a tokenizer (BPE, trained here on the
project's own text) and a random transformers Llama of its vocabulary in an HF directory; `hpctrain data build
--tokenizer` makes the training data and its validation split; a run with train.init_from = "hf:DIR" fine-tunes
with validation loss, records the tokenizer in its checkpoints (which still verify), and `hpctrain ckpt export
--format hf` hands back a directory whose model transformers loads with the trained logits and whose tokenizer
is the one the data was made with. Data made with another tokenizer is refused at submission. A run resumed from
its own checkpoint does not read init_from again.

    PATH=$PWD/.venv/bin:$PATH .venv/bin/python -m pytest -q tests/multiproc/hf/test_hf_finetune.py
"""
from __future__ import annotations

import math
import shutil

import torch
from click.testing import CliRunner
from hfcheck import LOGIT_TOL, logit_diff, make_hf_llama, ours_as_hf, project_paragraphs, train_bpe

from helpers.refusals import refused
from helpers.training import full_weights
from hpctrain.cli.main import main as cli
from hpctrain.config import load_config
from hpctrain.data import tokenize as tokenized
from hpctrain.job import launch, session
from hpctrain.train import resume
from hpctrain.train.trainer import Trainer


def test_fine_tune_an_hf_model_on_own_data_and_export(tmp_path) -> None:
    docs = project_paragraphs(60)
    tok = train_bpe(tmp_path / "tok" / "tokenizer.json", docs, vocab=400)
    from tokenizers import Tokenizer
    vocab = Tokenizer.from_file(str(tok)).get_vocab_size()
    hf = tmp_path / "hf"
    make_hf_llama(hf, vocab=vocab, layers=2, seed=5)
    shutil.copyfile(tok, hf / "tokenizer.json")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, d in enumerate(docs):
        (corpus / f"{i:02d}.txt").write_text(d)
    data = tmp_path / "data" / "train.bin"
    built = tokenized.build_tokenized([corpus], data, tok, val_fraction=0.2, workers=1)
    assert built["val_documents"] > 0

    sets = ["model.max_seq_len=64", "data.source=bin", f"data.path={data}", "data.seq_len=16",
            "train.micro_batch_size=2", "train.steps=4", "train.eval_every=2", "train.eval_batches=2",
            "train.lr=1e-3", "train.warmup_steps=1", "train.peak_tflops=1", f"train.init_from=hf:{hf}",
            f"job.run_root={tmp_path / 'runs'}", f"checkpoint.dir={tmp_path / 'ck'}"]
    cfg = load_config(None, sets)
    assert cfg.model.vocab_size == vocab  # from the HF directory's config.json
    launch.check_layout(cfg)  # what submission checks: the data's tokenizer is the model's
    with session.start(cfg) as s:
        trainer = Trainer(cfg, s)
        res = trainer.fit()
        weights = full_weights(trainer.model)
    assert [st for st, _ in res["val_losses"]] == [2, 4] and all(math.isfinite(v) for _, v in res["val_losses"])
    assert res["losses"][0] < math.log(vocab) + 2.0  # started from the HF weights, not from nothing

    step = tmp_path / "ck" / "step_00000004"
    assert (step / "tokenizer.json").read_bytes() == tok.read_bytes()
    verified = CliRunner().invoke(cli, ["ckpt", "verify", str(step)])
    assert verified.exit_code == 0, verified.output
    out = tmp_path / "export"
    said = CliRunner().invoke(cli, ["ckpt", "export", str(step), "--format", "hf", "--out", str(out)])
    assert said.exit_code == 0 and "tokenizer.json" in said.output, said.output
    assert (out / "tokenizer.json").read_bytes() == tok.read_bytes()
    assert logit_diff(out, step, weights, 24) < LOGIT_TOL
    from transformers import PreTrainedTokenizerFast
    back = PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"))
    assert back.decode(back.encode(docs[0])) == docs[0]

    other = train_bpe(tmp_path / "other" / "tokenizer.json", docs, vocab=350)
    tokenized.build_tokenized([corpus], tmp_path / "data2" / "train.bin", other, workers=1)
    cfg2 = load_config(None, sets + [f"data.path={tmp_path / 'data2' / 'train.bin'}", "train.eval_every=0"])
    refused(launch.check_layout, cfg2, fragments=["train.init_from's tokenizer.json"])


def test_resume_does_not_read_init_from(tmp_path) -> None:
    hf = tmp_path / "hf"
    theirs = make_hf_llama(hf)
    cfg = load_config(None, ["model.max_seq_len=64", "data.source=synthetic", "data.seq_len=16", "train.steps=2",
                             "train.lr=1e-3", "train.warmup_steps=1", "train.log_every=100", "train.peak_tflops=1",
                             "train.micro_batch_size=2", f"train.init_from=hf:{hf}",
                             f"job.run_root={tmp_path / 'runs'}", f"checkpoint.dir={tmp_path / 'ck'}"])
    with session.start(cfg) as s:
        Trainer(cfg, s).fit()  # 2 steps from the HF weights, saved at the end
    with session.start(cfg) as s:
        trainer = Trainer(cfg, s)
        with resume.checkpointer(trainer) as ckpt:
            assert resume.start(trainer, ckpt) == 2
        after = ours_as_hf(full_weights(trainer.pm.model), 100)
    assert not torch.equal(after["model.layers.0.self_attn.q_proj.weight"],
                           theirs["model.layers.0.self_attn.q_proj.weight"])
