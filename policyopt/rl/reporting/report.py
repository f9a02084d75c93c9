"""What a run tells its user: the start-up banner, warnings about settings that cannot act,
the critic's warm-up phases, sampled completions (the dry run that prints them without
training: ``policyopt.rl.reporting.dry_run``), and the iteration's batch, scoring and update
metrics.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Any, Collection, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from policyopt.advantages import length_adaptive_lambda, uses_critic
from policyopt.losses import OBJECTIVES
from policyopt.rewards.scoring import merge_metrics


def _ratio_fields(method: str) -> tuple[str, ...]:
    """The config fields of an objective's ratio-dependent part: its settings record's
    (``losses.register_objective``), ``algo.clip_low``, ... ."""
    objective = OBJECTIVES.get(method)
    if objective is None or objective.settings is None:
        return ()
    return tuple(f"algo.{f.name}" for f in dataclasses.fields(objective.settings))


# The fields that decide whether the ratio can leave 1 (how many updates a batch makes,
# where pi_old comes from).
_UPDATE_FIELDS = (
    "algo.method",
    "batch.epochs",
    "batch.n_minibatches",
    "algo.old_log_probs",
    "async_mode.enabled",
)
# The fields that decide a length-adaptive lambda's bound before any rollout.
_LAMBDA_FIELDS = (
    "algo.advantage",
    "algo.gae_length_adaptive",
    "algo.gae_alpha",
    "sampling.max_new_tokens",
)
# Below this mean, a length-adaptive lambda leaves the policy's advantages close to
# one-step TD errors: a warning names the lengths and the fields to change.
SHORT_LAMBDA = 0.5
# A variant's shortcut keys (configs/base.py) and the fields they set: `model=NAME` the
# preset; `scale=paper` the recipe's own paper values (no field of the user's).
_VARIANT_KEYS = {"model": ("model.preset",), "scale": ()}


def user_fields(recipe: str | None) -> frozenset[str] | None:
    """The config fields a command changed from its recipe, read from the recipe string the
    banner shows (``configs/sapo.py:model=tiny_dense,seed=1 --config.algo.tau_neg=1.1``):
    the variant's keys and the ``--config.X`` overrides. None when ``recipe`` is None (a
    config built in code: nothing is known of its origin)."""
    if recipe is None:
        return None
    first, *rest = recipe.split()
    variant = first.split(":", 1)[1] if ":" in first else ""
    fields = set()
    for key in re.findall(r"(?:^|,)\s*([A-Za-z_][\w.]*)\s*=", variant):
        fields.update(_VARIANT_KEYS.get(key, (key,)))
    for token in rest:
        if token.startswith("--config."):
            fields.add(token[len("--config.") :].split("=", 1)[0])
    return frozenset(fields)


def _lambda_max(algo, max_new_tokens: int) -> float:
    return float(length_adaptive_lambda([max_new_tokens], algo.gae_alpha)[0])


def advisories(config, changed: Collection[str] | None = None) -> list[str]:
    """Warnings about a config that runs but in which some settings cannot act.

    - One update per batch (``batch.epochs = 1``, ``batch.n_minibatches = 1``) with pi_old
      from the trainer: the update runs at the parameters that computed pi_old, so the
      ratio is 1 at every token and a method's clip or gate (its settings) changes
      nothing: the update is the plain policy gradient whatever those fields say. Said
      when the command changed one of those fields (``changed``, from ``user_fields``;
      None: always): a recipe that makes one update per batch by design (GRPO's one
      update per exploration stage, Magistral's, the demo's) says so in its banner.
    - A length-adaptive lambda (VAPO, 2504.05118) that the generation budget keeps below
      ``SHORT_LAMBDA`` for every response: ``1 - 1 / (alpha |y|)`` is 0 under ``1 /
      alpha`` tokens, and the policy's advantages are then one-step TD errors. Said when
      the command changed one of ``_LAMBDA_FIELDS`` (VAPO's recipe on the CPU task says
      so in its banner: ``lambda_bound``).
    """
    out = []
    b, algo = config.batch, config.algo
    if on_policy(config):
        ratio = _ratio_fields(algo.method)
        concerned = set(_UPDATE_FIELDS) | set(ratio)
        if changed is None or concerned & set(changed):
            settings = (
                "algo." + " / ".join(name.removeprefix("algo.") for name in ratio)
                if ratio
                else "the objective's ratio-dependent part"
            )
            out.append(
                f"batch.epochs={b.epochs} and batch.n_minibatches={b.n_minibatches}: one update "
                "per batch, at the parameters that computed pi_old, so the ratio is 1 at every "
                f"token and {settings} of algo.method={algo.method!r} change nothing; set "
                "batch.n_minibatches > 1 (or batch.epochs > 1) for off-policy updates"
            )
    lam = lambda_bound(config)
    if (
        lam is not None
        and lam < SHORT_LAMBDA
        and (changed is None or set(_LAMBDA_FIELDS) & set(changed))
    ):
        out.append(
            "algo.gae_length_adaptive: responses are at most sampling.max_new_tokens="
            f"{config.sampling.max_new_tokens} tokens, so lambda_policy = 1 - 1/(algo.gae_alpha "
            f"|y|) is at most {lam:.2f} (0 under {1 / algo.gae_alpha:.0f} tokens) and the "
            "policy's advantages are close to one-step TD errors of the critic; raise "
            "algo.gae_alpha (lambda reaches 0 at 1/alpha tokens) or set "
            "algo.gae_length_adaptive=False"
        )
    return out


def lambda_bound(config) -> float | None:
    """The largest policy lambda a length-adaptive GAE can reach under the generation
    budget (``sampling.max_new_tokens``), or None without one."""
    algo = config.algo
    if not (algo.advantage == "gae" and algo.gae_length_adaptive):
        return None
    return _lambda_max(algo, config.sampling.max_new_tokens)


def short_lambda_warning(config, response_lengths) -> str | None:
    """The warning for a length-adaptive lambda that a batch's responses keep below
    ``SHORT_LAMBDA`` on average (``advisories`` has already said so when the generation
    budget alone does: then None), or None."""
    algo = config.algo
    if not (algo.advantage == "gae" and algo.gae_length_adaptive):
        return None
    if _lambda_max(algo, config.sampling.max_new_tokens) < SHORT_LAMBDA:
        return None
    lengths = np.asarray(response_lengths, np.float32)
    if lengths.size == 0:
        return None
    lam = np.asarray(length_adaptive_lambda(lengths, algo.gae_alpha))
    if float(lam.mean()) >= SHORT_LAMBDA:
        return None
    return (
        f"algo.gae_length_adaptive: this batch's responses average {lengths.mean():.1f} tokens, "
        f"so lambda_policy = 1 - 1/(algo.gae_alpha |y|) averages {lam.mean():.2f} and is 0 for "
        f"{np.mean(lam == 0):.0%} of them (under {1 / algo.gae_alpha:.0f} tokens): the policy's "
        "advantages are close to one-step TD errors of the critic; raise algo.gae_alpha "
        "(lambda reaches 0 at 1/alpha tokens) or set algo.gae_length_adaptive=False"
    )


def on_policy(config) -> bool:
    """One update per batch at the parameters that computed pi_old (synchronous, pi_old
    from the trainer): every ratio is 1, and no clip or gate acts."""
    b = config.batch
    return (
        b.epochs == 1
        and b.n_minibatches == 1
        and config.algo.old_log_probs == "trainer"
        and not config.async_mode.enabled
    )


def method_name(config) -> str:
    """The method a config's settings make, by the setting each paper introduces: VAPO's
    length-adaptive lambda or NLL term on a critic, VC-PPO's value pretraining or decoupled
    lambdas, PPO's critic alone; SAPO's, GSPO's and GSPO-token's objectives (or a registered
    one's name); and for PPO's clipped objective on group advantages, Magistral's
    per-minibatch advantage scale, Dr. GRPO's constant-length aggregation, DAPO's dynamic
    sampling or clip-higher, else GRPO."""
    algo = config.algo
    if algo.advantage == "gae":
        decoupled = algo.gae_lambda_critic is not None and algo.gae_lambda_critic != algo.gae_lambda
        if algo.gae_length_adaptive or algo.nll_coef > 0:
            return "vapo"
        if config.critic.pretrain_iterations > 0 or decoupled:
            return "vc_ppo"
        return "ppo"
    if algo.method != "ppo":
        return algo.method
    if algo.adv_scale == "minibatch":
        return "magistral"
    if algo.aggregation == "seq_mean_token_sum_norm":
        return "dr_grpo"
    if config.dynamic_sampling.enabled or algo.clip_high > algo.clip_low:
        return "dapo"
    return "grpo"


def _span(first: int, last: int) -> str:
    return f"iteration {first}" if first == last else f"iterations {first}-{last}"


def critic_phase(config, iteration: int, metrics: dict | None = None) -> str | None:
    """The console line at the boundary after ``iteration`` iterations of a run with a
    critic warm-up (``critic.reward_model_iterations``, then ``critic.pretrain_iterations``,
    the policy frozen): at the start (``metrics`` None) the phase under way, later the
    phase that ends there with the critic's last figures (``metrics``); None elsewhere."""
    if not uses_critic(config.algo.advantage):
        return None
    reward_model = config.critic.reward_model_iterations
    pretrain = config.critic.pretrain_iterations
    warmup = reward_model + pretrain
    if warmup == 0:
        return None
    frozen = f"the policy is frozen until iteration {warmup + 1}"
    if metrics is None:
        if iteration < reward_model:
            then = f", then pretrains its values in {_span(reward_model + 1, warmup)}"
            return (
                "critic warm-up: the critic trains alone as an outcome reward model in "
                f"{_span(iteration + 1, reward_model)} (critic.reward_model_iterations="
                f"{reward_model}){then if pretrain else ''}; {frozen}"
            )
        if iteration < warmup:
            return (
                "critic warm-up: the critic pretrains its values on Monte-Carlo returns in "
                f"{_span(iteration + 1, warmup)} (critic.pretrain_iterations={pretrain}); {frozen}"
            )
        return None
    figures = [
        f"{name} {metrics[key]:.3g}"
        for key, name in (
            ("critic/value_loss", "value loss"),
            ("critic/explained_variance", "explained variance"),
        )
        if key in metrics
    ]
    shown = f" ({', '.join(figures)})" if figures else ""
    if iteration == reward_model and pretrain:
        return (
            f"critic warm-up: reward model done at iteration {iteration}{shown}; the critic "
            f"pretrains its values in {_span(iteration + 1, warmup)} (critic.pretrain_iterations="
            f"{pretrain}); {frozen}"
        )
    if iteration == warmup:
        done = "value pretraining" if pretrain else "reward model"
        return (
            f"critic warm-up: {done} done at iteration {iteration}{shown}; the policy trains "
            f"from iteration {iteration + 1}"
        )
    return None


def wrap(text: str, *, first: str = "", rest: str = "    ", width: int = 100) -> str:
    """``text`` as lines of at most ``width`` columns (the ``--list`` of
    ``experiments.reproduce`` and ``experiments.ablate``): the first line after ``first``,
    the others after ``rest``; broken at spaces, and a word too long for a line after its
    commas (a variant ``a=1,b=2`` keeps each field whole). A single field longer than a
    line stays whole."""
    room = width - len(rest)
    tokens = []  # (text, a space before it)
    for word in text.split(" "):
        parts = [word] if len(word) <= room else re.findall(r"[^,]*,|[^,]+$", word) or [word]
        tokens += [(part, i == 0) for i, part in enumerate(parts)]
    lines, line, empty = [], first, True
    for token, spaced in tokens:
        gap = " " if spaced and not empty else ""
        if not empty and len(line) + len(gap) + len(token) > width:
            lines.append(line.rstrip())
            line = rest + token
        else:
            line += gap + token
        empty = False
    lines.append(line.rstrip())
    return "\n".join(lines)


def first_iteration_line(seconds: float, compiled: int, loaded: int) -> str:
    """The console line after a run's first iteration: its time and what that time held,
    the programs XLA compiled and those loaded from the persistent compilation cache (a
    rerun of the same recipe, ``policyopt.runtime.enable_compilation_cache``)."""
    head = f"first iteration: {seconds:.1f}s"
    if compiled and loaded:
        return (
            f"{head} with compilation ({compiled} programs compiled, {loaded} loaded from the "
            "compilation cache)"
        )
    if compiled:
        return f"{head} with compilation ({compiled} programs compiled)"
    if loaded:
        return f"{head}, nothing compiled ({loaded} programs loaded from the compilation cache)"
    return f"{head}, nothing compiled (the programs were compiled earlier in this process)"


def parameter_count(params) -> int:
    return int(sum(math.prod(getattr(leaf, "shape", ())) for leaf in jax.tree.leaves(params)))


def _human(count: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.3g}{unit}"
    return str(count)


def starting_point(config, checkpoint_dir: str, resume_step: int | None) -> str:
    if resume_step is not None:
        path = os.path.join(checkpoint_dir, str(resume_step))
        return f"resuming from step {resume_step} ({path})"
    if config.init_checkpoint:
        return f"init_checkpoint {config.init_checkpoint}"
    if config.model.pretrained:
        return f"pretrained {config.model.pretrained}"
    return f"random initialisation (seed {config.seed})"


def banner(
    config,
    workdir: str,
    *,
    recipe: str | None,
    num_params: int,
    mesh,
    start: str,
    total: int,
    kind: str = "RL",
    trainable: int | None = None,
    critic_params: int | None = None,
) -> str:
    """The lines printed when a run starts: what runs, where, from what, on what
    (``trainable``: the parameters that train, when fewer than ``num_params``: LoRA;
    ``critic_params``: those of a critic of its own, ``critic.init_checkpoint``)."""
    devices = jax.devices()
    platforms = sorted({d.platform for d in devices})
    model = config.model.pretrained or config.model.preset
    b = config.batch
    lines = [
        f"{kind} run: {recipe or '(config given in code)'}",
        f"  workdir   {os.path.abspath(workdir)}",
        f"  start     {start}",
        f"  model     {model}, {_human(num_params)} parameters ({num_params:,})"
        + (
            ""
            if trainable is None
            else f"; LoRA rank {config.model.lora.rank} on {config.model.lora.targets}: "
            f"{_human(trainable)} trainable ({trainable:,}), the base frozen"
        ),
        f"  devices   {len(devices)} x {'/'.join(platforms)} over {jax.process_count()} "
        f"process(es); mesh {dict(mesh.shape)}",
    ]
    if kind != "RL":
        lines.append(f"  steps     {total} of {config.sft.batch_size} sequences")
        return "\n".join(lines)
    algo = config.algo
    advantages = "GAE with a critic" if algo.advantage == "gae" else f"{algo.advantage} advantages"
    asynchronous = ", asynchronous generation" if config.async_mode.enabled else ""
    lam = lambda_bound(config)
    if lam is not None and lam < SHORT_LAMBDA:
        advantages += (
            f" (length-adaptive lambda <= {lam:.2f} at sampling.max_new_tokens="
            f"{config.sampling.max_new_tokens}: close to one-step TD advantages)"
        )
    lines.append(
        f"  method    {method_name(config)}: objective {algo.method}, {advantages}{asynchronous}"
    )
    if config.critic.init_checkpoint and critic_params is not None:
        lines.append(
            f"  critic    its own model, {_human(critic_params)} parameters "
            f"({critic_params:,}), from {config.critic.init_checkpoint}"
        )
    updates = "one update per batch, on-policy: the ratio is 1" if on_policy(config) else ""
    lines.append(
        f"  batch     {b.n_prompts} prompts x {b.group_size} samples, {b.n_minibatches} "
        f"minibatch(es) x {b.epochs} epoch(s){f' ({updates})' if updates else ''}, {total} "
        "iterations"
    )
    return "\n".join(lines)


def sample_rows(
    prompts: Sequence[str],
    completions: Sequence[str],
    references: Sequence[Any],
    rewards,
    correct,
    *,
    step: int,
    limit: int,
    status=None,
    format_ok=None,
    split: str = "train",
) -> list[dict]:
    """One JSON-ready record per completion of the first ``limit`` completions: ``step``,
    ``split``, ``prompt``, ``completion``, ``reference``, ``reward``, ``correct`` and the
    verifier's ``status`` / ``format_ok`` when known (``samples.jsonl``)."""
    rows = []
    for i in range(min(limit, len(completions))):
        row = {
            "step": int(step),
            "split": split,
            "prompt": prompts[i],
            "completion": completions[i],
            "reference": str(references[i]),
            "reward": float(rewards[i]),
            "correct": bool(correct[i]),
        }
        if status is not None:
            row["status"] = str(status[i])
        if format_ok is not None:
            row["format_ok"] = bool(format_ok[i])
        rows.append(row)
    return rows


def batch_metrics(merged) -> dict[str, float]:
    """``batch/reward_mean`` and ``batch/accuracy`` over the batch's scored samples: the
    rows that train (dynamic sampling's fillers and missed samples left out; NaN if none)."""
    scored = merged.scored_rows()
    if not scored.any():
        return {"batch/reward_mean": float("nan"), "batch/accuracy": float("nan")}
    return {
        "batch/reward_mean": float(np.mean(merged.rewards[scored])),
        "batch/accuracy": float(np.mean(merged.correct[scored])),
    }


def scoring_metrics(batches: list[dict]) -> dict[str, float]:
    """``reward/*`` verifier-health metrics of the iteration's ``score_batch`` calls (every
    sample scored, dynamic sampling's dropped groups included): format failures,
    verifier timeouts and errors, missed deadlines, crashed workers (counts), mean length
    penalty, language consistency."""
    return {
        f"reward/{key}": value
        for key, value in merge_metrics(batches).items()
        if key != "truncated_fraction"
    }  # reported as response/truncated_fraction


def informative_fraction(
    rewards: np.ndarray, group_size: int, scored: np.ndarray | None = None
) -> float:
    """The fraction of a batch's groups whose scored rewards are not all equal (a group
    with fewer than two scored samples is not informative): the groups that have a
    nonzero group-relative advantage."""
    rewards = np.asarray(rewards, np.float64).reshape(-1, group_size)
    valid = (
        np.ones_like(rewards, bool)
        if scored is None
        else np.asarray(scored, bool).reshape(-1, group_size)
    )
    informative = []
    for row, keep in zip(rewards, valid):
        values = row[keep]
        informative.append(values.size >= 2 and bool(np.ptp(values) > 0))
    return float(np.mean(informative)) if informative else 0.0


# Update metrics that are counts over the minibatches (summed), not means.
UPDATE_COUNTS = ("update/skipped", "critic/skipped", "update/empty", "critic/empty")


class MinibatchMeans:
    """An iteration's update metrics over its minibatches: each metric's mean over the
    minibatches that were updates, NaN when none was, and the ``UPDATE_COUNTS`` summed.

        mean_k = sum_m (1 - empty_m) v_{k,m} / sum_m (1 - empty_m)

    with ``empty_m`` the minibatch's ``update/empty`` (``critic/empty`` for a ``critic/*``
    metric): a minibatch with no token to train on (fillers only, or every token rejected)
    reports zeros, which would dilute the means.
    """

    def __init__(self):
        self.sums: dict = {}
        self.weights: dict = {}

    def add(self, step_metrics: dict) -> None:
        """Adds one minibatch's metrics (scalars, on the device or the host)."""
        for k, v in step_metrics.items():
            if k in UPDATE_COUNTS:
                self.sums[k] = self.sums.get(k, 0.0) + v
                continue
            empty = "critic/empty" if k.startswith("critic/") else "update/empty"
            w = 1.0 - step_metrics[empty]
            self.sums[k] = self.sums.get(k, 0.0) + w * v
            self.weights[k] = self.weights.get(k, 0.0) + w

    def result(self) -> dict:
        """The means and counts, on the host."""
        weights = self.weights
        means = {
            k: v if k in UPDATE_COUNTS else v / jnp.where(weights[k] > 0, weights[k], jnp.nan)
            for k, v in self.sums.items()
        }
        return jax.device_get(means)


def padding_metrics(rnd, packed_slots: int, packed_real: int) -> dict[str, float]:
    """``batch/*`` widths and padding of the batch ``rnd`` (a ``batch.Round``): its prompt
    and response widths, the fraction of its padded rows' slots that are padding, and
    (``config.batch.pack``: ``packed_slots`` > 0) of its packed rows' slots."""
    metrics = {
        "batch/prompt_width": float(rnd.prompt_width),
        "batch/response_width": float(rnd.mask.shape[1]),
        "batch/padding_fraction": 1.0 - float(np.mean(rnd.attention_mask > 0)),
    }
    if packed_slots:
        metrics["batch/packed_padding_fraction"] = 1.0 - packed_real / packed_slots
    return metrics
