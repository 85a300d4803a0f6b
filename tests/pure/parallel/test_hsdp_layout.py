"""Pure tier: HSDP's layout (parallel.dp_replicate): the shard groups are runs of neighbouring dp ranks (inside a
node while they fit), the replica groups stride across them, and the config refuses what cannot run, naming the value.

    .venv/bin/python -m pytest -q tests/pure/parallel/test_hsdp_layout.py
"""
from __future__ import annotations

import pytest

from hpctrain.config import load_config
from hpctrain.parallel import mesh
from hpctrain.parallel.plan import make_plan


def test_shard_groups_sit_inside_nodes_and_replicas_stride_across() -> None:
    lay = mesh.resolve_layout(1, 4, 2, 8, replicate=2)  # 2 nodes x 4: tp pairs, dp 4 = 2 replicas x 2 shards
    assert (lay.dp, lay.shard, lay.replicate) == (4, 2, 2)
    assert lay.groups("dp_shard") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lay.groups("dp_replicate") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lay.groups("dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert lay.coords(6) == {"pp": 0, "dp": 3, "tp": 0, "dp_replicate": 1, "dp_shard": 1}
    assert lay.mesh_axes == ("pp", "dp_replicate", "dp_shard", "tp")
    assert lay.grid() == [[[[0, 1], [2, 3]], [[4, 5], [6, 7]]]]  # DeviceMesh's (pp, replicate, shard, tp)
    assert "dp_shard" in lay.axes and "dp_replicate" in lay.axes
    rows = mesh.rank_table(lay, mesh.block_placement(2, 4))
    assert all(len({r // 4 for r in row["dp_shard_group"]}) == 1 for row in rows)  # one node each
    text = mesh.format_rank_map(lay, rows)
    assert "hsdp: 2 replicas x 2 shards" in text and "dp_shard_group" in text and "dp_replicate_group" in text
    plain = mesh.resolve_layout(1, 4, 2, 8)
    assert plain.shard == 4 and plain.mesh_axes == mesh.AXES and "dp_shard" not in plain.axes


def test_cp_groups_stay_inside_the_shard_groups() -> None:
    lay = mesh.resolve_layout(1, 4, 1, 8, cp=2, replicate=2)  # 4 data replicas x cp 2: 8 ranks share gradients
    assert (lay.dp, lay.shard, lay.cp) == (8, 4, 2)
    for r in range(8):
        assert set(lay.group(r, "cp")) <= set(lay.group(r, "dp_shard"))


@pytest.mark.parametrize("sets, needle", [
    (["parallel.dp_replicate=2", "parallel.zero_stage=1"], "parallel.dp_replicate = 2"),
    (["parallel.dp_replicate=0", "parallel.zero_stage=3"], "dp_replicate"),
    (["parallel.dp_replicate=3", "parallel.zero_stage=3", "parallel.dp=4"], "parallel.dp_replicate = 3"),
])
def test_config_refuses_what_hsdp_cannot_run(sets, needle) -> None:
    with pytest.raises(ValueError, match=needle):
        load_config(None, sets)


def test_an_inferred_dp_that_replicate_does_not_divide_is_refused() -> None:
    cfg = load_config(None, ["parallel.dp_replicate=4", "parallel.zero_stage=3", "parallel.tp=2"])
    with pytest.raises(ValueError, match=r"dp_replicate = 4 does not divide dp = 2"):
        make_plan(cfg, mesh.block_placement(1, 4), training=False)
