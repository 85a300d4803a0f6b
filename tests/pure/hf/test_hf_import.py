"""train.init_from = "hf:DIR", one process: [model] filled in from config.json and refused where it disagrees;
a random transformers LlamaForCausalLM (GQA, untied, vocabulary 100 padded to 128, rope theta 5000) imported
through the product's Trainer holds exactly the HF weights (padding rows zero) and gives transformers' logits
within 1e-4 in fp32, from one file or a sharded directory with an index;
damaged directories are refused naming the tensor or file. The tp, pp and ZeRO-3 imports are
tests/multiproc/hf/test_hf_import_layouts.py's; that a resumed run does not read init_from (it trains)
tests/multiproc/hf/test_hf_finetune.py's.

    PATH=$PWD/.venv/bin:$PATH .venv/bin/python -m pytest -q tests/pure/hf/test_hf_import.py
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from faults import record
from hfcheck import LOGIT_TOL, hf_logits, hpctrain_logits, make_hf_llama, ours_as_hf, tokens

from helpers.refusals import refused
from helpers.training import full_weights
from hpctrain.config import hf as hfconfig
from hpctrain.config import load_config
from hpctrain.hf import load as hf_import
from hpctrain.job import session
from hpctrain.model.dims import ModelDims
from hpctrain.model.transformer import Transformer
from hpctrain.train import resume
from hpctrain.train.trainer import Trainer

# the run's own keys: no model sizes (they come from the directory), tiny batches
RUN = ["model.max_seq_len=64", "data.source=synthetic", "data.seq_len=16", "train.steps=2", "train.lr=1e-3",
       "train.warmup_steps=1", "train.log_every=100", "train.peak_tflops=1", "train.micro_batch_size=2"]


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("hfin")
    single = make_hf_llama(root / "single")
    sharded = make_hf_llama(root / "sharded", seed=1, max_shard_size="40KB")
    assert (root / "sharded" / hf_import.INDEX_NAME).is_file()
    assert len(list((root / "sharded").glob("*.safetensors"))) > 2
    return {"root": root, "single": (root / "single", single), "sharded": (root / "sharded", sharded)}


def _cfg(root: Path, hf: Path, *sets: str):
    return load_config(None, RUN + [f"train.init_from=hf:{hf}", f"job.run_root={root / 'runs'}",
                                    f"checkpoint.dir={root / 'ck'}", *sets])


def _imported(root: Path, hf: Path, *sets: str) -> tuple[dict[str, torch.Tensor], ModelDims]:
    cfg = _cfg(root, hf, *sets)
    with session.start(cfg) as s:
        trainer = Trainer(cfg, s)
        with resume.checkpointer(trainer) as ckpt:
            assert resume.start(trainer, ckpt) is None
        return full_weights(trainer.pm.model), trainer.pm.dims


# --- [model] from config.json -------------------------------------------------------------------------------

def test_model_section_comes_from_config_json(hf_dirs, tmp_path) -> None:
    hf, _ = hf_dirs["single"]
    m = _cfg(tmp_path, hf).model
    assert (m.vocab_size, m.dim, m.n_layers, m.n_heads, m.n_kv_heads, m.ffn_dim, m.tie_embeddings) == (
        100, 64, 2, 4, 2, 96, False)
    assert m.rope_theta == 5000.0 and m.norm_eps == 1e-6 and m.max_seq_len == 64  # max_seq_len stays the run's
    assert _cfg(tmp_path, hf, "model.dim=64", "model.n_kv_heads=2").model.dim == 64  # agreeing keys are fine
    refused(_cfg, tmp_path, hf, "model.n_layers=3", fragments=["model.n_layers = 3", "gives 2", "leave model.n_layers"])
    refused(_cfg, tmp_path, hf, "model.rope_theta=10000.0", fragments=["model.rope_theta = 10000.0", "5000.0"])
    refused(_cfg, tmp_path, tmp_path / "nowhere", fragments=["no such directory"])


def test_unsupported_configs_are_refused(hf_dirs, tmp_path) -> None:
    hf, _ = hf_dirs["single"]
    raw = json.loads((hf / "config.json").read_text())
    for change, fragment in (({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling"),
                             ({"attention_bias": True}, "attention_bias"), ({"hidden_act": "gelu"}, "hidden_act"),
                             ({"model_type": "mistral", "architectures": ["MistralForCausalLM"]}, "only Llama"),
                             ({"hidden_size": "64"}, "hidden_size = '64'")):
        d = tmp_path / fragment.split()[0].strip("'=")
        d.mkdir()
        (d / "config.json").write_text(json.dumps(raw | change))
        refused(hfconfig.model_table, f"hf:{d}", {}, fragments=[fragment])
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    refused(hfconfig.model_table, f"hf:{tmp_path / 'bad'}", {}, fragments=["is not JSON"])
    (tmp_path / "empty").mkdir()
    refused(hfconfig.model_table, f"hf:{tmp_path / 'empty'}", {}, fragments=["config.json", "missing"])
    refused(load_config, None, ["train.init_from=/models/x"], fragments=["'hf:PATH'"])


# --- the weights --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("which", ["single", "sharded"])
def test_imported_weights_and_logits_equal_transformers(hf_dirs, tmp_path, which) -> None:
    hf, theirs = hf_dirs[which]
    weights, dims = _imported(tmp_path, hf)
    assert dims.vocab_size == 128 and dims.true_vocab_size == 100
    for name in hf_import.VOCAB_ROWS:  # padding rows: zeros
        assert torch.count_nonzero(weights[name][100:]) == 0
    mine = ours_as_hf(weights, 100)
    assert mine.keys() == theirs.keys()
    for k, v in theirs.items():
        assert torch.equal(mine[k], v), k
    ids = tokens(100, 24)
    ours = hpctrain_logits(weights, dims, ids)
    assert ours.abs().max() > 0.1
    assert (ours - hf_logits(hf, ids)).abs().max().item() < LOGIT_TOL


def test_tied_directory(tmp_path) -> None:
    theirs = make_hf_llama(tmp_path / "tied", tied=True, seed=2)
    assert "lm_head.weight" not in {k for k in theirs if k != "lm_head.weight"} | set()  # saved once by HF
    weights, dims = _imported(tmp_path, tmp_path / "tied")
    assert dims.tie_embeddings and torch.equal(weights["tok_embeddings.weight"][:100],
                                               theirs["model.embed_tokens.weight"])
    ids = tokens(100, 16)
    assert (hpctrain_logits(weights, dims, ids) - hf_logits(tmp_path / "tied", ids)).abs().max() < LOGIT_TOL


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_damaged_directories_are_refused(hf_dirs, tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    hf, theirs = hf_dirs["single"]
    dims = ModelDims.from_config(_cfg(tmp_path, hf).model)
    model = Transformer(dims)

    def load(d: Path) -> None:
        hf_import.load_hf(model, dims, d)

    d = _copy(hf, tmp_path / "missing")
    tensors = load_file(d / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if "layers.1.mlp.up_proj" not in k}, d / "model.safetensors")
    refused(load, d, fragments=["missing", "model.layers.1.mlp.up_proj.weight"])
    d = _copy(hf, tmp_path / "unknown")
    save_file(tensors | {"model.layers.2.mlp.up_proj.weight": torch.zeros(2)}, d / "model.safetensors")
    refused(load, d, fragments=["unknown", "model.layers.2.mlp.up_proj.weight"])
    d = _copy(hf, tmp_path / "shape")
    save_file(tensors | {"model.norm.weight": torch.zeros(65)}, d / "model.safetensors")
    refused(load, d, fragments=["model.norm.weight has shape [65]", "[64]"])
    d = _copy(hf_dirs["sharded"][0], tmp_path / "escape")
    index = json.loads((d / hf_import.INDEX_NAME).read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = "../single/model.safetensors"
    (d / hf_import.INDEX_NAME).write_text(json.dumps(index))
    refused(load, d, fragments=["'../single/model.safetensors'", "plain"])
    d = _copy(hf, tmp_path / "link")
    (d / "model.safetensors").unlink()
    (d / "model.safetensors").symlink_to(hf / "model.safetensors")
    refused(load, d, fragments=["not a regular file"])


@pytest.mark.faults
def test_non_finite_weights_are_refused_before_training(hf_dirs, tmp_path) -> None:
    """A nan (or an inf) in one tensor made every step's loss nan, each step skipped, and the run ended with exit
    status 0 and a committed checkpoint. Refused now as the tensor is read, naming the file, the tensor and the
    count, before any step and with no checkpoint; a sharded directory names the shard that holds it."""
    from safetensors.torch import load_file, save_file

    hf, _ = hf_dirs["single"]
    for bad, key, count in ((float("nan"), "model.embed_tokens.weight", 2),
                            (float("inf"), "model.layers.1.mlp.down_proj.weight", 1)):
        d = _copy(hf, tmp_path / f"bad-{bad}")
        tensors = load_file(d / "model.safetensors")
        tensors[key].view(-1)[:count] = bad
        save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
        cfg = _cfg(tmp_path / str(bad), d)
        with session.start(cfg) as s:
            trainer = Trainer(cfg, s)
            refused(trainer.fit, fragments=[f"train.init_from = 'hf:{d}'", str(d / "model.safetensors"), key,
                                            f"{count} nan or inf values"])
            assert trainer.step == 0
        assert not (tmp_path / str(bad) / "ck").exists() or not any((tmp_path / str(bad) / "ck").iterdir())
    d = _copy(hf_dirs["sharded"][0], tmp_path / "sharded")
    index = json.loads((d / hf_import.INDEX_NAME).read_text())["weight_map"]
    key = "model.layers.0.self_attn.k_proj.weight"
    shard = d / index[key]
    tensors = load_file(shard)
    tensors[key][3, 5] = float("-inf")
    save_file(tensors, shard, metadata={"format": "pt"})
    dims = ModelDims.from_config(_cfg(tmp_path, d).model)
    refused(hf_import.load_hf, Transformer(dims), dims, d, fragments=[str(shard), key, "1 nan or inf values"])
    record("HF weights with a NaN (or an inf) in one tensor", "ValueError naming the file, the tensor and the "
           "count before the first step; no checkpoint", tier="pure")
