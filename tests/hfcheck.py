"""The check that an exported Hugging Face directory computes what hpctrain computes: the logits of
transformers' LlamaForCausalLM loaded from the export, against hpctrain's own Transformer holding the trained
weights (taken from the live model, not read back from the checkpoint), on the same tokens. Used by
tests/multiproc/hf/test_hf_export.py (1 rank) and tests/multiproc/checkpoint/test_checkpoint_train.py (tp2 x dp2
ZeRO-3).
Imports transformers, which `make install` brings in (setup.cfg extras "hf").
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

LOGIT_TOL = 1e-4  # fp32: the two implementations differ only in the order of their float operations


def tokens(vocab: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    """(2, seq_len) ids below vocab, the same for every caller with the same arguments."""
    return torch.randint(0, vocab, (2, seq_len), generator=torch.Generator().manual_seed(seed))


def hf_logits(out: Path, ids: torch.Tensor) -> torch.Tensor:
    """LlamaForCausalLM from the exported directory, in fp32: logits (B, T, vocab of its config.json)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


def hpctrain_logits(weights: dict[str, torch.Tensor], dims, ids: torch.Tensor) -> torch.Tensor:
    """hpctrain's Transformer holding `weights` (names without "model."), fp32: logits over the real vocabulary
    (padding columns dropped). Tied only when the weights hold one matrix for both ends."""
    from hpctrain.model.transformer import Transformer

    tied = "output.weight" not in weights or torch.equal(weights["output.weight"], weights["tok_embeddings.weight"])
    dims = dataclasses.replace(dims, tie_embeddings=dims.tie_embeddings and tied)
    model = Transformer(dims)
    model.init_buffers()
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= ({"output.weight"} if dims.tie_embeddings else set()), (
        missing, unexpected)
    with torch.no_grad():
        return model.eval()(ids)[..., :dims.true_vocab_size or dims.vocab_size]


def logit_diff(out: Path, ckpt: Path, weights: dict[str, torch.Tensor], seq_len: int) -> float:
    """Max |hpctrain - transformers| over the logits of the same random tokens; checks the shapes agree."""
    from hpctrain.checkpoint.layout import read_committed
    from hpctrain.hf.export import run_dims

    dims = run_dims(read_committed(ckpt)[0], ckpt)
    vocab = json.loads((out / "config.json").read_text())["vocab_size"]
    ids = tokens(vocab, seq_len)
    ours, theirs = hpctrain_logits(weights, dims, ids), hf_logits(out, ids)
    assert ours.shape == theirs.shape == (*ids.shape, vocab), (ours.shape, theirs.shape)
    assert ours.abs().max() > 0.1  # not a vacuous comparison of near-zero logits
    return (ours - theirs).abs().max().item()


def make_hf_llama(out: Path, vocab: int = 100, dim: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                  ffn: int = 96, tied: bool = False, theta: float = 5000.0, max_shard_size: str | None = None,
                  seed: int = 0) -> dict[str, torch.Tensor]:
    """A random LlamaForCausalLM made and saved by transformers (safetensors; sharded with an index when
    max_shard_size is given). Every weight, norms included, is drawn N(0, 0.2) so that a swapped or misplaced
    tensor changes the logits. Returns its state dict (fp32), under HF's names."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=dim, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, intermediate_size=ffn, tie_word_embeddings=tied,
                         rope_theta=theta, rms_norm_eps=1e-6, max_position_embeddings=128)
    model = LlamaForCausalLM(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, safe_serialization=True, **kwargs)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def ours_as_hf(weights: dict[str, torch.Tensor], vocab: int) -> dict[str, torch.Tensor]:
    """hpctrain's full weights (names without "model.") under HF's names, vocabulary padding rows dropped."""
    from hpctrain.hf.load import VOCAB_ROWS, hf_name

    return {hf_name(k): (v[:vocab] if k in VOCAB_ROWS else v) for k, v in weights.items()}


def project_paragraphs(count: int = 60) -> list[str]:
    """Documents from this project's own files: paragraphs of README.md, the docs/ pages and the package's modules."""
    from helpers.launch import REPO

    files = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "hpctrain").rglob("*.py"))]
    text = "\n\n".join(f.read_text(encoding="utf-8") for f in files)
    paragraphs = [p.strip() for p in text.split("\n\n") if len(p.strip()) > 40]
    assert len(paragraphs) >= count
    return paragraphs[:count]


def train_bpe(path: Path, docs: list[str], vocab: int = 500, eos: str = "<|endoftext|>") -> Path:
    """A byte-level BPE tokenizer.json trained on `docs` by the tokenizers library, with `eos` as special token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[eos],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path
