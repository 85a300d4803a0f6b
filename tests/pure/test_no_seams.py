"""Pure tier: the product holds no test seams. Fault injection, deliberate bugs, slowed and emulated parts live
under tests/ (tests/plugins/seams.py patches them in from outside); a production job must never change what it
does because a stray variable is set, nor take an option its help does not show.

    PATH=$PWD/.venv/bin:$PATH .venv/bin/python -m pytest -q tests/pure/test_no_seams.py

Two checks: no source file of hpctrain/ holds a string constant that names an environment variable like a test
seam (however it is read: os.environ, os.getenv, a module constant handed to either); no command of the CLI has a
hidden option or is itself hidden.
"""
from __future__ import annotations

import ast
import re

import click

from helpers.launch import REPO

SEAM_WORDS = ("TEST", "FAULT", "SLOW", "EMULATE", "INJECT", "MUTATION", "SEAM", "MOCK", "FAKE")
ENV_NAME = re.compile(r"[A-Z][A-Z0-9]*(_[A-Z0-9]+)+")  # FOO_BAR: how environment variables are named


def seam_names(source: str) -> list[tuple[int, str]]:
    """(line, name) of every string constant in `source` that is an environment variable's name with a seam word
    in it."""
    return [(node.lineno, node.value) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and ENV_NAME.fullmatch(node.value)
            and any(word in node.value for word in SEAM_WORDS)]


def test_the_scan_sees_a_seam() -> None:
    """The scan itself: each way a seam variable was read finds it; a product variable does not."""
    assert seam_names('os.environ.get("HPCTRAIN_FAULT", "")') == [(1, "HPCTRAIN_FAULT")]
    assert seam_names('ENV = "HPCTRAIN_TEST_MUTATION"\nos.environ.get(ENV)') == [(1, "HPCTRAIN_TEST_MUTATION")]
    assert seam_names('x = os.getenv("HPCTRAIN_DOCTOR_SLOW")')
    assert seam_names('if "HPCTRAIN_EMULATE_NCCL" in os.environ: pass')
    assert seam_names('os.environ.get("SLURM_JOB_ID", "")') == []
    assert seam_names('"""a docstring that says HPCTRAIN_FAULT"""') == []  # prose, not a name


def test_product_reads_no_test_variable() -> None:
    found = [f"{path.relative_to(REPO)}:{line}: {name}" for path in sorted((REPO / "hpctrain").rglob("*.py"))
             for line, name in seam_names(path.read_text())]
    assert not found, "test seams in product code (move them to tests/plugins/seams.py):\n" + "\n".join(found)


def _commands(cmd: click.Command, path: str = "hpctrain"):
    yield path, cmd
    if isinstance(cmd, click.Group):
        for name, sub in cmd.commands.items():
            yield from _commands(sub, f"{path} {name}")


def test_cli_has_no_hidden_option() -> None:
    from hpctrain.cli.main import main

    hidden = [f"{path}: {'/'.join(p.opts)}" for path, cmd in _commands(main) for p in cmd.params
              if getattr(p, "hidden", False)]
    hidden += [f"{path} (hidden command)" for path, cmd in _commands(main) if cmd.hidden]
    assert not hidden, "hidden CLI options or commands (a test seam or an undocumented feature):\n" + "\n".join(hidden)
