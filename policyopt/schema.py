"""The building blocks of the config schema: a field's default, doc, paper and check in one place.

A section of the run's config (``policyopt.config``) is a frozen dataclass whose fields are
``setting(default, doc, paper=..., check=...)``. From it come the ConfigDict that recipes and
``--config.X`` override (``to_configdict``), the typed section the library receives
(``from_node``, then ``check``), ``--print_config`` and the field reference of
docs/configuration.md. An objective's settings record (``losses.register_objective``) is
written the same way.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, Callable, Iterable

import ml_collections
from ml_collections import config_dict

from policyopt.checks import check_choice, check_number

__all__ = [
    "Check",
    "Field",
    "setting",
    "section",
    "pairs",
    "number",
    "integer",
    "positive",
    "choice",
    "flag",
    "buckets",
    "fields",
    "is_section",
    "to_configdict",
    "from_node",
    "check",
    "to_dict",
]


@dataclasses.dataclass(frozen=True)
class Check:
    """One field's check: ``fn(label, value)`` raises a one-line ValueError naming ``label``;
    ``rule`` says what it accepts, for the reference."""

    fn: Callable[[str, Any], None]
    rule: str

    def __call__(self, label: str, value: Any) -> None:
        self.fn(label, value)


def _is_int(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, int)


def number(
    low: float | None = None,
    high: float | None = None,
    *,
    low_inclusive: bool = True,
    optional: bool = False,
) -> Check:
    """A finite int or float in ``[low, high]`` (``(low, high]`` without ``low_inclusive``);
    None too with ``optional``."""
    bound = "" if low is None else (f">= {low}" if low_inclusive else f"> {low}")
    bound += "" if high is None else f"{' and ' if bound else ''}<= {high}"
    rule = f"number {bound}".strip() + (", or None" if optional else "")
    return Check(
        lambda label, value: check_number(
            label, value, low=low, high=high, low_inclusive=low_inclusive, optional=optional
        ),
        rule,
    )


def integer(least: int, *, none: str | None = None) -> Check:
    """An int (not a bool) ``>= least``; None too when ``none`` says what None means."""
    suffix = f" (or None: {none})" if none else ""

    def fn(label, value):
        if value is None and none:
            return
        if not _is_int(value) or value < least:
            raise ValueError(f"{label} must be an int >= {least}{suffix}, got {value!r}")

    return Check(fn, f"int >= {least}" + (", or None" if none else ""))


def positive(*, optional: bool = False) -> Check:
    """A number > 0 (None too with ``optional``)."""

    def fn(label, value):
        if value is None and optional:
            return
        number_ = not isinstance(value, bool) and isinstance(value, (int, float))
        if not number_ or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{label} must be > 0, got {value}")

    return Check(fn, "> 0" + (", or None" if optional else ""))


def choice(
    *choices, source: Callable[[], Iterable] | None = None, rule: str | None = None
) -> Check:
    """One of ``choices``, or of ``source()`` read when checked (a registry that user modules
    extend); ``rule`` describes a registry's choices for the reference."""

    def fn(label, value):
        check_choice(label, value, tuple(source()) if source else choices)

    if rule is None:
        rule = "one of " + ", ".join(repr(c) for c in choices)
    return Check(fn, rule)


def flag() -> Check:
    """True or False."""

    def fn(label, value):
        if not isinstance(value, bool):
            raise ValueError(f"{label} must be True or False, got {value!r}")

    return Check(fn, "True or False")


def buckets() -> Check:
    """A non-empty tuple of ints >= 1."""

    def fn(label, value):
        if (
            not isinstance(value, (tuple, list))
            or not value
            or any(not _is_int(n) or n < 1 for n in value)
        ):
            raise ValueError(f"{label} must be a non-empty tuple of ints >= 1, got {value!r}")

    return Check(fn, "non-empty tuple of ints >= 1")


def setting(
    default: Any,
    doc: str,
    *,
    paper: str | None = None,
    check: Check | None = None,
    note: str | None = None,
) -> Any:
    """A field of a section: its default, a one-line ``doc``, the ``paper`` its default or
    meaning comes from (arXiv id and section), its ``check``, and an optional longer ``note``
    (``--print_config`` and the reference show it under the doc)."""
    if isinstance(default, (list, dict, set)):
        raise TypeError(f"setting default {default!r}: use a tuple (sections are frozen)")
    metadata = {"doc": doc, "paper": paper, "check": check, "note": note}
    return dataclasses.field(default=default, metadata=metadata)


def pairs(default_factory: Callable[[], tuple], doc: str = "") -> Any:
    """A section's field holding ``((name, value), ...)``: settings that other modules
    define (an objective's, ``policyopt.losses.register_objective``), each a config field of
    the section. Not a config field itself: ``to_dict`` spreads the pairs into the section,
    and the section builds it from its node (``from_config_node``) and checks it."""
    return dataclasses.field(default_factory=default_factory, metadata={"pairs": True, "doc": doc})


def section(cls: type, doc: str = "") -> Any:
    """A nested section (a field holding a section dataclass), built from its defaults."""
    return dataclasses.field(default_factory=cls, metadata={"section": cls, "doc": doc})


@dataclasses.dataclass(frozen=True)
class Field:
    """What the schema says of one field, by its dotted ``path`` (``"algo.tau_neg"``)."""

    path: str
    default: Any
    type: type | None  # the value's type (of a None default: from the annotation)
    doc: str
    paper: str | None
    note: str | None
    check: Check | None


def is_section(cls) -> bool:
    return dataclasses.is_dataclass(cls) and isinstance(cls, type)


def _value_type(annotation) -> type | None:
    """``float | None`` -> float, ``tuple[int, ...]`` -> tuple, ``str`` -> str."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        kinds = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _value_type(kinds[0]) if len(kinds) == 1 else None
    if origin is not None:
        return origin
    return annotation if isinstance(annotation, type) else None


def fields(cls: type, prefix: str = "") -> list[Field]:
    """Every field of section ``cls`` and of its nested sections, flat, in definition order."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if not f.init or "pairs" in f.metadata:
            continue
        path = prefix + f.name
        if "section" in f.metadata:
            out.extend(fields(f.metadata["section"], path + "."))
            continue
        default = f.default
        if default is dataclasses.MISSING:
            raise TypeError(f"{cls.__name__}.{f.name} has no default")
        kind = type(default) if default is not None else _value_type(hints.get(f.name))
        out.append(
            Field(
                path,
                default,
                kind,
                f.metadata.get("doc", ""),
                f.metadata.get("paper"),
                f.metadata.get("note"),
                f.metadata.get("check"),
            )
        )
    return out


def to_configdict(cls: type) -> ml_collections.ConfigDict:
    """The ConfigDict of section ``cls``'s defaults: a None default is a typed placeholder,
    so that ``--config.X=...`` parses its value."""
    node = ml_collections.ConfigDict()
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init or "pairs" in f.metadata:
            continue
        if "section" in f.metadata:
            node[f.name] = to_configdict(f.metadata["section"])
        elif f.default is None:
            node[f.name] = config_dict.placeholder(_value_type(hints.get(f.name)))
        else:
            node[f.name] = f.default
    return node


def from_node(cls: type, node, **extra):
    """Section ``cls`` from a ConfigDict (or dict) ``node`` holding its fields; a field the node
    lacks keeps its default, lists become tuples. Not checked (``check``)."""
    values = {}
    for f in dataclasses.fields(cls):
        if not f.init or "pairs" in f.metadata or f.name in extra or f.name not in node:
            continue
        value = node[f.name]
        if "section" in f.metadata:
            kind = f.metadata["section"]
            build = getattr(kind, "from_config_node", None)  # a section with pairs
            value = build(value) if build else from_node(kind, value)
        elif isinstance(value, list):
            value = tuple(value)
        values[f.name] = value
    return cls(**values, **extra)


def check(obj, label: str) -> None:
    """Checks section ``obj`` (``label``: its dotted name, ``"config.algo"``): each field's
    check, nested sections likewise, then the section's own ``validate(label)`` if it has
    one (its rules between fields). The first failure raises a one-line ValueError."""
    for f in dataclasses.fields(obj):
        if not f.init or "pairs" in f.metadata:
            continue
        value = getattr(obj, f.name)
        if "section" in f.metadata:
            check(value, f"{label}.{f.name}")
        elif f.metadata.get("check") is not None:
            f.metadata["check"](f"{label}.{f.name}", value)
    validate = getattr(obj, "validate", None)
    if validate is not None:
        validate(label)


def to_dict(obj) -> dict:
    """Section ``obj`` as nested plain values (tuples stay tuples), a ``pairs`` field spread
    into its section: the shape of its ConfigDict."""
    out = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if "pairs" in f.metadata:
            out.update(dict(value))
        elif "section" in f.metadata:
            out[f.name] = to_dict(value)
        else:
            out[f.name] = value
    return out
