"""Imports run one way: every import of an hpctrain module, at module level or inside a function, goes to a module
of its own package or of a package lower in ORDER (the order docs/architecture.md's "## Layout" states, and the
rows of README.md's "Where to read the code" table follow); the import graph has
no cycle; every package and top-level module of hpctrain/ has its place. Pure: reads the sources with ast and
imports nothing of hpctrain.

    PATH=$PWD/.venv/bin:$PATH .venv/bin/python -m pytest -q tests/pure/test_imports.py

A unit is a package (a folder of hpctrain/) or a plain module at the top of hpctrain/. A new package or top-level
module gets a place here (and the same place in docs/architecture.md's Layout paragraph and the README's table).
Modules are named by their path
under hpctrain/ without ".py"; a package's own module is its __init__. Importing a submodule counts as an import of
that submodule only (not of the packages around it, which Python also runs).
"""
from __future__ import annotations

import ast
import re
from typing import NamedTuple

from helpers.launch import REPO

ROOT = REPO
PKG = ROOT / "hpctrain"

# The order of the house, lowest first: a unit imports from its own package and from lower places, never from its
# own place or above.
ORDER: list[list[str]] = [
    ["__init__", "untrusted", "fsutil", "dtypes", "hostprobe", "install_guard"],  # plain modules: files and hosts
    ["config"],      # typed sections, loading, --set, the HF config.json mapping
    ["model"],       # the single-device transformer and its dimensions
    ["hang"],        # heartbeats, the watchdog, ending a launch, diagnose, stragglers
    ["data"],        # token files, blends, the loader, data build and tokenize
    ["parallel"],    # the plan, the mesh, tensor/data/pipeline parallelism, recompute, materialize
    ["planner"],     # memory, time and open files of a layout, datasheets, the search
    ["checkpoint"],  # sharded HDF5 checkpoints: storage, layout, lock, manager, the run's checkpointer
    ["job"],         # submission, session, rendezvous, addresses, host lists, preemption, runs, the requeue policy
    ["bench"],       # collective and GEMM benchmarks, and the job that runs them
    ["doctor"],      # node measurements and their verdicts
    ["hf"],          # Hugging Face import and export
    ["train"],       # the trainer, optimizer, evaluation, metrics, plots
    ["cli"],         # the hpctrain command
    ["entry"],       # the console script: takes the signals, then imports cli
]


class Edge(NamedTuple):
    src: str  # module names as in LEVELS
    line: int
    dst: str


def module_key(path: str) -> str:
    """'bench/gemm.py' -> 'bench/gemm' (paths under hpctrain/)."""
    return path.removesuffix(".py")


def dotted(key: str) -> str:
    """'bench/gemm' -> 'hpctrain.bench.gemm', 'checkpoint/__init__' -> 'hpctrain.checkpoint'."""
    return ".".join(["hpctrain", *key.split("/")]).removesuffix(".__init__")


def scan(files: dict[str, str]) -> tuple[list[Edge], list[str]]:
    """Every import of an hpctrain module in files ({path under hpctrain/: source}), wherever it stands (module
    level, function, class, TYPE_CHECKING block); relative imports resolved. Returns (edges, errors): an import of
    something that is no module of hpctrain is an error."""
    keys = {dotted(module_key(p)): module_key(p) for p in files}
    edges, errors = [], []
    for path, source in sorted(files.items()):
        src = module_key(path)
        package = dotted(src).split(".") if src.endswith("__init__") else dotted(src).split(".")[:-1]
        for node in ast.walk(ast.parse(source, filename=path)):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # from . import x, from ..model import y
                    anchor = package[:len(package) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                # `from pkg import name`: the submodule pkg.name when there is one, else pkg itself
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in keys else base for a in node.names]
            else:
                continue
            for t in targets:
                if t != "hpctrain" and not t.startswith("hpctrain."):
                    continue
                if t not in keys:
                    errors.append(f"hpctrain/{path}:{node.lineno}: imports {t}, which is no module of hpctrain")
                    continue
                edges.append(Edge(src, node.lineno, keys[t]))
    return edges, errors


def unit(module: str) -> str:
    """'bench/gemm' -> 'bench', 'untrusted' -> 'untrusted', 'checkpoint/__init__' -> 'checkpoint'."""
    return module.split("/")[0]


def order_errors(edges: list[Edge], order: list[list[str]]) -> list[str]:
    """Imports that leave their package for one at the same place in the order or above it."""
    place = {u: i for i, us in enumerate(order) for u in us}
    errors = []
    for e in edges:
        a, b = unit(e.src), unit(e.dst)
        if a != b and a in place and b in place and place[b] >= place[a]:
            errors.append(f"hpctrain/{e.src}.py:{e.line}: {e.src} ({a}, place {place[a]}) imports {e.dst} ({b}, place "
                          f"{place[b]}); a package imports only from its own modules and lower places")
    return errors


def placement_errors(modules: set[str], order: list[list[str]]) -> list[str]:
    placed = [u for us in order for u in us]
    units = {unit(m) for m in modules}
    errors = [f"{u} is in ORDER {placed.count(u)} times" for u in sorted(set(placed)) if placed.count(u) > 1]
    errors += [f"hpctrain/{u} has no place: add it to ORDER here and to docs/architecture.md's Layout paragraph"
               for u in sorted(units - set(placed))]
    errors += [f"ORDER names {u}, which is no package or module of hpctrain" for u in sorted(set(placed) - units)]
    return errors


def cycles(edges: list[Edge]) -> list[list[str]]:
    """One cycle (first module repeated at the end) per strongly connected component that has one (Tarjan)."""
    graph: dict[str, list[str]] = {}
    for e in edges:
        graph.setdefault(e.src, []).append(e.dst)
        graph.setdefault(e.dst, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                found.append(_cycle_in(graph, component))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return found


def _cycle_in(graph: dict[str, list[str]], component: set[str]) -> list[str]:
    """A shortest path from the component's first module back to itself (breadth first, inside the component)."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in graph[v]:
                if w == start:
                    return paths[v] + [start]
                if w in component and w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start} in {sorted(component)}")


def render(order: list[list[str]]) -> str:
    """The order as docs/architecture.md states it: '0 `__init__`, `untrusted`; 1 `config`; ...'."""
    return "; ".join(f"{i} " + ", ".join(f"`{u}`" for u in us) for i, us in enumerate(order))


def hpctrain_sources() -> dict[str, str]:
    return {p.relative_to(PKG).as_posix(): p.read_text() for p in sorted(PKG.rglob("*.py"))}


def test_every_unit_has_one_place() -> None:
    files = hpctrain_sources()
    errors = placement_errors({module_key(p) for p in files}, ORDER)
    assert not errors, "\n".join(errors)


def test_imports_run_down_the_order() -> None:
    edges, errors = scan(hpctrain_sources())
    errors += order_errors(edges, ORDER)
    assert not errors, "\n".join(errors)
    # not vacuous: the scan sees function-level imports (cli imports launch only inside its commands)
    pairs = {(e.src, e.dst) for e in edges}
    assert ("cli/main", "job/launch") in pairs and len(pairs) > 50


def test_no_import_cycle() -> None:
    edges, _ = scan(hpctrain_sources())
    found = cycles(edges)
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_architecture_page_states_the_same_order() -> None:
    page = (ROOT / "docs" / "architecture.md").read_text()
    layout = re.search(r"^## Layout\n(.*?)^## ", page, re.S | re.M)
    assert layout, "docs/architecture.md has no '## Layout' section"
    text = " ".join(layout.group(1).split())
    assert render(ORDER) in text, \
        f"docs/architecture.md's Layout paragraph should state the order of ORDER:\n{render(ORDER)}"


def table_places(readme: str) -> dict[int, set[str]]:
    """{place: units} from the README's "Where to read the code" table, whose rows are '| 3 | `hang/` | ... |'."""
    section = re.search(r"^## Where to read the code\n(.*?)(?=^## |\Z)", readme, re.S | re.M)
    assert section, "README.md has no '## Where to read the code' section"
    places: dict[int, set[str]] = {}
    for place, where in re.findall(r"^\| (\d+) \| ([^|]*) \|", section.group(1), re.M):
        places[int(place)] = {re.sub(r"(\.py|/)$", "", u) for u in re.findall(r"`([^`]+)`", where)}
    return places


def test_readme_table_places_every_unit() -> None:
    want = {i: set(us) - {"__init__"} for i, us in enumerate(ORDER)}
    assert table_places((ROOT / "README.md").read_text()) == want, \
        "README.md's 'Where to read the code' table should list every unit of ORDER at its place"


def test_checker_catches_injected_violations() -> None:
    """A synthetic package: a function-level relative import that climbs the order and closes a cycle, a
    `from pkg import name` that means the package's own module, an import of no module, imports inside one
    package, and a unit with no place."""
    files = {
        "__init__.py": "",
        "low.py": "import os\n\n\ndef f():\n    from . import high  # climbs\n    return high\n",
        "high.py": "from hpctrain import low\nimport hpctrain.sub.leaf as leaf\n",
        "sub/__init__.py": "from .leaf import x\n",
        "sub/leaf.py": "x = 1\n",
        "sub/user.py": "from hpctrain.sub import x\nfrom ..low import f\nimport hpctrain.nothing\n",
        "unplaced.py": "",
    }
    order = [["__init__", "low"], ["sub"], ["high"]]
    edges, errors = scan(files)
    assert {(e.src, e.line, e.dst) for e in edges} == {
        ("low", 5, "high"), ("high", 1, "low"), ("high", 2, "sub/leaf"), ("sub/__init__", 1, "sub/leaf"),
        ("sub/user", 1, "sub/__init__"), ("sub/user", 2, "low")}
    assert errors == ["hpctrain/sub/user.py:3: imports hpctrain.nothing, which is no module of hpctrain"]
    assert order_errors(edges, order) == [
        "hpctrain/low.py:5: low (low, place 0) imports high (high, place 2); a package imports only from its own "
        "modules and lower places"]
    assert order_errors([Edge("high", 7, "sub/user")], [["sub", "high"]]) == [
        "hpctrain/high.py:7: high (high, place 0) imports sub/user (sub, place 0); a package imports only from its "
        "own modules and lower places"]
    assert cycles(edges) == [["high", "low", "high"]]
    assert placement_errors({module_key(p) for p in files}, order + [["low", "gone"]]) == [
        "low is in ORDER 2 times", "hpctrain/unplaced has no place: add it to ORDER here and to "
        "docs/architecture.md's Layout paragraph", "ORDER names gone, which is no package or module of hpctrain"]
    assert render(order[:2]) == "0 `__init__`, `low`; 1 `sub`"


def test_test_folders_mirror_the_packages() -> None:
    """Inside each tier a test file sits in the folder of the package it tests, or at the tier's top (the plain
    modules and the checks of the whole house): a folder that names no package of hpctrain is refused."""
    packages = {p.name for p in (REPO / "hpctrain").iterdir() if (p / "__init__.py").is_file()}
    for tier in ("pure", "multiproc", "cluster"):
        folders = {p.name for p in (REPO / "tests" / tier).iterdir() if p.is_dir() and p.name != "__pycache__"}
        assert folders, tier
        assert folders <= packages, (tier, sorted(folders - packages))
        assert not list((REPO / "tests" / tier).glob("*/*/test_*.py")), f"tests/{tier}: one folder level only"
