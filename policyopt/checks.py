"""One-line errors for settings: a number in a range, a value among choices, a prompt
template.

The config schema's field checks (``policyopt.schema.number``, ``choice``) and the losses'
own arguments use these, naming each field as the config spells it (``config.algo.tau_neg``),
so every error reads alike:

    config.algo.tau_neg must be a finite number > 0.0, got -1.0
"""

from __future__ import annotations

import math
from typing import Any, Iterable


def check_number(
    label: str,
    value: Any,
    *,
    low: float | None = None,
    high: float | None = None,
    low_inclusive: bool = True,
    optional: bool = False,
) -> None:
    """Raises a ValueError naming ``label`` unless ``value`` is a finite int or float (not a
    bool) with ``low <= value`` (``low < value`` if not ``low_inclusive``) and
    ``value <= high``; None passes when ``optional``."""
    if value is None and optional:
        return
    number = not isinstance(value, bool) and isinstance(value, (int, float))
    ok = (
        number
        and math.isfinite(value)
        and (low is None or (value >= low if low_inclusive else value > low))
        and (high is None or value <= high)
    )
    if not ok:
        bound = "" if low is None else (f">= {low}" if low_inclusive else f"> {low}")
        bound += "" if high is None else f"{' and ' if bound else ''}<= {high}"
        raise ValueError(
            f"{label} must be a finite number{' ' + bound if bound else ''}"
            f"{' (or None)' if optional else ''}, got {value!r}"
        )


def check_choice(label: str, value: Any, choices: Iterable) -> None:
    """Raises a ValueError naming ``label`` unless ``value`` is one of ``choices``."""
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"{label} must be one of {choices}, got {value!r}")


def check_prompt_template(label: str, template: str | None) -> None:
    """Raises a ValueError naming ``label`` unless ``template`` (or None) is a format string
    whose only field is ``{question}``, which it contains."""
    if template is None:
        return
    try:
        probe = template.format(question="\0")
    except (IndexError, KeyError, ValueError) as error:
        raise ValueError(
            f"{label}={template!r} is not a format string with only {{question}} ({error!r}); "
            "write literal braces twice, e.g. \\boxed{{}}"
        ) from None
    if "\0" not in probe:
        raise ValueError(f"{label} must contain '{{question}}', got {template!r}")
