"""Host-side pieces of the RL loop: buckets, layout, dynamic sampling, minibatches,
routing metrics (against plain Python loops and hand-worked cases)."""

import numpy as np
import pytest

from policyopt.rl import batch as B
from policyopt.rl.sft import sft_layout
from policyopt.rl.update.routing import ratio_share_metrics, routing_differences, routing_metrics


def test_bucket():
    assert B.bucket(1, (8, 16)) == 8 and B.bucket(8, (16, 8)) == 8 and B.bucket(9, (8, 16)) == 16
    with pytest.raises(ValueError, match="prompt length 17 exceeds the largest bucket 16"):
        B.bucket(17, (8, 16), name="prompt length")


def test_layout_matches_hand_worked_rows():
    out = B.layout([[5, 6], [7]], [[1, 2, 3], [4]], pad_id=0, prompt_width=3, response_width=3)
    np.testing.assert_array_equal(out["tokens"], [[0, 5, 6, 1, 2, 3], [0, 0, 7, 4, 0, 0]])
    np.testing.assert_array_equal(out["positions"], [[0, 0, 1, 2, 3, 4], [0, 0, 0, 1, 2, 3]])
    np.testing.assert_array_equal(out["attention_mask"], [[0, 1, 1, 1, 1, 1], [0, 0, 1, 1, 0, 0]])
    np.testing.assert_array_equal(out["mask"], [[1, 1, 1], [1, 0, 0]])
    # The SFT layout from right-padded pipeline batches gives the same thing.
    sft = sft_layout(
        np.array([[5, 6, 0], [7, 0, 0]]),
        np.array([2, 1]),
        np.array([[1, 2, 3], [4, 0, 0]]),
        np.array([3, 1]),
        pad_id=0,
    )
    for key in out:
        np.testing.assert_array_equal(sft[key], out[key])


def _round(rewards, prompt_width=2, response_width=2, num_layers=1, k=2, seed=0):
    rows = len(rewards)
    rng = np.random.default_rng(seed)
    width = prompt_width + response_width
    return B.Round(
        tokens=rng.integers(3, 9, (rows, width)).astype(np.int32),
        positions=np.tile(np.arange(width, dtype=np.int32), (rows, 1)),
        attention_mask=np.ones((rows, width), np.int32),
        mask=np.ones((rows, response_width), np.float32),
        behaviour_log_probs=-rng.random((rows, response_width)).astype(np.float32),
        routing=rng.integers(0, 4, (num_layers, rows, width, k)).astype(np.int32),
        rewards=np.asarray(rewards, np.float32),
        correct=np.asarray(rewards) > 0,
        prompt_width=prompt_width,
    )


def test_dynamic_sampling_fills_the_batch_with_non_constant_groups():
    sampler = B.DynamicSampler(n_prompts=3, group_size=2, enabled=True, max_rounds=5)
    r1 = _round([1, 1, 0, 1, 0, 0], seed=1)  # groups: constant, mixed, constant
    r2 = _round([0, 1, 1, 1, 0, 0], prompt_width=3, seed=2)  # mixed, constant, constant
    r3 = _round([1, 0, 0, 1, 1, 0], seed=3)
    assert not sampler.add(r1)
    assert not sampler.add(r2)
    assert sampler.add(r3)  # 1 + 1 + (1 of its 3 mixed groups)
    merged, metrics = sampler.batch(pad_id=0)
    assert metrics == {
        "dynamic_sampling/rounds": 3.0,
        "dynamic_sampling/prompts_drawn": 9.0,
        # informative groups drawn, the one beyond a full batch included
        "dynamic_sampling/kept_fraction": 5 / 9,
        "dynamic_sampling/shortfall": 0.0,
    }
    np.testing.assert_array_equal(merged.rewards, [0, 1, 0, 1, 1, 0])
    grouped = merged.rewards.reshape(3, 2)
    assert np.all(grouped.max(1) != grouped.min(1))
    # Prompt widths 2 and 3 are merged by left padding (hand-checked rows).
    assert merged.prompt_width == 3 and merged.tokens.shape == (6, 5)
    np.testing.assert_array_equal(merged.tokens[0], np.concatenate([[0], r1.tokens[2]]))
    np.testing.assert_array_equal(merged.attention_mask[0], [0, 1, 1, 1, 1])
    np.testing.assert_array_equal(merged.tokens[2], r2.tokens[0])
    np.testing.assert_array_equal(merged.routing[:, 0, 1:], r1.routing[:, 2])
    np.testing.assert_array_equal(merged.routing[:, 4, 1:], r3.routing[:, 0])


def test_dynamic_sampling_cap_fills_with_zero_variance_groups_and_reports_shortfall():
    sampler = B.DynamicSampler(n_prompts=2, group_size=2, enabled=True, max_rounds=2)
    assert not sampler.add(_round([1, 1, 0, 0]))
    assert sampler.add(_round([1, 0, 1, 1]))
    merged, metrics = sampler.batch(pad_id=0)
    assert metrics["dynamic_sampling/shortfall"] == 1.0
    assert merged.tokens.shape[0] == 4
    # The filler group (last) keeps the shape but counts in no loss or mean: mask 0.
    np.testing.assert_array_equal(merged.rewards, [1, 0, 1, 1])
    np.testing.assert_array_equal(merged.mask, [[1, 1], [1, 1], [0, 0], [0, 0]])
    np.testing.assert_array_equal(merged.scored_rows(), [True, True, False, False])
    assert B.mask_fillers(merged, 0, 2) is merged  # nothing to mask
    disabled = B.DynamicSampler(n_prompts=2, group_size=2, enabled=False, max_rounds=1)
    assert disabled.add(_round([1, 1, 0, 0]))
    merged, metrics = disabled.batch(pad_id=0)
    np.testing.assert_array_equal(merged.rewards, [1, 1, 0, 0])
    assert metrics["dynamic_sampling/kept_fraction"] == 1.0


def test_filler_groups_stay_out_of_batch_advantage_statistics():
    """With the "accuracy" criterion a filler (all wrong) can have unequal rewards, e.g. two
    length penalties: it is masked out of the loss and must not move the batch mean and std
    of the kept groups' advantages either (Magistral's minibatch normalisation)."""
    from policyopt.advantages import outcome_advantages

    sampler = B.DynamicSampler(
        n_prompts=2, group_size=2, enabled=True, max_rounds=1, criterion="accuracy"
    )
    rnd = _round([1.0, 0.0, -0.1, -0.3])  # group 2: both wrong, different length penalties
    rnd = rnd._replace(correct=np.array([True, False, False, False]))
    assert sampler.add(rnd)
    merged, metrics = sampler.batch(pad_id=0)
    assert metrics["dynamic_sampling/shortfall"] == 1.0
    valid = merged.scored_rows()
    advantages = np.asarray(
        outcome_advantages(merged.rewards, 2, center="group", scale="batch", valid=valid)
    )
    # Hand-worked: kept group (1, 0) centred to (0.5, -0.5), batch std over those two rows
    # (ddof 1: sqrt(0.5)); the filler gets 0.
    np.testing.assert_allclose(
        advantages, [0.5 / np.sqrt(0.5), -0.5 / np.sqrt(0.5), 0, 0], rtol=1e-5
    )


def test_minibatches_hold_whole_groups_and_cover_the_batch():
    import jax

    parts = B.minibatch_indices(6, 3, 2, jax.random.PRNGKey(0))
    rows = np.sort(np.concatenate(parts))
    np.testing.assert_array_equal(rows, np.arange(18))
    for part in parts:
        assert len(part) == 9
        assert np.all(part.reshape(-1, 3) // 3 == (part.reshape(-1, 3) // 3)[:, :1])
    np.testing.assert_array_equal(B.minibatch_indices(2, 2, 1, None)[0], [0, 1, 2, 3])


def _volatility_loop(a, b, mask):
    num_layers, rows, length, k = a.shape
    per_layer = []
    for layer in range(num_layers):
        differ = count = 0
        for r in range(rows):
            for s in range(length):
                if mask[r, s]:
                    differ += k - len(set(a[layer, r, s]) & set(b[layer, r, s]))
                    count += k
        per_layer.append(differ / count)
    return np.mean(per_layer), per_layer


def test_routing_volatility_against_a_loop_and_by_hand():
    # Hand-worked: token 0 same set in another order (0 differ), token 1 one expert
    # changed (1 of 2), token 2 masked out.
    a = np.array([[[[0, 1], [2, 3], [0, 1]]]])
    b = np.array([[[[1, 0], [2, 0], [3, 2]]]])
    mask = np.array([[1, 1, 0]])
    overall, per_layer = routing_differences(a, b, mask)
    assert float(overall) == pytest.approx(0.25) and per_layer.shape == (1,)
    rng = np.random.default_rng(0)
    a = np.stack(
        [np.stack([rng.permutation(8)[:3] for _ in range(5 * 7)]) for _ in range(4)]
    ).reshape(4, 5, 7, 3)
    b = a.copy()
    for index in zip(*np.nonzero(rng.random(a.shape[:-1]) < 0.3)):
        b[index] = rng.permutation(8)[:3]  # a fresh choice, sometimes overlapping
    mask = rng.random((5, 7)) < 0.7
    overall, per_layer = routing_differences(a, b, mask)
    want_overall, want_layers = _volatility_loop(a, b, mask)
    np.testing.assert_allclose(per_layer, want_layers, rtol=1e-6)
    assert float(overall) == pytest.approx(want_overall)
    metrics = routing_metrics("routing/volatility", a, b, mask)
    assert set(metrics) == {"routing/volatility"} | {
        f"routing/volatility/layer_{i}" for i in range(4)
    }


def test_dynamic_sampling_criteria_reward_spread_or_accuracy():
    # Rewards with an overlong penalty: group 0 all correct but of unequal reward, group 1
    # mixed, group 2 all wrong with equal rewards, group 3 all wrong of unequal reward.
    rewards = np.array([1.0, 0.5, 1.0, -1.0, -1.0, -1.0, -1.0, -1.5], np.float32)
    correct = np.array([1, 1, 1, 0, 0, 0, 0, 0], bool)
    np.testing.assert_array_equal(
        B.uninformative_groups(rewards, correct, 2, "reward"), [False, False, True, False]
    )
    # DAPO eq. 11 keeps a group iff 0 < #correct < G.
    np.testing.assert_array_equal(
        B.uninformative_groups(rewards, correct, 2, "accuracy"), [True, False, True, True]
    )
    with pytest.raises(ValueError, match="criterion"):
        B.uninformative_groups(rewards, correct, 2, "variance")
    sampler = B.DynamicSampler(
        n_prompts=1, group_size=2, enabled=True, max_rounds=1, criterion="accuracy"
    )
    r = _round(rewards)._replace(correct=correct)
    assert sampler.add(r)
    merged, metrics = sampler.batch(pad_id=0)
    np.testing.assert_array_equal(merged.rewards, [1.0, -1.0])  # the one mixed group
    assert (
        metrics["dynamic_sampling/kept_fraction"] == 1 / 1
        and metrics["dynamic_sampling/shortfall"] == 0
    )


def test_dynamic_sampling_compares_scored_samples_only():
    """A missed sample's stand-in reward (``scored`` False) says nothing: a group is
    informative only through its scored samples, and needs two of them."""
    rewards = np.array([1, 1, 0, 1, 1, 0, 0, 0, 1, 0, 1, 1], np.float32)  # G = 3
    correct = rewards > 0
    scored = np.array([1, 1, 0, 1, 1, 1, 0, 0, 1, 1, 1, 1], bool)
    for criterion in ("reward", "accuracy"):
        # Group 0: scored [1, 1] (the 0 was missed); group 2: one scored sample (the 1
        # that makes it informative was missed).
        np.testing.assert_array_equal(
            B.uninformative_groups(rewards, correct, 3, criterion, scored=scored),
            [True, False, True, False],
            err_msg=criterion,
        )
        np.testing.assert_array_equal(
            B.uninformative_groups(rewards, correct, 3, criterion),
            [False, False, False, False],
            err_msg=criterion,
        )
    sampler = B.DynamicSampler(n_prompts=4, group_size=3, enabled=True, max_rounds=1)
    assert sampler.add(_round(rewards)._replace(scored=scored))
    merged, metrics = sampler.batch(pad_id=0)
    # Kept: groups 1 and 3, each row with its flag, then the dropped groups 0 and 2 as
    # fillers, unscored (they count in no statistic).
    assert (
        metrics["dynamic_sampling/shortfall"] == 2
        and metrics["dynamic_sampling/kept_fraction"] == 2 / 4
    )
    rows = [3, 4, 5, 9, 10, 11, 0, 1, 2, 6, 7, 8]
    np.testing.assert_array_equal(merged.rewards, rewards[rows])
    np.testing.assert_array_equal(
        merged.scored, np.concatenate([scored[rows[:6]], np.zeros(6, bool)])
    )
    disabled = B.DynamicSampler(n_prompts=4, group_size=3, enabled=False, max_rounds=1)
    disabled.add(_round(rewards)._replace(scored=scored))
    np.testing.assert_array_equal(disabled.batch(pad_id=0)[0].scored, scored)
    assert _round(rewards).scored is None and _round(rewards).scored_rows().all()


def test_truncated_rows_end_tokens_at_the_limit_are_complete():
    tokens = np.array([[5, 6, 2], [5, 6, 7], [5, 2, 0], [5, 6, 9]])
    lengths = np.array([3, 3, 2, 3])
    # Row 0 ends with EOS (2) at the limit, row 3 with a stop id (9): complete; row 1 is cut.
    np.testing.assert_array_equal(
        B.truncated_rows(tokens, lengths, 3, (2, 9)), [False, True, False, False]
    )
    np.testing.assert_array_equal(
        B.truncated_rows(tokens, lengths, 3, ()), [True, True, False, True]
    )


def test_routing_share_by_hand():
    """log r = (new - replayed) + (replayed - old): the routing part's mean square over
    both parts', on the valid tokens only. By hand: routing parts [0.2, 0], parameter
    parts [0.1, -0.1] -> 0.02 / (0.02 + 0.01) = 2/3; the masked third token is ignored."""
    new = np.array([[0.3, -0.1, 5.0]])
    replayed = np.array([[0.1, -0.1, -5.0]])
    old = np.zeros((1, 3))
    mask = np.array([[1.0, 1.0, 0.0]])
    metrics = ratio_share_metrics(new, replayed, old, mask)
    assert float(metrics["routing/ratio_share"]) == pytest.approx(2 / 3, rel=1e-6)
    assert float(metrics["routing/log_ratio_ms_routing"]) == pytest.approx(0.02, rel=1e-6)
    assert float(metrics["routing/log_ratio_ms_params"]) == pytest.approx(0.01, rel=1e-6)
    assert float(metrics["routing/log_ratio_ms"]) == pytest.approx((0.09 + 0.01) / 2, rel=1e-6)
    # Replay changes nothing: share 0; routing alone moves the ratio: share 1.
    assert float(ratio_share_metrics(replayed, replayed, old, mask)["routing/ratio_share"]) == 0
    assert float(ratio_share_metrics(new, old, old, mask)["routing/ratio_share"]) == 1
    # Nothing moved: undefined.
    assert np.isnan(float(ratio_share_metrics(old, old, old, mask)["routing/ratio_share"]))
