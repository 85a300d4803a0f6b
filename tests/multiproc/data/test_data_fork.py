"""A token source made before a fork reads in the child (the sources themselves: tests/pure/data/test_data.py).

    PATH=$PWD/.venv/bin:$PATH .venv/bin/python -m pytest -q tests/multiproc/data/test_data_fork.py
"""
from __future__ import annotations

from pathlib import Path

import pytest

from helpers.tokenized import write_text_tree
from hpctrain.config import DataConfig
from hpctrain.data.build import build_dataset
from hpctrain.data.sources import open_source

SUFFIX_SOURCE = {".bin": "bin", ".npy": "bin", ".h5": "hdf5", ".hdf5": "hdf5"}


@pytest.fixture
def texts(tmp_path: Path) -> Path:
    return write_text_tree(tmp_path)


def _read_in_child(source, queue) -> None:
    queue.put(source.read(2, 5).tolist())


@pytest.mark.parametrize("suffix", [".bin", ".h5"])
def test_source_made_before_fork_reads_in_the_child(texts, tmp_path, suffix):
    ctx = pytest.importorskip("multiprocessing").get_context("fork")
    build_dataset([texts], tmp_path / f"c{suffix}")
    source = open_source(DataConfig(source=SUFFIX_SOURCE[suffix], path=str(tmp_path / f"c{suffix}"), seq_len=4), 256)
    want = source.read(2, 5).tolist()  # the parent has its handle open now
    queue = ctx.Queue()
    child = ctx.Process(target=_read_in_child, args=(source, queue))
    child.start()
    got = queue.get(timeout=30)
    child.join(timeout=30)
    assert got == want and child.exitcode == 0
