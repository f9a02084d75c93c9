"""The iteration's host-side helpers against hand-worked cases: a sampling round's texts,
response width, samples and sampling metrics (``policyopt.rl.rollouts.rounds``), the update metrics'
means over minibatches, the padding and the routing metrics."""

import jax.numpy as jnp
import numpy as np
import pytest

from configs import base
from policyopt.data.tokenizer import CharTokenizer
from policyopt.rewards.scoring import RewardSpec, score_batch
from policyopt.rl.batch import Round, round_from_rollout
from policyopt.rl.reporting.report import MinibatchMeans, padding_metrics
from policyopt.rl.rollouts.rounds import ScoredRound, response_width, round_texts, sampling_metrics
from policyopt.rl.update.routing import update_routing_metrics
from policyopt.sampling import Rollout


def _rollout(tokenizer, prompts, responses, max_new_tokens):
    """A sampler's ``Rollout`` (NumPy) of the given prompt and response texts: prompts
    left-padded, responses right-padded with ``pad_id`` (a response ending in ``<eos>``
    counts it as its last valid token)."""
    prompt_ids = [tokenizer.encode_prompt(p) for p in prompts]
    width = max(len(p) for p in prompt_ids)
    prompt_tokens = np.full((len(prompts), width), tokenizer.pad_id, np.int32)
    for row, ids in enumerate(prompt_ids):
        prompt_tokens[row, width - len(ids) :] = ids
    tokens = np.full((len(responses), max_new_tokens), tokenizer.pad_id, np.int32)
    lengths = np.zeros(len(responses), np.int32)
    for row, (text, end) in enumerate(responses):
        ids = tokenizer.encode(text) + ([tokenizer.eos_id] if end else [])
        tokens[row, : len(ids)], lengths[row] = ids, len(ids)
    mask = (np.arange(max_new_tokens)[None] < lengths[:, None]).astype(np.float32)
    raw = -0.1 * np.arange(1, tokens.size + 1, dtype=np.float32).reshape(tokens.shape) * mask
    return Rollout(
        tokens=tokens,
        mask=mask,
        log_probs=raw,
        raw_log_probs=raw,
        lengths=lengths,
        prompt_tokens=prompt_tokens,
        prompt_lengths=np.array([len(p) for p in prompt_ids], np.int32),
        routing=None,
        num_steps=np.int32(max_new_tokens),
    )


def test_a_hand_worked_round_through_texts_scores_layout_and_metrics():
    """2 prompts x 2 samples, answers 3 and 7, scored as ``iteration.sample`` scores them:
    plain correctness (1 / 0) with DAPO's overlong filter, so the 6-token response without
    <eos> is truncated and left out of the loss, its reward still 0."""
    tokenizer = CharTokenizer()
    config = base.get_config()
    config.unlock()
    config.batch.group_size = 2
    config.sampling.max_new_tokens = 6
    config.batch.response_buckets = (4, 8)
    prompts = {"prompt": ["1+2=", "3+4="], "answer": ["3", "7"]}
    responses = [("\\boxed{3}", True), ("\\boxed{4}", True), ("\\boxed{7}", False)]
    responses.append(("777777", False))
    rollout = _rollout(tokenizer, [p for p in prompts["prompt"] for _ in range(2)], responses, 6)
    lengths = rollout.lengths
    texts = round_texts(rollout.tokens, lengths, prompts, config, tokenizer, (tokenizer.eos_id,))
    assert texts.completions == ["\\boxed{3}", "\\boxed{4}", "\\boxed{7}", "777777"]
    assert texts.prompts == ["1+2=", "1+2=", "3+4=", "3+4="]
    assert texts.references == ["3", "3", "7", "7"] and texts.tasks is None
    # lengths 3 + 1 (<eos>), 3 + 1, 3, 6: only the last reached N = 6 without <eos>.
    np.testing.assert_array_equal(lengths, [4, 4, 3, 6])
    np.testing.assert_array_equal(texts.truncated, [False, False, False, True])
    mixed = dict(prompts, task=["math", "code"])
    tasks = round_texts(rollout.tokens, lengths, mixed, config, tokenizer, ()).tasks
    assert tasks == ["math", "math", "code", "code"]
    # The bucket of the longest response (6) is 8, capped at N = 6; of 3, 4.
    assert response_width(lengths, config) == 6 and response_width(lengths[:3] - 1, config) == 4
    config.batch.response_buckets = (4,)
    with pytest.raises(ValueError, match="response length 6 exceeds the largest bucket 4"):
        response_width(lengths, config)

    spec = RewardSpec(format_reward=False, overlong_filter=True, max_len=6)
    scores = score_batch(
        texts.completions, texts.references, lengths, spec, truncated=texts.truncated
    )
    np.testing.assert_array_equal(scores.rewards, [1.0, 0.0, 1.0, 0.0])
    np.testing.assert_array_equal(scores.sample_mask, [1.0, 1.0, 1.0, 0.0])
    rnd = round_from_rollout(rollout, scores.rewards, scores.correct, 6, scores.scored)
    scored = ScoredRound(rnd, texts, scores, lengths)
    samples = scored.samples()
    assert samples["completions"] == texts.completions and samples["prompts"] == texts.prompts
    assert list(samples["correct"]) == [True, False, True, False]
    # Two such rounds drawn (dynamic sampling), the batch one of them.
    metrics = sampling_metrics([scored, scored], rnd)
    assert metrics["reward/mean"] == 0.5 and metrics["reward/accuracy"] == 0.5
    assert metrics["batch/reward_mean"] == 0.5 and metrics["batch/accuracy"] == 0.5
    assert metrics["response/length_mean"] == pytest.approx(17 / 4)
    assert metrics["response/length_max"] == 6.0
    assert metrics["response/truncated_fraction"] == 0.25


def test_minibatch_means_weigh_out_empty_minibatches_and_sum_counts():
    """Three minibatches; the second has no token to train the policy on (update/empty):
    policy means over the first and third, critic means over all three, counts summed."""
    steps = [
        {"loss": 2.0, "update/empty": 0.0, "update/skipped": 0.0},
        {"loss": 0.0, "update/empty": 1.0, "update/skipped": 0.0},
        {"loss": 5.0, "update/empty": 0.0, "update/skipped": 1.0},
    ]
    critic = [(1.0, 0.0), (3.0, 1.0), (8.0, 0.0)]  # (value loss, skipped)
    means = MinibatchMeans()
    for step, (value_loss, skipped) in zip(steps, critic):
        metrics = {k: jnp.float32(v) for k, v in step.items()}
        metrics |= {
            "critic/value_loss": jnp.float32(value_loss),
            "critic/empty": jnp.float32(0.0),
            "critic/skipped": jnp.float32(skipped),
        }
        means.add(metrics)
    got = means.result()
    assert float(got["loss"]) == (2.0 + 5.0) / 2
    assert float(got["critic/value_loss"]) == pytest.approx((1.0 + 3.0 + 8.0) / 3)
    assert float(got["update/empty"]) == 1.0 and float(got["update/skipped"]) == 1.0
    assert float(got["critic/skipped"]) == 1.0 and float(got["critic/empty"]) == 0.0
    assert all(isinstance(v, np.ndarray) for v in got.values())  # on the host
    # Every minibatch empty: the means are NaN, not 0.
    none = MinibatchMeans()
    for _ in range(2):
        none.add({"loss": jnp.float32(0.0), "update/empty": jnp.float32(1.0)})
    got = none.result()
    assert np.isnan(got["loss"]) and float(got["update/empty"]) == 2.0


def test_padding_metrics_of_a_hand_worked_batch():
    attention_mask = np.array([[0, 1, 1, 1, 0], [1, 1, 1, 0, 0]], np.int32)  # 6 of 10 real
    rnd = Round(
        tokens=np.zeros((2, 5), np.int32),
        positions=np.zeros((2, 5), np.int32),
        attention_mask=attention_mask,
        mask=np.zeros((2, 3), np.float32),
        behaviour_log_probs=np.zeros((2, 3), np.float32),
        routing=None,
        rewards=np.zeros(2, np.float32),
        correct=np.zeros(2, bool),
        prompt_width=2,
    )
    assert padding_metrics(rnd, 0, 0) == {
        "batch/prompt_width": 2.0,
        "batch/response_width": 3.0,
        "batch/padding_fraction": pytest.approx(0.4),
    }
    packed = padding_metrics(rnd, 8, 6)
    assert packed["batch/packed_padding_fraction"] == pytest.approx(0.25)


def test_update_routing_metrics_of_a_hand_worked_token_pair():
    """One layer, two tokens, k = 2, compared as sets: the updated policy changes one
    expert of the second token (1 of 4 choices), the sampler both of the first (2 of 4)."""
    old = jnp.array([[[[0, 1], [2, 3]]]], jnp.int32)  # [L=1, R=1, S=2, k=2]
    new = jnp.array([[[[1, 0], [2, 4]]]], jnp.int32)
    sampler = jnp.array([[[[5, 6], [3, 2]]]], jnp.int32)
    got = update_routing_metrics(old, new, sampler, jnp.ones((1, 2)), "stale")
    assert {k: float(v) for k, v in got.items()} == {
        "routing/volatility": 0.25,
        "routing/volatility/layer_0": 0.25,
        "stale": 0.5,
        "stale/layer_0": 0.5,
    }
