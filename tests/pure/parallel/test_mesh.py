"""Pure tests of the (pp, dp, tp) rank arithmetic in hpctrain.parallel.mesh: no processes, no torch.distributed.

    .venv/bin/python -m pytest tests/pure/parallel/test_mesh.py -q
"""
from __future__ import annotations

import itertools

import pytest

from hpctrain.parallel.mesh import (
    AXES,
    Layout,
    block_placement,
    check_topology,
    format_rank_map,
    node_members,
    rank_table,
    resolve_layout,
)

SHAPES = [(1, 1, 1), (1, 4, 1), (2, 2, 2), (2, 1, 4), (4, 2, 8), (3, 2, 2)]  # (pp, dp, tp)


def refused(fn, *args, fragments) -> str:
    with pytest.raises(ValueError) as info:
        fn(*args)
    msg = str(info.value)
    for fragment in fragments:
        assert fragment in msg, f"{fragment!r} not in {msg!r}"
    return msg


# --- coordinates ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_coords_and_rank_are_inverse(shape):
    layout = Layout(*shape)
    assert layout.world_size == shape[0] * shape[1] * shape[2]
    seen = set()
    for r in range(layout.world_size):
        c = layout.coords(r)
        assert set(c) == set(AXES)
        assert all(0 <= c[a] < layout.size(a) for a in AXES)
        assert layout.rank(**c) == r
        assert c["tp"] == r % layout.tp  # tp innermost
        seen.add((c["pp"], c["dp"], c["tp"]))
    # every coordinate triple is hit exactly once
    assert seen == set(itertools.product(range(layout.pp), range(layout.dp), range(layout.tp)))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_grid_holds_each_rank_at_its_coordinates(shape):
    layout = Layout(*shape)
    grid = layout.grid()
    assert (len(grid), len(grid[0]), len(grid[0][0])) == shape
    for p, d, t in itertools.product(range(layout.pp), range(layout.dp), range(layout.tp)):
        assert layout.coords(grid[p][d][t]) == {"pp": p, "dp": d, "tp": t}


# --- groups -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("axis", AXES)
def test_groups_partition_the_world(shape, axis):
    layout = Layout(*shape)
    size = layout.size(axis)
    groups = layout.groups(axis)
    assert len(groups) == layout.world_size // size
    assert all(len(g) == size for g in groups)
    assert sorted(r for g in groups for r in g) == list(range(layout.world_size))
    others = [a for a in AXES if a != axis]
    for g in groups:
        coords = [layout.coords(r) for r in g]
        assert [c[axis] for c in coords] == list(range(size))  # listed in axis order
        for a in others:  # members differ only along `axis`
            assert len({c[a] for c in coords}) == 1
        for r in g:
            assert layout.group(r, axis) == g


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_tp_groups_are_runs_of_consecutive_ranks(shape):
    layout = Layout(*shape)
    for g in layout.groups("tp"):
        assert g[0] % layout.tp == 0
        assert g == list(range(g[0], g[0] + layout.tp))


def test_groups_for_pp2_dp2_tp2_by_hand():
    layout = Layout(pp=2, dp=2, tp=2)
    assert layout.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.grid() == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    assert layout.coords(6) == {"pp": 1, "dp": 1, "tp": 0}
    assert layout.group(6, "dp") == [4, 6]
    assert str(layout) == "pp=2 dp=2 tp=2"


# --- resolve_layout ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("pp, dp, tp, world, expected", [
    (1, -1, 1, 1, Layout(1, 1, 1)),
    (1, -1, 2, 8, Layout(1, 4, 2)),
    (2, -1, 1, 6, Layout(2, 3, 1)),
    (2, -1, 8, 32, Layout(2, 2, 8)),
    (2, 2, 8, 32, Layout(2, 2, 8)),
])
def test_resolve_layout(pp, dp, tp, world, expected):
    assert resolve_layout(pp, dp, tp, world) == expected


def test_resolve_layout_refuses_world_not_divisible_for_inferred_dp():
    refused(resolve_layout, 1, -1, 3, 8, fragments=["8", "pp(1)", "tp(3)", "= 3"])


def test_resolve_layout_refuses_wrong_product():
    refused(resolve_layout, 2, 3, 2, 8, fragments=["pp(2) * dp(3) * tp(2) = 12", "world size 8"])


# --- topology ---------------------------------------------------------------------------------------------

def test_block_placement_and_node_members():
    assert block_placement(2, 3) == [0, 0, 0, 1, 1, 1]
    assert block_placement(1, 1) == [0]
    assert node_members([0, 1, 0, 1]) == [[0, 2], [1, 3]]


@pytest.mark.parametrize("nodes, tasks_per_node", [(1, 1), (1, 4), (2, 2), (2, 8), (4, 8), (3, 4)])
def test_check_topology_accepts_tp_inside_nodes(nodes, tasks_per_node):
    world = nodes * tasks_per_node
    placement = block_placement(nodes, tasks_per_node)
    for tp in (t for t in range(1, tasks_per_node + 1) if tasks_per_node % t == 0):
        for pp in (p for p in (1, 2) if (world // tp) % p == 0):
            check_topology(resolve_layout(pp, -1, tp, world), placement)  # must not raise


def test_check_topology_refuses_tp_not_dividing_ranks_per_node():
    refused(check_topology, Layout(1, 2, 3), block_placement(3, 2), fragments=["tp(3)", "2 ranks per node"])
    refused(check_topology, Layout(2, 1, 16), block_placement(4, 8), fragments=["tp(16)", "8 ranks per node"])


def test_check_topology_refuses_cyclic_placement():
    msg = refused(check_topology, Layout(1, 2, 2), [0, 1, 0, 1], fragments=["tp group [0, 1]", "nodes [0, 1]"])
    assert "block" in msg  # says how to fix it


def test_check_topology_refuses_uneven_nodes():
    refused(check_topology, Layout(1, 3, 1), [0, 0, 1], fragments=["different numbers", "[1, 2]"])


def test_check_topology_refuses_layout_of_other_size():
    refused(check_topology, Layout(1, 2, 2), [0, 0], fragments=["4 ranks", "has 2"])


# --- rank table and map -----------------------------------------------------------------------------------

def test_rank_table_rows():
    layout = Layout(pp=2, dp=2, tp=2)
    rows = rank_table(layout, block_placement(2, 4))
    assert [row["rank"] for row in rows] == list(range(8))
    assert rows[5] == {"rank": 5, "node": "node1", "node_index": 1, "local_rank": 1,
                       "pp": 1, "dp": 0, "tp": 1,
                       "pp_group": [1, 5], "dp_group": [5, 7], "tp_group": [4, 5]}
    assert [row["local_rank"] for row in rows] == [0, 1, 2, 3, 0, 1, 2, 3]


def test_rank_table_uses_given_names_and_local_ranks():
    layout = Layout(pp=1, dp=2, tp=2)
    rows = rank_table(layout, [0, 0, 1, 1], node_names=["gpu7", "gpu7", "gpu9", "gpu9"],
                      local_ranks=[1, 0, 1, 0])
    assert [row["node"] for row in rows] == ["gpu7", "gpu7", "gpu9", "gpu9"]
    assert [row["local_rank"] for row in rows] == [1, 0, 1, 0]


def test_format_rank_map_content():
    layout = Layout(pp=2, dp=2, tp=2)
    text = format_rank_map(layout, rank_table(layout, block_placement(2, 4)))
    lines = text.splitlines()
    assert len(lines) == 2 + 8  # summary, column names, one line per rank
    assert "pp=2 dp=2 tp=2" in lines[0] and "2 node(s)" in lines[0] and "4 rank(s)" in lines[0]
    assert lines[1].split() == ["rank", "node", "local", "pp", "dp", "tp", "tp_group", "dp_group", "pp_group"]
    assert lines[2 + 5].split() == ["5", "node1", "1", "1", "0", "1", "[4,5]", "[5,7]", "[1,5]"]
    assert lines[2 + 0].split() == ["0", "node0", "0", "0", "0", "0", "[0,1]", "[0,2]", "[0,4]"]
    assert all(line == line.rstrip() for line in lines)


# --- node groups: members without processes ------------------------------------------------------------------

@pytest.mark.parametrize("node_of_rank, intra, inter", [
    ([0, 0, 1, 1], [[0, 1], [0, 1], [2, 3], [2, 3]], [[0, 2], [1, 3], [0, 2], [1, 3]]),
    ([0, 1, 0, 1], [[0, 2], [1, 3], [0, 2], [1, 3]], [[0, 1], [0, 1], [2, 3], [2, 3]]),  # cyclic placement
    ([0, 0, 0, 0], [[0, 1, 2, 3]] * 4, [[0], [1], [2], [3]]),
])
def test_node_members_need_no_groups(node_of_rank, intra, inter):
    """members() of the node axes is arithmetic: asking it builds no group (a mesh without a device mesh and no
    torch.distributed answers), so a rank may ask alone, e.g. to print."""
    from hpctrain.parallel.mesh import Mesh

    m = Mesh(Layout(1, len(node_of_rank), 1), device_mesh=None, node_of_rank=node_of_rank)
    assert [m.members("intra", r) for r in range(len(node_of_rank))] == intra
    assert [m.members("inter", r) for r in range(len(node_of_rank))] == inter
    assert m.node_mesh is None
    refused(m.members, "node", 0, fragments=["unknown axis 'node'", "intra", "inter"])
