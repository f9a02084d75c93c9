"""Shared defaults of every RL recipe (big_vision style: `get_config(arg)` -> ConfigDict).

A recipe (`configs/grpo.py`, `configs/sapo.py`, ...) starts from `base_config()`, sets
the fields its paper fixes (each value cited: paper and section, or marked as this
project's choice; docs/algorithms.md has them all), and calls `finalize(config,
arg)`, which applies the variant string and locks the config, so that a mistyped field,
from a recipe, a variant or the command line, is an error naming it.

Variant strings are comma-separated `key=value` pairs after the file name:

    --config configs/sapo.py:model=tiny_dense,algo.routing_replay=R2

`model=NAME` picks a model preset (`policyopt.models.presets`); `scale=paper` switches to
a real-size model and the settings the paper fixes (learning rate, batch geometry and
generation budget, as the paper states them; for accelerators); where the paper records
no generation budget (GSPO, SAPO, PPO, VC-PPO) the variant must name
`sampling.max_new_tokens`, and fields the paper leaves open keep the CPU defaults (check
`batch.*`); any other key is a
dotted field path, its value a Python literal (tuples in brackets:
`batch.response_buckets=(16,32)`). The command line then overrides single fields:
`--config.algo.tau_neg=1.1`.

Defaults are sized for the CPU: a tiny MoE, the synthetic addition task, 8 prompts x 8
samples, responses of at most 24 tokens.

The defaults, docs, paper references and checks of every field live in one schema,
`policyopt.config` (one typed section per part of a run); `base_config()` is its ConfigDict
and `check` builds the typed sections the library receives. `config.imports` names modules
of your own (objectives, estimators, tasks, verifiers) imported before the check.
"""

from __future__ import annotations

import ast
import json

import ml_collections


def base_config() -> ml_collections.ConfigDict:
    """The shared defaults: every field of the schema (`policyopt.config`) at its default.
    Recipes override what their paper fixes."""
    from policyopt import config as schema

    return schema.default_configdict()


def _parse_value(text: str):
    """`"3"` -> 3, `"1e-3"` -> 0.001, `"True"` -> True, anything else stays a string."""
    if text in ("true", "false"):
        text = text.capitalize()
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def unknown_field(config: ml_collections.ConfigDict, path: str) -> str | None:
    """The one-line error for a dotted field that ``config`` does not have, with the
    closest name (``unknown config field 'optimizer.lr': no section 'optimizer' (did you
    mean 'optim'?)``), or None when the field exists."""
    import difflib

    parts, node = path.split("."), config
    for i, part in enumerate(parts):
        is_section = i < len(parts) - 1
        if not isinstance(node, ml_collections.ConfigDict):
            return f"unknown config field {path!r}: {'.'.join(parts[:i])} is a field, not a section"
        if part in node and (not is_section or isinstance(node[part], ml_collections.ConfigDict)):
            node = node[part]
            continue
        names = [
            key
            for key in node.keys()
            if not is_section or isinstance(node[key], ml_collections.ConfigDict)
        ]
        close = difflib.get_close_matches(part, names, n=1)
        prefix = ".".join(parts[:i] + [""])
        if not is_section:
            hint = f" (did you mean {prefix + close[0]!r}?)" if close else ""
            return f"unknown config field {path!r}{hint}"
        hint = f"did you mean {prefix + close[0]!r}?" if close else "sections: " + ", ".join(names)
        return f"unknown config field {path!r}: no section {prefix + part!r} ({hint})"
    return None


def set_field(config: ml_collections.ConfigDict, path: str, value) -> None:
    """Sets a dotted field, raising a KeyError that names it (``unknown_field``) when it
    does not exist."""
    message = unknown_field(config, path)
    if message is not None:
        raise KeyError(message)
    *parents, name = path.split(".")
    node = config
    for part in parents:
        node = node[part]
    node[name] = value


def split_variant(arg: str) -> list[str]:
    """Splits a variant string at the commas outside brackets and quotes, so that a tuple,
    list or quoted value stays whole: `"a=1,b=(16, 32),c='x,y'"` -> `["a=1", "b=(16, 32)",
    "c='x,y'"]`. Unbalanced brackets or quotes are an error naming the string."""
    items, stack, quote, start = [], [], None, 0
    pairs = {")": "(", "]": "[", "}": "{"}
    for i, char in enumerate(arg):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "([{":
            stack.append(char)
        elif char in pairs:
            if not stack or stack.pop() != pairs[char]:
                raise ValueError(f"config variant {arg!r}: unbalanced {char!r} at position {i}")
        elif char == "," and not stack:
            items.append(arg[start:i])
            start = i + 1
    if stack or quote:
        raise ValueError(f"config variant {arg!r}: unclosed {(quote or stack[-1])!r}")
    items.append(arg[start:])
    return [item for item in items if item.strip()]


# Fields that `scale=paper` must set, from the recipe's paper or from the variant: the
# CPU default (24 tokens) silently changes the methods at scale (VAPO's length-adaptive
# lambda, Dr. GRPO's constant, overlong shaping).
PAPER_SCALE_REQUIRED = ("sampling.max_new_tokens",)

# What every recipe's `scale=paper` sets before its own paper values (this project's
# choices for 16k-40k-token responses on accelerators; the recipe or the variant may
# override them): bf16 matmuls, the decoder layers stacked and scanned with full
# rematerialisation (each layer keeps only its input for the backward: "save_dots" would
# keep every projection's output, ~2.5 GB per layer of Qwen3-8B at 32k tokens), and
# `model.attention="auto"`, which is cuDNN's flash attention on GPUs and splash on TPUs
# (blockwise on CPUs past 1,024 tokens). MoE presets train with the "blocked" dispatch in
# blocks of 4,096 token copies: XLA:GPU (and XLA:CPU) run "ragged" as a product over every
# expert (qwen3_30b_a3b's GSPO update at 32k tokens on 64 devices: 326 GiB per device),
# and small blocks multiply the per-block copies of the expert weights (blocks of 64:
# 248 GiB, 1,024: 71, 4,096: 67 at the time); decode steps, a few tokens per expert,
# keep "ragged" (blocks of 4,096 would pad each expert's tokens to a block). The blocked
# dispatch's matmuls take 65,536 padded rows at a time, recomputed per chunk in the
# backward: whole, the padded buffer and its matmuls' gradients held ~30 GiB per device
# (qwen3_30b_a3b, 32k tokens a device; LoRA rank 32 on 8 devices: 70.87 -> 46.22 GiB).
# TPUs: set `model.moe_dispatch=megablox`. `benchmarks/scale_sim.py` measures the result.
PAPER_SCALE_MODEL = {
    "model.dtype": "bfloat16",
    "model.scan_layers": True,
    "model.remat": "full",
    "model.attention": "auto",
    "model.moe_dispatch": "blocked",
    "model.moe_block_size": 4096,
    "model.moe_chunk_rows": 65536,
    "model.moe_decode_dispatch": "ragged",
}


def check_variant_fields(arg: str | None) -> None:
    """Raises a ValueError naming a field that the variant string `arg` sets twice
    (`model=NAME` sets `model.preset`): in a string a user types, the later value would
    silently win. `apply_variant` itself lets a later item override an earlier one, as
    composed variants need (`experiments/ablate.py`: an arm's, then the command line's)."""
    named = set()
    for item in split_variant(arg or ""):
        key = item.split("=", 1)[0].strip()
        field = "model.preset" if key == "model" else key
        if field in named:
            raise ValueError(
                f"config variant {arg!r}: {field} is given twice (name each field once)"
            )
        named.add(field)


def apply_variant(
    config: ml_collections.ConfigDict, arg: str | None, paper: dict | None = None
) -> ml_collections.ConfigDict:
    """Applies a variant string `key=value,key=value` (see the module docstring); a later
    item overrides an earlier one (`check_variant_fields` refuses that in a user's string).

    Args:
      config: the config to change in place.
      arg: the variant string.
      paper: dotted-field -> value overrides that `scale=paper` applies.
    """
    if not arg:
        return config
    named, paper_scale = set(), False
    for item in split_variant(arg):  # no empty items
        if "=" not in item:
            raise ValueError(f"config variant {item!r} is not key=value (in {arg!r})")
        key, text = (s.strip() for s in item.split("=", 1))
        named.add(key)
        if key == "model":
            config.model.preset = text
        elif key == "imports":
            from policyopt import config as schema

            config.imports = schema.import_names(_parse_value(text))
        elif key == "scale":
            if text != "paper":
                raise ValueError(f"scale={text!r}: only scale=paper is defined")
            if not paper:
                raise ValueError("this recipe defines no paper-scale variant")
            for path, value in {**PAPER_SCALE_MODEL, **paper}.items():
                set_field(config, path, value)
            paper_scale = True
        else:
            set_field(config, key, _parse_value(text))
    missing = [key for key in PAPER_SCALE_REQUIRED if key not in (paper or {}) and key not in named]
    if paper_scale and missing:
        raise ValueError(
            f"scale=paper: this recipe's paper records no value for {', '.join(missing)} "
            f"(docs/algorithms.md); keeping the CPU default would be wrong at scale, so name "
            f"it in the variant, e.g. scale=paper,{missing[0]}=16384"
        )
    return config


def finalize(
    config: ml_collections.ConfigDict, arg: str | None, paper: dict | None = None
) -> ml_collections.ConfigDict:
    """Imports the modules of `imports` (the recipe's or the variant's), adds the settings
    fields of the objectives they register, applies the variant string, checks the config
    and locks it.

    Args:
      config: the recipe's config.
      arg: the variant string after `:` in `--config`.
      paper: dotted-field -> value overrides of the `scale=paper` variant.
    """
    from policyopt import config as schema

    for item in split_variant(arg or ""):  # first: its modules may add fields it sets
        key, _, text = item.partition("=")
        if key.strip() == "imports":
            config.imports = schema.import_names(_parse_value(text.strip()))
    schema.import_modules(schema.import_names(config.imports))
    schema.add_objective_fields(config)
    config = apply_variant(config, arg, paper)
    check(config)
    config.lock()
    return config


def check(config: ml_collections.ConfigDict):
    """Builds the typed config of ``config`` and checks it (``policyopt.config``): the
    modules of ``config.imports`` imported, each section's fields and rules, then the rules
    between sections. Raises a ValueError naming the first field with an impossible value;
    returns the typed config."""
    from policyopt import config as schema

    return schema.from_configdict(config)


def describe(config: ml_collections.ConfigDict, width: int = 100) -> str:
    """The resolved config as `section.field = value` lines, each under its doc from the
    schema (`--print_config`)."""
    from policyopt.config import reference

    return reference.describe(config, width)


def load_run_config(path: str) -> ml_collections.ConfigDict:
    """The config a run wrote (`workdir/config.json`), rebuilt on `base_config()` so that
    every field keeps its type (tuples stay tuples); checked and locked. A field that
    `base_config()` does not have is an error naming it."""
    from policyopt import config as schema

    with open(path) as f:
        values = json.load(f)
    schema.import_modules(schema.import_names(values.get("imports", ())))
    config = base_config()

    def assign(node, tree, prefix):
        for key, value in tree.items():
            name = prefix + key
            if key not in node:
                raise KeyError(f"{path}: {name!r} is not a config field")
            if isinstance(value, dict):
                assign(node[key], value, name + ".")
            else:
                node[key] = tuple(value) if isinstance(value, list) else value

    assign(config, values, "")
    check(config)
    config.lock()
    return config


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    """The base defaults alone (PPO-clip with GRPO advantages, no KL)."""
    return finalize(base_config(), arg)
