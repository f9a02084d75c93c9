"""The command line shared by the experiment scripts: the `--config` flag with its
`--config.X=...` overrides, checked once on the final config; `--print_config`,
`--dry_run`, `--verbose`; errors as one or two lines.

    python -m experiments.train --config configs/sapo.py --print_config   # every field, commented
    python -m experiments.train --config configs/sapo.py --workdir runs/x --dry_run

A script defines its flags with ``define_config_flag`` and runs with ``cli.run(main)``
instead of ``app.run(main)``; ``final_config()`` gives the checked config.

Errors a user makes (a missing config file, a mistyped field, a value out of range, a
checkpoint of another model) end the process with ``error: ...`` and exit status 2 (a bad
command line or config) or 1 (a failure while running), without a traceback; ``--verbose``
shows it.
"""

from __future__ import annotations

import ast
import os
import re
import sys

from absl import app, flags
from ml_collections import config_flags

from configs import base
from policyopt.checkpoint import WorkdirLocked
from policyopt.rl.loop.trainer import UpdatesSkipped
from policyopt.runtime import enable_compilation_cache

_VERBOSE = flags.DEFINE_bool("verbose", False, "Show the traceback of an error.")
_COMPILATION_CACHE = flags.DEFINE_bool(
    "compilation_cache",
    True,
    "Keep compiled programs in JAX's persistent cache ($POLICYOPT_COMPILATION_CACHE, "
    "default ~/.cache/policyopt/jax; docs/runs.md), so a rerun loads them; "
    "--nocompilation_cache compiles everything afresh.",
)


class UsageError(ValueError):
    """A missing or contradictory command-line flag."""


# Errors that speak to the user (a bad field, file or checkpoint): one line, no traceback.
USER_ERRORS = (
    ValueError,
    KeyError,
    FileNotFoundError,
    NotADirectoryError,
    NotImplementedError,
    AttributeError,
    IOError,
)
# Failures of a run that say all there is in one line: the workdir's owner, a run whose
# updates are all skipped by the non-finite guard.
RUN_ERRORS = (WorkdirLocked, UpdatesSkipped)


def interrupted_status(signal_name: str) -> int:
    """The exit status of a run stopped by a signal: 128 + its number (130 for SIGINT)."""
    import signal

    return 128 + int(signal.Signals[signal_name])


def define_workdir_flag():
    """Defines `--workdir`, a run's directory (created; resumed if it holds checkpoints)."""
    return flags.DEFINE_string(
        "workdir", None, "Run directory (created; resumed if it holds checkpoints)."
    )


def required_workdir(holder) -> str:
    """The value of `--workdir` (``holder``: :func:`define_workdir_flag`'s); a usage error
    when it is not given."""
    if holder.value is None:
        raise UsageError("--workdir is required (the run directory)")
    return holder.value


_holder = None


def define_config_flag(help_text: str, *, dry_run: bool = True) -> None:
    """Defines `--config` (a recipe file with an optional `:variant`), whose fields the
    command line overrides with `--config.section.field=value`, and `--print_config`
    (and `--dry_run` with ``dry_run``: the script then implements it)."""
    global _holder
    _holder = config_flags.DEFINE_config_file(
        "config",
        None,
        help_text + " Override any field with --config.section.field=value; "
        "--print_config lists every field with its comment.",
    )
    flags.DEFINE_bool(
        "print_config",
        False,
        "Print the resolved config (recipe, variant and "
        "--config.X overrides), each field with its comment, and exit.",
    )
    if dry_run:
        flags.DEFINE_bool(
            "dry_run",
            False,
            "Check the config and build the run (model shapes, "
            "data, evaluation prompts, checkpoints to start from) without "
            "compiling or writing anything, then exit.",
        )


def config_given() -> bool:
    return _holder is not None and flags.FLAGS["config"].present


def final_config():
    """The config after the recipe, its variant and every `--config.X` override, checked
    (``configs.base.check``) before anything is built or written."""
    if not config_given():
        raise UsageError("--config is required (a recipe file, e.g. configs/sapo.py)")
    config = _holder.value
    base.check(config)
    return config


def config_source() -> str:
    """The `--config` argument and the overrides, for the start-up banner:
    ``configs/sapo.py:model=tiny_dense --config.algo.tau_neg=1.1``."""
    overrides = [arg for arg in sys.argv[1:] if arg.startswith("--config.")]
    return " ".join([flags.FLAGS["config"].serialize().split("=", 1)[-1]] + overrides)


def user_message(error: BaseException) -> str:
    """The one-line (or two-line) form of an error: its own message, without the
    traceback text that config_flags folds into it, and a mistyped field's suggestion."""
    keyed = isinstance(error, (KeyError, AttributeError)) and error.args
    text = str(error.args[0]) if keyed else str(error)
    if "Error whilst parsing config file" in text or "Traceback (most recent call last)" in text:
        # config_flags re-raises the recipe's error with the traceback in its message.
        lines = [line for line in text.splitlines() if line.strip()]
        for i in range(len(lines) - 1, -1, -1):
            if re.match(r"^\w*(Error|Exception): ", lines[i]):
                text = "\n".join([lines[i].split(": ", 1)[1]] + lines[i + 1 :])
                break
    if text[:1] in "'\"":  # ConfigDict's KeyError message arrives as the repr of a string
        try:
            unwrapped = ast.literal_eval(text)
            text = unwrapped if isinstance(unwrapped, str) else text
        except (ValueError, SyntaxError):
            pass
    # ConfigDict's KeyError for a missing field: "'tau_ng'\nDid you mean ...", or the bare
    # name once unquoted above (a missing section: "optimizer").
    unknown = re.match(r"^'?([\w.]+)'?\s*(?:\n(Did you mean .*))?$", text, re.S)
    if unknown and isinstance(error, (KeyError, AttributeError)):
        key, hint = unknown.group(1), (unknown.group(2) or "").strip()
        paths = [
            arg[len("--config.") :].split("=", 1)[0]
            for arg in sys.argv[1:]
            if arg.startswith("--config.")
        ]
        named = next((p for p in paths if key in p.split(".")), None)
        message = named and base.unknown_field(base.base_config(), named)
        if message:  # a `--config.X` override naming no field
            return message
        if hint or text.startswith("'"):
            hint = f": {hint[0].lower()}{hint[1:]}" if hint else ""
            text = f"unknown config field {named or key!r}{hint}"
    return text


def _import_user_modules(argv) -> None:
    """The modules of `--config.imports=...`, imported before the recipe builds its config:
    the objectives they register bring `algo.<setting>` fields that the same command line
    may set. One that does not import is one line naming it."""
    from policyopt import config as schema

    for i, arg in enumerate(argv):
        value = None
        if arg.startswith("--config.imports="):
            value = arg.split("=", 1)[1]
        elif arg == "--config.imports" and i + 1 < len(argv):
            value = argv[i + 1]
        if value is not None:
            try:
                parsed = ast.literal_eval(value)
            except (ValueError, SyntaxError):
                parsed = value
            try:
                schema.import_modules(schema.import_names(parsed))
            except ValueError as error:
                _fail(str(error), 2)


def _check_config_path(argv) -> None:
    """A missing recipe file is named first (config_flags defers its error until the
    config is read, and then reports it under the first override), and a field its
    variant string names twice."""
    for i, arg in enumerate(argv):
        value = None
        if arg.startswith("--config="):
            value = arg.split("=", 1)[1]
        elif arg == "--config" and i + 1 < len(argv):
            value = argv[i + 1]
        if value is not None:
            path, _, variant = value.partition(":")
            if not os.path.isfile(path):
                _fail(f"config file not found: {path!r} (--config={value})", 2)
            try:
                base.check_variant_fields(variant)
            except ValueError as error:
                _fail(str(error), 2)


def _fail(message: str, status: int) -> None:
    print(f"error: {message}", file=sys.stderr)
    if "--verbose" not in sys.argv:
        print("(rerun with --verbose for the traceback)", file=sys.stderr)
    sys.exit(status)


def usage() -> str:
    """The running script's command lines (the first indented block of its docstring) and
    where to find every flag."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    command = f"python -m {spec.name}" if spec else f"python {sys.argv[0]}"
    doc = getattr(sys.modules.get("__main__"), "__doc__", None) or ""
    examples = []
    for line in doc.splitlines()[1:]:
        if line.startswith("    "):
            examples.append(line.rstrip())
        elif examples:
            break
    return "\n".join(["usage:", *examples, f"({command} --helpshort lists every flag)"])


def _usage_fail(error: Exception) -> None:
    """A missing or contradictory flag: the usage, the error, status 2."""
    print(usage(), file=sys.stderr)
    print(f"error: {error}", file=sys.stderr)
    sys.exit(2)


def _parse(argv):
    verbose = "--verbose" in argv
    asks_help = any(arg in ("--help", "-h", "--helpfull", "--helpshort", "-?") for arg in argv)
    if not asks_help:
        _check_config_path(argv)
        _import_user_modules(argv)
    try:
        return flags.FLAGS(argv)
    except SystemExit as exit_:
        if asks_help:  # absl exits 1 after printing the usage; asking for help is no failure
            sys.exit(0)
        raise exit_
    except (flags.Error, *USER_ERRORS) as error:
        if verbose:
            raise
        if isinstance(error, flags.Error) and "Error whilst parsing config file" in str(error):
            _fail(user_message(error), 2)  # the recipe or its variant: the error's own line
        if isinstance(error, flags.Error):  # an unknown, missing or malformed flag
            _usage_fail(error)
        _fail(user_message(error), 2)


def run(main) -> None:
    """``app.run(main)`` with the shared flags: one-line errors, `--print_config`, the
    config checked before ``main`` runs. ``main`` then reads ``final_config()``."""

    def wrapped(argv):
        if _COMPILATION_CACHE.value:
            enable_compilation_cache()  # policyopt.runtime: before anything compiles
        try:
            if config_given():
                config = final_config()
                if flags.FLAGS.print_config:
                    try:
                        print(base.describe(config), flush=True)
                    except BrokenPipeError:  # `--print_config | head`
                        sys.stdout = None
                    return 0
            elif "print_config" in flags.FLAGS and flags.FLAGS.print_config:
                raise UsageError("--print_config needs --config")
        except USER_ERRORS as error:  # the command line or the config: status 2
            if _VERBOSE.value:
                raise
            if isinstance(error, UsageError):
                _usage_fail(error)
            _fail(user_message(error), 2)
        try:
            return main(argv)
        except KeyboardInterrupt:
            if _VERBOSE.value:
                raise
            print("interrupted (nothing saved since the last checkpoint)", file=sys.stderr)
            sys.exit(130)
        except USER_ERRORS + RUN_ERRORS as error:  # while building or running
            if _VERBOSE.value:
                raise
            if isinstance(error, UsageError):
                _usage_fail(error)
            _fail(user_message(error), 1)

    app.run(wrapped, flags_parser=_parse)


def dry_run() -> bool:
    return "dry_run" in flags.FLAGS and flags.FLAGS.dry_run
