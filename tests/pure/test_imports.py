"""Imports run one way: every import of an hpctrain module, at module level or inside a function, goes from a
module to one at a lower level of LEVELS (the order README.md's "## Layout" states); the import graph has no cycle;
every module of hpctrain/ has a level. Pure: reads the sources with ast and imports nothing of hpctrain.

    PATH=$PWD/.venv/bin:$PATH .venv/bin/python -m pytest -q tests/pure/test_imports.py

A new module gets a level here (and the same place in the README's Layout paragraph). Modules are named by their
path under hpctrain/ without ".py"; a package's own module is its __init__. Importing a submodule counts as an
import of that submodule only (not of the packages around it, which Python also runs).
"""
from __future__ import annotations

import ast
import re
from typing import NamedTuple

from helpers import REPO

ROOT = REPO
PKG = ROOT / "hpctrain"

# The module order, lowest first. A module imports only from lower levels: never from its own level or above.
LEVELS: list[list[str]] = [
    # 0: import nothing of hpctrain
    ["cliutil", "sections", "hostlist", "untrusted", "install_guard"],
    # 1: an HF directory's config.json, read through untrusted
    ["hfconfig"],
    # 2: the typed config (it reads an HF directory's config.json through hfconfig), and modules importing
    # nothing of hpctrain
    ["__init__", "config", "netaddr", "fsutil", "mutations", "preempt", "dtypes", "heartbeat", "ending",
     "parallel/__init__",
     "planner/__init__", "planner/hardware", "bench/__init__", "bench/pattern", "bench/sweep", "checkpoint/h5file",
     "checkpoint/index"],
    # 3: run directories, token files, who am I, the rank arithmetic, the model's dimensions, pipeline stages, the
    # GEMM probe, DCP planners, the checkpoint lock, the doctor's verdicts (pure)
    ["runs", "tokenfiles", "rendezvous", "mesh", "dims", "parallel/pipeline", "bench/gemm", "checkpoint/planners",
     "checkpoint/lock", "doctor_report"],
    # 4: the job's plan (layout, topology check, model dimensions, pipeline stages, batch plan), made once; the
    # single-device model; what checkpoints cost; what a host says about itself (storage, environment); the hang
    # watchdog; the straggler report; the open files a layout needs
    ["plan", "model", "planner/ckpt_cost", "planner/activations", "planner/timing", "databuild", "hostprobe",
     "watchdog", "stragglers", "planner/fds"],
    # 5: one module per parallelism; the planner's model-state memory
    ["parallel/tensor", "parallel/recompute", "parallel/materialize", "parallel/data", "planner/memory",
     "planner/peak", "tokenized", "blend", "diagnose"],
    # 6: what the trainer is made of
    ["session", "parallel/compose", "optim", "data", "metrics", "bench/colls", "hangrequeue",
     "checkpoint/hdf5_storage", "checkpoint/state", "planner/report"],
    # 7
    ["bench/harness", "bench/plot", "checkpoint/__init__", "checkpoint/layout", "planner/search",
     "checkpoint/hf_import", "evaluate"],
    # 8: the checkpoint directory's lifecycle; the doctor's measurements and the training preflight
    ["checkpoint/manager", "doctor"],
    # 9: a run's checkpoint policy
    ["checkpoint/checkpointer"],
    # 10: the jobs (what one rank runs) and the login-node readers
    ["train", "benchjob", "checkpoint/inspection", "plot"],
    # 11: submission, on the login node (torch only when a dry run checks the model); the Hugging Face export; the
    # commands cli registers (doctor gets cli's launch helpers as arguments)
    ["launch", "checkpoint/hf", "cli_data", "cli_doctor", "cli_diagnose"],
    # 12: the `hpctrain` command
    ["cli"],
    # 13: the console script: takes the signals, then imports cli
    ["entry"],
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


def level_errors(edges: list[Edge], levels: list[list[str]]) -> list[str]:
    """Imports that do not go down the order: to the importer's own level or above it."""
    level = {m: i for i, ms in enumerate(levels) for m in ms}
    return [f"hpctrain/{e.src}.py:{e.line}: {e.src} (level {level[e.src]}) imports {e.dst} (level {level[e.dst]}); "
            f"a module imports only from lower levels"
            for e in edges if e.src in level and e.dst in level and level[e.dst] >= level[e.src]]


def placement_errors(modules: set[str], levels: list[list[str]]) -> list[str]:
    placed = [m for ms in levels for m in ms]
    errors = [f"{m} is in LEVELS {placed.count(m)} times" for m in sorted(set(placed)) if placed.count(m) > 1]
    errors += [f"hpctrain/{m}.py has no level: add it to LEVELS here and to README.md's Layout paragraph"
               for m in sorted(modules - set(placed))]
    errors += [f"LEVELS names {m}, which is no module of hpctrain" for m in sorted(set(placed) - modules)]
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


def render(levels: list[list[str]]) -> str:
    """The order as the README states it: '0 `config`, `netaddr`; 1 `rendezvous`; ...'."""
    return "; ".join(f"{i} " + ", ".join(f"`{m}`" for m in ms) for i, ms in enumerate(levels))


def hpctrain_sources() -> dict[str, str]:
    return {p.relative_to(PKG).as_posix(): p.read_text() for p in sorted(PKG.rglob("*.py"))}


def test_every_module_has_one_level() -> None:
    files = hpctrain_sources()
    errors = placement_errors({module_key(p) for p in files}, LEVELS)
    assert not errors, "\n".join(errors)


def test_imports_run_down_the_order() -> None:
    edges, errors = scan(hpctrain_sources())
    errors += level_errors(edges, LEVELS)
    assert not errors, "\n".join(errors)
    # not vacuous: the scan sees function-level imports (cli imports launch only inside its commands)
    pairs = {(e.src, e.dst) for e in edges}
    assert ("cli", "launch") in pairs and len(pairs) > 50


def test_no_import_cycle() -> None:
    edges, _ = scan(hpctrain_sources())
    found = cycles(edges)
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_readme_states_the_same_order() -> None:
    readme = (ROOT / "README.md").read_text()
    layout = re.search(r"^## Layout\n(.*?)^## ", readme, re.S | re.M)
    assert layout, "README.md has no '## Layout' section"
    text = " ".join(layout.group(1).split())
    assert render(LEVELS) in text, f"README.md's Layout paragraph should state the order of LEVELS:\n{render(LEVELS)}"


def test_checker_catches_injected_violations() -> None:
    """A synthetic package: a function-level relative import that climbs the order and closes a cycle, a
    `from pkg import name` that means the package's own module, an import of no module, and a module with no
    level."""
    files = {
        "__init__.py": "",
        "low.py": "import os\n\n\ndef f():\n    from . import high  # climbs\n    return high\n",
        "high.py": "from hpctrain import low\nimport hpctrain.sub.leaf as leaf\n",
        "sub/__init__.py": "from .leaf import x\n",
        "sub/leaf.py": "x = 1\n",
        "sub/user.py": "from hpctrain.sub import x\nfrom ..low import f\nimport hpctrain.nothing\n",
        "unplaced.py": "",
    }
    levels = [["__init__", "sub/leaf", "low"], ["sub/__init__"], ["high", "sub/user"]]
    edges, errors = scan(files)
    assert {(e.src, e.line, e.dst) for e in edges} == {
        ("low", 5, "high"), ("high", 1, "low"), ("high", 2, "sub/leaf"), ("sub/__init__", 1, "sub/leaf"),
        ("sub/user", 1, "sub/__init__"), ("sub/user", 2, "low")}
    assert errors == ["hpctrain/sub/user.py:3: imports hpctrain.nothing, which is no module of hpctrain"]
    assert level_errors(edges, levels) == [
        "hpctrain/low.py:5: low (level 0) imports high (level 2); a module imports only from lower levels"]
    assert level_errors([Edge("high", 7, "sub/user")], levels) == [
        "hpctrain/high.py:7: high (level 2) imports sub/user (level 2); a module imports only from lower levels"]
    assert cycles(edges) == [["high", "low", "high"]]
    assert placement_errors({module_key(p) for p in files}, levels + [["low", "gone"]]) == [
        "low is in LEVELS 2 times", "hpctrain/unplaced.py has no level: add it to LEVELS here and to README.md's "
        "Layout paragraph", "LEVELS names gone, which is no module of hpctrain"]
    assert render(levels[:2]) == "0 `__init__`, `sub/leaf`, `low`; 1 `sub/__init__`"
