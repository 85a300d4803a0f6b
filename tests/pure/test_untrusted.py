"""hpctrain.untrusted: bounded reads of files we did not write (pure tier, no torch).

    pytest tests/pure/test_untrusted.py
"""
from __future__ import annotations

import os

import pytest

from hpctrain.untrusted import MAX_DEPTH, Untrusted, parse_json, read_bytes, read_json


def test_reads_a_small_regular_file(tmp_path) -> None:
    (tmp_path / "a.json").write_text('{"x": [1, "\\u00e9", "\\ud83d\\ude00"]}')
    assert read_json(tmp_path / "a.json", 1 << 10) == {"x": [1, "\u00e9", "\U0001f600"]}
    assert read_bytes(tmp_path / "a.json", 1 << 10).startswith(b'{"x"')


def test_refuses_links_fifos_directories_missing_and_large(tmp_path) -> None:
    outside = tmp_path / "outside.json"
    outside.write_text("{}")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "link.json").symlink_to(outside)
    with pytest.raises(Untrusted, match="symbolic link"):
        read_json(tmp_path / "run" / "link.json", 1 << 10)
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(Untrusted, match="not a regular file"):  # never blocks on a FIFO without a writer
        read_bytes(tmp_path / "fifo", 10)
    with pytest.raises(Untrusted, match="not a regular file"):
        read_bytes(tmp_path / "run", 10)
    with pytest.raises(Untrusted, match="missing"):
        read_bytes(tmp_path / "nope", 10)
    (tmp_path / "big").write_bytes(b"x" * 101)
    with pytest.raises(Untrusted, match="101 bytes, more than the 100"):
        read_bytes(tmp_path / "big", 100)
    assert read_bytes(tmp_path / "big", 100, tail=True) == b"x" * 100
    (tmp_path / "lines").write_bytes(b"a\nb\nc\n")
    assert read_bytes(tmp_path / "lines", 4, tail=True) == b"b\nc\n"


def test_refuses_deep_nesting_surrogates_and_bad_bytes() -> None:
    assert parse_json("[" * MAX_DEPTH + "]" * MAX_DEPTH, "x") is not None
    with pytest.raises(Untrusted, match=f"nested more than {MAX_DEPTH} deep"):
        parse_json("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1), "x")
    with pytest.raises(Untrusted, match="nested more than"):  # past the interpreter's recursion limit
        parse_json("[" * 200_000, "deep.json")
    with pytest.raises(Untrusted, match="deep.json: JSON nested"):
        parse_json('{"a": ' * 100 + "1" + "}" * 100, "deep.json")
    with pytest.raises(Untrusted, match="lone surrogate"):
        parse_json('{"text": "a\\ud800b"}', "x")
    with pytest.raises(Untrusted, match="lone surrogate"):
        parse_json('{"\\udfff": 1}', "x")  # in a key
    with pytest.raises(Untrusted, match="not UTF-8"):
        parse_json(b'{"a": "\xff"}', "x")
    with pytest.raises(Untrusted, match="not JSON"):
        parse_json("{", "x")
    assert isinstance(Untrusted("x"), ValueError)
