"""`hpctrain data build` runs in bounded memory whatever its input (issue 25): each case runs the CLI in a fresh
process over a file made here and asserts the process's peak resident size (wait4's ru_maxrss), far below what
reading the file whole takes:
- byte level (no --tokenizer), a 256 MiB file of one line: under 128 MiB (the old whole-file build: 1.8 GB);
- a real BPE tokenizer.json, a 6 MiB line: under 600 MB, and it decodes back to the text (old: 1.3 GB);
- a .txt.gz of 1 MB that expands to 1 GiB of NUL characters (one line, no space to cut at), encoded through a
  stand-in for the tokenizer (tests/workers/fast_tokenizer_build.py) so that a gigabyte passes in seconds: one
  document, 2^30 tokens and its EOS, under 200 MiB;
- a .jsonl.gz whose one line expands to 1 GiB: refused at the 16 MiB line bound, exit 2 naming the file and line,
  under 200 MiB.
The peak is measured by tests/workers/peak_rss.py, which kills a child that passes twice its bound, so a
regression fails the test without taking the machine's memory. By hand (not in the suite), the byte-level build of
a 1 GiB single-line file peaked at 51 MB and took 12 s here.

    .venv/bin/python -m pytest -q tests/multiproc/data/test_data_build_bounded.py
"""
from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from faults import record
from hfcheck import project_paragraphs, train_bpe

from helpers.launch import REPO, WORKERS
from hpctrain.data.tokenfiles import ArraySource

pytestmark = pytest.mark.faults

MiB = 1 << 20


def run_measured(args: list[str], bound_mb: float, tmp_path: Path, timeout: float = 240) -> tuple[int, str, float]:
    """(exit code, output, peak resident MB) of `args`, run under tests/workers/peak_rss.py, which kills it when it
    passes twice `bound_mb` or the timeout. The peak is the kernel's high-water mark, not a sample."""
    result = tmp_path / "peak.json"
    res = subprocess.run([sys.executable, str(WORKERS / "peak_rss.py"), str(result), str(2 * bound_mb),
                          str(timeout), *args], capture_output=True, text=True, cwd=REPO, timeout=timeout + 30)
    got = json.loads(result.read_text())
    print(f"peak resident {got['peak_mb']:.0f} MB")
    return got["rc"], res.stdout + res.stderr, got["peak_mb"]


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "hpctrain.cli", "data", "build", *args]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> Path:
    return train_bpe(tmp_path_factory.mktemp("tok") / "tokenizer.json", project_paragraphs(60))


def test_byte_level_build_of_a_256_mib_line(tmp_path) -> None:
    line = tmp_path / "line.txt"
    block = (b"the quick brown fox jumps over the lazy dog, " * 23302)[:MiB]
    with open(line, "wb") as f:
        for _ in range(256):
            f.write(block)
    out = tmp_path / "line.bin"
    rc, output, peak = run_measured(cli(str(out), str(line)), 128, tmp_path)
    assert rc == 0, output
    assert peak < 128, f"peak resident {peak:.0f} MB for a 256 MiB line"
    src = ArraySource(out)
    assert len(src) == 256 * MiB and bytes(src.read(5 * MiB - 7, 100).astype(np.uint8)) == \
        (block * 6)[5 * MiB - 7:5 * MiB + 93]
    record("data build (byte level) of a 256 MiB single-line text file, in a fresh process",
           "exit 0, every byte a token, peak resident under 128 MiB",
           tier="cli")


def test_real_tokenizer_build_of_a_6_mib_line(bpe, tmp_path) -> None:
    from tokenizers import Tokenizer
    text = ("the quick brown fox jumps over the lazy dog, " * 140000)[:6 * MiB]
    line = tmp_path / "line.txt"
    line.write_text(text)
    out = tmp_path / "line.bin"
    rc, output, peak = run_measured(cli(str(out), str(line), "--tokenizer", str(bpe)), 600, tmp_path)
    assert rc == 0, output
    assert peak < 600, f"peak resident {peak:.0f} MB for a 6 MiB line"
    src = ArraySource(out)
    tokens = src.read(0, len(src))
    tok = Tokenizer.from_file(str(bpe))
    eos = tok.token_to_id("<|endoftext|>")
    assert src.record["num_docs"] == 1 and int((tokens == eos).sum()) == 1 and tokens[-1] == eos
    assert tok.decode(tokens[:-1].tolist()) == text  # six pieces, nothing lost or doubled at the cuts
    record("data build --tokenizer (BPE) of a 6 MiB single-line text file, in a fresh process",
           "exit 0, one document that decodes back to the text with one EOS, peak resident under 600 MB",
           tier="cli")


def _gzip_bomb(path: Path, head: bytes, body: bytes, repeat: int) -> None:
    """head, then `body` `repeat` times, as gzip members (a gzip stream may hold many): a file of about
    repeat * len(gzip(body)) bytes that expands to repeat * len(body)."""
    member = gzip.compress(body, compresslevel=9)
    with open(path, "wb") as f:
        f.write(gzip.compress(head))
        for _ in range(repeat):
            f.write(member)


def test_gz_bomb_expanding_to_1_gib_streams(bpe, tmp_path) -> None:
    bomb = tmp_path / "bomb.txt.gz"
    _gzip_bomb(bomb, b"", b"\0" * MiB, 1024)
    assert bomb.stat().st_size < 2 * MiB
    out = tmp_path / "bomb.bin"
    rc, output, peak = run_measured([sys.executable, str(WORKERS / "fast_tokenizer_build.py"), "data", "build",
                                     str(out), str(bomb), "--tokenizer", str(bpe)], 200, tmp_path)
    assert rc == 0, output
    assert peak < 200, f"peak resident {peak:.0f} MB for a gzip stream of 1 GiB"
    src = ArraySource(out)
    assert len(src) == 1024 * MiB + 1 and src.record["num_docs"] == 1
    assert src.read(0, 4).tolist() == [0] * 4 and src.read(len(src) - 1, 1).item() == src.record["eos_id"]
    record("data build --tokenizer of a 1 MB .txt.gz expanding to 1 GiB of one line (NUL characters), the "
           "tokenizer's encoding stood in for",
           "exit 0, one document of 2^30 tokens and one EOS, peak resident under 200 MiB", tier="cli")


def test_jsonl_gz_bomb_is_refused_at_the_line_bound(bpe, tmp_path) -> None:
    bomb = tmp_path / "bomb.jsonl.gz"
    _gzip_bomb(bomb, b'{"text": "', b"a" * MiB, 1024)
    rc, output, peak = run_measured(cli(str(tmp_path / "b.bin"), str(bomb), "--tokenizer", str(bpe)), 200,
                                    tmp_path)
    assert rc == 2 and f"{bomb}:1" in output and "16 MiB" in output and "--max-line-mib" in output, output
    assert "Traceback" not in output
    assert peak < 200, f"peak resident {peak:.0f} MB for a JSON line of 1 GiB"
    assert not (tmp_path / "b.bin").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".b.bin")]
    record("data build --tokenizer of a .jsonl.gz whose one line expands to 1 GiB",
           "exit 2 naming the file, line 1 and --max-line-mib after 16 MiB of it; peak resident under 200 MiB; "
           "no output or temporary file left", tier="cli")
