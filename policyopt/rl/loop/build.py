"""From a config to the objects of a run: device mesh, tokenizer, model, task records,
reward spec, initial parameters. Shared by RL (`policyopt.rl.loop.trainer`) and SFT
(`policyopt.rl.sft`)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from typing import Any, NamedTuple, Sequence

import jax
from absl import logging
from flax import nnx
from jax.sharding import Mesh

from policyopt import sharding
from policyopt.checkpoint import Checkpointer, holds_workdir_lock, unlock_workdir, workdir_owner
from policyopt.config import typed
from policyopt.data import CharTokenizer, HFTokenizer, as_record, load_tokenizer
from policyopt.data.tasks import TASKS
from policyopt.models import Transformer, lora, preset
from policyopt.rewards.custom import VerifierImportError
from policyopt.rewards.scoring import RewardSpec
from policyopt.rl.update import adapters
from policyopt.rl.update.learner import split_params

# Fields of config.model that override the preset. The runtime ones (how the model
# computes, not its shapes) also apply to a pretrained checkpoint.
_RUNTIME_OVERRIDES = (
    "dtype",
    "param_dtype",
    "moe_dispatch",
    "moe_decode_dispatch",
    "moe_block_size",
    "moe_chunk_rows",
    "moe_weight_gather",
    "attention",
    "attention_block_size",
    "scan_layers",
    "remat",
    "moe_ep_transport",
    "moe_ep_buffer_factor",
)
_MODEL_OVERRIDES = (
    "num_layers",
    "hidden_size",
    "num_experts",
    "num_experts_per_tok",
) + _RUNTIME_OVERRIDES


# Config fields a run may change when it resumes from its checkpoint: how long it runs,
# how often it logs, evaluates and saves, the evaluation itself, the mesh (checkpoints
# restore onto any), worker counts, and how the same computation is laid out (MoE
# dispatch and its blocks, decode loops, async slots: the same results up to float
# rounding, chosen per machine). Any other change would continue one experiment under
# another's settings (the data position, for one, counts batches of the old size and
# order), so a resumed run with one refuses to start unless `train.allow_config_change`.
RESUME_FREE_FIELDS = (
    "train.num_iterations",
    "train.eval_every",
    "train.checkpoint_every",
    "train.keep_checkpoints",
    "train.log_every",
    "train.loggers",
    "train.routing_metrics",
    "train.allow_config_change",
    "eval.",
    "mesh.",
    "train.sample_every",
    "train.sample_prompts",
    "train.zero_variance_patience",
    "sft.steps",
    "sft.checkpoint_every",
    "init_checkpoint",
    "reward.num_workers",
    "async_mode.join_timeout_s",
    "async_mode.num_slots",
    "model.moe_dispatch",
    "model.moe_decode_dispatch",
    "model.moe_block_size",
    "model.moe_chunk_rows",
    "model.moe_weight_gather",
    "model.attention",
    "model.attention_block_size",
    "model.remat",
    "model.moe_ep_transport",
    "model.moe_ep_buffer_factor",
    "model.lora.sampler",
    "sampling.decode_segments",
    "batch.micro_batch_tokens",
)


def config_record(config) -> dict:
    """The config (typed, or a ConfigDict) as flat ``{dotted.name: JSON value}``, as a
    checkpoint stores it."""
    flat = {}

    def visit(node, prefix):
        for key, value in node.items():
            if isinstance(value, dict):
                visit(value, prefix + key + ".")
            else:
                flat[prefix + key] = value

    visit(json.loads(typed(config).to_json(sort_keys=True)), "")
    return flat


# Fields whose None means a value the library derives from the rest of the config, and
# fields naming files: a record from an older version (which wrote the derived value) or
# from another spelling of the same path (a symlinked run directory) is the same setting.
DERIVED_FIELDS = {
    "reward.answer_format": lambda record: (
        TASKS[record["task.name"]].answer_format if record.get("task.name") in TASKS else None
    ),
}
PATH_FIELDS = (
    "init_checkpoint",
    "critic.init_checkpoint",
    "task.train_file",
    "task.test_file",
    "task.tfds_dir",
    "model.tokenizer",
)


def resolved_record(record: dict) -> dict:
    """``record`` (``config_record``'s form) with each ``DERIVED_FIELDS`` entry that is None
    replaced by the value the library derives for it, and each ``PATH_FIELDS`` entry by its
    real path: the form in which two records compare as settings."""
    out = dict(record)
    for name, derive in DERIVED_FIELDS.items():
        if name in out and out[name] is None:
            out[name] = derive(out)
    for name in PATH_FIELDS:
        if isinstance(out.get(name), str):
            out[name] = os.path.realpath(out[name])
    return out


def check_resume_config(
    saved: dict | None,
    config,
    directory: str,
    *,
    sections: Sequence[str] | None = None,
    ignore: Sequence[str] = (),
) -> None:
    """Compares the config a checkpoint was saved under (``config_record``) with the
    config resuming from it; a checkpoint without one (older runs) is not checked, nor
    are fields its config does not have (added to the library since it was saved) or
    that the current config no longer has. ``sections``: compare only the fields under
    these prefixes (SFT: what an SFT run reads), default all, but those under ``ignore``.

    Raises:
      ValueError: naming the changed fields, unless ``config.train.allow_config_change``
        (then they are logged as a warning).
    """
    if saved is None:
        return
    saved, current = resolved_record(saved), resolved_record(config_record(config))
    changed = sorted(
        name
        for name in set(saved) & set(current)
        if saved[name] != current[name]
        and (sections is None or any(name == s or name.startswith(s) for s in sections))
        and not any(name.startswith(s) for s in ignore)
        and not any(
            name == free or (free.endswith(".") and name.startswith(free))
            for free in RESUME_FREE_FIELDS
        )
    )
    if not changed:
        return
    lines = "; ".join(f"{name}: {saved[name]!r} -> {current[name]!r}" for name in changed[:8]) + (
        f"; and {len(changed) - 8} more" if len(changed) > 8 else ""
    )
    if config.train.allow_config_change:
        logging.warning("resuming %s under a changed config: %s", directory, lines)
        return
    raise ValueError(
        f"the checkpoint in {directory} was saved under another config ({lines}). Resume with "
        "the same config, start a new workdir (config.init_checkpoint=<that checkpoints "
        "directory> starts from its parameters), or set train.allow_config_change=True to "
        "continue anyway."
    )


def same_evaluation(saved: dict | None, config) -> bool:
    """Whether a checkpoint's config (``config_record``) evaluates as ``config`` does (the
    same ``eval.*`` fields): an evaluation logged at its step is then the one this run
    would do."""
    if saved is None:
        return False
    current = config_record(config)
    return all(
        saved.get(name) == value for name, value in current.items() if name.startswith("eval.")
    )


def make_mesh(config) -> Mesh:
    """The run's mesh over every device (``policyopt.sharding.make_mesh``), one axis size
    per field of ``config.mesh`` (checked by ``configs/base.check``)."""
    shape = {name: int(getattr(config.mesh, name)) for name in sharding.MESH_AXES}
    try:
        return sharding.make_mesh(shape)
    except ValueError as error:
        raise ValueError(f"config.mesh: {error}") from None


def check_mesh(config, mesh: Mesh, num_experts: int) -> None:
    """Refuses a mesh that expert parallelism cannot use (``policyopt.models.expert_parallel``).

    On a mesh with ``expert`` > 1 the MoE block keeps ``num_experts / expert`` experts
    per device and each device routes its own rows, split over the row axes
    (``data`` x ``fsdp`` x ``expert``). So the expert axis must divide the number of
    experts, and the row axes the rows of every RL update (``batch.n_prompts *
    batch.group_size / batch.n_minibatches``).

    Raises:
      ValueError: naming the mesh field, the config field and both numbers.
    """
    n_ep = int(mesh.shape.get("expert", 1))
    if num_experts == 0 or n_ep == 1:
        return
    if num_experts % n_ep:
        raise ValueError(
            f"config.mesh.expert={n_ep} does not divide the model's num_experts="
            f"{num_experts}: expert parallelism holds num_experts / mesh.expert "
            "experts on each device"
        )
    row_axes = [a for a in ("data", "fsdp", "expert") if a in mesh.shape]
    split = 1
    for a in row_axes:
        split *= int(mesh.shape[a])
    b = config.batch
    checks = [
        (
            "batch.n_prompts * batch.group_size / batch.n_minibatches",
            b.n_prompts * b.group_size // max(b.n_minibatches, 1),
        )
    ]
    for name, rows in checks:
        if rows % split:
            sizes = " x ".join(f"mesh.{a}={mesh.shape[a]}" for a in row_axes)
            raise ValueError(
                f"config.{name} = {rows} rows are not divisible by the {split} row "
                f"shards of the mesh ({sizes}): with mesh.expert > 1 every device "
                "routes its own rows to the experts"
            )


@contextlib.contextmanager
def undo_workdir_on_failure(workdir: str):
    """Around building a run whose builder takes ``workdir``'s lock (``lock_workdir``) once
    everything it can check has passed: if the build raises after taking it, the lock is
    released and what the build made is removed (the ``.lock`` file, an empty
    ``checkpoints/``, and the directory itself when it did not exist before), so a failed
    start leaves nothing behind. A lock this process already held is left alone."""
    path = os.path.abspath(workdir)
    existed, held = os.path.isdir(path), holds_workdir_lock(path)
    try:
        yield
    except BaseException:
        if not held and holds_workdir_lock(path):
            unlock_workdir(path)
            for made in (os.path.join(path, ".lock"), os.path.join(path, "checkpoints")):
                with contextlib.suppress(OSError):  # a non-empty checkpoints/ stays
                    os.rmdir(made) if made.endswith("checkpoints") else os.remove(made)
            if not existed:
                with contextlib.suppress(OSError):
                    os.rmdir(path)
        raise


def _pretrained_file(config, name: str) -> str:
    """The path of ``name`` in the ``config.model.pretrained`` folder; an error naming the
    field when the folder or the file is missing."""
    folder = config.model.pretrained
    if not os.path.isdir(folder):
        raise FileNotFoundError(
            f"config.model.pretrained={folder!r} is not a directory (expected a HuggingFace "
            "Qwen3 / Qwen3-MoE checkpoint folder: config.json, tokenizer.json, *.safetensors)"
        )
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"config.model.pretrained={folder!r} has no {name} (expected a HuggingFace "
            "Qwen3 / Qwen3-MoE checkpoint folder: config.json, tokenizer.json, *.safetensors)"
        )
    return path


def make_tokenizer(config):
    """The tokenizer of the run: the pretrained model's ``tokenizer.json``,
    ``config.model.tokenizer`` (``policyopt.data.load_tokenizer``: e.g. a BPE trained on the
    task's files), or the char tokenizer of the synthetic task."""
    if config.model.pretrained:
        _pretrained_file(config, "tokenizer.json")
        return HFTokenizer.from_pretrained(config.model.pretrained)
    if config.model.tokenizer:
        return load_tokenizer(config.model.tokenizer)
    return CharTokenizer()


def lora_config(config, param_dtype: str) -> lora.LoRAConfig:
    """``config.model.lora`` as the model's ``LoRAConfig`` (rank 0: none), the adapters
    stored in ``param_dtype`` (the run's; ``model.lora.base_dtype`` is the base's)."""
    c = config.model.lora
    return lora.LoRAConfig(rank=c.rank, alpha=float(c.alpha), targets=c.targets, dtype=param_dtype)


def make_model(
    config, vocab_size: int, mesh: Mesh | None = None, *, with_lora: bool = True
) -> nnx.Module:
    """The policy: a preset (with ``config.model`` overrides) initialised from
    ``config.seed``, or a HuggingFace checkpoint folder (with the runtime overrides:
    dtypes, MoE dispatch, attention implementation); with LoRA adapters
    (``config.model.lora.rank > 0``, unless ``with_lora`` is False: SFT trains full
    weights), the base held in ``model.lora.base_dtype`` (None: the parameter dtype).

    With ``mesh`` (checked by ``check_mesh`` first) the parameters are born on it, each
    device receiving only its shards (placed by their logical axes as ``init_params``
    places them; the values are those of a build without a mesh), so a model larger than
    one device can be built.

    Raises:
      ValueError: before anything compiles, for a LoRA target the model lacks or a rank
        above a target's smaller dimension (``lora.LoRAConfig.check``).
    """
    overrides = {
        name: getattr(config.model, name)
        for name in _MODEL_OVERRIDES
        if getattr(config.model, name) is not None
    }
    use_lora = with_lora and config.model.lora.rank > 0
    base_dtype = config.model.lora.base_dtype if use_lora else None
    if config.model.pretrained:
        from policyopt.models import from_pretrained

        shapes = sorted(set(overrides) - set(_RUNTIME_OVERRIDES))
        if shapes:
            raise ValueError(
                f"config.model.{shapes[0]} cannot change the shape of the pretrained "
                f"checkpoint {config.model.pretrained!r}; only {_RUNTIME_OVERRIDES} apply"
            )
        _pretrained_file(config, "config.json")
        if use_lora:
            dtype = overrides.get("param_dtype") or "float32"
            overrides["lora"] = lora_config(config, dtype)
            overrides["param_dtype"] = base_dtype or dtype
        model = from_pretrained(config.model.pretrained, mesh=mesh, seed=config.seed, **overrides)
        if mesh is not None:
            check_mesh(config, mesh, model.config.num_experts)
        return model
    model_config = preset(config.model.preset, vocab_size=vocab_size, **overrides)
    if use_lora:
        model_config = model_config.replace(
            param_dtype=base_dtype or model_config.param_dtype,
            lora=lora_config(config, model_config.param_dtype),
        )
    if mesh is not None:
        check_mesh(config, mesh, model_config.num_experts)
    with contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh):
        return Transformer(model_config, rngs=nnx.Rngs(config.seed))


def _prepared_builder(config):
    """The task as tfds array_record files under ``task.tfds_dir`` (prepared once, by the
    first process of a multi-process job while the others wait, then reused; the
    directory must be one that every process sees, e.g. shared storage)."""
    t = config.task
    spec = TASKS[t.name]
    if spec.prepare is None:
        raise ValueError(f"config.task.tfds_dir: task {t.name!r} has no tfds form ({spec.where})")
    prepare = lambda download=True: spec.prepare(t, t.tfds_dir, download)  # noqa: E731
    if jax.process_count() == 1:
        return prepare()
    from jax.experimental import multihost_utils

    builder = error = None
    if jax.process_index() == 0:
        try:
            builder = prepare()
        except Exception as e:  # noqa: BLE001 - re-raised after the barrier, so no process waits forever
            error = e
    multihost_utils.sync_global_devices("policyopt.task.tfds_prepare")
    if error is not None:
        raise error
    if builder is None:
        builder = prepare(download=False)  # opens what process 0 prepared
    return builder


def task_source(config, split: str) -> Sequence:
    """The records of the task's ``"train"`` or ``"test"`` split, as a random-access
    sequence (what the grain pipelines read): the registered task's ``read``
    (``policyopt.data.tasks``: the synthetic arithmetic problems, the rows of local JSONL
    files, or a user's task).

    With ``task.tfds_dir`` the task is written once as tfds array_record files there (its
    ``prepare``, ``policyopt.data.tfds_builders``, named by content) and read back by
    random access instead of being held in memory; text fields then come back as bytes
    (``policyopt.data.as_record`` decodes them). The records are the same.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    t = config.task
    if t.name not in TASKS:
        raise ValueError(f"config.task.name={t.name!r} is not one of {tuple(TASKS)}")
    if t.tfds_dir:
        return _prepared_builder(config).as_data_source(split)
    return TASKS[t.name].read(t, split)


def task_records(config, split: str) -> list[dict]:
    """``task_source`` as a list of records with ``str`` text fields."""
    return [as_record(record) for record in task_source(config, split)]


def eval_records(config, tokenizer) -> list[dict]:
    """The held-out records evaluated: the first ``eval.num_prompts`` of the test split.

    Held-out prompts longer than the largest prompt bucket (chat template included) raise
    here, naming the record, with ``task.overlong_prompt = "error"``; otherwise they are
    left out (logged): a truncated problem is not the problem.
    """
    records = task_records(config, "test")
    limit, kept = max(config.batch.prompt_buckets), []
    for index, record in enumerate(records):
        if len(kept) == config.eval.num_prompts:
            break
        length = len(tokenizer.encode_prompt(record["prompt"]))
        if length <= limit:
            kept.append(record)
        elif config.task.overlong_prompt == "error":
            raise ValueError(
                f"held-out record {index}: prompt of {length} tokens, longer than the "
                f"largest of batch.prompt_buckets ({limit}) ({record['prompt'][:60]!r}...); "
                "set task.overlong_prompt to leave such prompts out"
            )
    if config.eval.num_prompts > 0 and not kept:
        raise ValueError(
            f"no held-out prompt to evaluate: the test split has {len(records)} "
            f"records{f', all longer than {limit} tokens' if records else ''}; set "
            "eval.num_prompts=0 to train without evaluation"
        )
    if len(kept) < min(len(records), config.eval.num_prompts):
        logging.warning(
            "evaluation: held-out prompts longer than %d tokens are left out; %d kept",
            limit,
            len(kept),
        )
    return kept


def _reward_task(config) -> str:
    """``RewardSpec.task`` of the run: the verifier its task names (``policyopt.data.tasks``;
    "math" for a task whose records name their own, ``"mixed_jsonl"``: each sample's then
    says its own, ``score_batch(tasks=)``)."""
    return TASKS[config.task.name].verifier or "math"


def _task_limits(config) -> dict:
    r = config.reward
    return dict(
        task=_reward_task(config),
        verifier=r.verifier or None,
        verifier_timeout_s=float(r.verifier_timeout_s),
        answer_format=r.answer_format or TASKS[config.task.name].answer_format,
        imports=tuple(config.imports),
        code_timeout_s=float(r.code_timeout_s),
        code_memory_mb=int(r.code_memory_mb),
        code_disk_mb=int(r.code_disk_mb),
        code_partial=bool(r.code_partial),
        code_isolation=r.code_isolation,
        code_max_tests=None if r.code_max_tests is None else int(r.code_max_tests),
    )


def reward_spec(config) -> RewardSpec:
    """``RewardSpec`` from ``config.reward`` (length limits default to max_new_tokens).

    The task's verifier: math (the synthetic arithmetic task and math JSONL files: a
    reference answer) or code (``task.name = "code_jsonl"``: tests run in the sandbox),
    or ``config.reward.verifier`` in its place.
    """
    r = config.reward
    max_len = r.max_len or config.sampling.max_new_tokens
    cache_len = r.cache_len or max(1, max_len // 4)
    shaping = r.overlong != "none" or r.overlong_filter
    return _spec(
        format_reward=bool(r.format),
        format_value=float(r.format_value),
        correct_value=float(r.correct_value),
        incorrect_value=float(r.incorrect_value),
        overlong=r.overlong,
        max_len=max_len if shaping else None,
        cache_len=cache_len if r.overlong != "none" else None,
        overlong_filter=bool(r.overlong_filter),
        language_bonus=float(r.language_bonus),
        **_task_limits(config),
    )


def _spec(**fields) -> RewardSpec:
    """``RewardSpec(**fields)``, with a verifier that cannot be imported named as the
    config field that set it (``config.reward.verifier``)."""
    try:
        return RewardSpec(**fields)
    except VerifierImportError as error:
        raise VerifierImportError(
            str(error).replace("RewardSpec.verifier", "config.reward.verifier", 1)
        ) from None


def correctness_spec(config=None) -> RewardSpec:
    """Plain correctness (1 correct / 0 otherwise, no format gate or shaping): the
    evaluation metric, with the run's verifier (math or code, or ``config.reward.verifier``)
    and its limits and ``reward.answer_format``; code tasks run every test (the training
    reward's ``code_max_tests`` cap does not apply) and stop at a sample's first failing
    one (pass@1 needs no pass rate)."""
    if config is None:
        return RewardSpec(task="math", format_reward=False)
    return _spec(
        format_reward=False,
        **(_task_limits(config) | {"code_partial": False, "code_max_tests": None}),
    )


def init_params(config, model: nnx.Module, mesh: Mesh, field: str = "config.init_checkpoint"):
    """``(graphdef, params)`` of the initial policy, placed on ``mesh`` by the parameters'
    logical axes (``policyopt.sharding.shard_params``; a model built on ``mesh`` by
    ``make_model`` is already placed so and is not copied): the model's own
    initialisation, or the parameters of ``config.init_checkpoint`` (an SFT or RL
    checkpoint directory), restored onto those shardings. Full weights (SFT); RL takes
    ``init_policy``."""
    graphdef, params = split_params(model)
    params = sharding.shard_params(params, mesh)
    if config.init_checkpoint:
        directory = check_init_directory(config.init_checkpoint, field)
        target = {"train": {"params": params}}
        with Checkpointer(directory) as source:
            params = source.restore_subtree(
                ("train", "params"),
                params,
                check=lambda step, _: check_checkpoint_shapes(
                    source, target, config, step=step, field=field
                ),
            )
    return graphdef, params


#: The model fields a critic's own checkpoint fixes (what it is, its shapes and its
#: parameters' layout: ``scan_layers`` stacks the layers); the run's other runtime fields
#: (``_RUNTIME_OVERRIDES``) apply to it as to the policy.
_CRITIC_MODEL_FIELDS = (
    ("preset", "pretrained")
    + tuple(name for name in _MODEL_OVERRIDES if name not in _RUNTIME_OVERRIDES)
    + ("scan_layers",)
)


def _vocabulary(tokenizer) -> dict:
    if isinstance(tokenizer, CharTokenizer):
        return dict(enumerate(tokenizer.tokens))
    return tokenizer.tokenizer.get_vocab(with_added_tokens=True)


def critic_config(config, tokenizer, saved: dict | None = None):
    """The run's config with the critic's own model (no adapters): the one
    ``config.critic.init_checkpoint``'s record names, that directory its
    ``init_checkpoint``; or, resuming, the one the run's checkpoints kept (``saved``,
    ``critic_model_record``), with no ``init_checkpoint`` (the run's checkpoint holds its
    parameters, and the source may have moved). What ``critic_model`` builds.

    Raises:
      ValueError: a LoRA checkpoint, a checkpoint that records no config, or one whose
        recorded tokenizer is not the run's (``tokenizer``).
    """
    field = "config.critic.init_checkpoint"
    directory, record = None, saved
    if saved is None:
        directory = check_init_directory(config.critic.init_checkpoint, field)
        with Checkpointer(directory) as source:
            if source.latest_step() is None:
                raise FileNotFoundError(f"{field}: no checkpoint in {directory}")
            meta = source.meta()
        if meta.get("lora"):
            raise ValueError(
                f"{field}={directory!r} holds LoRA adapters; a critic of its own starts from "
                "a full-weight checkpoint (e.g. an SFT run's)"
            )
        record = meta.get("config")
        if not record:
            raise ValueError(f"{field}={directory!r}: its checkpoint records no config (no model)")
    shape = {name: record.get(f"model.{name}") for name in _CRITIC_MODEL_FIELDS}
    model_section = dataclasses.replace(
        config.model,
        **shape,
        tokenizer=record.get("model.tokenizer"),
        lora=dataclasses.replace(config.model.lora, rank=0),
    )
    own = dataclasses.replace(config, model=model_section, init_checkpoint=directory)
    theirs = make_tokenizer(own)
    if type(theirs) is not type(tokenizer) or _vocabulary(theirs) != _vocabulary(tokenizer):
        named = record.get("model.pretrained") or record.get("model.tokenizer") or "char"
        raise ValueError(
            f"{field}={config.critic.init_checkpoint!r} was trained with another tokenizer "
            f"({named!r}, {theirs.vocab_size} tokens) than this run's "
            f"({tokenizer.vocab_size} tokens): the critic would read the policy's token ids "
            "as other tokens"
        )
    return own


def critic_model_record(own) -> dict:
    """The fields of a critic's own model (``critic_config``'s ``own``) that the run's
    checkpoints keep (``meta["critic_model"]``), so that it resumes without its source."""
    return {
        f"model.{name}": getattr(own.model, name) for name in (*_CRITIC_MODEL_FIELDS, "tokenizer")
    }


def saved_critic_model(workdir: str) -> dict | None:
    """The critic model record kept by the latest checkpoint of the run in ``workdir``
    (``critic_model_record``), or None (no checkpoint yet, or none kept)."""
    directory = os.path.join(workdir, "checkpoints")
    if not os.path.isdir(directory):  # a Checkpointer would create it
        return None
    with Checkpointer(directory) as own:
        if own.latest_step() is None:
            return None
        return own.meta().get("critic_model")


def check_dropless(model: nnx.Module, field: str) -> None:
    """Refuses an MoE model whose dispatch drops token copies (``"capacity"``): RL needs
    a dropless one.

    Raises:
      ValueError: naming ``field``.
    """
    dispatches = (model.config.moe_dispatch, model.config.moe_decode_dispatch)
    if model.config.is_moe and "capacity" in dispatches:
        raise ValueError(
            f"{field} 'capacity' drops token copies by their position in the whole forward "
            "call, so a response's log-probs (and values) depend on the rows it is batched "
            "with: the sampler (R rows per step), the old-log-prob pass and each minibatch "
            "would compute different policies (ratio != 1 at the first update) and routing "
            "replay does not replay the drops. RL needs a dropless dispatch ('ragged' or "
            "'blocked')."
        )


def critic_model(config, tokenizer, mesh: Mesh, saved: dict | None = None):
    """The critic's own backbone (``config.critic.init_checkpoint``): the model that
    checkpoint's config record names (preset or HuggingFace folder, its shape overrides
    and layer layout), built with this run's runtime fields and no adapters, its
    parameters restored onto ``mesh``; resuming (``saved``, ``saved_critic_model``), the
    model the run's checkpoints kept, initialised for the restore to overwrite. Returns
    ``(graphdef, params, hidden_size, record)`` (``record``: ``critic_model_record``).

    Raises:
      ValueError: ``critic_config``'s, or parameters of another shape
        (``check_checkpoint_shapes``).
    """
    own = critic_config(config, tokenizer, saved)
    model = make_model(own, tokenizer.vocab_size, mesh, with_lora=False)
    check_dropless(model, "config.critic.init_checkpoint's model: its moe_dispatch")
    graphdef, params = init_params(own, model, mesh, field="config.critic.init_checkpoint")
    return graphdef, params, model.config.hidden_size, critic_model_record(own)


def _init_directory(config) -> str:
    return check_init_directory(config.init_checkpoint, "config.init_checkpoint")


def check_init_directory(directory: str, field: str) -> str:
    """``directory``, a checkpoints directory a run starts from, refused when missing or
    while another process still trains the run that writes it (its workdir's lock is
    held): its latest step would be a partial start, and another one at each read."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"{field}={directory!r} is not a directory")
    workdir = os.path.dirname(os.path.abspath(directory))
    owner = workdir_owner(workdir)
    if owner is not None:
        raise RuntimeError(
            f"{field}={directory!r}: its run is still training (pid {owner} holds "
            f"{os.path.join(workdir, '.lock')}); start once it has finished"
        )
    return directory


class Policy(NamedTuple):
    """The initial policy of an RL run (``init_policy``)."""

    weights: adapters.PolicyWeights  # graphdef, frozen base (LoRA), sampler weights
    trainable: Any  # nnx.State: the adapters (LoRA) or every parameter
    record: dict | None  # adapters.lora_record for the checkpoints' meta (LoRA), else None


def init_policy(config, model: nnx.Module, mesh: Mesh) -> Policy:
    """The RL policy's trainable parameters and frozen base, placed on ``mesh``.

    Full weights: ``init_params``. With LoRA (``policyopt.rl.update.adapters``) the base is the
    model's own (preset from the seed, or HuggingFace folder), or with
    ``config.init_checkpoint`` per ``model.lora.init_checkpoint``: "base" (a full-weight
    checkpoint is the base, fresh adapters), "match" (a LoRA checkpoint's adapters on
    the base its record names, its fingerprint checked); a full-weight run starts from
    a LoRA checkpoint only with "merged" (its base with the adapters merged in). Any
    other pairing is a one-line error before anything compiles
    (``adapters.check_kind``).
    """
    _, trainable, frozen = lora.split(model)
    trainable = sharding.shard_params(trainable, mesh)
    frozen = None if frozen is None else sharding.shard_params(frozen, mesh)
    directory = _init_directory(config) if config.init_checkpoint else None
    saved = adapters.saved_lora(directory) if directory else None
    if directory:
        adapters.check_kind(saved, config, directory, "config.init_checkpoint")

    def shapes(target):
        return lambda source, step: check_checkpoint_shapes(
            source, {"train": {"params": target}}, config, step=step, field="config.init_checkpoint"
        )

    if directory and frozen is None:  # full weights
        if saved is None:
            _, trainable = init_params(config, model, mesh)
        else:  # "merged": a LoRA checkpoint's base with its adapters merged in
            base = adapters.base_of_record(saved, trainable)
            adapters.check_base(saved, base, directory)
            target, scale = adapters.saved_adapters(model.config, saved, mesh, config.seed)
            restored = adapters.restore_params(directory, target, check=shapes(target))
            merge = jax.jit(lambda b, a: lora.merged_params(b, a, scale))
            trainable = sharding.shard_params(merge(base, restored), mesh)
    elif directory and saved is None:  # "base": a full-weight checkpoint is the base
        frozen = adapters.restore_params(directory, frozen, check=shapes(frozen))
    elif directory:  # "match": continue a LoRA checkpoint's adapters on its base
        _check_same_adapters(saved, model.config.lora, directory)
        frozen = adapters.base_of_record(saved, frozen)
        adapters.check_base(saved, frozen, directory)
        trainable = adapters.restore_params(directory, trainable, check=shapes(trainable))
    weights = adapters.make_weights(config, model, trainable, frozen)
    record = None
    if frozen is not None:
        source = saved["base"]["source"] if saved else adapters.base_source(config)
        record = adapters.lora_record(config, model.config, frozen, source)
    return Policy(weights, trainable, record)


def _check_same_adapters(saved: dict, current: lora.LoRAConfig, directory: str) -> None:
    """A LoRA checkpoint continued ("match") must hold this run's rank and targets."""
    theirs = (int(saved["rank"]), tuple(saved["targets"]))
    if theirs != (current.rank, tuple(current.targets)):
        raise ValueError(
            f"config.init_checkpoint={directory} holds adapters of rank {theirs[0]} on "
            f"{','.join(theirs[1])}; this run has model.lora.rank={current.rank}, "
            f"targets={','.join(current.targets)}: use the checkpoint's"
        )


def check_checkpoint_shapes(
    checkpointer: Checkpointer,
    target,
    config,
    *,
    step: int | None = None,
    field: str = "the checkpoint",
) -> None:
    """Compares the shapes of ``target``'s arrays with the checkpoint's (its metadata;
    no array is read) before restoring: a checkpoint of another model would otherwise fail
    deep inside orbax without naming either.

    Raises:
      ValueError: naming the first differing parameters with both shapes, the checkpoint
        directory and step, and the model the checkpoint was saved with (its
        ``model.preset`` / ``model.pretrained`` and shape overrides) against this run's.
    """
    step = checkpointer.latest_step() if step is None else step
    if step is None:
        raise FileNotFoundError(f"{field}: no checkpoint in {checkpointer.directory}")
    diffs, missing = checkpointer.compare_shapes(target, step)
    missing = [name for name in missing if name.startswith("train.params")]
    if not diffs and not missing:
        return
    try:
        record = checkpointer.meta(step).get("config") or {}
    except Exception:  # noqa: BLE001 - the shapes are the error; the record only explains it
        record = {}

    def model_of(values) -> str:
        shapes = [n for n in _MODEL_OVERRIDES if n not in _RUNTIME_OVERRIDES]
        names = ["preset", "pretrained"] + shapes
        parts = [
            f"model.{n}={values.get('model.' + n)!r}"
            for n in names
            if values.get("model." + n) is not None
        ]
        return ", ".join(parts) or "an unrecorded model"

    where = f"{checkpointer.directory} (step {step})"
    lines = [f"{field}: {where} holds another model than this run's"]
    for name, old, new in diffs[:3]:
        short = name.removeprefix("train.params.").removesuffix(".value")
        lines.append(f"  {short}: checkpoint {old}, this run {new}")
    if len(diffs) > 3:
        lines.append(f"  ... and {len(diffs) - 3} more parameters of other shapes")
    if missing:
        names = ", ".join(n.removeprefix("train.params.") for n in missing[:3])
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        lines.append(f"  not in the checkpoint: {names}{more}")
    lines.append(f"  saved with {model_of(record)}; this run: {model_of(config_record(config))}")
    raise ValueError("\n".join(lines))
