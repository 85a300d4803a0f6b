"""The tiny model learns the synthetic data: a short training loop in the test process (the data itself:
tests/pure/data/test_data.py).

    PATH=$PWD/.venv/bin:$PATH .venv/bin/python -m pytest -q tests/multiproc/data/test_data_training.py
"""
from __future__ import annotations

import torch

from hpctrain.data.loader import TokenLoader
from hpctrain.data.sources import SyntheticSource


def test_tiny_model_learns_synthetic_data():
    torch.manual_seed(0)
    loader = TokenLoader(SyntheticSource(256, seed=0), seq_len=32, micro_batch_size=8, dp_rank=0, dp_size=1, seed=0)
    embed, head = torch.nn.Embedding(256, 32), torch.nn.Linear(64, 256)
    params = [*embed.parameters(), *head.parameters()]
    losses = []
    for _ in range(40):
        x, y = loader.next_batch()
        prev = torch.cat([x[:, :1], x[:, :-1]], dim=1)
        logits = head(torch.cat([embed(x), embed(prev)], dim=-1))  # (B, T, vocab) from the last two tokens
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
        with torch.no_grad():  # plain SGD by hand: torch.optim's first import costs seconds
            for p, g in zip(params, torch.autograd.grad(loss, params)):
                p -= 5.0 * g
        losses.append(loss.item())
    assert losses[0] > 5.0 and sum(losses[-5:]) / 5 < 2.5, losses  # from ~log(256) towards ~1 nat
