"""Pure tier for the model: shapes, grouped-query attention (SDPA's enable_gqa against repeated K/V), tied
embeddings, causality, the layout-independent init, parameter and FLOP counts (70B example included), and the
refusals of model dims against tp."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

from helpers.launch import REPO
from hpctrain.cli.main import main as cli
from hpctrain.config import ModelConfig, load_config
from hpctrain.model import transformer as model
from hpctrain.model.transformer import ModelDims, Transformer, init_value, native_gqa, sdpa_has_gqa


def _model(**kw) -> Transformer:
    dims = ModelDims.from_config(ModelConfig(**({"dim": 32, "n_layers": 2, "n_heads": 4, "max_seq_len": 16} | kw)))
    m = Transformer(dims)
    m.init_buffers()
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(init_value(name, p.shape, dims, seed=0))
    return m


def test_forward_shape_and_param_count() -> None:
    m = _model()
    logits = m(torch.randint(0, 256, (3, 10)))
    assert logits.shape == (3, 10, 256)
    assert sum(p.numel() for p in m.parameters()) == m.dims.num_params()


def test_gqa_and_tied_embeddings_count() -> None:
    m = _model(n_kv_heads=2, tie_embeddings=True)
    assert m.layers["0"].attention.wk.weight.shape == (2 * 8, 32)  # 2 kv heads of head_dim 8
    assert m.output.weight is m.tok_embeddings.weight
    assert sum(p.numel() for p in m.parameters()) == m.dims.num_params()
    assert m(torch.randint(0, 256, (2, 5))).shape == (2, 5, 256)


def test_gelu_mlp_has_two_matrices_and_gpt_width() -> None:
    m = _model(mlp="gelu")
    ff = m.layers["0"].feed_forward
    assert ff.w3 is None and ff.w1.weight.shape == (4 * 32, 32) and ff.w2.weight.shape == (32, 4 * 32)
    assert sum(p.numel() for p in m.parameters()) == m.dims.num_params()
    assert {n for n, _ in m.named_parameters()} == set(m.dims.param_shapes())
    x = torch.randn(2, 5, 32)
    assert torch.equal(ff(x), ff.w2(F.gelu(ff.w1(x), approximate="tanh")))
    with pytest.raises(ValueError, match="model.mlp = 'relu' is not one of"):
        ModelConfig(mlp="relu")


@pytest.mark.parametrize("mlp, autocast", [("swiglu", False), ("swiglu", True), ("gelu", False)])
def test_fused_projections_are_the_same_model(mlp, autocast) -> None:
    """model.fused_projections: q/k/v and SwiGLU's gate/up as one matmul each, over the same parameters (names,
    count, state dict): the forward equal to the separate projections', the gradients equal to rounding (fp32; bf16
    autocast to bf16's), each in the parameter's dtype; the fused matmul keeps its input and the weights themselves,
    no concatenated copy, and v gets its own storage (attention keeps it)."""
    a, b = _model(n_kv_heads=2, mlp=mlp), _model(n_kv_heads=2, mlp=mlp, fused_projections=True)
    assert a.state_dict().keys() == b.state_dict().keys() and b.dims.fused_projections
    b.load_state_dict(a.state_dict())
    att, ff = b.layers["0"].attention, b.layers["0"].feed_forward
    assert isinstance(att.qkv, model.FusedProjection) and (ff.gate_up is None) == (mlp == "gelu")
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    outs = []
    for m in (a, b):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = m(tokens)
        out.float().square().mean().backward()
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    tol = 2e-2 if autocast else 1e-5
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert q.grad.dtype == p.dtype
        assert (p.grad - q.grad).abs().max() <= tol * p.grad.abs().max(), name
    x = torch.randn(2, 16, 32)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        q, k, v = att.qkv(x.requires_grad_(True))
    assert len(saved) == 4 and saved[0] is x and all(s is w for s, w in zip(saved[1:], (att.wq.weight, att.wk.weight,
                                                                                         att.wv.weight)))
    assert q.shape == (2, 16, 32) and k.shape == v.shape == (2, 16, 16)


def test_native_gqa_where_a_kernel_reads_grouped_heads() -> None:
    """enable_gqa on CPUs and for CUDA flash (fp16/bf16, not ROCm); repeat where only the memory-efficient
    kernel fits (CUDA fp32), which rejects grouped heads, and where this torch lacks the argument."""
    assert native_gqa("cpu", torch.float32, rocm=False, has_gqa=True)
    assert native_gqa("cuda", torch.bfloat16, rocm=False, has_gqa=True)
    assert native_gqa("cuda", torch.float16, rocm=False, has_gqa=True)
    assert not native_gqa("cuda", torch.float32, rocm=False, has_gqa=True)
    assert not native_gqa("cuda", torch.bfloat16, rocm=True, has_gqa=True)
    assert not native_gqa("cpu", torch.float32, rocm=False, has_gqa=False)
    assert sdpa_has_gqa()  # torch >= 2.5 here


def _attention_calls(monkeypatch) -> list[tuple[int, int, dict]]:
    """Records (query heads, key heads, keyword arguments) of every SDPA call (the model's: sdpa_has_gqa's probe,
    cached, is made first)."""
    sdpa_has_gqa()
    calls, sdpa = [], F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        calls.append((q.shape[1], k.shape[1], kw))
        return sdpa(q, k, v, **kw)
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return calls


def _logits_and_grads(m: Transformer, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    m.zero_grad(set_to_none=True)
    logits = m(x)
    logits.square().mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}


def test_gqa_through_enable_gqa_matches_repeated_kv(monkeypatch) -> None:
    m = _model(n_kv_heads=2)  # 4 query heads share 2 kv heads
    x = torch.randint(0, 256, (3, 12))
    calls = _attention_calls(monkeypatch)
    native, native_grads = _logits_and_grads(m, x)
    assert calls and all(c == (4, 2, {"is_causal": True, "enable_gqa": True}) for c in calls)  # K/V not repeated
    calls.clear()
    monkeypatch.setattr(model, "sdpa_has_gqa", lambda: False)  # a torch without enable_gqa
    repeated, repeated_grads = _logits_and_grads(m, x)
    assert calls and all(c == (4, 4, {"is_causal": True}) for c in calls)
    assert torch.allclose(native, repeated, atol=1e-6, rtol=0)
    for name, g in repeated_grads.items():
        assert torch.allclose(native_grads[name], g, atol=1e-6, rtol=0), name


def test_causal() -> None:
    m = _model()
    x = torch.randint(0, 256, (1, 12))
    y = x.clone()
    y[0, 8:] = (y[0, 8:] + 1) % 256  # change only the future of position 7
    assert torch.allclose(m(x)[0, :8], m(y)[0, :8], atol=1e-6)
    assert not torch.allclose(m(x)[0, 8:], m(y)[0, 8:])


def test_init_depends_on_name_and_seed_only() -> None:
    dims = ModelDims.from_config(ModelConfig())
    a = init_value("layers.1.attention.wq.weight", torch.Size([8, 4]), dims, seed=3)
    assert torch.equal(a, init_value("layers.1.attention.wq.weight", torch.Size([8, 4]), dims, seed=3))
    assert not torch.equal(a, init_value("layers.0.attention.wq.weight", torch.Size([8, 4]), dims, seed=3))
    assert not torch.equal(a, init_value("layers.1.attention.wq.weight", torch.Size([8, 4]), dims, seed=4))
    assert torch.equal(init_value("norm.weight", torch.Size([4]), dims, 0), torch.ones(4))


def test_vocab_padding_and_tp_refusals() -> None:
    assert ModelDims.from_config(ModelConfig(vocab_size=250), tp=2).vocab_size == 256
    assert ModelDims.from_config(ModelConfig(vocab_size=256, n_heads=6, dim=96, ffn_dim=192), tp=3).vocab_size == 384
    with pytest.raises(ValueError, match="model.n_kv_heads = 2 is not divisible by parallel.tp = 4"):
        ModelDims.from_config(ModelConfig(n_heads=4, n_kv_heads=2), tp=4)


def test_70b_example_counts_and_dry_run() -> None:
    cfg = load_config(REPO / "slurm" / "examples" / "llama-70b.toml")
    dims = ModelDims.from_config(cfg.model, cfg.parallel.tp)
    assert 70.0e9 < dims.num_params() < 71.0e9
    # 6 FLOPs per matmul weight and token plus attention: ~6 * 70e9 + 12 * 80 * 8192 * 8192
    assert dims.flops_per_token(8192) == pytest.approx(6 * 69.5e9 + 12 * 80 * 8192 * 8192, rel=0.02)
    res = CliRunner().invoke(cli, ["submit", str(REPO / "slurm" / "examples" / "llama-70b.toml"), "--dry-run"])
    assert res.exit_code == 0, res.output
    assert "layout pp=1 dp=16 tp=8 on 16 node(s) x 8 rank(s)" in res.output and "#SBATCH --nodes=16" in res.output


def test_swiglu_keeps_two_tensors_and_gives_autograds_gradients_bit_for_bit() -> None:
    """SwiGLU (the MLP's silu(gate) * up) saves gate and up only, and its backward is autograd's: the same values,
    bit for bit, in fp32 and bf16 (the memory it saves is counted by benchmarks/activation_memory.py)."""
    for dtype in (torch.float32, torch.bfloat16):
        g = torch.Generator().manual_seed(0)
        gate, up, grad = (torch.randn(2, 16, 48, generator=g).to(dtype) for _ in range(3))
        gate.requires_grad_(True)
        up.requires_grad_(True)
        ref = F.silu(gate) * up
        ref_grads = torch.autograd.grad(ref, (gate, up), grad)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            out = model.SwiGLU.apply(gate, up)
        assert len(saved) == 2 and torch.equal(out, ref)
        for ours, theirs in zip(torch.autograd.grad(out, (gate, up), grad), ref_grads):
            assert torch.equal(ours, theirs), dtype


def test_rmsnorm_keeps_its_input_and_gives_the_gradients_of_its_formula() -> None:
    """RMSNorm saves its input, its weight and the per-token 1/rms (not the normalised tensor), gives the forward of
    the plain ops bit for bit, and the gradients of the same formula through autograd: equal in fp32 to rounding,
    in bf16 to bf16's rounding of the same values. Under autocast its output is in the compute dtype (the three
    projections then share it instead of each casting a copy), and the residual stream is too."""
    def plain(x, w, eps=1e-5):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * w

    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 2e-2)):
        g = torch.Generator().manual_seed(1)
        x, grad = (torch.randn(2, 16, 48, generator=g).to(dtype) for _ in range(2))
        norm = model.RMSNorm(48, 1e-5).to(dtype)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(48, generator=g))
        x.requires_grad_(True)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            out = norm(x)
        assert torch.equal(out, plain(x, norm.weight))
        assert sorted(tuple(t.shape) for t in saved) == [(2, 16, 1), (2, 16, 48), (48,)], [t.shape for t in saved]
        ours = torch.autograd.grad(out, (x, norm.weight), grad)
        theirs = torch.autograd.grad(plain(x, norm.weight), (x, norm.weight), grad)
        for a, b in zip(ours, theirs):
            assert a.dtype == b.dtype and torch.allclose(a.float(), b.float(), rtol=tol, atol=tol), (dtype, a, b)
    dims = ModelDims(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=8,
                     tie_embeddings=False)
    m = model.Transformer(dims)
    m.init_buffers()
    seen = []
    m.layers["0"].attention.wq.register_forward_pre_hook(lambda mod, args: seen.append(args[0].dtype))
    m.layers["0"].register_forward_pre_hook(lambda mod, args: seen.append(args[0].dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        m(torch.zeros(1, 8, dtype=torch.long))
    assert seen == [torch.bfloat16, torch.bfloat16], seen  # the block's input, the projections' input
