"""How `make test` hands tests to its workers (tests/conftest.py): a module whose tests share a module-scoped fixture
(its own, or one of the conftest files' and helpers') stays one unit, so the fixture runs once; the others are
spread test by test. Read from the sources, as the controller does.

    .venv/bin/python -m pytest -q tests/pure/test_test_scheduling.py
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

from helpers.launch import REPO

_spec = importlib.util.spec_from_file_location("tests_conftest", REPO / "tests" / "conftest.py")
conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(conftest)  # the run's own conftest, as a plain module (its hooks are not registered again)


def test_modules_with_a_shared_fixture_stay_whole() -> None:
    tests = REPO / "tests"
    shared = frozenset().union(*(conftest._module_fixtures(f) for f in [*tests.glob("**/conftest.py"),
                                                                         *tests.glob("helpers/*.py")]))
    assert {"bpe", "inputs", "files", "blend"} <= shared
    whole = {str(f.relative_to(tests)) for f in tests.glob("**/test_*.py") if conftest.shares_a_fixture(f, shared)}
    # own module fixtures (the layouts' training runs, spawned once), and a shared one (the tokenizer)
    assert {"multiproc/parallel/test_train_equivalence.py", "multiproc/planner/test_planner_memory.py",
            "pure/data/test_tokenized.py"} <= whole
    assert "multiproc/checkpoint/test_faults_ckpt.py" not in whole  # no shared fixture: spread test by test


def test_a_fixture_is_wide_by_its_scope_keyword(tmp_path) -> None:
    module = tmp_path / "test_m.py"
    module.write_text("import pytest\n\n@pytest.fixture(scope='module')\ndef a():\n    pass\n\n"
                      '@pytest.fixture(scope="class")\ndef b():\n    pass\n\n@pytest.fixture\ndef c():\n    pass\n\n'
                      "@pytest.fixture(scope='function')\ndef d():\n    pass\n")
    assert conftest._module_fixtures(Path(module)) == {"a", "b"}
