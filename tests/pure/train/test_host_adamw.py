"""HostAdamW's step in buckets (parallel.offload = "optimizer") is torch's AdamW step: the pipeline over buckets
changes when the parts move, never what they compute. On the CPU device the buckets run in order with plain copies;
the stream overlap of the same loop runs in tests/device/gpu_smoke.sh."""
import torch
from torch import nn

from hpctrain.train.optim import HostAdamW, param_groups


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 24), nn.Linear(24, 8))


def _train(model: nn.Module, opt, steps: int, skip_grad_of=None) -> list[float]:
    torch.manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(4, 16)
        loss = model(x).pow(2).mean()
        loss.backward()
        if skip_grad_of is not None:
            skip_grad_of.grad = None  # a parameter without a gradient this step (AdamW leaves it alone)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_bucketed_host_step_is_adamw():
    kwargs = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8}
    ref, host = _model(0), _model(0)
    ref_opt = torch.optim.AdamW(param_groups(ref, 0.1), foreach=True, **kwargs)
    host_opt = HostAdamW(param_groups(host, 0.1), pin=False, bucket_bytes=1000, **kwargs)
    assert len(host_opt.buckets) >= 4  # small buckets: several per group, and one spanning the two groups
    assert any(all(part for part in b) for b in host_opt.buckets)
    with torch.no_grad():  # the masters are taken from the weights at the first step, not at construction
        for p in host.parameters():
            p.mul_(1.0)
    a = _train(ref, ref_opt, 4, skip_grad_of=ref[3].bias)
    b = _train(host, host_opt, 4, skip_grad_of=host[3].bias)
    assert a == b
    for p, q in zip(ref.parameters(), host.parameters()):
        assert torch.equal(p, q)
    for p, q in zip(ref_opt.state.values(), host_opt.state.values()):
        assert torch.equal(p["exp_avg_sq"], q["exp_avg_sq"])
    assert all(len(g["params"]) == len(r["params"]) for g, r in zip(host_opt.param_groups, ref_opt.param_groups))


def test_masters_reloaded_after_weights_change():
    kwargs = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8}
    model = _model(0)
    opt = HostAdamW(param_groups(model, 0.0), pin=False, bucket_bytes=1000, **kwargs)
    _train(model, opt, 1)
    with torch.no_grad():
        model[0].weight.fill_(0.5)  # as a checkpoint's load does
    opt.reload_masters()
    _train(model, opt, 1)
    master = next(m for m, p in opt.params_of.items() if p is model[0].weight)
    assert torch.equal(master, model[0].weight)
    assert (model[0].weight - 0.5).abs().max() < 0.05  # one small step from the loaded weights, not the old ones
