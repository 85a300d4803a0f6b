"""The trainer reads on one screen: the Trainer class (hpctrain/train/trainer.py) stays under MAX_LINES lines, its
docstrings, comments and blank lines included; evaluation, straggler reporting, the start from a checkpoint or a
Hugging Face directory, the checkpointer and the run's summary are collaborators it calls (hpctrain/train/). Pure:
reads the source with ast and imports nothing of hpctrain.

    PATH=$PWD/.venv/bin:$PATH .venv/bin/python -m pytest -q tests/pure/train/test_trainer_screen.py
"""
from __future__ import annotations

import ast

from helpers.launch import REPO

MAX_LINES = 180


def class_lines(source: str, name: str) -> int:
    """Lines from the class statement (its first decorator) to its last line."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            return node.end_lineno - first + 1
    raise AssertionError(f"no class {name}")


def test_trainer_class_fits_on_one_screen() -> None:
    n = class_lines((REPO / "hpctrain" / "train" / "trainer.py").read_text(), "Trainer")
    assert n <= MAX_LINES, (f"class Trainer is {n} lines, over {MAX_LINES}: move what is not the step or the loop "
                            f"into a collaborator in hpctrain/train/ named for what it holds")


def test_class_lines_counts_the_whole_class() -> None:
    source = "x = 1\n\n@dec\nclass A:\n    '''doc'''\n\n    def f(self):\n        return 1\n\nclass B:\n    pass\n"
    assert class_lines(source, "A") == 6 and class_lines(source, "B") == 2


def test_training_never_configures_the_watchdog() -> None:
    """The session owns the watchdog (hpctrain/job/session.py): training code reports progress through the
    heartbeat and names no watchdog."""
    for path in sorted((REPO / "hpctrain" / "train").glob("*.py")):
        names = {n.attr for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Attribute)}
        assert "watchdog" not in names, f"{path.name} reaches for the watchdog: the session configures it"
