"""Pure tier: docs/configuration.md is what hpctrain/config/reference.py makes of the config sections, so a key
added, removed, renamed, retyped or given another default in hpctrain/config/sections.py fails here until the page
is regenerated (`python -m hpctrain.config.reference --write docs/configuration.md`); and every key has a comment
to be described by.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest

from helpers.launch import REPO
from hpctrain.config import SECTIONS
from hpctrain.config import reference as ref

PAGE = REPO / "docs" / "configuration.md"


def test_page_is_generated_from_the_sections() -> None:
    text = PAGE.read_text(encoding="utf-8")
    assert ref.splice(text, ref.reference()) == text, \
        "docs/configuration.md differs from the config sections: run " \
        "`python -m hpctrain.config.reference --write docs/configuration.md`"


def test_every_key_is_in_the_page_with_a_meaning() -> None:
    text = PAGE.read_text(encoding="utf-8")
    for name, cls in SECTIONS.items():
        for key, _, _, meaning in ref.section_rows(cls):
            assert meaning, f"{name}.{key} has no comment in hpctrain/config/sections.py to describe it"
            assert f"| `{name}.{key}` |" in text
    keys = sum(len(dataclasses.fields(cls)) for cls in SECTIONS.values())
    assert text.count("\n| `") == keys  # no row for a key that is gone


@dataclass
class _Example:
    """[example]: a stand-in section."""
    # the comment above,
    # on two lines
    above: int = 3  # and beside
    plain: str = "a|b"  # beside only, <tag> kept
    listed: list[float] = field(default_factory=list)

    bare: bool = True
    # a comment after a blank line belongs to no field above it

    def method(self) -> None:  # not a field
        pass


def test_comments_types_and_defaults_are_read_from_the_source() -> None:
    assert ref.section_rows(_Example) == [
        ("above", "integer", "`3`", "the comment above, on two lines and beside"),
        ("plain", "string", '`"a|b"`', "beside only, <tag> kept"),
        ("listed", "array of floats", "`[]`", ""),
        ("bare", "boolean", "`true`", ""),
    ]
    text = ref.reference({"example": _Example})
    assert text.startswith("### [example]\n\n[example]: a stand-in section.\n\n| key | type | default | meaning |")
    assert "| `example.plain` | string | `\"a\\|b\"` | beside only, &lt;tag> kept |" in text


def test_splice_needs_one_pair_of_markers() -> None:
    assert ref.splice(f"a\n{ref.BEGIN}\nold\n{ref.END}\nz", "new") == f"a\n{ref.BEGIN}\nnew\n{ref.END}\nz"
    with pytest.raises(ValueError, match="exactly one"):
        ref.splice("no markers", "new")
