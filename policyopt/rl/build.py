"""From a config to the objects of a run: device mesh, tokenizer, model, task records,
reward spec, initial parameters. Shared by RL (`policyopt.rl.trainer`) and SFT
(`policyopt.rl.sft`)."""

from __future__ import annotations

import contextlib
import functools
import os

import jax
from flax import nnx
from jax.sharding import Mesh

from policyopt import sharding
from policyopt.checkpoint import Checkpointer
from policyopt.data import ArithmeticConfig, CharTokenizer, HFTokenizer, generate_arithmetic
from policyopt.models import Transformer, preset
from policyopt.rewards.batch import RewardSpec
from policyopt.rl.learner import split_params

# Fields of config.model that override the preset. The runtime ones (how the model
# computes, not its shapes) also apply to a pretrained checkpoint.
_RUNTIME_OVERRIDES = ("dtype", "param_dtype", "moe_dispatch", "moe_decode_dispatch",
                      "moe_block_size", "moe_weight_gather")
_MODEL_OVERRIDES = (("num_layers", "hidden_size", "num_experts", "num_experts_per_tok")
                    + _RUNTIME_OVERRIDES)


def make_mesh(config) -> Mesh:
    """The run's mesh over every device (``policyopt.sharding.make_mesh``), one axis size
    per field of ``config.mesh`` (checked by ``configs/base.check``)."""
    shape = {name: int(config.mesh[name]) for name in sharding.MESH_AXES}
    try:
        return sharding.make_mesh(shape)
    except ValueError as error:
        raise ValueError(f"config.mesh: {error}") from None


def make_tokenizer(config):
    """The tokenizer of the run: the char tokenizer of the synthetic task, or the
    pretrained model's ``tokenizer.json``."""
    if config.model.pretrained:
        return HFTokenizer.from_pretrained(config.model.pretrained)
    return CharTokenizer()


def make_model(config, vocab_size: int, mesh: Mesh | None = None) -> nnx.Module:
    """The policy: a preset (with ``config.model`` overrides) initialised from
    ``config.seed``, or a HuggingFace checkpoint folder (with the runtime overrides:
    dtypes and MoE dispatch).

    With ``mesh`` the parameters are born on it, each device receiving only its shards
    (placed by their logical axes as ``init_params`` places them; the values are those of
    a build without a mesh), so a model larger than one device can be built.
    """
    overrides = {name: config.model[name] for name in _MODEL_OVERRIDES if config.model[name] is not None}
    if config.model.pretrained:
        from policyopt.models import from_pretrained

        shapes = sorted(set(overrides) - set(_RUNTIME_OVERRIDES))
        if shapes:
            raise ValueError(f"config.model.{shapes[0]} cannot change the shape of the pretrained "
                             f"checkpoint {config.model.pretrained!r}; only {_RUNTIME_OVERRIDES} apply")
        return from_pretrained(config.model.pretrained, mesh=mesh, **overrides)
    model_config = preset(config.model.preset, vocab_size=vocab_size, **overrides)
    with contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh):
        return Transformer(model_config, rngs=nnx.Rngs(config.seed))


def task_config(config) -> ArithmeticConfig:
    task = config.task
    if task.name != "arithmetic":
        raise ValueError(f"config.task.name={task.name!r}: only 'arithmetic' is built in")
    return ArithmeticConfig(num_operands=task.num_operands, min_digits=task.min_digits,
                            max_digits=task.max_digits, operators=task.operators,
                            wrong_procedure_fraction=task.wrong_procedure_fraction)


@functools.lru_cache(maxsize=8)
def _records(arith: ArithmeticConfig, split: str, seed: int, num: int) -> tuple:
    return tuple(generate_arithmetic(arith, split=split, seed=seed, num_examples=num))


def task_records(config, split: str) -> list[dict]:
    """Records of the task's ``"train"`` or ``"test"`` split (deterministic, cached)."""
    num = config.task.num_train if split == "train" else config.task.num_test
    return list(_records(task_config(config), split, int(config.task.seed), int(num)))


def reward_spec(config) -> RewardSpec:
    """``RewardSpec`` from ``config.reward`` (length limits default to max_new_tokens).

    The task is math: the trainer's tasks (``task_config``) are math problems. The code
    verifier (``RewardSpec(task="code")``) is used through ``policyopt.rewards`` directly.
    """
    r = config.reward
    max_len = r.max_len or config.sampling.max_new_tokens
    cache_len = r.cache_len or max(1, max_len // 4)
    shaping = r.overlong != "none" or r.overlong_filter
    return RewardSpec(
        task="math", format_reward=bool(r.format), format_value=float(r.format_value),
        correct_value=float(r.correct_value), incorrect_value=float(r.incorrect_value),
        overlong=r.overlong, max_len=max_len if shaping else None,
        cache_len=cache_len if r.overlong != "none" else None,
        overlong_filter=bool(r.overlong_filter),
        language_bonus=0.1 if r.language_bonus else 0.0)


def correctness_spec() -> RewardSpec:
    """Plain correctness (1 correct / 0 otherwise): the evaluation metric."""
    return RewardSpec(task="math", format_reward=False)


def init_params(config, model: nnx.Module, mesh: Mesh):
    """``(graphdef, params)`` of the initial policy, placed on ``mesh`` by the parameters'
    logical axes (``policyopt.sharding.shard_params``; a model built on ``mesh`` by
    ``make_model`` is already placed so and is not copied): the model's own
    initialisation, or the parameters of ``config.init_checkpoint`` (an SFT or RL
    checkpoint directory), restored onto those shardings."""
    graphdef, params = split_params(model)
    params = sharding.shard_params(params, mesh)
    if config.init_checkpoint:
        directory = config.init_checkpoint
        if not os.path.isdir(directory):
            raise FileNotFoundError(f"config.init_checkpoint={directory!r} is not a directory")
        with Checkpointer(directory) as source:
            params = source.restore_subtree(("train", "params"), params)
    return graphdef, params
