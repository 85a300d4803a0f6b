"""Token files for blend tests (data.paths + data.weights), each token its own position plus an offset, so that a
row's first token names the file and the sample it came from."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

SEQ = 8  # data.seq_len of every blend test
VOCAB = 4200  # model.vocab_size for `blend` (its tokens reach 4049)
BASE = [f"model.vocab_size={VOCAB}", "data.source=bin", f"data.seq_len={SEQ}"]


def token_file(path: Path, n_tokens: int, offset: int) -> Path:
    """Tokens offset, offset+1, ...: each sample's first token says which file and where it came from."""
    path.write_bytes((np.arange(n_tokens) + offset).astype("<u2").tobytes())
    return path


def sample_file(path: Path, n_samples: int, offset: int) -> str:
    """n_samples samples of tokens offset, offset+1, ...: a row's first token names its file and sample."""
    return str(token_file(path, n_samples * SEQ + 1, offset))


def two_files(root: Path) -> list[Path]:
    """A big file (200 samples, tokens from 0) and a small one (5 samples, tokens from 2000)."""
    return [token_file(root / "big.bin", SEQ * 200 + 1, 0), token_file(root / "small.bin", SEQ * 5 + 1, 2000)]


def three_files(root: Path) -> list[str]:
    """A big file (300 samples), a small one (7 samples) and a middle one (40), each with a validation sibling
    (40, 12 and 20 samples: a blend of 64 samples before the big one runs out); weights 5:1:2 in the tests."""
    from hpctrain.data.tokenfiles import val_file

    paths = [sample_file(root / "big.bin", 300, 0), sample_file(root / "small.bin", 7, 3000),
             sample_file(root / "mid.bin", 40, 3500)]
    for p, n, offset in zip(paths, (40, 12, 20), (3600, 3930, 4030)):
        sample_file(Path(val_file(p)), n, offset)
    return paths


# module-scoped fixtures of the blend tests, offered by tests/pure/data/conftest.py and tests/multiproc/data/conftest.py
@pytest.fixture(scope="module")
def files(tmp_path_factory) -> list[Path]:
    """two_files' blend."""
    return two_files(tmp_path_factory.mktemp("blend"))


@pytest.fixture(scope="module")
def blend(tmp_path_factory) -> list[str]:
    """three_files' blend."""
    return three_files(tmp_path_factory.mktemp("blend3"))
