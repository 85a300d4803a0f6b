"""A checkpoint as a Hugging Face Llama directory, which `transformers` loads as LlamaForCausalLM. What
`hpctrain ckpt export STEP_DIR --format hf --out DIR [--dtype bf16] [--max-shard-gb 5]` runs.

    DIR/config.json                           LlamaForCausalLM's sizes, GQA heads, rope theta, norm eps, tying
    DIR/model.safetensors                     or, above --max-shard-gb:
    DIR/model-00001-of-00003.safetensors ...  + model.safetensors.index.json (tensor -> file)
    DIR/tokenizer.json ...                    only when the step directory holds tokenizer files

Tensors are streamed one at a time: each is assembled from its HDF5 shards (whatever layout saved it: tp, pp,
dp, ZeRO), checked against its crc32, converted to the chosen dtype and written, so memory holds one full tensor
and its converted copy, never the model. Nothing is unpickled: sizes come from the COMMITTED marker's config
(JSON) and every tensor's shape is checked against them. The directory is written beside DIR under a temporary
name and renamed into place; an existing non-empty DIR is refused. This module imports no `transformers`: the
tests load its output with it (tests/multiproc/hf/test_hf_export.py,
tests/multiproc/checkpoint/test_checkpoint_train.py).

Conventions, and why:
- Rotary layout: hpctrain's apply_rope rotates the two halves of each head (x1, x2 = chunk(2)) with frequency
  i shared by dims i and i + head_dim/2, which is the convention of HF Llama's rotate_half. q and k are therefore
  written unpermuted (the permutation in HF's conversion of Meta's weights is for their interleaved pairs).
- Vocabulary: hpctrain pads the embedding and output rows to a multiple of 64 (and of tp); the padding rows are
  dropped, so config.json's vocab_size is the run's model.vocab_size, the size of its tokenizer. The logits of
  every real id are the same; the padding ids never get probability.
- Tied embeddings: only model.embed_tokens.weight is written and tie_word_embeddings is true, when the checkpoint
  holds one matrix; a run configured tied whose saved output.weight differs is written untied, and says so.
- No generation_config.json: byte-level runs have no BOS or EOS token to record, and transformers derives the
  default from config.json.
"""
from __future__ import annotations

import dataclasses
import json
import os
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hpctrain.checkpoint.hdf5_storage import untrusted_corrupt
from hpctrain.checkpoint.inspection import (
    MODEL_PREFIX,
    ModelTensors,
    full_tensor_reader,
    model_tensors,
    provenance_meta,
    safetensors_dtype,
    write_safetensors,
)
from hpctrain.checkpoint.layout import read_committed
from hpctrain.config import from_dict
from hpctrain.fsutil import fsync_path
from hpctrain.hf.load import (
    _MAX_TOKENIZER_BYTES,
    INDEX_NAME,
    SINGLE,
    TOKENIZER_FILES,
    VOCAB_ROWS,
    hf_name,
)
from hpctrain.model.dims import ModelDims
from hpctrain.untrusted import Untrusted, read_bytes

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def run_dims(marker: dict[str, Any], where: Path) -> ModelDims:
    """The model's dimensions from the config the run recorded in its COMMITTED marker, padded as it trained."""
    config = marker.get("config")
    if not isinstance(config, dict) or not isinstance(config.get("model"), dict):
        raise ValueError(f"{where}: the COMMITTED marker records no [model] config; cannot write config.json")
    try:
        cfg = from_dict(config)
    except ValueError as e:
        raise ValueError(f"{where}: the recorded config is not valid here: {e}") from None
    return ModelDims.from_config(cfg.model, tp=cfg.parallel.tp)


def hf_config(d: ModelDims, dtype: str) -> dict[str, Any]:
    """config.json of LlamaForCausalLM. rope_theta is given both ways: transformers 4 reads "rope_theta",
    5 reads "rope_parameters"; likewise "torch_dtype" and "dtype"."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": d.true_vocab_size or d.vocab_size, "hidden_size": d.dim, "intermediate_size": d.ffn_dim,
        "num_hidden_layers": d.n_layers, "num_attention_heads": d.n_heads, "num_key_value_heads": d.n_kv_heads,
        "head_dim": d.head_dim, "hidden_act": "silu", "max_position_embeddings": d.max_seq_len,
        "rms_norm_eps": d.norm_eps, "rope_theta": d.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": d.rope_theta},
        "tie_word_embeddings": d.tie_embeddings, "attention_bias": False, "mlp_bias": False,
        "initializer_range": 0.02, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
        "use_cache": True, "torch_dtype": dtype, "dtype": dtype,
    }


@dataclass(frozen=True)
class Item:
    """One tensor to write: its checkpoint FQN, full size and saved dtype, its HF name, the rows kept."""
    fqn: str
    size: tuple[int, ...]
    saved: torch.dtype
    name: str
    rows: int

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.rows, *self.size[1:])

    def nbytes(self, dtype: torch.dtype) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * dtype.itemsize


def plan_items(tensors: list, d: ModelDims, where: Path) -> list[Item]:
    """The tensors in LlamaForCausalLM's order, checked: the set and every shape the recorded config implies."""
    expected = d.param_shapes()
    if d.tie_embeddings:
        expected.pop("output.weight", None)  # saved under both names when tied: the embedding is the one written
    saved = {fqn.removeprefix(MODEL_PREFIX): tmd for fqn, tmd in tensors}
    missing = sorted(expected.keys() - saved.keys())
    extra = sorted(saved.keys() - expected.keys() - ({"output.weight"} if d.tie_embeddings else set()))
    if missing or extra:
        raise ValueError(f"{where}: the model tensors do not match the recorded config (missing {missing[:4]}, "
                         f"unexpected {extra[:4]})")
    items = []
    for name, shape in expected.items():
        tmd = saved[name]
        if tuple(tmd.size) != shape:
            raise ValueError(f"{where}: {MODEL_PREFIX}{name} has shape {list(tmd.size)}, the recorded config "
                             f"implies {list(shape)}")
        safetensors_dtype(tmd.properties.dtype, name)  # a stored dtype we cannot convert is refused up front
        rows = (d.true_vocab_size or d.vocab_size) if name in VOCAB_ROWS else shape[0]
        items.append(Item(MODEL_PREFIX + name, shape, tmd.properties.dtype, hf_name(name), rows))
    return items


def plan_shards(items: list[Item], dtype: torch.dtype, max_bytes: int) -> list[list[Item]]:
    """Consecutive items into files of at most max_bytes of tensor data each (a larger tensor gets a file of its
    own)."""
    shards: list[list[Item]] = [[]]
    size = 0
    for it in items:
        if shards[-1] and size + it.nbytes(dtype) > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(it)
        size += it.nbytes(dtype)
    return shards


def converted(raw: np.ndarray, saved: torch.dtype, dtype: torch.dtype, rows: int) -> np.ndarray:
    """A tensor read as stored (bfloat16 as raw uint16 bits), first `rows` rows kept, as `dtype` in numpy (again
    raw bits for bfloat16). torch does the conversion: round to nearest even, as training's casts do."""
    t = torch.from_numpy(raw[:rows])
    if t.dtype != saved:
        t = t.view(saved)
    t = t.to(dtype)
    return (t.view(torch.int16) if dtype == torch.bfloat16 else t).numpy()


def _saved_dtype(items: list[Item], where: Path) -> str:
    """The one dtype of the model tensors written, by its --dtype name; ValueError when mixed or not a float."""
    names = {v: k for k, v in DTYPES.items()}
    kinds = {it.saved for it in items}
    if len(kinds) != 1 or next(iter(kinds)) not in names:
        raise ValueError(f"{where}: the model was saved in {sorted(map(str, kinds))}: choose --dtype "
                         f"({', '.join(DTYPES)})")
    return names[kinds.pop()]


def _tied_in_fact(mt: ModelTensors) -> bool:
    """Whether a run configured with tied embeddings saved one matrix: no output.weight, or one bitwise equal to
    tok_embeddings.weight. (Materialising a model from the meta device re-creates each module's parameters, which
    can leave a tied run with two.)"""
    sizes = {fqn: tuple(tmd.size) for fqn, tmd in mt.tensors}
    emb, out = MODEL_PREFIX + "tok_embeddings.weight", MODEL_PREFIX + "output.weight"
    if out not in sizes:
        return True
    if sizes.get(emb) != sizes[out]:
        return False
    with full_tensor_reader(mt) as read:
        return bool(np.array_equal(read(emb, sizes[emb]), read(out, sizes[out])))


def export_hf(ckpt: Path, out: Path, dtype: str | None = None, max_shard_bytes: int = 5 * 10**9) -> dict[str, Any]:
    """Writes the Hugging Face Llama directory `out` from the committed checkpoint `ckpt` (see the module
    docstring). dtype: "fp32", "bf16", "fp16" or None (as saved). Returns what was written."""
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if max_shard_bytes <= 0:
        raise ValueError(f"max shard size {max_shard_bytes} bytes must be positive")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} exists and is not an empty directory: refusing to write over it")
    marker, _ = read_committed(ckpt)  # CheckpointCorrupt when uncommitted or its index does not match
    dims = run_dims(marker, ckpt)
    if dims.mlp != "swiglu":
        raise ValueError(f"{ckpt}: the run trained model.mlp = {dims.mlp!r}; a Hugging Face Llama has a SwiGLU MLP "
                         f"(gate, up and down), so this model has no Llama form to export")
    mt = model_tensors(ckpt)
    untied = dims.tie_embeddings and not _tied_in_fact(mt)
    if untied:  # written untied, so transformers computes what the saved weights compute
        dims = dataclasses.replace(dims, tie_embeddings=False)
    items = plan_items(mt.tensors, dims, ckpt)
    dtype = dtype or _saved_dtype(items, ckpt)
    target = DTYPES[dtype]
    shards = plan_shards(items, target, max_shard_bytes)
    names = [SINGLE] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    tokenizer = [n for n in TOKENIZER_FILES if (ckpt / n).is_file() and not (ckpt / n).is_symlink()]

    tmp = out.with_name(f".{out.name}.{secrets.token_hex(4)}.tmp")
    tmp.mkdir(parents=False)
    try:
        with full_tensor_reader(mt) as read:
            sdtype = safetensors_dtype(target, "export")
            for name, shard in zip(names, shards):
                arrays = (converted(read(it.fqn, it.size), it.saved, target, it.rows) for it in shard)
                entries = [(it.name, sdtype, it.shape, it.nbytes(target)) for it in shard]
                write_safetensors(tmp / name, entries, arrays, provenance_meta(ckpt))
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(it.nbytes(target) for it in items)},
                     "weight_map": {it.name: name for name, shard in zip(names, shards) for it in shard}}
            (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        (tmp / "config.json").write_text(json.dumps(hf_config(dims, _hf_dtype(dtype)), indent=2) + "\n")
        for n in tokenizer:  # read without following a link, bounded as the run recorded them
            try:
                (tmp / n).write_bytes(read_bytes(ckpt / n, _MAX_TOKENIZER_BYTES))
            except Untrusted as e:
                raise untrusted_corrupt(ckpt / n, e) from None
        for f in tmp.iterdir():
            fsync_path(f)
        fsync_path(tmp)
        if out.is_dir():
            out.rmdir()  # empty, checked above; a file or directory appearing meanwhile makes the rename fail
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_path(out.parent)
    files = sorted(out.iterdir())
    return {"path": str(out), "files": [p.name for p in files], "num_tensors": len(items),
            "params": sum(it.nbytes(target) for it in items) // target.itemsize, "dtype": dtype,
            "num_shards": len(shards), "bytes": sum(p.stat().st_size for p in files), "tokenizer": tokenizer,
            "vocab_size": dims.true_vocab_size or dims.vocab_size, "padded_vocab_size": dims.vocab_size,
            "untied": untied}


def _hf_dtype(dtype: str) -> str:
    return str(DTYPES[dtype]).removeprefix("torch.")


def format_export(done: dict[str, Any], source: Path) -> str:
    """What `ckpt export --format hf` prints."""
    vocab = (f"vocab {done['vocab_size']}" + (f" (padding rows to {done['padded_vocab_size']} dropped)"
                                              if done["padded_vocab_size"] != done["vocab_size"] else ""))
    tok = (f"tokenizer files copied: {', '.join(done['tokenizer'])}" if done["tokenizer"] else
           "no tokenizer recorded (byte-level runs: token id = byte value); no tokenizer files written")
    if done["untied"]:
        tok += ("\nmodel.tie_embeddings = true, but the checkpoint's output.weight differs from tok_embeddings.weight:"
                " written untied (lm_head.weight, tie_word_embeddings false) so the logits are the trained model's")
    return (f"{done['path']}: LlamaForCausalLM, {done['num_tensors']} tensors, {done['params'] / 1e6:.2f}M "
            f"parameters in {done['dtype']}, {done['num_shards']} safetensors file(s), {vocab}, from {source}\n"
            f"{tok}")
