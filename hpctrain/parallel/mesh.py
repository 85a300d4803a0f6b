"""The parallel layout: pure (pp, dp, tp) rank arithmetic, the topology check, and the one place that builds
process groups.

Ranks are laid out as a (pp, dp, tp) grid with tp innermost, rank = (pp_rank * dp + dp_rank) * tp + tp_rank,
so with Slurm's block placement a tp group is a run of neighbouring ranks on one node (NVLink) while pp and dp
groups stride across nodes (InfiniBand). Context parallel (cp > 1) splits each dp group: the dp ranks hold the same
parameters and average their gradients (Megatron's data x context group), and each run of cp neighbouring dp
ranks (cp_rank = dp_rank % cp) reads the same sequences, each its share of every sequence: so a cp group sits
next to the tp groups, inside a node while cp x tp fits in one. HSDP (replicate > 1) splits the dp group the
other way: R replicas of dp / R neighbouring dp ranks (the shard group: FSDP's shards, inside a node or a few
nodes), the replicate group striding across them (the gradients' all-reduce). The arithmetic needs no processes;
`build_mesh` needs an initialised torch.distributed and creates a DeviceMesh with axes ("pp", "dp", "tp") (dp as
("dp_replicate", "dp_shard") under HSDP, flattened into one dp mesh beside it); the node mesh
("inter", "intra") and the cp groups are built when something first asks for one of their groups (the benchmark
does for the node mesh; the model's build for cp).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

AXES = ("pp", "dp", "tp")
HSDP_AXES = ("dp_replicate", "dp_shard")  # dp's two levels under HSDP (parallel.dp_replicate > 1)
NODE_AXES = ("inter", "intra")  # inter: same local rank on every node; intra: all ranks of one node


@dataclass(frozen=True)
class Layout:
    pp: int
    dp: int  # ranks that share parameters and gradients: data-parallel replicas x cp
    tp: int
    cp: int = 1  # context parallel: dp ranks that read the same sequences, each a share of them
    replicate: int = 1  # HSDP: replicas of the model's shards within dp (dp / replicate ranks shard it)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def data(self) -> int:
        """Data-parallel replicas: groups of ranks that read different sequences (dp / cp)."""
        return self.dp // self.cp

    @property
    def shard(self) -> int:
        """The ranks of one replica that shard the parameters (FSDP's shard group): dp / replicate."""
        return self.dp // self.replicate

    def size(self, axis: str) -> int:
        return {"dp_shard": self.shard, "dp_replicate": self.replicate}.get(axis) or getattr(self, axis)

    def coords(self, rank: int) -> dict[str, int]:
        """rank -> {"pp": i, "dp": j, "tp": k}; with cp > 1 also "cp" (j % cp) and "data" (j // cp); with replicate
        > 1 also "dp_replicate" (j // shard) and "dp_shard" (j % shard)."""
        pp_rank, rest = divmod(rank, self.dp * self.tp)
        dp_rank, tp_rank = divmod(rest, self.tp)
        out = {"pp": pp_rank, "dp": dp_rank, "tp": tp_rank}
        if self.cp > 1:
            out |= {"data": dp_rank // self.cp, "cp": dp_rank % self.cp}
        if self.replicate > 1:
            out |= {"dp_replicate": dp_rank // self.shard, "dp_shard": dp_rank % self.shard}
        return out

    def rank(self, pp: int, dp: int, tp: int, **_derived: int) -> int:
        return (pp * self.dp + dp) * self.tp + tp

    def group(self, rank: int, axis: str) -> list[int]:
        """The ranks that share every coordinate with `rank` except `axis`, in axis order (cp: the dp ranks that
        read the same sequences)."""
        c = self.coords(rank)
        if axis == "cp":
            first = self.rank(c["pp"], c["dp"] - c["dp"] % self.cp, c["tp"])
            return [first + i * self.tp for i in range(self.cp)]
        if axis == "dp_shard":
            first = self.rank(c["pp"], c["dp"] - c["dp"] % self.shard, c["tp"])
            return [first + i * self.tp for i in range(self.shard)]
        if axis == "dp_replicate":
            first = self.rank(c["pp"], c["dp"] % self.shard, c["tp"])
            return [first + i * self.shard * self.tp for i in range(self.replicate)]
        members = []
        for i in range(self.size(axis)):
            c[axis] = i
            members.append(self.rank(**c))
        return members

    def groups(self, axis: str) -> list[list[int]]:
        """Every group along `axis`, each listed once, ordered by first member."""
        seen: dict[int, list[int]] = {}
        for r in range(self.world_size):
            g = self.group(r, axis)
            seen.setdefault(g[0], g)
        return [seen[k] for k in sorted(seen)]

    def grid(self) -> list:
        """grid[pp][dp][tp] = rank, the argument DeviceMesh wants; with replicate > 1
        grid[pp][dp_replicate][dp_shard][tp] (mesh_axes)."""
        if self.replicate > 1:
            return [[[[self.rank(p, r * self.shard + d, t) for t in range(self.tp)] for d in range(self.shard)]
                     for r in range(self.replicate)] for p in range(self.pp)]
        return [[[self.rank(p, d, t) for t in range(self.tp)] for d in range(self.dp)] for p in range(self.pp)]

    @property
    def mesh_axes(self) -> tuple[str, ...]:
        """The DeviceMesh's axes: AXES, with dp as (dp_replicate, dp_shard) under HSDP."""
        return AXES if self.replicate == 1 else ("pp", *HSDP_AXES, "tp")

    @property
    def axes(self) -> tuple[str, ...]:
        """Every group axis of the layout: AXES, and cp and the HSDP axes where they exist (checked at start)."""
        return AXES + (("cp",) if self.cp > 1 else ()) + (HSDP_AXES if self.replicate > 1 else ())

    def __str__(self) -> str:
        out = f"pp={self.pp} dp={self.data} cp={self.cp} tp={self.tp}" if self.cp > 1 else \
            f"pp={self.pp} dp={self.dp} tp={self.tp}"  # dp as the user gives it: replicas of the data, cp apart
        return out + (f" (hsdp: {self.replicate} replicas x {self.shard} shards)" if self.replicate > 1 else "")


def resolve_layout(pp: int, dp: int, tp: int, world_size: int, cp: int = 1, replicate: int = 1) -> Layout:
    """Fills in dp = -1 and checks pp * dp * cp * tp == world_size; dp counts data-parallel replicas (the
    Layout's dp is dp x cp: the ranks that share gradients); replicate (HSDP) must divide dp."""
    if dp == -1:
        if world_size % (pp * cp * tp):
            named = f"pp({pp}) * cp({cp}) * tp({tp})" if cp > 1 else f"pp({pp}) * tp({tp})"
            raise ValueError(f"world size {world_size} is not divisible by {named} = {pp * cp * tp}, so dp cannot "
                             f"be inferred")
        dp = world_size // (pp * cp * tp)
    if pp * dp * cp * tp != world_size:
        named = f"pp({pp}) * dp({dp}) * cp({cp}) * tp({tp})" if cp > 1 else f"pp({pp}) * dp({dp}) * tp({tp})"
        raise ValueError(f"{named} = {pp * dp * cp * tp} != world size {world_size}")
    if dp % replicate:
        raise ValueError(f"parallel.dp_replicate = {replicate} does not divide dp = {dp}: HSDP splits the "
                         f"data-parallel ranks into {replicate} replicas of equal shard groups")
    return Layout(pp, dp * cp, tp, cp, replicate)


def block_placement(nodes: int, tasks_per_node: int) -> list[int]:
    """node index of each rank under Slurm's default block distribution (ranks 0..k-1 on the first node)."""
    return [r // tasks_per_node for r in range(nodes * tasks_per_node)]


def node_members(node_of_rank: Sequence[int]) -> list[list[int]]:
    """Ranks of each node, nodes in index order, ranks ascending (so list position = local rank)."""
    nodes: dict[int, list[int]] = {}
    for r, n in enumerate(node_of_rank):
        nodes.setdefault(n, []).append(r)
    return [nodes[n] for n in sorted(nodes)]


def check_topology(layout: Layout, node_of_rank: Sequence[int]) -> None:
    """Refuses a layout whose tp groups leave a node, or whose nodes hold different numbers of ranks."""
    if layout.world_size != len(node_of_rank):
        raise ValueError(f"layout {layout} covers {layout.world_size} ranks but the job has {len(node_of_rank)}")
    per_node = node_members(node_of_rank)
    counts = sorted({len(m) for m in per_node})
    if len(counts) > 1:
        raise ValueError(f"nodes hold different numbers of ranks ({counts}); hpctrain needs the same on each")
    ranks_per_node = counts[0]
    if ranks_per_node % layout.tp:
        raise ValueError(f"tp({layout.tp}) does not divide the {ranks_per_node} ranks per node: "
                         f"every tensor-parallel group must lie inside one node")
    for group in layout.groups("tp"):
        nodes = sorted({node_of_rank[r] for r in group})
        if len(nodes) > 1:
            raise ValueError(f"tp group {group} spans nodes {nodes}: tensor parallel must stay inside one node "
                             f"(ranks are not placed node by node; use Slurm's block distribution)")


def rank_table(layout: Layout, node_of_rank: Sequence[int], node_names: Sequence[str] | None = None,
               local_ranks: Sequence[int] | None = None) -> list[dict[str, Any]]:
    """One row per rank: node, local rank, coordinates and the members of each axis group."""
    per_node = node_members(node_of_rank)
    rows = []
    for r in range(layout.world_size):
        n = node_of_rank[r]
        row: dict[str, Any] = {
            "rank": r,
            "node": node_names[r] if node_names else f"node{n}",
            "node_index": n,
            "local_rank": local_ranks[r] if local_ranks else per_node[n].index(r),
        }
        row.update(layout.coords(r))
        for axis in layout.axes:
            row[f"{axis}_group"] = layout.group(r, axis)
        rows.append(row)
    return rows


def format_rank_map(layout: Layout, rows: Sequence[dict[str, Any]]) -> str:
    """The rank map as text, one line per rank, for `hpctrain topo` and the job's first log lines."""
    num_nodes = len({row["node_index"] for row in rows})
    head = (f"layout {layout} on {num_nodes} node(s) x {len(rows) // max(num_nodes, 1)} rank(s): "
            f"tp inside nodes, pp and dp across")
    cp = layout.cp > 1
    if cp:
        head += "; cp next to tp (a cp group reads the same sequences; dp_group: the ranks sharing gradients)"
    coords, axes = ("pp", "dp", "cp", "tp") if cp else ("pp", "dp", "tp"), ("tp", "cp", "dp", "pp") if cp else (
        "tp", "dp", "pp")
    if layout.replicate > 1:  # HSDP: the shard group (FSDP's) and the replica group (the gradients' all-reduce)
        head += "; hsdp: parameters sharded over dp_shard_group, its replicas across dp_replicate_group"
        axes = (*axes[:-1], "dp_shard", "dp_replicate", "pp")
    cols = ["rank", "node", "local", *coords, *(f"{a}_group" for a in axes)]
    cells = [[str(row["rank"]), str(row["node"]), str(row["local_rank"]),
              *(str(row["data"] if a == "dp" and cp else row[a]) for a in coords)]
             + ["[" + ",".join(map(str, row[f"{a}_group"])) + "]" for a in axes] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(cols)]
    lines = [head] + ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [cols] + cells]
    return "\n".join(lines)


@dataclass
class Mesh:
    """Process groups of a running job. Pass it (or one of its groups) to whatever communicates."""
    layout: Layout
    device_mesh: Any  # torch DeviceMesh, axes Layout.mesh_axes: ("pp", "dp", "tp"), dp in two under HSDP
    node_of_rank: Sequence[int] = ()
    node_mesh: Any = None  # torch DeviceMesh, axes ("inter", "intra"): built by the first request for its groups
    node_checks: dict[str, Any] | None = None  # check_groups of the node axes, once built
    rank: int = 0  # this process's rank (global)
    cp_group: Any = None  # built by the first request for it (Mesh.group("cp"))
    dp_mesh: Any = None  # under HSDP: dp_replicate x dp_shard flattened into one 1-D mesh (kept: torch wants it kept)

    def sub(self, axis: str):
        """The 1-D DeviceMesh of axis "tp" or "dp", or "fsdp": the mesh FSDP shards over (dp, or under HSDP the 2-D
        (dp_replicate, dp_shard) mesh: reduce-scatter over the shard group, all-reduce over the replicas)."""
        if axis == "fsdp":
            return self.device_mesh[HSDP_AXES] if self.layout.replicate > 1 else self.device_mesh["dp"]
        if axis == "dp" and self.dp_mesh is not None:
            return self.dp_mesh
        return self.device_mesh[axis]

    @property
    def coords(self) -> dict[str, int]:
        """This rank's {"pp": i, "dp": j, "tp": k}."""
        return self.layout.coords(self.rank)

    @property
    def pp_rank(self) -> int:
        return self.coords["pp"]

    @property
    def dp_rank(self) -> int:
        return self.coords["dp"]

    @property
    def tp_rank(self) -> int:
        return self.coords["tp"]

    def group(self, axis: str):
        import torch.distributed as dist
        if axis == "world":
            return dist.group.WORLD
        if axis == "dp" and self.dp_mesh is not None:
            return self.dp_mesh.get_group()
        if axis in self.layout.mesh_axes:
            return self.device_mesh.get_group(axis)
        if axis == "cp":
            return self._cp_group()
        if axis in NODE_AXES:
            return self._node_mesh().get_group(axis)
        raise ValueError(f"unknown axis {axis!r}; valid: world, {', '.join(self.layout.axes + NODE_AXES)}")

    def members(self, axis: str, rank: int) -> list[int]:
        """The ranks of `rank`'s group along axis, from the arithmetic alone (no group is built)."""
        if axis == "world":
            return list(range(self.layout.world_size))
        if axis in self.layout.axes:
            return self.layout.group(rank, axis)
        if axis in NODE_AXES:
            per_node = node_members(self.node_of_rank)
            mine = per_node[self.node_of_rank[rank]]
            return mine if axis == "intra" else [ranks[mine.index(rank)] for ranks in per_node]
        raise ValueError(f"unknown axis {axis!r}; valid: world, {', '.join(self.layout.axes + NODE_AXES)}")

    @property
    def data_rank(self) -> int:
        """Which replica of the data this rank reads (dp_rank without cp)."""
        return self.coords["dp"] // self.layout.cp

    @property
    def cp_rank(self) -> int:
        return self.coords["dp"] % self.layout.cp

    def _cp_group(self):
        """The cp groups, made on the first request (collective: every rank asks at the same point, the model's
        build) as subgroups of dp: dist.new_subgroups_by_enumeration, every rank creating every group."""
        if self.cp_group is None:
            import torch.distributed as dist
            self.cp_group, _ = dist.new_subgroups_by_enumeration(self.layout.groups("cp"))
        return self.cp_group

    def _node_mesh(self):
        """The per-node groups, built on the first request and checked like the others. Collective: every rank
        asks at the same point, as the benchmark does (--group intra/inter, the two-level all-reduce). Training
        never asks, so its ranks hold no communicator it does not use (each NCCL one costs device memory)."""
        if self.node_mesh is None:
            import torch
            from torch.distributed.device_mesh import DeviceMesh

            device_type = self.device_mesh.device_type
            self.node_mesh = DeviceMesh(device_type, torch.tensor(node_members(self.node_of_rank)),
                                        mesh_dim_names=NODE_AXES)
            self.node_checks = check_groups(self, self.rank, torch.device(device_type), NODE_AXES)
            if not self.node_checks["ok"]:
                raise RuntimeError("group checks failed:\n" + "\n".join(self.node_checks["failures"]))
        return self.node_mesh


def build_mesh(layout: Layout, node_of_rank: Sequence[int], device_type: str) -> Mesh:
    """Creates the (pp, dp, tp) groups; all ranks must call it with the same arguments, a layout whose topology
    was checked (hpctrain.parallel.plan.make_plan checks it). The per-node groups wait for their first use (Mesh.group).
    The mesh keeps this process's rank: its coordinates are Mesh.coords, .pp_rank, .dp_rank, .tp_rank."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    # no backend argument: every axis inherits the default group's backends (NCCL jobs: "cpu:gloo,cuda:nccl"), its
    # gloo connecting a pair on their first message (rendezvous.lazy_gloo): an axis whose collectives all run on the
    # device holds no gloo connection, and no call site can hand an axis a host tensor it cannot serve
    device_mesh = DeviceMesh(device_type, torch.tensor(layout.grid()), mesh_dim_names=layout.mesh_axes)
    dp_mesh = device_mesh[HSDP_AXES]._flatten("dp") if layout.replicate > 1 else None
    return Mesh(layout, device_mesh, list(node_of_rank), rank=dist.get_rank(), dp_mesh=dp_mesh)


def verify_mesh(mesh: Mesh, rank: int, device: Any, axes: Sequence[str] = ("world",) + AXES
                ) -> dict[str, dict[str, Any]]:
    """Checked all-reduce on each axis group (the world and the (pp, dp, tp) axes unless told).

    Each rank adds a one-hot vector at its own rank, so the sum is 1 exactly at the group's members: a group
    with a wrong member, a missing member or a broken link shows up as a wrong vector.
    """
    import torch
    import torch.distributed as dist

    world = mesh.layout.world_size
    results = {}
    for axis in axes:
        members = mesh.members(axis, rank)
        x = torch.zeros(world, dtype=torch.float32, device=device)
        x[rank] = 1.0
        dist.all_reduce(x, group=mesh.group(axis))
        got = [r for r in range(world) if x[r].item() == 1.0]
        ok = got == sorted(members) and float(x.sum().item()) == len(members)
        results[axis] = {"members": members, "got": got, "ok": ok}
    return results


def check_groups(mesh: Mesh, rank: int, device: Any, axes: Sequence[str] = ("world",) + AXES) -> dict[str, Any]:
    """verify_mesh on every rank, the verdicts gathered on all ranks: every rank sees the same failures."""
    import torch.distributed as dist

    mine = verify_mesh(mesh, rank, device, axes)
    every: list[Any] = [None] * mesh.layout.world_size
    dist.all_gather_object(every, mine)
    bad = [f"rank {r} axis {axis}: expected {res['members']} got {res['got']}"
           for r, checks in enumerate(every) for axis, res in checks.items() if not res["ok"]]
    groups = {axis: sorted({tuple(c[axis]["members"]) for c in every}) for axis in mine}
    return {"ok": not bad, "failures": bad, "groups": {a: [list(g) for g in gs] for a, gs in groups.items()}}
