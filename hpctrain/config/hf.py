"""The [model] section of a run that starts from a Hugging Face Llama directory (train.init_from = "hf:PATH").

    table = model_table("hf:/models/llama-1b", {"max_seq_len": 2048})   # -> the [model] keys config.toml gets

The directory's config.json gives every size the run's [model] section leaves out; a size the section does give
must agree with it, else the run is refused here, on the login node, naming both values. Only what hpctrain's
model computes is accepted: LlamaForCausalLM with SiLU gates, no biases, head_dim = hidden_size / heads and plain
RoPE (no rope_scaling). max_seq_len is the run's choice (the positions trained), never taken from the directory.
Every value read has its JSON type (a bool is true or false, never the string "false"; a size an integer; a float
a finite number) or the run is refused naming the key and the value. Reads JSON only, through hpctrain.untrusted
(size, nesting, lone surrogates, no link); imports nothing else of hpctrain, so hpctrain.config calls it while
building a Config. Tests: pytest tests/pure/config/test_hfconfig.py
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from hpctrain import untrusted

PREFIX = "hf:"

# [model] key <- config.json key (int sizes; the floats and the tying flag below)
_SIZES = {"vocab_size": "vocab_size", "dim": "hidden_size", "n_layers": "num_hidden_layers",
          "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads", "ffn_dim": "intermediate_size"}
_BOOLS = ("tie_word_embeddings", "attention_bias", "mlp_bias")
_FLOATS = {"rope_theta": 10000.0, "rms_norm_eps": 1e-6}  # config.json key -> its default when absent
_MAX_CONFIG_BYTES = 1 << 20  # a config.json is a few kB: anything far larger is not one


def hf_dir(init_from: str) -> Path | None:
    """The directory of train.init_from = "hf:PATH", or None when the run does not start from one."""
    return Path(init_from[len(PREFIX):]) if init_from.startswith(PREFIX) else None


def read_json_object(path: Path, max_bytes: int, where: str) -> dict[str, Any]:
    """A JSON object from an untrusted file (hpctrain.untrusted's checks): refused when larger than max_bytes, a
    link or not a regular file, not UTF-8 JSON, nested too deep, holding a lone surrogate, or not an object."""
    try:
        data = untrusted.read_bytes(path, max_bytes)
    except untrusted.Untrusted as e:
        raise untrusted.Untrusted(f"{where}: {e}") from None
    name = repr(str(path))
    try:
        raw = untrusted.parse_json(data, name)
    except untrusted.Untrusted as e:  # its message starts with `name: `
        raise untrusted.Untrusted(f"{where}: {name} is not JSON: {str(e)[len(name) + 2:]}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: {name} is not a JSON object")
    return raw


def _typed(raw: dict[str, Any], key: str, kind: type, default: Any, where: str, name: str | None = None) -> Any:
    """raw[key] (default when absent) checked to have its JSON type: bool for a flag (a string "false" is truthy
    in Python), int for a size, a finite number (int or float, not a bool) for a float. name: the key as the
    message says it (a nested one)."""
    value = raw.get(key, default)
    if kind is float:
        ok = type(value) in (int, float) and math.isfinite(value)
    else:
        ok = type(value) is kind
    if not ok:
        want = {bool: "true or false", int: "an integer", float: "a finite number", str: "a string"}[kind]
        raise ValueError(f"{where}: config.json {name or key} = {value!r} must be {want} "
                         f"(a JSON {type(value).__name__ if value is not None else 'null'} is not read as one)")
    return float(value) if kind is float else value


def read_hf_config(directory: Path) -> dict[str, Any]:
    """config.json of an HF model directory, checked to be a Llama that hpctrain's model computes exactly."""
    path = directory / "config.json"
    where = f"train.init_from = 'hf:{directory}'"
    if not directory.is_dir():
        raise ValueError(f"{where}: no such directory")
    if not path.is_file() or path.is_symlink():
        raise ValueError(f"{where}: {str(path)!r} is missing (an HF model directory holds config.json)")
    raw = read_json_object(path, _MAX_CONFIG_BYTES, where)
    arch = raw.get("architectures") or []
    if raw.get("model_type") != "llama" and "LlamaForCausalLM" not in arch:
        raise ValueError(f"{where}: model_type = {raw.get('model_type')!r}, architectures = {arch}: only Llama "
                         f"(LlamaForCausalLM) directories can be imported")
    for key in _SIZES.values():
        if key == "num_key_value_heads" and key not in raw:
            continue  # older configs: as many kv heads as heads
        if type(raw.get(key)) is not int or raw[key] < 1:
            raise ValueError(f"{where}: config.json {key} = {raw.get(key)!r} must be a positive integer")
    heads, hidden = raw["num_attention_heads"], raw["hidden_size"]
    for key in _BOOLS:
        _typed(raw, key, bool, False, where)
    for key, default in _FLOATS.items():
        _typed(raw, key, float, default, where)
    head_dim = raw.get("head_dim")
    if head_dim is not None:
        _typed(raw, "head_dim", int, None, where)
    rope_parameters = raw.get("rope_parameters")
    if rope_parameters is not None and not isinstance(rope_parameters, dict):
        raise ValueError(f"{where}: config.json rope_parameters = {rope_parameters!r} must be an object")
    if rope_parameters and "rope_theta" in rope_parameters:
        _typed(rope_parameters, "rope_theta", float, None, where, "rope_parameters.rope_theta")
    refused = {"hidden_act": (raw.get("hidden_act", "silu"), "silu"),
               "attention_bias": (raw.get("attention_bias", False), False),
               "mlp_bias": (raw.get("mlp_bias", False), False),
               "rope_scaling": (raw.get("rope_scaling"), None),
               "head_dim": (head_dim or hidden // heads, hidden // heads)}
    if rope_parameters and rope_parameters.get("rope_type", "default") != "default":
        refused["rope_parameters.rope_type"] = (rope_parameters.get("rope_type"), "default")
    for key, (value, wanted) in refused.items():
        if value != wanted:
            raise ValueError(f"{where}: config.json {key} = {value!r}; hpctrain's model computes {key} = "
                             f"{wanted!r} only")
    return raw


def _hf_values(raw: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {ours: raw[theirs] for ours, theirs in _SIZES.items() if theirs in raw}
    out.setdefault("n_kv_heads", raw["num_attention_heads"])
    rope_parameters = raw.get("rope_parameters") or {}  # types checked by read_hf_config
    theta = raw.get("rope_theta", rope_parameters.get("rope_theta", _FLOATS["rope_theta"]))
    out["rope_theta"] = float(theta)
    out["norm_eps"] = float(raw.get("rms_norm_eps", _FLOATS["rms_norm_eps"]))
    out["tie_embeddings"] = raw.get("tie_word_embeddings", False)
    out["mlp"] = "swiglu"  # a Llama's MLP (hidden_act silu, checked above)
    return out


def model_table(init_from: str, table: dict[str, Any]) -> dict[str, Any]:
    """The [model] table of a run: `table` (what the user wrote) completed from the HF directory's config.json.
    Raises ValueError naming both values where they disagree; `table` is returned as is without "hf:"."""
    directory = hf_dir(init_from)
    if directory is None:
        return table
    theirs = _hf_values(read_hf_config(directory))
    merged = dict(table)
    for key, value in theirs.items():
        if key not in table:
            merged[key] = value
            continue
        mine = table[key]
        same = (abs(float(mine) - value) <= 1e-9 * abs(value) if isinstance(value, float) and
                isinstance(mine, (int, float)) and not isinstance(mine, bool) else mine == value)
        if not same:
            raise ValueError(f"model.{key} = {mine!r} disagrees with train.init_from = {init_from!r}, whose "
                             f"config.json gives {value!r}: leave model.{key} out to take it from there")
    return merged
