"""What hpctrain reads from a Hugging Face directory before any weight reaches the model, one process, no
transformers (the directories are written by hand here): config.json -> the [model] section (hfconfig.model_table,
and load_config with train.init_from = "hf:DIR"), filled, agreeing or refused; the safetensors index and files
refused when they name paths outside the directory, links, or tensors where they are not; shapes, dtypes, tied
and untied heads, padding rows; and which tokenizer files a run records in its checkpoints. The imports through
transformers' own saves, and their logits, are tests/pure/hf/test_hf_import.py's and
tests/multiproc/hf/test_hf_import_layouts.py's.

    PATH=$PWD/.venv/bin:$PATH .venv/bin/python -m pytest -q tests/pure/config/test_hfconfig.py
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from faults import record

from helpers.refusals import refused
from hpctrain.config import ModelConfig, load_config
from hpctrain.config import hf as hfconfig
from hpctrain.hf import load as hf_import
from hpctrain.model.dims import ModelDims
from hpctrain.model.transformer import Transformer

# a tiny Llama: vocabulary 70 (padded to 128), GQA 4 heads / 2 kv heads, untied
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 70, "hidden_size": 32,
          "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
          "max_position_embeddings": 4096}
RUN = ["model.max_seq_len=32", "data.source=synthetic", "data.seq_len=16"]


def _config_dir(path: Path, **change) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    raw = {k: v for k, v in (CONFIG | change).items() if v is not ...}  # ...: the key left out
    (path / "config.json").write_text(json.dumps(raw))
    return path


def _dims(**change) -> ModelDims:
    """The dimensions load_config gives a run started from a directory with CONFIG | change."""
    cfg = CONFIG | change
    return ModelDims.from_config(ModelConfig(
        vocab_size=cfg["vocab_size"], dim=cfg["hidden_size"], n_layers=cfg["num_hidden_layers"],
        n_heads=cfg["num_attention_heads"], n_kv_heads=cfg["num_key_value_heads"], ffn_dim=cfg["intermediate_size"],
        max_seq_len=32, tie_embeddings=cfg["tie_word_embeddings"]))


def _hf_tensors(dims: ModelDims, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Random weights under HF's names with HF's (unpadded) vocabulary rows."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in dims.param_shapes().items():
        rows = dims.true_vocab_size if name in hf_import.VOCAB_ROWS else shape[0]
        out[hf_import.hf_name(name)] = torch.randn((rows, *shape[1:]), generator=g).to(dtype)
    return out


def _weights_dir(path: Path, tensors: dict[str, torch.Tensor], files: int = 1, **change) -> Path:
    """config.json plus the tensors in one model.safetensors, or split over `files` files with an index."""
    from safetensors.torch import save_file

    _config_dir(path, **change)
    if files == 1:
        save_file(tensors, path / hf_import.SINGLE)
        return path
    names = sorted(tensors)
    weight_map = {}
    for i in range(files):
        part = {k: tensors[k] for k in names[i::files]}
        fname = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        save_file(part, path / fname)
        weight_map |= {k: fname for k in part}
    (path / hf_import.INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def _load(d: Path, dims: ModelDims) -> dict[str, torch.Tensor]:
    model = Transformer(dims)
    hf_import.load_hf(model, dims, d)
    return {k: v.detach() for k, v in model.state_dict().items()}


# --- config.json -> [model] -------------------------------------------------------------------------------------

def test_model_table_fills_what_the_run_leaves_out(tmp_path) -> None:
    d = _config_dir(tmp_path / "a")
    table = hfconfig.model_table(f"hf:{d}", {"max_seq_len": 32})
    assert table == {"max_seq_len": 32, "vocab_size": 70, "dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
                     "ffn_dim": 48, "rope_theta": 500000.0, "norm_eps": 1e-5, "tie_embeddings": False,
                     "mlp": "swiglu"}
    # older configs: no num_key_value_heads (as many as heads), no rope_theta / rms_norm_eps (the defaults);
    # transformers 5 gives rope_theta inside rope_parameters
    old_dir = _config_dir(tmp_path / "b", num_key_value_heads=..., rope_theta=..., rms_norm_eps=...)
    old = hfconfig.model_table(f"hf:{old_dir}", {})
    assert (old["n_kv_heads"], old["rope_theta"], old["norm_eps"]) == (4, 10000.0, 1e-6)
    v5_dir = _config_dir(tmp_path / "c", rope_theta=..., rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    v5 = hfconfig.model_table(f"hf:{v5_dir}", {})
    assert v5["rope_theta"] == 1e6
    assert hfconfig.model_table("", {"dim": 8}) == {"dim": 8}  # no init_from: the table as written


def test_model_table_accepts_agreeing_keys_and_refuses_disagreeing_ones(tmp_path) -> None:
    d = _config_dir(tmp_path / "a")
    same = {"vocab_size": 70, "dim": 32, "n_kv_heads": 2, "rope_theta": 500000, "norm_eps": 1e-5,
            "tie_embeddings": False}
    assert hfconfig.model_table(f"hf:{d}", same)["rope_theta"] == 500000  # an int theta equal to the float
    refused(hfconfig.model_table, f"hf:{d}", {"dim": 64},
            fragments=["model.dim = 64", "gives 32", f"hf:{d}", "leave model.dim out"])
    refused(hfconfig.model_table, f"hf:{d}", {"n_kv_heads": 4}, fragments=["model.n_kv_heads = 4", "gives 2"])
    refused(hfconfig.model_table, f"hf:{d}", {"tie_embeddings": True}, fragments=["model.tie_embeddings = True"])
    refused(hfconfig.model_table, f"hf:{d}", {"norm_eps": 1e-6}, fragments=["model.norm_eps = 1e-06", "1e-05"])
    refused(hfconfig.model_table, f"hf:{d}", {"mlp": "gelu"}, fragments=["model.mlp = 'gelu'", "gives 'swiglu'"])


@pytest.mark.parametrize("change,fragments", [
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, ["rope_scaling", "llama3"]),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, ["rope_parameters.rope_type = 'yarn'"]),
    ({"attention_bias": True}, ["attention_bias = True"]),
    ({"mlp_bias": True}, ["mlp_bias = True"]),
    ({"hidden_act": "gelu"}, ["hidden_act = 'gelu'"]),
    ({"head_dim": 16}, ["head_dim = 16", "head_dim = 8"]),
    ({"model_type": "mistral", "architectures": ["MistralForCausalLM"]}, ["'mistral'", "only Llama"]),
    ({"hidden_size": "32"}, ["hidden_size = '32'", "positive integer"]),
    ({"num_hidden_layers": True}, ["num_hidden_layers = True"]),
    ({"num_attention_heads": 0}, ["num_attention_heads = 0"]),
    ({"vocab_size": ...}, ["vocab_size = None"]),
])
def test_unsupported_or_broken_configs_are_refused(tmp_path, change, fragments) -> None:
    d = _config_dir(tmp_path / "x", **change)
    refused(hfconfig.model_table, f"hf:{d}", {}, fragments=["train.init_from", *fragments])


def test_config_json_itself_is_checked(tmp_path) -> None:
    def table(d: Path) -> dict:
        return hfconfig.model_table(f"hf:{d}", {})

    refused(table, tmp_path / "none", fragments=["no such directory"])
    (tmp_path / "empty").mkdir()
    refused(table, tmp_path / "empty", fragments=["config.json", "is missing"])
    for name, text, fragment in (("bad", "{not json", "is not JSON"), ("list", "[1, 2]", "not a JSON object"),
                                 ("latin", b"{\"a\": \"\xff\"}", "is not JSON")):
        (tmp_path / name).mkdir()
        f = tmp_path / name / "config.json"
        f.write_bytes(text) if isinstance(text, bytes) else f.write_text(text)
        refused(table, tmp_path / name, fragments=[fragment])
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "config.json").write_text(" " * (2 << 20) + "{}")
    refused(table, tmp_path / "big", fragments=["config.json", "bytes, more than the 1048576"])
    (tmp_path / "link").mkdir()
    (tmp_path / "link" / "config.json").symlink_to(_config_dir(tmp_path / "real") / "config.json")
    refused(table, tmp_path / "link", fragments=["is missing"])  # a link is not read


@pytest.mark.faults
@pytest.mark.parametrize("change,fragments", [
    ({"tie_word_embeddings": "false"}, ["tie_word_embeddings = 'false'", "true or false"]),
    ({"tie_word_embeddings": 0}, ["tie_word_embeddings = 0", "true or false"]),
    ({"attention_bias": "false"}, ["attention_bias = 'false'", "true or false"]),
    ({"mlp_bias": None}, ["mlp_bias = None", "true or false"]),
    ({"rope_theta": "500000"}, ["rope_theta = '500000'", "a finite number"]),
    ({"rope_theta": True}, ["rope_theta = True", "a finite number"]),
    ({"rms_norm_eps": [1e-5]}, ["rms_norm_eps = [1e-05]", "a finite number"]),
    ({"rope_theta": ..., "rope_parameters": {"rope_theta": "1e6"}}, ["rope_parameters.rope_theta = '1e6'"]),
    ({"rope_parameters": "default"}, ["rope_parameters = 'default'", "an object"]),
    ({"head_dim": 8.0}, ["head_dim = 8.0", "an integer"]),
])
def test_config_json_values_must_have_their_json_type(tmp_path, change, fragments) -> None:
    """A JSON string where a bool belongs is truthy in Python: "false" was read as a tied model. Every flag, size
    and float of config.json is read with its JSON type or refused naming the key and the value."""
    d = _config_dir(tmp_path / "x", **change)
    refused(hfconfig.model_table, f"hf:{d}", {}, fragments=["train.init_from", "config.json", *fragments])
    refused(load_config, None, RUN + [f"train.init_from=hf:{d}"], fragments=fragments)
    record("HF config.json with tie_word_embeddings = \"false\" (a string; read as true) or another flag, size "
           "or float of the wrong JSON type", "ValueError at config load naming the key and the value", tier="pure")


@pytest.mark.faults
def test_config_json_is_read_as_untrusted(tmp_path) -> None:
    """Nesting past untrusted.MAX_DEPTH (a RecursionError traceback in json before) and a lone surrogate are
    refused naming the file; a well-typed config.json is read as before (NaN and Infinity are not numbers here)."""
    deep = _config_dir(tmp_path / "deep")
    (deep / "config.json").write_text(json.dumps(CONFIG)[:-1] + ', "x": ' + "[" * 100000 + "]" * 100000 + "}")
    refused(hfconfig.model_table, f"hf:{deep}", {}, fragments=["train.init_from", "config.json", "is not JSON",
                                                               "nested more than 64 deep"])
    lone = _config_dir(tmp_path / "lone")
    (lone / "config.json").write_text(json.dumps(CONFIG)[:-1] + ', "model_type": "\\ud800"}')
    refused(hfconfig.model_table, f"hf:{lone}", {}, fragments=["config.json", "lone surrogate"])
    inf = _config_dir(tmp_path / "inf")
    (inf / "config.json").write_text(json.dumps(CONFIG).replace("500000.0", "Infinity"))
    refused(hfconfig.model_table, f"hf:{inf}", {}, fragments=["rope_theta = inf", "a finite number"])
    assert hfconfig.model_table(f"hf:{_config_dir(tmp_path / 'ok')}", {})["tie_embeddings"] is False
    record("HF config.json nested 100000 deep or holding a lone surrogate", "ValueError naming the file, no "
           "traceback", tier="pure")


def test_load_config_takes_model_from_the_directory(tmp_path) -> None:
    d = _config_dir(tmp_path / "hf")
    cfg = load_config(None, RUN + [f"train.init_from=hf:{d}"])
    m = cfg.model
    assert (m.vocab_size, m.dim, m.n_layers, m.n_heads, m.n_kv_heads, m.ffn_dim, m.tie_embeddings) == (
        70, 32, 2, 4, 2, 48, False)
    assert (m.rope_theta, m.norm_eps, m.max_seq_len) == (500000.0, 1e-5, 32)  # max_seq_len stays the run's
    assert ModelDims.from_config(m, tp=2).vocab_size == 128 and ModelDims.from_config(m).true_vocab_size == 70
    toml = tmp_path / "run.toml"
    toml.write_text(f'[train]\ninit_from = "hf:{d}"\n[model]\nmax_seq_len = 32\nn_layers = 2\n')
    assert load_config(toml, RUN).model.dim == 32
    toml.write_text(f'[train]\ninit_from = "hf:{d}"\n[model]\nmax_seq_len = 32\nn_layers = 3\n')
    refused(load_config, toml, RUN, fragments=["model.n_layers = 3", "gives 2"])  # before any training
    refused(load_config, None, RUN + [f"train.init_from=hf:{d}", "model.ffn_dim=64"],
            fragments=["model.ffn_dim = 64", "gives 48"])
    refused(load_config, None, RUN + [f"train.init_from=hf:{tmp_path / 'nowhere'}"], fragments=["no such directory"])
    refused(load_config, None, RUN + [f"train.init_from={d}"], fragments=["'hf:PATH'"])


# --- the weights: names, shapes, dtypes, files ------------------------------------------------------------------

def test_weights_land_under_our_names_with_zero_padding_rows(tmp_path) -> None:
    dims = _dims()
    theirs = _hf_tensors(dims)
    for files in (1, 3):
        mine = _load(_weights_dir(tmp_path / f"f{files}", theirs, files=files), dims)
        for name in dims.param_shapes():
            want = theirs[hf_import.hf_name(name)]
            assert torch.equal(mine[name][:want.shape[0]], want), (files, name)
        for name in hf_import.VOCAB_ROWS:
            assert mine[name].shape[0] == 128 and torch.count_nonzero(mine[name][70:]) == 0
    half = {k: v.to(torch.bfloat16) for k, v in theirs.items()}  # bf16 and fp16 files, converted exactly
    mine = _load(_weights_dir(tmp_path / "bf16", half), dims)
    assert mine["layers.1.feed_forward.w2.weight"].dtype == torch.float32
    assert torch.equal(mine["layers.1.feed_forward.w2.weight"], half["model.layers.1.mlp.down_proj.weight"].float())
    fp16 = {k: v.to(torch.float16) for k, v in theirs.items()}
    mine = _load(_weights_dir(tmp_path / "fp16", fp16), dims)
    assert torch.equal(mine["norm.weight"], fp16["model.norm.weight"].float())


def test_tied_heads(tmp_path) -> None:
    dims = _dims(tie_word_embeddings=True)
    theirs = _hf_tensors(dims)
    assert "lm_head.weight" not in theirs
    model = Transformer(dims)
    hf_import.load_hf(model, dims, _weights_dir(tmp_path / "tied", theirs, tie_word_embeddings=True))
    assert model.output.weight is model.tok_embeddings.weight  # still one matrix
    assert torch.equal(model.tok_embeddings.weight[:70], theirs["model.embed_tokens.weight"])
    # a tied directory that also saved lm_head (some tools do): accepted, the embedding is the one used
    extra = theirs | {"lm_head.weight": theirs["model.embed_tokens.weight"].clone()}
    _load(_weights_dir(tmp_path / "both", extra, tie_word_embeddings=True), dims)
    untied = _dims()
    refused(_load, _weights_dir(tmp_path / "untied", theirs), untied, fragments=["missing", "lm_head.weight"])


def test_damaged_tensors_are_refused_by_name(tmp_path) -> None:
    dims = _dims()
    theirs = _hf_tensors(dims)
    without = {k: v for k, v in theirs.items() if k != "model.layers.0.self_attn.k_proj.weight"}
    refused(_load, _weights_dir(tmp_path / "missing", without), dims,
            fragments=["missing ['model.layers.0.self_attn.k_proj.weight']"])
    more = theirs | {"model.layers.0.self_attn.q_proj.bias": torch.zeros(32)}
    refused(_load, _weights_dir(tmp_path / "bias", more), dims,
            fragments=["unknown ['model.layers.0.self_attn.q_proj.bias']"])
    old = theirs | {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(4)}  # older saves carry it
    _load(_weights_dir(tmp_path / "invfreq", old), dims)
    bad = theirs | {"model.layers.1.self_attn.k_proj.weight": torch.zeros(32, 32)}  # k as wide as q: not GQA
    refused(_load, _weights_dir(tmp_path / "shape", bad), dims,
            fragments=["model.layers.1.self_attn.k_proj.weight has shape [32, 32]", "[16, 32]"])
    padded = theirs | {"model.embed_tokens.weight": torch.zeros(128, 32)}  # rows are the real vocabulary only
    refused(_load, _weights_dir(tmp_path / "padded", padded), dims, fragments=["[128, 32]", "[70, 32]"])
    ints = theirs | {"model.norm.weight": torch.ones(32, dtype=torch.int32)}
    refused(_load, _weights_dir(tmp_path / "int", ints), dims, fragments=["model.norm.weight is I32"])
    d = _weights_dir(tmp_path / "truncated", theirs)
    data = (d / hf_import.SINGLE).read_bytes()
    (d / hf_import.SINGLE).write_bytes(data[:len(data) // 2])
    refused(_load, d, dims, fragments=["model.safetensors", "not a readable safetensors file"])
    (tmp_path / "nothing").mkdir()
    _config_dir(tmp_path / "nothing")
    refused(_load, tmp_path / "nothing", dims, fragments=["model.safetensors", "not a regular file"])


def test_the_index_names_only_files_inside_and_says_what_they_hold(tmp_path) -> None:
    dims = _dims()
    theirs = _hf_tensors(dims)
    good = _weights_dir(tmp_path / "good", theirs, files=2)

    def with_index(name: str, edit) -> Path:
        d = tmp_path / name
        d.mkdir()
        for f in good.iterdir():
            (d / f.name).write_bytes(f.read_bytes())
        index = json.loads((d / hf_import.INDEX_NAME).read_text())
        edit(index["weight_map"], d)
        (d / hf_import.INDEX_NAME).write_text(json.dumps(index))
        return d

    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    key = next(k for k, f in json.loads((good / hf_import.INDEX_NAME).read_text())["weight_map"].items() if f == first)
    for name, target in (("up", "../good/" + first), ("abs", str(good / first)), ("sub", "sub/x.safetensors"),
                         ("notsafetensors", "config.json"), ("hidden", ".x.safetensors")):
        d = with_index(name, lambda m, d, t=target: m.__setitem__(key, t))
        refused(_load, d, dims, fragments=[repr(target), "plain *.safetensors names"])
    d = with_index("link", lambda m, d: (d / first).unlink() or (d / first).symlink_to(good / first))
    refused(_load, d, dims, fragments=[repr(first), "not a regular file"])
    d = with_index("elsewhere", lambda m, d: m.__setitem__(key, second))  # placed in a file that lacks it
    refused(_load, d, dims, fragments=[repr(key), f"places in {second!r}"])
    d = with_index("dropped", lambda m, d: m.pop(key))  # a file holding a tensor the index does not place
    refused(_load, d, dims, fragments=[repr(key), "places nowhere"])
    d = with_index("nomap", lambda m, d: m.clear())
    refused(_load, d, dims, fragments=["holds no weight_map"])
    d = tmp_path / "indexlink"
    d.mkdir()
    for f in good.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    (d / hf_import.INDEX_NAME).unlink()
    (d / hf_import.INDEX_NAME).symlink_to(good / hf_import.INDEX_NAME)
    refused(_load, d, dims, fragments=[hf_import.INDEX_NAME, "is a link"])
    # the same tensor saved twice, in both files
    from safetensors.torch import load_file, save_file
    d = with_index("twice", lambda m, d: None)
    both = load_file(d / second) | {key: theirs[key]}
    save_file(both, d / second)
    refused(_load, d, dims, fragments=[repr(key), f"in {first!r}"])


# --- tokenizer files a run records ------------------------------------------------------------------------------

def test_tokenizer_files_come_from_init_from_else_beside_the_data(tmp_path) -> None:
    hf = _config_dir(tmp_path / "hf")
    (hf / "tokenizer.json").write_text("{}")
    (hf / "tokenizer_config.json").write_text("{}")
    data = tmp_path / "data" / "train.bin"
    data.parent.mkdir()
    beside = data.with_name("train.tokenizer.json")
    beside.write_text('{"beside": 1}')
    found, skipped = hf_import.tokenizer_files(hf, [str(data)])
    assert found == {"tokenizer.json": hf / "tokenizer.json", "tokenizer_config.json": hf / "tokenizer_config.json"}
    assert skipped == []
    bare = _config_dir(tmp_path / "bare")  # an HF directory without a tokenizer: the data's
    assert hf_import.tokenizer_files(bare, [str(data)]) == ({"tokenizer.json": beside}, [])
    assert hf_import.tokenizer_files(None, [str(data)]) == ({"tokenizer.json": beside}, [])
    assert hf_import.tokenizer_files(None, []) == ({}, [])  # synthetic data, no init_from
    assert hf_import.tokenizer_files(None, [str(tmp_path / "other.bin")]) == ({}, [])
    (hf / "tokenizer.json").unlink()
    (hf / "tokenizer.json").symlink_to(beside)
    found, skipped = hf_import.tokenizer_files(hf, [str(data)])
    assert found == {"tokenizer_config.json": hf / "tokenizer_config.json"}
    assert len(skipped) == 1 and "tokenizer.json (a link" in skipped[0]
    (hf / "tokenizer.json").unlink()
    with open(hf / "tokenizer.json", "wb") as f:  # sparse: 64 MB + 1 byte, nothing written
        f.truncate((64 << 20) + 1)
    found, skipped = hf_import.tokenizer_files(hf, [str(data)])
    assert "tokenizer.json" not in found and f"({(64 << 20) + 1} bytes)" in skipped[0]
    os.remove(hf / "tokenizer.json")
