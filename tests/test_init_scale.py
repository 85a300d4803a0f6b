"""Initialisation that scales: any slice of a parameter's init equals the same slice of its full value (pure);
the shards of real gloo layouts (2-D FSDP+TP with uneven and empty dim-0 chunks, TP alone, ZeRO-3 over 4 ranks)
reassemble to the single-process init, and each rank draws only the tiles its shards touch; a resume from a
checkpoint never runs the init, a fresh run does, and a Trainer stepped by hand fills on first use.

    python tests/test_init_scale.py OUT CASES_JSON BASE_PORT     # one rank of the spawned worker
"""
from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch
from train_worker import TINY

from conftest import free_base_port, spawn_ranks
from hpctrain import model, parallelize, session
from hpctrain.config import ModelConfig, load_config
from hpctrain.model import INIT_TILE, ModelDims, init_slice, init_value

DIMS = ModelDims.from_config(ModelConfig(n_layers=4))
TR, TC = INIT_TILE


def counting_tiles(monkeypatch) -> dict[str, int]:
    """Elements drawn per parameter name, from the one place that draws (model.init_tile)."""
    drawn: dict[str, int] = {}
    real = model.init_tile

    def counted(name, *args):
        tile = real(name, *args)
        drawn[name] = drawn.get(name, 0) + tile.numel()
        return tile
    monkeypatch.setattr(model, "init_tile", counted)
    return drawn


def touched(shape, offset, local_shape) -> int:
    """Elements of the tiles a 2-D (or 1-D) box touches: the most a rank may draw for it."""
    if len(shape) < 2:
        shape, offset, local_shape = (1, *shape), (0, *offset), (1, *local_shape)
    assert len(shape) == 2
    total = 1
    for size, o, n, t in zip(shape, offset, local_shape, (TR, TC)):
        lo, hi = o // t * t, min(size, math.ceil((o + n) / t) * t)
        total *= hi - lo if n else 0
    return total


SLICES = [  # (shape, offset, local shape): tile multiples, ragged edges, 1-D, 3-D, empty boxes, one element
    ((64, 2048), (16, 1024), (16, 1024)),
    ((50, 3000), (5, 1000), (37, 1999)),
    ((1003, 17), (998, 0), (5, 17)),
    ((5000,), (1500,), (2100,)),
    ((7,), (0,), (7,)),
    ((5, 7, 300), (1, 2, 17), (3, 4, 200)),
    ((40, 6, 700), (0, 3, 0), (40, 1, 700)),
    ((33, 2050), (33, 0), (0, 2050)),
    ((33, 2050), (3, 2050), (20, 0)),
    ((), (), ()),
]


@pytest.mark.parametrize("shape,offset,local_shape", SLICES)
def test_any_slice_is_the_slice_of_the_full_tensor(shape, offset, local_shape) -> None:
    name = "layers.3.feed_forward.w2.weight"
    full = init_value(name, shape, DIMS, seed=7)
    box = tuple(slice(o, o + n) for o, n in zip(offset, local_shape))
    part = init_slice(name, shape, DIMS, 7, offset, local_shape)
    assert part.shape == full[box].shape and torch.equal(part, full[box])
    out = torch.full(tuple(local_shape) + (3,), float("nan"))[..., 1]  # a strided target is written through
    init_slice(name, shape, DIMS, 7, offset, local_shape, out=out)
    assert torch.equal(out, full[box])


def test_init_statistics_and_norms() -> None:
    w = init_value("layers.0.attention.wq.weight", (1000, 3000), DIMS, seed=0)
    assert abs(w.std().item() - 0.02) < 2e-4 and abs(w.mean().item()) < 1e-4
    wo = init_value("layers.0.attention.wo.weight", (1000, 3000), DIMS, seed=0)
    assert abs(wo.std().item() - 0.02 / math.sqrt(2 * DIMS.n_layers)) < 1e-4
    assert torch.equal(init_slice("layers.2.ffn_norm.weight", (4096,), DIMS, 0, (100,), (50,)), torch.ones(50))
    # tiles are independent draws, not one stream restarted: neighbouring tiles differ
    assert not torch.equal(w[:TR, :TC], w[:TR, TC:2 * TC]) and not torch.equal(w[:TR, :TC], w[TR:2 * TR, :TC])


def test_a_slice_draws_only_the_tiles_it_touches(monkeypatch) -> None:
    drawn = counting_tiles(monkeypatch)
    cases = [((8192, 8192), (64, 0), (64, 8192)), ((8192, 3584 * 8), (512, 3584), (512, 3584)),
             ((1002 * 16, 8192), (1002 * 5, 0), (1002, 8192)), ((8192,), (1024,), (2048,))]
    for i, (shape, offset, local_shape) in enumerate(cases):
        init_slice(f"p{i}.weight", shape, DIMS, 0, offset, local_shape)
        assert drawn[f"p{i}.weight"] == touched(shape, offset, local_shape) < math.prod(shape)
        assert drawn[f"p{i}.weight"] <= 1.3 * math.prod(local_shape)


# -- real layouts: one spawned 4-rank worker ---------------------------------------------------------------------
# head_dim 9 with 2 kv heads: wk/wv have 18 rows, 9 per tp rank, split 5 + 4 by FSDP (uneven); over dp 4 with
# one kv head, 9 rows split 3, 3, 3, 0 (an empty shard). ffn 1152: w2's tp halves cross a tile column boundary.
SHARD_MODEL = ["model.dim=36", "model.n_heads=4", "model.ffn_dim=1152", "model.vocab_size=1000"]
CASES = [
    {"name": "tp2dp2_zero3", "overrides": SHARD_MODEL + ["model.n_kv_heads=2", "parallel.tp=2",
                                                         "parallel.zero_stage=3"]},
    {"name": "tp2dp2_zero0", "overrides": SHARD_MODEL + ["model.n_kv_heads=2", "parallel.tp=2",
                                                         "parallel.zero_stage=0"]},
    {"name": "dp4_zero3", "overrides": SHARD_MODEL + ["model.n_kv_heads=1", "parallel.zero_stage=3"]},
]


def worker(out: str, cases_json: str, base_port: int) -> None:
    from torch.distributed.tensor import DTensor

    rank = int(os.environ["RANK"])
    errors = {}
    for i, case in enumerate(json.loads(cases_json)):
        os.environ["MASTER_PORT"] = str(base_port + i)
        try:
            cfg = load_config(None, TINY + case["overrides"] + [f"job.run_root={out}/{case['name']}-runs"])
            with session.start(cfg) as s:
                drawn = counting_tiles(pytest.MonkeyPatch())
                pm = parallelize.build(cfg, s.mesh, s.device)
                pieces = {}
                for name, p in pm.model.named_parameters():
                    name = model.clean_name(name)
                    offset, local_shape = parallelize.shard_box(p)
                    local = p.to_local() if isinstance(p, DTensor) else p
                    pieces[name] = {"shape": tuple(p.shape), "offset": offset, "local": local.detach().clone(),
                                    "drawn": drawn.get(name, 0)}
                torch.save({"pieces": pieces, "dims": pm.dims}, Path(out) / f"{case['name']}-rank{rank}.pt")
        except Exception as e:  # recorded so the test names the case that failed
            errors[case["name"]] = f"{type(e).__name__}: {e}"
    Path(out, f"errors-rank{rank}.json").write_text(json.dumps(errors))


def test_real_shards_reassemble_to_the_single_process_init(tmp_path) -> None:
    cmd = [sys.executable, __file__, str(tmp_path), json.dumps(CASES), str(free_base_port(len(CASES)))]
    logs = [p.communicate(timeout=300)[0] for p in spawn_ranks(4, cmd, ranks_per_node=4, run_id="init-scale")]
    errors = {}
    for f in tmp_path.glob("errors-rank*.json"):
        errors.update(json.loads(f.read_text()))
    assert not errors and len(list(tmp_path.glob("errors-rank*.json"))) == 4, (errors, logs[0][-3000:])
    for case in CASES:
        ranks = [torch.load(tmp_path / f"{case['name']}-rank{r}.pt", weights_only=False) for r in range(4)]
        dims, seed = ranks[0]["dims"], load_config(None, TINY).train.seed
        seen_uneven = seen_empty = False
        for name, first in ranks[0]["pieces"].items():
            full = init_value(name, first["shape"], dims, seed)
            covered = torch.zeros(first["shape"], dtype=torch.bool)
            sizes = set()
            for rank in ranks:
                piece = rank["pieces"][name]
                box_shape = tuple(piece["local"].shape)
                box = tuple(slice(o, o + n) for o, n in zip(piece["offset"], box_shape))
                assert torch.equal(piece["local"], full[box]), (case["name"], name, piece["offset"])
                covered[box] = True
                sizes.add(piece["local"].shape[0] if piece["local"].ndim else 1)
                # the rank drew exactly the tiles its shard touches (none for the norms' ones), never more
                want = 0 if name.endswith("norm.weight") else touched(piece["shape"], piece["offset"], box_shape)
                assert piece["drawn"] == want, (case["name"], name, piece["drawn"], want)
            assert bool(covered.all()), (case["name"], name)
            seen_uneven |= len(sizes) > 1
            seen_empty |= 0 in sizes
        assert seen_uneven == case["name"].endswith("zero3"), case["name"]  # FSDP's uneven dim-0 chunks
        assert seen_empty == (case["name"] == "dp4_zero3"), case["name"]
    # the embedding (1024 x 36 padded) under dp 4: 256 rows each, so no rank drew the others' tiles
    emb = torch.load(tmp_path / "dp4_zero3-rank1.pt", weights_only=False)["pieces"]["tok_embeddings.weight"]
    assert emb["drawn"] == 256 * 36 < 1024 * 36


# -- the trainer: no init under a resume -------------------------------------------------------------------------
SMALL = TINY + ["model.dim=32", "model.n_heads=2", "model.n_layers=1", "data.seq_len=16", "train.micro_batch_size=2"]


def counting_fills(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = parallelize.init_weights
    monkeypatch.setattr(parallelize, "init_weights", lambda *a: calls.append(1) or real(*a))
    return calls


def test_resume_skips_the_init_and_a_fresh_run_fills(tmp_path, monkeypatch) -> None:
    from hpctrain.train import Trainer
    calls, drawn = counting_fills(monkeypatch), counting_tiles(monkeypatch)

    def fit(steps: int) -> dict:
        cfg = load_config(None, SMALL + [f"job.run_root={tmp_path / 'runs'}", f"checkpoint.dir={tmp_path / 'ck'}",
                                         f"train.steps={steps}"])
        with session.start(cfg) as s:
            return Trainer(cfg, s).fit()
    fresh = fit(2)
    assert calls == [1] and drawn and fresh["resumed_from"] is None
    calls.clear(), drawn.clear()
    resumed = fit(4)
    assert resumed["resumed_from"] == 2 and resumed["steps"] == 4
    assert calls == [] and drawn == {}  # the checkpoint filled every weight: not one tile drawn


def test_a_trainer_stepped_by_hand_fills_on_first_use(tmp_path, monkeypatch) -> None:
    """Callers that step without fit() (benchmarks, workers) and readers of .model never see unfilled memory."""
    from hpctrain.train import Trainer
    calls = counting_fills(monkeypatch)
    cfg = load_config(None, SMALL + [f"job.run_root={tmp_path}"])
    with session.start(cfg) as s:
        tr = Trainer(cfg, s)
        assert calls == []  # allocated, not filled: a resume may still overwrite it
        row = tr.train_step()
        assert calls == [1] and math.isfinite(row["loss"])
        tr.train_step()
        assert calls == [1]
        read = Trainer(cfg, s)
        weights = dict(read.model.named_parameters())  # reading .model fills
        assert calls == [1, 1]
        assert torch.equal(weights["tok_embeddings.weight"].detach(),
                           init_value("tok_embeddings.weight", weights["tok_embeddings.weight"].shape,
                                      read.pm.dims, cfg.train.seed))


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2], int(sys.argv[3]))
