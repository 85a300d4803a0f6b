"""`hpctrain ckpt export --format hf`, one process: a tiny GQA Llama (untied, vocabulary 200 padded to 256) trained
two steps by the product's own Trainer, its checkpoint exported and loaded by transformers: logits equal
hpctrain's within 1e-4 in fp32; sharded with an index under a small --max-shard-gb; bf16 weights are the fp32
ones rounded; a run configured tied is exported as what it saved; tokenizer files travel when present; bad
output paths, dtypes, damaged or mismatched checkpoints are refused and leave nothing behind. The tp2 x dp2
ZeRO-3 export is tests/multiproc/checkpoint/test_checkpoint_train.py's.

    PATH=$PWD/.venv/bin:$PATH .venv/bin/python -m pytest -q tests/multiproc/hf/test_hf_export.py
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from hfcheck import LOGIT_TOL, logit_diff

from helpers.refusals import refused
from helpers.training import SMALL, full_weights
from hpctrain.checkpoint.hdf5_storage import CheckpointCorrupt
from hpctrain.cli.main import main as cli
from hpctrain.config import load_config
from hpctrain.hf import export as hf
from hpctrain.job import session
from hpctrain.train.trainer import Trainer

# lr 0.05: weights far enough from the init that attention is not uniform, so a wrong rotary layout shows
GQA = ["model.n_heads=4", "model.n_kv_heads=2", "model.n_layers=2", "model.vocab_size=200", "train.steps=2",
       "train.lr=0.05"]
SEQ = 24


def _train(root: Path, *sets: str) -> tuple[Path, dict[str, torch.Tensor]]:
    """(the checkpoint saved at the end, the live model's final weights without the "model." prefix)."""
    cfg = load_config(None, SMALL + GQA + [f"job.run_root={root / 'runs'}", f"checkpoint.dir={root / 'ck'}", *sets])
    with session.start(cfg) as s:
        trainer = Trainer(cfg, s)
        trainer.fit()
        weights = full_weights(trainer.model)
    return root / "ck" / "step_00000002", weights


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    return _train(tmp_path_factory.mktemp("hf"))


def _export(*args) -> str:
    res = CliRunner().invoke(cli, ["ckpt", "export", *map(str, args)])
    assert res.exit_code == 0, res.output
    return res.output


def test_logits_match_transformers(run, tmp_path) -> None:
    ckpt, weights = run
    out = tmp_path / "hf"
    said = _export(ckpt, "--format", "hf", "--out", out)
    assert "vocab 200 (padding rows to 256 dropped)" in said and "no tokenizer recorded" in said
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["vocab_size"] == 200
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["hidden_size"]) == (4, 2, 32)
    assert config["tie_word_embeddings"] is False and config["rope_theta"] == 10000.0
    diff = logit_diff(out, ckpt, weights, SEQ)
    print(f"1 rank: max |logit diff| {diff:.2e}")
    assert diff <= LOGIT_TOL


def test_sharded_bf16(run, tmp_path) -> None:
    from safetensors.torch import load_file

    ckpt, weights = run
    out = tmp_path / "hf"
    said = _export(ckpt, "--format", "hf", "--out", out, "--dtype", "bf16", "--max-shard-gb", "0.00001")
    index = json.loads((out / hf.INDEX_NAME).read_text())
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors" and f"{len(files)} " in said
    assert sorted(set(index["weight_map"].values())) == files
    got: dict[str, torch.Tensor] = {}
    for name in files:
        part = load_file(out / name)
        assert all(index["weight_map"][k] == name for k in part)
        got |= part
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in got.values())
    assert len(got) == len(weights) and json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    for name, value in weights.items():
        want = value[:200] if name in hf.VOCAB_ROWS else value
        assert torch.equal(got[hf.hf_name(name)], want.to(torch.bfloat16)), name


def test_tied_run_exports_what_it_saved(tmp_path) -> None:
    ckpt, weights = _train(tmp_path, "model.tie_embeddings=true")
    out = tmp_path / "hf"
    said = _export(ckpt, "--format", "hf", "--out", out)
    # one matrix since parallel/materialize.py re-ties after to_empty; a checkpoint of a run from before that fix
    # holds two, and is written untied (hf.py)
    assert torch.equal(weights["output.weight"], weights["tok_embeddings.weight"])
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    assert "written untied" not in said
    assert logit_diff(out, ckpt, weights, SEQ) <= LOGIT_TOL


def test_tokenizer_files_travel(run, tmp_path) -> None:
    ckpt = tmp_path / "step_00000002"
    shutil.copytree(run[0], ckpt)
    (ckpt / "tokenizer.json").write_text('{"model": {"type": "BPE"}}')
    done = hf.export_hf(ckpt, tmp_path / "hf")
    assert done["tokenizer"] == ["tokenizer.json"]
    assert (tmp_path / "hf" / "tokenizer.json").read_text() == '{"model": {"type": "BPE"}}'


def test_refusals_leave_nothing(run, tmp_path) -> None:
    ckpt, _ = run
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("")
    refused(hf.export_hf, ckpt, full, fragments=[str(full), "not an empty directory"])
    (tmp_path / "file").write_text("")
    refused(hf.export_hf, ckpt, tmp_path / "file", fragments=["file", "not an empty directory"])
    refused(hf.export_hf, ckpt, tmp_path / "a", dtype="fp8", fragments=["'fp8'", "fp32, bf16, fp16"])
    refused(hf.export_hf, ckpt, tmp_path / "a", max_shard_bytes=0, fragments=["0 bytes"])
    res = CliRunner().invoke(cli, ["ckpt", "export", str(ckpt), "--to", "safetensors", "--dtype", "bf16"])
    assert res.exit_code == 2 and "--dtype bf16 applies to --format hf only" in res.output

    # a recorded config that does not match the tensors, and a checkpoint that was never committed
    bad = tmp_path / "ck" / "step_00000002"
    shutil.copytree(ckpt, bad)
    marker = json.loads((bad / "COMMITTED").read_text())
    marker["config"]["model"]["ffn_dim"] = 64
    (bad / "COMMITTED").write_text(json.dumps(marker))
    refused(hf.export_hf, bad, tmp_path / "a", fragments=["feed_forward.w1.weight has shape [128, 32]", "[64, 32]"])
    marker["config"]["model"]["mlp"] = "gelu"  # GPT's MLP: no Llama form
    (bad / "COMMITTED").write_text(json.dumps(marker))
    refused(hf.export_hf, bad, tmp_path / "a", fragments=["model.mlp = 'gelu'", "SwiGLU"])
    (bad / "COMMITTED").unlink()
    with pytest.raises(CheckpointCorrupt, match="COMMITTED"):
        hf.export_hf(bad, tmp_path / "a")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "file", "full"]  # no output, no temporary
