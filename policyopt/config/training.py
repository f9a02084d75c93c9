"""The sections of the loop around the method: ``optim``, ``train``, ``eval``, ``sft`` and
``mesh``."""

from __future__ import annotations

import dataclasses

from policyopt.schema import Check, choice, integer, number, setting

# float32's smallest normal number (numpy.finfo(numpy.float32).tiny): an Adam eps below it
# is 0 on the device (subnormals flush to zero), which divides 0 by 0 on weights without
# gradient, so every update would be skipped by the non-finite guard.
FLOAT32_TINY = 1.1754943508222875e-38
# Learning rates must be > 0: 0 trains nothing, a negative one ascends the loss.
_LR = number(0.0, low_inclusive=False)


@dataclasses.dataclass(frozen=True)
class Optim:
    """The policy's optimiser: optax AdamW, linear warm-up then constant, global-norm
    clipping (`policyopt.rl.update.learner.make_optimizer`)."""

    lr: float = setting(
        1e-6, "Learning rate.", paper="DeepSeekMath 2402.03300 §4.2: 1e-6", check=_LR
    )
    warmup_steps: int = setting(
        0, "Linear warm-up from 0 over this many updates, then constant.", check=integer(0)
    )
    b1: float = setting(0.9, "Adam's beta1.", check=number(0.0, 1.0))
    b2: float = setting(0.999, "Adam's beta2.", check=number(0.0, 1.0))
    eps: float = setting(
        1e-8,
        "Adam's epsilon.",
        note="At least float32's smallest normal number, 1.18e-38: below it eps is 0 on the "
        "device and every update divides 0 by 0.",
        check=number(FLOAT32_TINY),
    )
    weight_decay: float = setting(0.01, "AdamW weight decay (verl's default).", check=number(0.0))
    max_grad_norm: float | None = setting(
        1.0,
        "Global gradient-norm clipping threshold (verl's default 1.0); None: off.",
        check=number(0.0, low_inclusive=False, optional=True),
    )
    router_lr_scale: float = setting(
        1.0,
        "The MoE routers' learning rate as a multiple of optim.lr (1.0: the same).",
        note="A lever on routing volatility: the routers move faster than the rest of the "
        "policy, so that routing causes more of the ratio's noise (docs/claims.md, "
        '"routing_share"). The policy\'s optimiser only; SFT and the critic keep 1.0.',
        check=number(0.0, low_inclusive=False),
    )


def _loggers() -> Check:
    def fn(label, value):
        from policyopt.loggers import check_loggers

        if not isinstance(value, str):
            raise ValueError(f"{label} must be a comma-separated string, got {value!r}")
        check_loggers(value)

    return Check(fn, "comma-separated of 'jsonl', 'tensorboard', 'wandb', 'mlflow'")


def _keep() -> Check:
    return integer(1, none="keep every checkpoint")


@dataclasses.dataclass(frozen=True)
class Train:
    """The RL loop: iterations, evaluation, checkpoint and logging cadence, samples, the
    non-finite guard and resuming (docs/runs.md)."""

    num_iterations: int = setting(100, "RL iterations (batches).", check=integer(1))
    eval_every: int = setting(
        25, "Evaluate every K iterations (0 = only at the start and the end).", check=integer(0)
    )
    checkpoint_every: int = setting(
        25, "Save a checkpoint every K iterations (and at the end).", check=integer(1)
    )
    keep_checkpoints: int | None = setting(
        2, "Checkpoints kept; None: every checkpoint.", check=_keep()
    )
    log_every: int = setting(1, "Console progress line every K iterations.", check=integer(1))
    loggers: str = setting(
        "jsonl,tensorboard",
        "Where the metrics, the config, the sampled completions and the evaluations go, "
        "comma-separated.",
        note='"jsonl" (metrics.jsonl, always written), "tensorboard" (event files in the run '
        'directory), "wandb" (Weights & Biases; WANDB_MODE=offline writes it to the run '
        'directory) and "mlflow" (MLflow; a file store in the run directory unless '
        "MLFLOW_TRACKING_URI); docs/runs.md. The last two are extras: pip install "
        "'policyopt[wandb]' / 'policyopt[mlflow]'.",
        check=_loggers(),
    )
    routing_metrics: bool = setting(
        True, "Measure routing volatility (an extra router-only forward pass per iteration)."
    )
    allow_config_change: bool = setting(
        False,
        "Resume from the workdir's checkpoint even if the config differs from the one it was "
        "saved under (the changed fields are logged).",
        note="By default a change other than the loop's cadence, the evaluation and the mesh "
        "(`build.RESUME_FREE_FIELDS`) is refused.",
    )
    max_skipped_updates: int = setting(
        10,
        "Stop the run once this many policy or critic updates in a row were skipped by the "
        "non-finite guard.",
        note="Loss, gradient, new parameters or optimiser state not finite: such a run learns "
        "nothing more. The message is one line.",
        check=integer(1),
    )
    sample_every: int = setting(
        10,
        "At iteration 1 and every K iterations (K, 2K, ...; 0 = never), write sampled "
        "completions to samples.jsonl and TensorBoard text.",
        note="The completions of the batch's first `sample_prompts` prompts, with rewards and "
        "verdicts.",
        check=integer(0),
    )
    sample_prompts: int = setting(2, "Prompts whose completions are written.", check=integer(1))
    zero_variance_patience: int = setting(
        5,
        "Warn after this many iterations in a row with no informative group; 0 = never.",
        note="Every group's rewards equal: zero advantage, nothing to learn.",
        check=integer(0),
    )


@dataclasses.dataclass(frozen=True)
class Eval:
    """Held-out evaluation: greedy pass@1, and mean@k at a temperature."""

    num_prompts: int = setting(
        512, "Held-out prompts evaluated (at most task.num_test).", check=integer(0)
    )
    batch_size: int = setting(256, "Prompts per sampler call.", check=integer(1))
    k: int = setting(
        0,
        "mean@k: k samples per prompt at `temperature` (0 = only greedy pass@1).",
        check=integer(0),
    )
    temperature: float = setting(
        1.0, "Temperature of the mean@k samples.", check=number(0.0, low_inclusive=False)
    )


@dataclasses.dataclass(frozen=True)
class Sft:
    """The SFT cold start (experiments/sft.py): next-token training on worked solutions."""

    steps: int = setting(
        300, "Updates of next-token training on worked solutions.", check=integer(0)
    )
    batch_size: int = setting(64, "Sequences per update.", check=integer(1))
    lr: float = setting(
        3e-3, "Its AdamW learning rate (Adam's betas and eps shared with `optim`).", check=_LR
    )
    warmup_steps: int = setting(20, "Linear warm-up, in updates.", check=integer(0))
    lr_decay: str = setting(
        "constant",
        'After the warm-up: "constant", or "cosine" to lr * min_lr_ratio at update sft.steps.',
        note="A run extended past sft.steps (`experiments/sft.py --steps`) continues at that rate.",
        check=choice("constant", "cosine"),
    )
    min_lr_ratio: float = setting(
        0.0, "The cosine's final learning rate over lr.", check=number(0.0, 1.0)
    )
    weight_decay: float = setting(0.0, "Its AdamW weight decay.", check=number(0.0))
    max_grad_norm: float | None = setting(
        1.0,
        "Global gradient-norm clipping threshold; None: off.",
        check=number(0.0, low_inclusive=False, optional=True),
    )
    checkpoint_every: int = setting(
        500,
        "Save a checkpoint every K updates (and at the end); 0: only at the end.",
        check=integer(0),
    )
    overlong_response: str = setting(
        "error",
        'Worked solutions longer than the SFT batch\'s length buckets: "error", "drop" or '
        '"truncate".',
        note="The buckets are the largest of batch.prompt_buckets and batch.response_buckets "
        '(EOS included). "error" raises when the data is built, naming the record; '
        '"truncate" keeps the first tokens, EOS lost: the model learns not to stop.',
        check=choice("error", "drop", "truncate"),
    )


def _axis() -> Check:
    def fn(label, size):
        if isinstance(size, bool) or not isinstance(size, int) or (size < 1 and size != -1):
            raise ValueError(
                f"{label} must be a positive int, or -1 for the devices the other axes "
                f"leave, got {size!r}"
            )

    return Check(fn, "int >= 1, or -1")


@dataclasses.dataclass(frozen=True)
class Mesh:
    """One device mesh over every device of every host (`policyopt.sharding`), one field per
    axis of `policyopt.sharding.MESH_AXES`; the sizes multiply to the device count."""

    data: int = setting(
        -1,
        "Data parallelism: batch rows split, parameters replicated; -1: the devices the other "
        "axes leave.",
        note="At most one axis is -1. The default puts every device on `data`, which on one "
        "CPU is a single device. Parameters and optimiser states are sharded by their logical "
        "axes, batch rows split over data x fsdp (replicated when the row count does not "
        "divide).",
        check=_axis(),
    )
    fsdp: int = setting(
        1,
        "FSDP (ZeRO-3 style): batch rows split and parameters sharded along `embed`.",
        check=_axis(),
    )
    tensor: int = setting(
        1,
        "Tensor parallelism: attention heads, MLP hidden units and the vocabulary split.",
        check=_axis(),
    )
    expert: int = setting(1, "Expert parallelism: the MoE experts split.", check=_axis())

    def sizes(self) -> dict[str, int]:
        """``{axis: size}`` in `policyopt.sharding.MESH_AXES` order."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def validate(self, label: str) -> None:
        free = [name for name, size in self.sizes().items() if size == -1]
        if len(free) > 1:
            raise ValueError(f"{label}: at most one axis may be -1, got -1 for {free}")
