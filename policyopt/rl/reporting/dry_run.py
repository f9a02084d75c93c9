"""The dry run (``experiments/train.py --dry_run``): builds a run's pieces, checks them and
prints the banner, without compiling a step or writing a file.

Above the trainer in the import order (it uses ``make_prompt_iterator``); nothing in the
library imports it.
"""

from __future__ import annotations

import os

from flax import nnx

from policyopt.checkpoint import Checkpointer
from policyopt.config import typed
from policyopt.models import lora
from policyopt.rl.loop import build
from policyopt.rl.loop.trainer import make_prompt_iterator
from policyopt.rl.reporting.report import (
    advisories,
    banner,
    parameter_count,
    starting_point,
    user_fields,
)
from policyopt.rl.update import adapters


def _critic_of_its_own(config, tokenizer) -> int:
    """Checks ``config.critic.init_checkpoint`` as the run would (``build.critic_config``,
    then its parameters' shapes, no array read) and returns the critic's parameter count
    (its model and value head)."""
    own = build.critic_config(config, tokenizer)

    def make():
        return build.make_model(own, tokenizer.vocab_size, None, with_lora=False)

    critic = make() if own.model.pretrained else nnx.eval_shape(make)  # a folder: its weights
    params = nnx.state(critic, nnx.Param)
    with Checkpointer(own.init_checkpoint) as source:
        build.check_checkpoint_shapes(
            source, {"train": {"params": params}}, own, field="config.critic.init_checkpoint"
        )
    return parameter_count(params) + critic.config.hidden_size + 1


def plan_run(config, workdir: str, *, recipe: str | None = None) -> str:
    """The dry run: checks and builds what a run would (mesh, tokenizer, the model's
    shapes without allocating them, task data with every prompt tokenised, the held-out
    prompts, the reward spec, the checkpoint it would start from and its shapes), without
    compiling a step or writing a file. Returns the banner with the warnings."""
    config = typed(config)
    mesh = build.make_mesh(config)
    tokenizer = build.make_tokenizer(config)
    if config.model.pretrained:
        model = build.make_model(config, tokenizer.vocab_size, None)
    else:
        model = nnx.eval_shape(lambda: build.make_model(config, tokenizer.vocab_size, None))
    params = nnx.state(model, nnx.Param)
    # LoRA: the checkpoints hold the adapters; a full-weight init_checkpoint is the base.
    _, trainable, frozen = lora.split(model)
    notes = []
    if config.task.tfds_dir:  # preparing the tfds files would write them
        notes.append(f"  data      task.tfds_dir={config.task.tfds_dir!r}: not read in a dry run")
        held_out = []
    else:
        make_prompt_iterator(config, build.task_source(config, "train"), seed=config.seed)
        held_out = build.eval_records(config, tokenizer) if config.eval.num_prompts > 0 else []
    build.reward_spec(config)
    directory = os.path.join(workdir, "checkpoints")
    resume_step = None
    if os.path.isdir(directory) and os.listdir(directory):
        with Checkpointer(directory) as checkpointer:
            resume_step = checkpointer.latest_step()
            if resume_step is not None:
                meta = checkpointer.meta()
                adapters.check_kind(meta.get("lora"), config, directory, "resume")
                build.check_resume_config(meta.get("config"), config, directory)
                build.check_checkpoint_shapes(
                    checkpointer, {"train": {"params": trainable}}, config, field="resume"
                )
    if resume_step is None and config.init_checkpoint:
        if not os.path.isdir(config.init_checkpoint):
            raise FileNotFoundError(
                f"config.init_checkpoint={config.init_checkpoint!r} is not a directory"
            )
        saved = adapters.saved_lora(config.init_checkpoint)
        field = "config.init_checkpoint"
        adapters.check_kind(saved, config, config.init_checkpoint, field)
        target = frozen if frozen is not None and saved is None else trainable
        if frozen is not None or saved is None:  # a merged LoRA start has other shapes
            with Checkpointer(config.init_checkpoint) as source:
                build.check_checkpoint_shapes(
                    source, {"train": {"params": target}}, config, field=field
                )
    critic_params = None
    if config.algo.uses_critic and config.critic.init_checkpoint and resume_step is None:
        critic_params = _critic_of_its_own(config, tokenizer)
    text = banner(
        config,
        workdir,
        recipe=recipe,
        num_params=parameter_count(params),
        trainable=None if frozen is None else parameter_count(trainable),
        mesh=mesh,
        start=starting_point(config, directory, resume_step),
        total=config.train.num_iterations,
        critic_params=critic_params,
    )
    lines = [text, f"  held-out  {len(held_out)} prompts", *notes]
    lines += [f"warning: {w}" for w in advisories(config, user_fields(recipe))]
    lines.append("dry run: config checked and run built; nothing compiled, nothing written")
    return "\n".join(lines)
