r"""The explained variance a perfect critic reaches on a setting's task under its SFT
policy: the ceiling of ``critic/rollout_explained_variance`` (docs/claims.md "vc_ppo").

With gamma = lambda_critic = 1 every response token's return is its response's outcome
reward R, and no value function of the state s_t (prompt and response before token t)
explains more than ``1 - E_t[Var(R | s_t)] / Var_t(R)`` of it, both over the response
tokens: ``R - E[R | s_t]`` is noise that no critic removes. This estimates that bound by
Monte Carlo: ``responses`` sampled as the trainer samples them (training prompts, the
rollout temperature), ``positions`` token positions drawn uniformly in each, and
``continuations`` completions from each prefix, whose sample variance estimates
``Var(R | s_t)`` (unbiased; each position weighted by its response's length / positions,
so that the mean is over tokens).

    python -m experiments.value_ceiling --setting testbed_long --sft_root runs
"""

from __future__ import annotations

import json
import os
from typing import Sequence

import jax
import numpy as np
from absl import app, flags

from configs.ablations import SETTINGS
from policyopt.rewards.scoring import score_batch
from policyopt.rl.loop import build
from policyopt.rl.reporting.evaluate import complete

#: Relative positions in a response (t / |y|) whose noise ``ceiling`` reports apart.
DEPTH_BINS = (0.0, 0.25, 0.5, 0.75, 1.0)


def ceiling(
    lengths: Sequence[int],
    rewards: Sequence[float],
    positions: np.ndarray,
    continuation_rewards: np.ndarray,
    *,
    bootstrap: int = 1000,
    seed: int = 0,
) -> dict:
    """The explained-variance ceiling from sampled responses and their prefixes' rollouts.

    Args:
      lengths: ``[N]`` response lengths |y_i| (the valid tokens a critic is scored on).
      rewards: ``[N]`` their outcome rewards R_i.
      positions: ``[N, K]`` token positions t in ``[0, |y_i|)``, drawn uniformly.
      continuation_rewards: ``[N, K, M]`` the rewards of M >= 2 completions of each prefix
        (the prompt and ``y_i[:t]``).
      bootstrap: resamples of the responses for the 95% interval (0: none).
      seed: the resampling's seed.

    Returns:
      ``explained_variance_ceiling`` = 1 - noise / return_variance, ``return_variance``
      (Var_t R over the tokens), ``noise`` (E_t Var(R | s_t)), ``noise_by_depth`` (the
      noise of the positions in each ``DEPTH_BINS`` interval of t / |y|), and with
      ``bootstrap`` the interval ``explained_variance_ceiling_95``. Constant returns give
      a ceiling of 1 (``losses.explained_variance``'s convention) and no interval.
    """
    lengths = np.asarray(lengths, np.float64)
    rewards = np.asarray(rewards, np.float64)
    positions = np.asarray(positions)
    outcomes = np.asarray(continuation_rewards, np.float64)
    n, k = positions.shape
    if lengths.shape != (n,) or rewards.shape != (n,) or outcomes.shape[:2] != (n, k):
        raise ValueError(
            f"lengths {lengths.shape}, rewards {rewards.shape}, positions {positions.shape} "
            f"and continuation_rewards {outcomes.shape} must be [N], [N], [N, K], [N, K, M]"
        )
    if outcomes.ndim != 3 or outcomes.shape[2] < 2:
        raise ValueError(f"continuation_rewards needs M >= 2 completions, got {outcomes.shape}")
    if np.any(lengths < 1) or np.any(positions < 0) or np.any(positions >= lengths[:, None]):
        raise ValueError("every response needs >= 1 token and positions in [0, |y|)")
    variance = outcomes.var(axis=2, ddof=1)  # [N, K]: unbiased Var(R | s_t)

    def figures(rows):
        weights = lengths[rows]
        mean = np.sum(weights * rewards[rows]) / weights.sum()
        returns_var = np.sum(weights * (rewards[rows] - mean) ** 2) / weights.sum()
        noise = np.sum(weights * variance[rows].mean(axis=1)) / weights.sum()
        return returns_var, noise

    every = np.arange(n)
    returns_var, noise = figures(every)
    depth = positions / lengths[:, None]
    by_depth = {}
    for low, high in zip(DEPTH_BINS[:-1], DEPTH_BINS[1:]):
        inside = (depth >= low) & (depth < high)
        if inside.any():
            weights = np.broadcast_to(lengths[:, None], depth.shape)[inside]
            by_depth[f"{low:g}-{high:g}"] = float(
                np.sum(weights * variance[inside]) / weights.sum()
            )
    out = {
        "explained_variance_ceiling": float(1 - noise / returns_var) if returns_var else 1.0,
        "return_variance": float(returns_var),
        "noise": float(noise),
        "noise_by_depth": by_depth,
        "responses": n,
        "positions": k,
        "continuations": int(outcomes.shape[2]),
        "tokens": int(lengths.sum()),
    }
    if bootstrap:
        rng = np.random.default_rng(seed)
        draws = []
        for _ in range(bootstrap):
            rows = rng.integers(0, n, n)
            r_var, r_noise = figures(rows)
            if r_var > 0:
                draws.append(1 - r_noise / r_var)
        if draws:  # (none when every resample's returns are constant)
            out["explained_variance_ceiling_95"] = [
                float(np.quantile(draws, 0.025)),
                float(np.quantile(draws, 0.975)),
            ]
    return out


def measure(
    config,
    *,
    num_prompts: int = 64,
    samples: int = 2,
    positions: int = 4,
    continuations: int = 16,
    batch_size: int = 16,
    seed: int = 0,
) -> dict:
    """``ceiling`` of ``config``'s policy (its ``init_checkpoint``) on its training prompts.

    ``num_prompts`` x ``samples`` responses at ``config.sampling.temperature``, each with
    ``positions`` prefixes completed ``continuations`` times (the rollout budget
    ``config.sampling.max_new_tokens`` counts the prefix), scored by the run's reward
    (``build.reward_spec``). Needs a tokenizer that encodes a prompt and a prefix of its
    response as the two concatenated (the character tokenizer of the synthetic tasks).
    """
    tokenizer = build.make_tokenizer(config)
    model = build.make_model(config, tokenizer.vocab_size)
    mesh = build.make_mesh(config)
    graphdef, params = build.init_params(config, model, mesh)
    spec = build.reward_spec(config)
    records = build.task_records(config, "train")[:num_prompts]
    prompts = [r["prompt"] for r in records]
    answers = [r["answer"] for r in records]
    budget = config.sampling.max_new_tokens
    buckets = tuple(sorted(set(config.batch.prompt_buckets) | {2**p for p in range(4, 16)}))
    rng = jax.random.PRNGKey(seed)
    with jax.set_mesh(mesh):
        texts, lengths = complete(
            graphdef,
            params,
            prompts,
            tokenizer,
            max_new_tokens=budget,
            batch_size=min(batch_size * continuations // samples, len(prompts)),
            prompt_buckets=buckets,
            rng=rng,
            temperature=config.sampling.temperature,
            num_samples=samples,
        )
        references = [a for a in answers for _ in range(samples)]
        scores = score_batch(texts, references, lengths, spec)
        rewards = scores.rewards
        response_prompts = [p for p in prompts for _ in range(samples)]
        draw = np.random.default_rng(seed)
        chosen = np.stack([draw.integers(0, n, positions) for n in lengths])
        prefixes, owners = [], []
        for i, (prompt, text) in enumerate(zip(response_prompts, texts)):
            ids = tokenizer.encode(text)
            for t in chosen[i]:
                prefix = tokenizer.decode(ids[:t])
                if tokenizer.encode_prompt(prompt + prefix) != (
                    tokenizer.encode_prompt(prompt) + ids[:t]
                ):
                    raise ValueError(
                        "value_ceiling needs a tokenizer that encodes prompt + prefix as "
                        "their concatenation (the character tokenizer)"
                    )
                prefixes.append((prompt + prefix, prefix, int(t), references[i]))
                owners.append(i)
        order = sorted(range(len(prefixes)), key=lambda j: len(prefixes[j][0]))
        completions, counts = complete(
            graphdef,
            params,
            [prefixes[j][0] for j in order],
            tokenizer,
            max_new_tokens=budget,
            batch_size=batch_size,
            prompt_buckets=buckets,
            rng=jax.random.fold_in(rng, 1),
            temperature=config.sampling.temperature,
            num_samples=continuations,
        )
    full, full_lengths, full_refs = [], [], []
    for rank, j in enumerate(order):
        _, prefix, t, reference = prefixes[j]
        for c in range(continuations):
            index = rank * continuations + c
            # The rollout budget counts the prefix: a continuation past it is cut there.
            keep = budget - t
            text = completions[index]
            if counts[index] > keep:
                text = tokenizer.decode(tokenizer.encode(text)[:keep])
            full.append(prefix + text)
            full_lengths.append(t + min(int(counts[index]), keep))
            full_refs.append(reference)
    scored = np.asarray(score_batch(full, full_refs, full_lengths, spec).rewards, np.float64)
    outcomes = np.empty((len(prefixes), continuations))
    for rank, j in enumerate(order):
        outcomes[j] = scored[rank * continuations : (rank + 1) * continuations]
    result = ceiling(
        lengths,
        rewards,
        chosen,
        outcomes.reshape(len(texts), positions, continuations),
        seed=seed,
    )
    result["accuracy"] = float(np.mean(np.asarray(scores.correct)))
    result["length_mean"] = float(np.mean(lengths))
    return result


def define_flags() -> None:
    flags.DEFINE_string("setting", "testbed_long", f"One of: {', '.join(SETTINGS)}.")
    flags.DEFINE_string("recipe", "vc_ppo", "The recipe (configs/<recipe>.py) set in it.")
    flags.DEFINE_string("sft_root", "runs", "Cache of the settings' SFT starts.")
    flags.DEFINE_integer("start", 0, "The SFT start (experiments/reproduce.py sft_dir).")
    flags.DEFINE_integer("num_prompts", 64, "Training prompts.")
    flags.DEFINE_integer("samples", 2, "Responses per prompt.")
    flags.DEFINE_integer("positions", 4, "Prefixes per response.")
    flags.DEFINE_integer("continuations", 16, "Completions per prefix.")
    flags.DEFINE_integer("seed", 0, "Sampling seed.")
    flags.DEFINE_string("out", None, "Write the result as JSON here.")


def main(argv):
    del argv
    import importlib  # noqa: PLC0415

    from experiments.reproduce import sft_dir  # noqa: PLC0415
    from policyopt.metrics import quiet_library_logging  # noqa: PLC0415
    from policyopt.runtime import keep_freed_host_memory  # noqa: PLC0415

    args = flags.FLAGS
    if args.setting not in SETTINGS:
        raise app.UsageError(f"--setting {args.setting!r}: one of {', '.join(SETTINGS)}")
    quiet_library_logging()
    keep_freed_host_memory()
    checkpoint = os.path.join(sft_dir(args.sft_root, args.setting, args.start), "checkpoints")
    recipe = importlib.import_module(f"configs.{args.recipe}").get_config()
    config = SETTINGS[args.setting](recipe, checkpoint)
    result = measure(
        config,
        num_prompts=args.num_prompts,
        samples=args.samples,
        positions=args.positions,
        continuations=args.continuations,
        seed=args.seed,
    )
    result |= {"setting": args.setting, "start": args.start, "checkpoint": checkpoint}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    low, high = result.get("explained_variance_ceiling_95", (float("nan"),) * 2)
    print(
        f"explained-variance ceiling {result['explained_variance_ceiling']:.3f} "
        f"(95% {low:.3f} to {high:.3f}) over {result['tokens']} tokens of "
        f"{result['responses']} responses; batch accuracy {result['accuracy']:.3f}"
    )


if __name__ == "__main__":
    define_flags()
    app.run(main)
