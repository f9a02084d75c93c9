"""The run's config schema: one typed section per part of a run, and the rules between them.

``RunConfig`` is the whole schema (a frozen dataclass of sections, each field with its
default, doc, paper and check: ``policyopt.schema``). Recipes and the command line edit
its ConfigDict (``default_configdict``, ml_collections' format); ``from_configdict``
imports the modules of ``imports``, builds the typed sections and checks them, and the
library receives those sections. docs/configuration.md lists every field.
"""

from __future__ import annotations

import dataclasses
import importlib
import json

import ml_collections
from ml_collections import config_dict

from policyopt import schema
from policyopt.config.algo import Algo, Critic, objective_fields
from policyopt.config.model import Lora, Model
from policyopt.config.reward import Reward
from policyopt.config.rollout import AsyncMode, Batch, DynamicSampling, Sampling
from policyopt.config.task import Task
from policyopt.config.training import Eval, Mesh, Optim, Sft, Train
from policyopt.schema import integer, section, setting

__all__ = [
    "RunConfig",
    "Algo",
    "AsyncMode",
    "Batch",
    "Critic",
    "DynamicSampling",
    "Eval",
    "Mesh",
    "Lora",
    "Model",
    "Optim",
    "Reward",
    "Sampling",
    "Sft",
    "Task",
    "Train",
    "add_objective_fields",
    "default_configdict",
    "objective_fields",
    "from_configdict",
    "import_modules",
    "import_names",
    "typed",
]


def _imports() -> schema.Check:
    def fn(label, value):
        if not isinstance(value, tuple) or not all(isinstance(v, str) and v for v in value):
            raise ValueError(f"{label} must be a tuple of module names, got {value!r}")

    return schema.Check(fn, "tuple of module names")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Every setting of a run, by section. Built and checked by ``from_configdict``."""

    seed: int = setting(
        0,
        "Seed of parameter initialisation (when not starting from a checkpoint), of the "
        "sampler's rng stream and of minibatch shuffling.",
        check=integer(0),
    )
    init_checkpoint: str | None = setting(
        None,
        "Orbax checkpoint directory of the base policy (e.g. an SFT run's `checkpoints/`); "
        "None: random initialisation from `seed`.",
    )
    imports: tuple[str, ...] = setting(
        (),
        "Modules imported before the config is checked, e.g. a package of your own that "
        "registers an objective, an advantage estimator, a task or a verifier.",
        note="From the command line: --config.imports=mypkg.rl (several: \"('a','b')\"). "
        'docs/design.md, "Extension points".',
        check=_imports(),
    )
    model: Model = section(Model)
    task: Task = section(Task)
    batch: Batch = section(Batch)
    sampling: Sampling = section(Sampling)
    algo: Algo = section(Algo)
    critic: Critic = section(Critic)
    dynamic_sampling: DynamicSampling = section(DynamicSampling)
    reward: Reward = section(Reward)
    optim: Optim = section(Optim)
    train: Train = section(Train)
    async_mode: AsyncMode = section(AsyncMode)
    mesh: Mesh = section(Mesh)
    eval: Eval = section(Eval)
    sft: Sft = section(Sft)

    def validate(self, label: str) -> None:
        for rule in RULES:
            rule(self)

    def to_dict(self) -> dict:
        """The config as nested plain values, the shape of its ConfigDict (``config.json``;
        tuples stay tuples)."""
        return schema.to_dict(self)

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)


# ---- Rules between sections: each a small function of the sections it relates. -------------


def _buckets_hold_responses(c: RunConfig) -> None:
    """batch x sampling: the response buckets hold max_new_tokens; a micro-batch holds the
    longest row."""
    b, max_new = c.batch, c.sampling.max_new_tokens
    if max(b.response_buckets) < max_new:
        raise ValueError(
            f"config.batch.response_buckets (max {max(b.response_buckets)}) must hold "
            f"sampling.max_new_tokens ({max_new})"
        )
    micro, longest = b.micro_batch_tokens, max(b.prompt_buckets) + max_new
    if micro and micro < longest:
        raise ValueError(
            f"config.batch.micro_batch_tokens ({micro}) is below the longest row, {longest} "
            f"tokens (the largest of batch.prompt_buckets, {max(b.prompt_buckets)}, + "
            f"sampling.max_new_tokens, {max_new}): a micro-batch holds whole rows"
        )


def engine_pages(prompt_width: int, max_new: int, group: int, page_size: int, rows_to_end: int):
    """Pages one engine shard needs for any prompt of 1..P tokens: to admit its group of G
    rows, ceil(L / ps) + (G - 1) [L % ps > 0] + G (`policyopt.engine.group_pages`), and to
    take `rows_to_end` of its rows to their ends alone, floor(L / ps) + rows_to_end
    (ceil((L + N) / ps) - floor(L / ps)) (the full prompt pages are shared)."""
    need = 0
    for length in range(1, prompt_width + 1):
        pages, shared = -(-length // page_size), length // page_size
        admit = pages + (group - 1) * int(length % page_size > 0) + group
        end = shared + rows_to_end * (-(-(length + max_new) // page_size) - shared)
        need = max(need, admit, end)
    return need


def _engine_budget(c: RunConfig) -> None:
    """sampling x batch (x async_mode): `sampling.engine_kv_tokens` against the engine's need
    for the longest prompt (the largest of `batch.prompt_buckets`, or
    `async_mode.prompt_width`): a budget that cannot admit a group leaves the engine waiting
    for pages for ever. The synchronous engine preempts rows down to one, which must reach
    its end; the asynchronous one needs the whole group to reach its end alone."""
    s, group, asynchronous = c.sampling, c.batch.group_size, c.async_mode.enabled
    if s.engine_kv_tokens <= 0:
        return
    if s.engine_rows % group:
        raise ValueError(
            f"config.sampling.engine_rows ({s.engine_rows}) must be a multiple of "
            f"batch.group_size ({group}): rows are refilled by group"
        )
    width = max(c.batch.prompt_buckets, default=1)
    if asynchronous and c.async_mode.prompt_width:
        width = max(1, c.async_mode.prompt_width)
    rows_to_end = group if asynchronous else 1
    need = engine_pages(width, s.max_new_tokens, group, s.engine_page_size, rows_to_end)
    if s.engine_kv_tokens // s.engine_page_size < need:
        where = (
            f"async_mode.prompt_width={width}"
            if asynchronous and c.async_mode.prompt_width
            else f"the largest of batch.prompt_buckets, {width}"
        )
        to_end = f"all {group} rows" if asynchronous else "one row"
        raise ValueError(
            f"config.sampling.engine_kv_tokens ({s.engine_kv_tokens}) is too small for "
            f"batch.group_size={group}: admitting the group of a prompt of up to {width} "
            f"tokens ({where}) and taking {to_end} to sampling.max_new_tokens="
            f"{s.max_new_tokens} takes {need} pages of engine_page_size={s.engine_page_size}; "
            f"the smallest budget that works is engine_kv_tokens={need * s.engine_page_size}"
        )


def _overlong_within_budget(c: RunConfig) -> None:
    """reward x sampling: the length shaping's L_max is reachable."""
    r, max_new = c.reward, c.sampling.max_new_tokens
    if r.overlong != "none" and r.max_len is not None and r.max_len > max_new:
        raise ValueError(
            f"config.reward.max_len ({r.max_len}) must be <= sampling.max_new_tokens "
            f"({max_new}) with reward.overlong={r.overlong!r}: responses stop at "
            "max_new_tokens, so none would get the full overlong penalty"
        )


def _critic_needs_gae(c: RunConfig) -> None:
    """critic x algo x model: the critic's warm-up phases and its own model need a critic;
    its own model has full weights."""
    for name in ("pretrain_iterations", "reward_model_iterations"):
        if not c.algo.uses_critic and getattr(c.critic, name) > 0:
            raise ValueError(f"config.critic.{name} > 0 needs a critic: set algo.advantage='gae'")
    if c.critic.init_checkpoint and not c.algo.uses_critic:
        raise ValueError("config.critic.init_checkpoint needs a critic: set algo.advantage='gae'")
    if c.critic.init_checkpoint and c.model.lora.rank > 0 and c.model.lora.critic == "adapters":
        raise ValueError(
            "config.critic.init_checkpoint is a full-weight value model, but "
            "model.lora.critic='adapters' puts the critic's adapters on the policy's base: "
            "set model.lora.critic='full'"
        )


def _async_groups(c: RunConfig) -> None:
    """async_mode x batch: completions in flight and slots hold whole groups."""
    a, group = c.async_mode, c.batch.group_size
    for name in ("n_async", "num_slots"):
        value = getattr(a, name)
        if value is not None and (value < group or value % group):
            raise ValueError(
                f"config.async_mode.{name} ({value}) must be a positive multiple of "
                f"batch.group_size ({group})"
            )


def _groups_for_group_statistics(c: RunConfig) -> None:
    """algo x batch: group-relative advantages need G >= 2."""
    algo, group = c.algo, c.batch.group_size
    if algo.advantage == "outcome" and group < 2 and "group" in (algo.adv_center, algo.adv_scale):
        raise ValueError(
            f"config.batch.group_size must be >= 2 with group-relative advantages "
            f"(algo.adv_center={algo.adv_center!r}, adv_scale={algo.adv_scale!r}), "
            f"got {group}: a group of one has advantage 0 and trains nothing"
        )


RULES = (
    _buckets_hold_responses,
    _engine_budget,
    _overlong_within_budget,
    _critic_needs_gae,
    _async_groups,
    _groups_for_group_statistics,
)


# ---- From the ConfigDict to the typed config. -----------------------------------------------


def default_configdict() -> ml_collections.ConfigDict:
    """Every field at its default, as the ConfigDict that recipes and `--config.X` edit: the
    schema's, and the ``algo.<setting>`` fields of the registered objectives."""
    config = schema.to_configdict(RunConfig)
    add_objective_fields(config)
    return config


def add_objective_fields(config: ml_collections.ConfigDict) -> None:
    """Adds to an unlocked ConfigDict's ``algo`` the settings fields of objectives registered
    since it was made (by a module of ``imports``), at their defaults."""
    for name, field in objective_fields().items():
        if name not in config.algo:
            config.algo[name] = (
                config_dict.placeholder(field.type) if field.default is None else field.default
            )


def import_names(value) -> tuple[str, ...]:
    """The module names of an ``imports`` value: a tuple of names, each of which may also be
    comma-separated (``--config.imports=a,b`` arrives as ``("a,b",)``)."""
    if isinstance(value, str):
        value = (value,)
    return tuple(part.strip() for item in value for part in str(item).split(",") if part.strip())


def import_modules(names) -> None:
    """Imports each module of ``config.imports`` (they register objectives, estimators, tasks
    or verifiers); one that does not import is a one-line error naming it."""
    for name in names or ():
        try:
            importlib.import_module(name)
        except Exception as error:  # noqa: BLE001 - any failure of the user's module is reported
            raise ValueError(
                f"config.imports: module {name!r} does not import: {type(error).__name__}: {error}"
            ) from None


def from_configdict(node) -> RunConfig:
    """The typed, checked config of a ConfigDict (or a dict of the same shape): the modules
    of ``imports`` imported first, then each section built and checked, then the rules
    between sections. The first fault raises a one-line ValueError naming its field."""
    config = schema.from_node(RunConfig, node)
    if isinstance(config.imports, (tuple, list)):
        names = import_names(config.imports)
        import_modules(names)
        config = dataclasses.replace(config, imports=names)
    schema.check(config, "config")
    return config


def typed(config) -> RunConfig:
    """``config`` as a ``RunConfig``: itself if it is one, else built and checked from a
    ConfigDict (``from_configdict``)."""
    return config if isinstance(config, RunConfig) else from_configdict(config)
