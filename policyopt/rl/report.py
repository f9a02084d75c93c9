"""What a run tells its user: the start-up banner, warnings about settings that cannot act,
sampled completions (the dry run that prints them without training:
``policyopt.rl.dry_run``), and the iteration's batch, scoring and update metrics.
"""

from __future__ import annotations

import math
import os
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from policyopt.rewards.batch import merge_metrics

# Which settings each objective's ratio-dependent part reads (policyopt.losses).
_RATIO_SETTINGS = {
    "ppo": "algo.clip_low / clip_high / dual_clip",
    "gspo": "algo.clip_low / clip_high",
    "gspo_token": "algo.clip_low / clip_high",
    "sapo": "algo.tau_pos / tau_neg (the gate is 1)",
}


def advisories(config) -> list[str]:
    """Warnings about a config that runs but in which some settings cannot act.

    - One update per batch (``batch.epochs = 1``, ``batch.n_minibatches = 1``) with pi_old
      from the trainer: the update runs at the parameters that computed pi_old, so the
      ratio is 1 at every token and a method's clip or gate (``_RATIO_SETTINGS``) changes
      nothing: the update is the plain policy gradient whatever those fields say.
    """
    out = []
    b, algo = config.batch, config.algo
    one_update = b.epochs == 1 and b.n_minibatches == 1
    synchronous = not config.async_mode.enabled
    if one_update and algo.old_log_probs == "trainer" and synchronous:
        settings = _RATIO_SETTINGS.get(algo.method, "the objective's ratio-dependent part")
        out.append(
            f"batch.epochs=1 and batch.n_minibatches=1: one update per batch, at the "
            f"parameters that computed pi_old, so the ratio is 1 at every token and "
            f"{settings} of algo.method={algo.method!r} change nothing; set "
            "batch.n_minibatches > 1 (or batch.epochs > 1) for off-policy updates"
        )
    return out


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
) -> str:
    """The lines printed when a run starts: what runs, where, from what, on what
    (``trainable``: the parameters that train, when fewer than ``num_params``: LoRA)."""
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
        f"  method    {config.algo.method}, {b.n_prompts} prompts x {b.group_size} samples, "
        f"{b.n_minibatches} minibatch(es) x {b.epochs} epoch(s), {total} iterations"
        if kind == "RL"
        else f"  steps     {total} of {config.sft.batch_size} sequences",
    ]
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
