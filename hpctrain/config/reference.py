"""The configuration reference, generated from the config sections themselves: for every TOML table ([job],
[parallel], ...) its dataclass's docstring, and for every key its TOML type, its default and what it means, taken
from the comment written for the field in hpctrain/config/sections.py (the comment lines right above the field,
then the one beside it). The sections' source is the one place a key is described; docs/configuration.md holds
this text between its markers, and tests/pure/config/test_config_reference.py fails when the two disagree.

    python -m hpctrain.config.reference                                # print the reference (Markdown)
    python -m hpctrain.config.reference --write docs/configuration.md  # rewrite it between the page's markers

Reads the sections' source with inspect, so it needs the .py files (always there: hpctrain ships as source).
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import json
import sys
import tokenize
import typing
from pathlib import Path

from hpctrain.config.load import SECTIONS

BEGIN, END = "<!-- config:begin -->", "<!-- config:end -->"
TOML_TYPES = {str: "string", int: "integer", float: "float", bool: "boolean"}


def field_comments(cls: type) -> dict[str, str]:
    """{field name: its comment}: the comment-only lines right above the field (no blank line between), then the
    comment on the field's own line(s), joined into one line without the '#'."""
    lines, _ = inspect.getsourcelines(cls)
    source = "".join(lines)
    comments: dict[int, str] = {}  # row -> comment text
    code_rows: set[int] = set()  # rows holding anything but a comment
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                              tokenize.ENDMARKER):
            code_rows.update(range(tok.start[0], tok.end[0] + 1))
    (node,) = ast.parse(source).body
    assert isinstance(node, ast.ClassDef), cls
    out: dict[str, str] = {}
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        above = []
        row = stmt.lineno - 1
        while row in comments and row not in code_rows:
            above.insert(0, comments[row])
            row -= 1
        beside = [comments[r] for r in range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1) if r in comments]
        out[stmt.target.id] = " ".join(above + beside)
    return out


def toml_type(hint: object) -> str:
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint)
        return f"array of {TOML_TYPES[item]}s"
    return TOML_TYPES[hint]


def toml_value(value: object) -> str:
    """A default as it would be written in a config file."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return repr(value)


def default_text(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return f"`{toml_value(f.default)}`"
    if f.default_factory in (list, dict):  # type: ignore[comparison-overlap]
        return f"`{toml_value(f.default_factory())}`"  # type: ignore[misc]
    return "computed when loaded (see its meaning)"  # e.g. job.run_root: depends on $SCRATCH


def cell(text: str) -> str:
    """Comment text made safe inside a Markdown table cell: no column break, no HTML tag (`<stem>` would vanish)."""
    return text.replace("|", "\\|").replace("<", "&lt;")


def section_rows(cls: type) -> list[tuple[str, str, str, str]]:
    """(key, TOML type, default, meaning) for every field of a section dataclass, in source order."""
    hints = typing.get_type_hints(cls)
    comments = field_comments(cls)
    return [(f.name, toml_type(hints[f.name]), default_text(f), comments.get(f.name, ""))
            for f in dataclasses.fields(cls)]  # unescaped: reference() makes them table cells


def reference(sections: dict[str, type] | None = None) -> str:
    """The reference in Markdown: per section a heading, its docstring and a table of its keys."""
    parts = []
    for name, cls in (SECTIONS if sections is None else sections).items():
        doc = " ".join((cls.__doc__ or "").split())
        parts.append(f"### [{name}]\n\n{doc}\n\n| key | type | default | meaning |\n|---|---|---|---|")
        parts[-1] += "".join(f"\n| `{name}.{key}` | {kind} | {cell(default)} | {cell(meaning)} |"
                             for key, kind, default, meaning in section_rows(cls))
    return "\n\n".join(parts)


def splice(text: str, body: str, where: str = "the page") -> str:
    """`text` with `body` between its one pair of config markers."""
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise ValueError(f"{where} needs exactly one {BEGIN} ... {END} section")
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    return f"{head}{BEGIN}\n{body}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hpctrain.config.reference", description=__doc__.splitlines()[0])
    ap.add_argument("--write", metavar="PAGE", type=Path, help="rewrite the reference between PAGE's markers")
    args = ap.parse_args(argv)
    if args.write is None:
        print(reference())
        return 0
    text = args.write.read_text(encoding="utf-8")
    new = splice(text, reference(), str(args.write))
    if new != text:
        args.write.write_text(new, encoding="utf-8")
        print(f"# wrote the configuration reference in {args.write}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
