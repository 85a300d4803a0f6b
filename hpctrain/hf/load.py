"""Start a run from a Hugging Face Llama directory (train.init_from = "hf:DIR"): every rank reads, from the
directory's safetensors files, only the slices its own shards hold, whatever the layout (tp, pp stages, dp, ZeRO).

    stats = load_hf(model, dims, Path("/models/llama"))   # every parameter of `model` filled; then pm.loaded()

The names are LlamaForCausalLM's (hf_name maps ours to them; hpctrain.hf.export writes the same names on
export). q and k need no permutation: hpctrain's apply_rope is HF's rotate_half. The vocabulary rows that
hpctrain pads on (to a multiple of lcm(64, tp)) are zeros: their logits start at 0 and training pushes them down,
as no target is ever a padding id. Nothing in the directory is trusted: model.safetensors.index.json may only
name plain files inside the directory, every tensor hpctrain needs must be there exactly once with its shape,
and an unknown tensor is refused (a directory of another architecture or size). Every rank checks every
tensor's header (shape, dtype) before reading, so a bad directory stops all ranks alike; every value a rank reads
is checked finite before it reaches the model (a nan there makes every step's loss nan), and as each rank reads
only its own slices the trainer makes every rank fail when one does (train.Trainer.start). hfconfig has already
checked config.json against [model] when the Config was built. Imports safetensors (the `hf` extras) only when
called.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from hpctrain.config.hf import read_json_object
from hpctrain.model.dims import ModelDims
from hpctrain.model.transformer import clean_name, weight_of
from hpctrain.parallel.materialize import shard_box

# names as in hpctrain.model.transformer.Transformer -> LlamaForCausalLM's; BLOCK_NAMES are under layers.{i}.
TOP_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
BLOCK_NAMES = {
    "attention_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight", "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight", "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight", "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}
VOCAB_ROWS = ("tok_embeddings.weight", "output.weight")  # padded vocabulary rows: trimmed on export, zeros here
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")
_MAX_TOKENIZER_BYTES = 64 << 20
SINGLE = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")  # a buffer older exports carry
_MAX_INDEX_BYTES = 64 << 20
_DTYPES = {"F32", "BF16", "F16"}


def hf_name(name: str) -> str:
    """'layers.3.attention.wq.weight' -> 'model.layers.3.self_attn.q_proj.weight' (names without "model.")."""
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "layers" and parts[1].isdigit() and parts[2] in BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{BLOCK_NAMES[parts[2]]}"
    raise ValueError(f"{name}: no Hugging Face Llama name for this tensor")


def _plain_file(directory: Path, name: object, where: str) -> Path:
    """A weight file named by the index: a plain file name inside `directory`, a regular file, no link."""
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+\.safetensors", name) or name.startswith("."):
        raise ValueError(f"{where} names weight file {name!r}: only plain *.safetensors names inside the directory")
    path = directory / name
    if path.is_symlink() or not path.is_file():
        raise ValueError(f"{where} names weight file {name!r}, which is not a regular file in {str(directory)!r}")
    return path


def _open(path: Path) -> Any:
    """A safetensors file opened for reading (a context manager); a truncated or foreign file is a ValueError
    naming it, not safetensors' own error."""
    from safetensors import safe_open

    try:
        return safe_open(str(path), framework="pt")
    except Exception as e:  # SafetensorError, or OSError from the header read
        raise ValueError(f"{str(path)!r} is not a readable safetensors file: {e}") from None


def weight_map(directory: Path) -> dict[str, Path]:
    """Every tensor of an HF directory -> its safetensors file: from model.safetensors.index.json when there is
    one (which must say exactly what each file holds), else the keys of the single model.safetensors."""
    index = directory / INDEX_NAME
    if index.is_symlink():
        raise ValueError(f"{str(index)!r} is a link: only regular files inside the directory are read")
    if index.is_file():
        entries = read_json_object(index, _MAX_INDEX_BYTES, "train.init_from").get("weight_map")
        if not isinstance(entries, dict) or not entries:
            raise ValueError(f"{str(index)!r} holds no weight_map object")
        files = {f: _plain_file(directory, f, str(index)) for f in sorted({str(v) for v in entries.values()})}
        mapping = {str(k): files[str(v)] for k, v in entries.items()}
        for path in files.values():  # a tensor in two files, or one the index places where it is not, is refused
            with _open(path) as h:
                held = set(h.keys())
            for key in held:
                if mapping.get(key) != path:
                    raise ValueError(f"{str(path)!r} holds {key!r}, which {INDEX_NAME} places "
                                     f"{'in ' + repr(mapping[key].name) if key in mapping else 'nowhere'}")
            absent = sorted(k for k, f in mapping.items() if f == path and k not in held)
            if absent:
                raise ValueError(f"{INDEX_NAME} places {absent[:3]} in {path.name!r}, which does not hold them")
        return mapping
    single = _plain_file(directory, SINGLE, f"{str(directory)!r} (no {INDEX_NAME})")
    with _open(single) as h:
        return {key: single for key in h.keys()}


def tokenizer_files(init_from_dir: Path | None, data_files: list[str]) -> tuple[dict[str, Path], list[str]]:
    """The tokenizer files a run records in each checkpoint ({name in the step directory: source}), and why any
    were passed over: those of the HF directory it starts from, else the tokenizer.json that `hpctrain data
    build --tokenizer` left beside its data (the first file's). Links and files over 64 MB are passed over."""
    from hpctrain.data.tokenfiles import tokenizer_file
    found: dict[str, Path] = {}
    if init_from_dir is not None:
        found = {n: init_from_dir / n for n in TOKENIZER_FILES if (init_from_dir / n).exists()}
    if not found and data_files:
        beside = tokenizer_file(data_files[0])
        if beside.exists():
            found = {"tokenizer.json": beside}
    skipped = [f"{p} (a link or not a regular file)" for p in found.values() if p.is_symlink() or not p.is_file()]
    skipped += [f"{p} ({p.stat().st_size} bytes)" for p in found.values()
                if p.is_file() and not p.is_symlink() and p.stat().st_size > _MAX_TOKENIZER_BYTES]
    bad = {s.split(" (")[0] for s in skipped}
    return {n: p for n, p in found.items() if str(p) not in bad}, skipped


def expected_names(dims: ModelDims) -> dict[str, str]:
    """HF name -> hpctrain name of every tensor a directory for `dims` must hold (lm_head only when untied)."""
    return {hf_name(n): n for n in dims.param_shapes()}


def _check_names(found: dict[str, Path], dims: ModelDims, directory: Path) -> None:
    wanted = expected_names(dims)
    missing = sorted(set(wanted) - set(found))
    unknown = sorted(k for k in found if k not in wanted and not _IGNORED.fullmatch(k)
                     and not (k == "lm_head.weight" and dims.tie_embeddings))
    if missing or unknown:
        raise ValueError(f"train.init_from = 'hf:{directory}' does not hold this model's tensors: missing "
                         f"{missing[:5]}{' ...' if len(missing) > 5 else ''}, unknown {unknown[:5]}"
                         f"{' ...' if len(unknown) > 5 else ''} (model: {dims.n_layers} layers, dim {dims.dim})")


def _check_headers(handles: dict[Path, Any], found: dict[str, Path], dims: ModelDims, where: str) -> None:
    """Every tensor this model takes has the shape [model] implies (the vocabulary rows unpadded) and a float
    dtype we convert. Headers only: every rank checks them all, so a bad directory stops every rank alike
    instead of one rank raising while the others wait in a collective."""
    true_rows, shapes = dims.true_vocab_size or dims.vocab_size, dims.param_shapes()
    for key, name in expected_names(dims).items():
        part = handles[found[key]].get_slice(key)
        stored, dtype = tuple(part.get_shape()), part.get_dtype()
        full = shapes[name]
        want = (true_rows, *full[1:]) if name in VOCAB_ROWS else full
        if stored != want:
            raise ValueError(f"{where}: {key} has shape {list(stored)}, this model needs {list(want)}")
        if dtype not in _DTYPES:
            raise ValueError(f"{where}: {key} is {dtype}; only F32, BF16 and F16 weights are read")


def _read_box(handle: Any, key: str, offset: tuple[int, ...], shape: tuple[int, ...], rows_held: int
              ) -> torch.Tensor:
    """The [offset, offset + shape) box of tensor `key` (checked by _check_headers), in fp32; rows at or past
    rows_held (vocabulary padding) come back as zeros. Reads only the box from the file."""
    out = torch.zeros(shape, dtype=torch.float32)
    rows = max(0, min(offset[0] + shape[0], rows_held) - offset[0])  # of this box, those the file holds
    if rows:
        index = (slice(offset[0], offset[0] + rows), *(slice(o, o + s) for o, s in zip(offset[1:], shape[1:])))
        out[:rows] = handle.get_slice(key)[index].float()
    return out


def load_hf(model: nn.Module, dims: ModelDims, directory: Path) -> dict[str, Any]:
    """Fills every parameter of `model` (this rank's shards of it, any layout; tied ones once) from the HF
    directory, after checking all of it. Returns {"tensors", "bytes" (read by this rank), "files"}.
    Collective-free: each rank reads alone. The caller marks the model filled (pm.loaded())."""
    try:
        import safetensors  # noqa: F401
    except ImportError:
        raise ValueError("train.init_from = 'hf:...' needs the safetensors package: pip install 'hpctrain[hf]'") \
            from None
    where = f"train.init_from = 'hf:{directory}'"
    found = weight_map(directory)
    _check_names(found, dims, directory)
    shapes = dims.param_shapes()
    true_rows = dims.true_vocab_size or dims.vocab_size
    handles: dict[Path, Any] = {}
    read = 0
    try:
        for path in sorted(set(found.values())):
            handles[path] = _open(path).__enter__()
        _check_headers(handles, found, dims, where)
        with torch.no_grad():
            for name, p in model.named_parameters():
                n = weight_of(clean_name(name), dims)  # a pipeline's tied output: the embedding's weights
                key = hf_name(n)
                if key not in found:  # only lm_head of a tied model, which shares the embedding's parameter
                    raise ValueError(f"{where}: {key} is missing")
                offset, shape = shard_box(p)
                rows_held = true_rows if n in VOCAB_ROWS else shapes[n][0]
                box = _read_box(handles[found[key]], key, offset, shape, rows_held)
                bad = int((~torch.isfinite(box)).sum())  # on the host, before the box reaches the model
                if bad:
                    raise ValueError(f"{where}: {str(found[key])!r} holds non-finite weights: {key} has {bad} nan "
                                     f"or inf values among the {box.numel()} this rank read; every step would be "
                                     f"nan")
                local = p.to_local() if isinstance(p, DTensor) else p
                local.copy_(box.to(local.dtype))
                read += box.numel() * box.element_size()
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
    return {"tensors": sum(1 for _ in model.parameters()), "bytes": read, "files": len(handles)}
