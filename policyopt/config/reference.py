"""``--print_config`` and the field reference of docs/configuration.md, both from the schema."""

from __future__ import annotations

import dataclasses
import re
import textwrap

import ml_collections

from policyopt import schema
from policyopt.config import RunConfig, objective_fields

PAGE = "docs/configuration.md"
COMMAND = "make config-docs"
_BEGIN = "<!-- fields: {} (generated from the schema by `make config-docs`; do not edit) -->"
_BLOCK = re.compile(r"<!-- fields: (\S*) \(generated[^\n]*-->\n.*?<!-- end fields -->", re.S)


def field_index() -> dict[str, schema.Field]:
    """Every field of the schema by dotted path (``"algo.tau_neg"``), the registered
    objectives' settings after ``algo.method``, each noting the objectives that read it."""
    from policyopt import losses

    index = {}
    for field in schema.fields(RunConfig):
        index[field.path] = field
        if field.path == "algo.method":
            for name, setting in objective_fields().items():
                owners = ", ".join(repr(o) for o in losses.setting_owners(name))
                note = f"A setting of objective {owners}." + (
                    f" {setting.note}" if setting.note else ""
                )
                index["algo." + name] = dataclasses.replace(setting, path="algo." + name, note=note)
    return index


def _comment(field: schema.Field | None) -> str:
    if field is None:
        return ""
    paper = f"[{field.paper}]" if field.paper else ""
    return " ".join(part for part in (field.doc, field.note, paper) if part)


def describe(config: ml_collections.ConfigDict, width: int = 100) -> str:
    """The resolved config as ``section.field = value`` lines, each under its doc and note
    (``--print_config``)."""
    index, lines = field_index(), []

    def visit(node, prefix):
        for key in node.keys():
            value, name = node[key], prefix + key
            if isinstance(value, ml_collections.ConfigDict):
                lines.append(f"\n# ---- {name} " + "-" * max(4, 40 - len(name)))
                visit(value, name + ".")
                continue
            comment = _comment(index.get(name))
            if comment:
                lines.extend(
                    textwrap.wrap(comment, width, initial_indent="# ", subsequent_indent="# ")
                )
            lines.append(f"{name} = {value!r}")

    visit(config, "")
    return "\n".join(lines).lstrip("\n")


def section_reference(section: str) -> str:
    """The markdown list of the fields of ``section`` ("" for the top-level fields): each
    with its default, doc, check, paper and note."""
    out = []
    for path, field in field_index().items():
        head, _, _ = path.rpartition(".")
        if head != section:
            continue
        tags = []
        if field.check is not None:
            tags.append(f"check: {field.check.rule}")
        if field.paper:
            tags.append(f"paper: {field.paper}")
        line = f"- `{path} = {field.default!r}`: {field.doc}"
        line += f" ({'; '.join(tags)})" if tags else ""
        out.append(line + (f"\n  {field.note}" if field.note else ""))
    return "\n".join(out)


def sections() -> list[str]:
    """The section names, "" first (the top-level fields)."""
    names = []
    for path in field_index():
        head = path.rpartition(".")[0]
        if head not in names:
            names.append(head)
    return names


def update_page(text: str) -> str:
    """``text`` (docs/configuration.md) with each generated block rewritten from the schema."""

    def block(match):
        name = match.group(1).strip("`")
        name = "" if name == "top" else name
        body = section_reference(name)
        return f"{_BEGIN.format(match.group(1))}\n{body}\n<!-- end fields -->"

    return _BLOCK.sub(block, text)


def begin_marker(section: str) -> str:
    """The first line of the generated block of ``section`` ("" -> "top")."""
    return _BEGIN.format(section or "top")


def blocks(text: str) -> list[str]:
    """The sections whose generated blocks ``text`` holds ("" for "top")."""
    return ["" if name == "top" else name for name in _BLOCK.findall(text)]
