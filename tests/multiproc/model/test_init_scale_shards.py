"""Initialisation that scales, on real gloo layouts: the shards of 2-D FSDP+TP (with uneven and empty dim-0
chunks), TP alone and ZeRO-3 over 4 ranks reassemble to the single-process init, and each rank draws only the tiles
its shards touch. One spawn of 4 ranks runs tests/workers/init_scale_worker.py; the pure half of these checks is
tests/pure/model/test_init_scale.py.

    .venv/bin/python -m pytest tests/multiproc/model/test_init_scale_shards.py -q
"""
from __future__ import annotations

import json
import sys

import torch

from helpers.launch import WORKERS, free_base_port, spawn_ranks
from helpers.training import TINY, touched
from hpctrain.config import load_config
from hpctrain.model.transformer import init_value

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


def test_real_shards_reassemble_to_the_single_process_init(tmp_path) -> None:
    cmd = [sys.executable, str(WORKERS / "init_scale_worker.py"), str(tmp_path), json.dumps(CASES),
           str(free_base_port(len(CASES)))]
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
