"""experiments/verdicts.py: the sign-flip test against enumeration by hand and in integers,
Holm's correction and Student's t against hand-worked cases and scipy, judge's verdicts on
hand-made inputs (zero spread, quantised values, too few pairs, equivalence, missing pairs,
disagreeing starts), a claim's verdict over its checks, and the pairs a check needs."""

import itertools
import math

import numpy as np
import pytest
from scipy import stats

from experiments import verdicts
from experiments.verdicts import claim_verdict, judge


def _enumerated(values, center):
    """p_above, p_below by listing every sign assignment (values in exact units)."""
    d = [v - center for v in values]
    observed = sum(d)
    sums = [
        sum(s * abs(x) for s, x in zip(signs, d))
        for signs in itertools.product((1, -1), repeat=len(d))
    ]
    return (
        sum(s >= observed for s in sums) / len(sums),
        sum(s <= observed for s in sums) / len(sums),
    )


def test_sign_flip_hand_worked():
    # 1, 2, 3: only the all-plus assignment reaches 6 of the 8.
    assert verdicts.sign_flip_p([1, 2, 3]) == (1 / 8, 1.0)
    # 1, -2, 3 (sum 2): the sums are 6, 0, 2, -4, 4, -2, 0, -6.
    assert verdicts.sign_flip_p([1, -2, 3]) == (3 / 8, 6 / 8)
    # Zero spread: two equal values are no more than 2 coin flips.
    assert verdicts.sign_flip_p([0.004, 0.004]) == (0.25, 1.0)
    # Every value at the centre: no evidence either way.
    assert verdicts.sign_flip_p([0.5, 0.5, 0.5], 0.5) == (1.0, 1.0)
    assert verdicts.sign_flip_p([7.0], 0.0) == (0.5, 1.0)
    with pytest.raises(ValueError, match="at least one value"):
        verdicts.sign_flip_p([])


def test_sign_flip_on_quantised_values_counts_ties_as_integers_do():
    """pass@1 differences in 1/256: float sums tie where the integers (x 256) tie."""
    rng = np.random.default_rng(3)
    for _ in range(20):
        units = rng.integers(-3, 4, size=rng.integers(2, 9))
        values = [(int(u) + 64) / 256 - 64 / 256 for u in units]  # rounding as pass@1 does
        assert verdicts.sign_flip_p(values) == _enumerated([int(u) for u in units], 0), units
    for _ in range(10):
        values = rng.normal(0.1, 0.3, size=7)
        assert verdicts.sign_flip_p(values, 0.05) == pytest.approx(_enumerated(values, 0.05))


def test_sign_flip_draws_beyond_the_exact_range():
    n = verdicts.EXACT_MAX_N + 4
    draws = verdicts.MONTE_CARLO_DRAWS
    # All positive: no draw but the observed one reaches the sum (exact: 2^-24).
    assert verdicts.sign_flip_p([1.0] * n) == (1 / (1 + draws), 1.0)
    # Half +1, half -1 (sum 0): P(sum of n fair signs >= 0), exactly from the binomial.
    exact = stats.binom.sf(n / 2 - 1, n, 0.5)
    above, below = verdicts.sign_flip_p([1.0, -1.0] * (n // 2))
    assert above == pytest.approx(exact, abs=0.005) and below == pytest.approx(exact, abs=0.005)
    assert verdicts.sign_flip_p([1.0, -1.0] * (n // 2)) == (above, below)  # a fixed rng


def test_holm_hand_worked():
    # Sorted 0.01, 0.03, 0.04: x3 = 0.03, x2 = 0.06, x1 = 0.04 -> kept non-decreasing: 0.06.
    assert verdicts.holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert verdicts.holm([0.5]) == [0.5]
    assert verdicts.holm([0.4, 0.4]) == pytest.approx([0.8, 0.8])
    assert verdicts.holm([0.6, 0.9]) == [1.0, 1.0]
    assert verdicts.holm([]) == []


def test_student_t_matches_scipy():
    for df in (1, 2, 3, 4.5, 9, 30, 200):
        for q in (0.6, 0.8, 0.975, 0.995, 0.9999):
            got = verdicts.student_t_quantile(q, df)
            assert got == pytest.approx(stats.t.ppf(q, df), rel=1e-7), (q, df)
            assert verdicts.student_t_quantile(1 - q, df) == pytest.approx(-got)
        for t in (-3.0, -0.5, 0.0, 1.2, 8.0):
            assert verdicts.student_t_cdf(t, df) == pytest.approx(stats.t.cdf(t, df), abs=1e-12)
    with pytest.raises(ValueError, match="0 < q < 1"):
        verdicts.student_t_quantile(1.0, 3)


def test_judge_needs_more_than_zero_spread():
    got = judge([0.004, 0.004], 0)
    assert got["verdict"] == "inconclusive" and got["half_width"] == 0.0
    assert (got["p_above"], got["p"]) == (0.25, 0.5)
    # The old rule's "supported" at 3 seeds (mean 0.6 - h 0.248 > 0): p >= 2 / 8 here.
    three = judge([0.5, 0.6, 0.7], 0.0)
    assert three["verdict"] == "inconclusive" and three["p"] == 0.25
    assert three["mean"] == pytest.approx(0.6) and three["std"] == pytest.approx(0.1)
    assert three["half_width"] == pytest.approx(4.302653 * 0.1 / math.sqrt(3), rel=1e-6)
    assert three["effect"] == pytest.approx(0.6)
    # Six pairs of one sign: two-sided p = 2 / 64 <= 0.05; five: 2 / 32 > 0.05.
    assert judge([0.1, 0.2, 0.05, 0.3, 0.1, 0.2], 0)["verdict"] == "supported"
    assert judge([0.1, 0.2, 0.05, 0.3, 0.1], 0)["verdict"] == "inconclusive"
    assert judge([-0.1, -0.2, -0.05, -0.3, -0.1, -0.2], 0)["verdict"] == "contradicted"
    # Quantised, no spread: six equal gains of 1/256 are six same-sign pairs...
    assert judge([1 / 256] * 6, 0)["verdict"] == "supported"
    # ...and six values at the threshold say nothing.
    at = judge([1 / 256] * 6, 1 / 256)
    assert at["verdict"] == "inconclusive" and at["p"] == 1.0
    assert at["pairs_needed"] == "not estimable (no spread)"
    one = judge([0.9], 0)
    assert one["verdict"] == "inconclusive" and one["half_width"] == math.inf
    assert judge([], 0) == {
        "n": 0,
        "missing": 0,
        "verdict": "not run",
        "note": "no pair has a value",
    }


def test_judge_equivalence_by_two_one_sided_tests():
    near = [0.01, -0.01, 0.0, 0.02, -0.02, 0.01]
    got = judge(near, 0, margin=0.05)
    # Every value above -0.05 and below +0.05: each one-sided p is 1/64; two hypotheses
    # (equivalent, beyond the margin): Holm x2.
    assert got["p_equivalent"] == 1 / 64 and got["p"] == pytest.approx(2 / 64)
    assert got["verdict"] == "equivalent"
    assert judge(near[:5], 0, margin=0.05)["verdict"] == "inconclusive"  # 2 x 1/32
    # Without the margin the same values decide nothing.
    assert judge(near, 0)["verdict"] == "inconclusive"
    # Beyond the margin below (harm): 7 pairs, p = 2/128, x2.
    harm = judge([-0.2, -0.15, -0.3, -0.12, -0.25, -0.2, -0.18], 0, margin=0.05)
    assert harm["verdict"] == "contradicted" and harm["p"] == pytest.approx(4 / 128)
    better = judge([0.2, 0.15, 0.3, 0.12, 0.25, 0.2, 0.18], 0, margin=0.05)
    assert better["verdict"] == "supported"
    # Inside the margin on average but spread over it: no decision.
    assert judge([0.06, -0.07, 0.04, -0.05, 0.08, -0.06], 0, margin=0.05)["verdict"] == (
        "inconclusive"
    )
    with pytest.raises(ValueError, match="margin must be > 0"):
        judge(near, 0, margin=0.0)


def test_missing_pairs_and_disagreeing_starts_decide_nothing():
    values = [0.1, 0.2, 0.05, 0.3, 0.1, 0.2]
    missing = judge(values, 0, missing=2)
    assert missing["verdict"] == "inconclusive" and missing["p"] == pytest.approx(2 / 64)
    assert missing["note"] == "2 of 8 pairs missing; the test alone: supported"
    # Start 0's six pairs clearly positive, start 1's two slightly negative: the test over
    # the 8 pairs is significant (4 of 256 assignments reach the sum), start 1 is not.
    d = [1, 1, 1, 1, 1, 1, -0.1, -0.1]
    split = judge(d, 0, starts=[0] * 6 + [1] * 2)
    assert split["p_above"] == 4 / 256 and split["p"] == pytest.approx(8 / 256)
    assert split["start_means"] == pytest.approx({0: 1.0, 1: -0.1})
    assert split["verdict"] == "inconclusive"
    assert split["note"] == "start(s) 1 disagree; the test alone: supported"
    assert judge(d, 0)["verdict"] == "supported"  # one start: nothing to disagree
    with pytest.raises(ValueError, match="3 values but 2 starts"):
        judge([1, 2, 3], 0, starts=[0, 1])


def test_claim_verdict_corrects_across_checks():
    six = [0.1, 0.2, 0.05, 0.3, 0.1, 0.2]
    seven = six + [0.15]
    # Alone, each six-pair check is supported (p 2/64); two of them: Holm x2 -> 0.0625.
    assert judge(six, 0)["verdict"] == "supported"
    verdict, checks = claim_verdict([judge(six, 0), judge(six, 0)])
    assert verdict == "inconclusive" and [c["verdict"] for c in checks] == ["inconclusive"] * 2
    assert checks[0]["p"] == pytest.approx(4 / 64)
    # Seven pairs: 2/128 x2 = 0.031 and 2/128 x1 (kept at 0.031): both hold.
    verdict, checks = claim_verdict([judge(seven, 0), judge(seven, 0)])
    assert verdict == "supported" and [c["p"] for c in checks] == pytest.approx([4 / 128] * 2)
    # A check that did not run leaves the claim inconclusive, whatever the others say.
    verdict, checks = claim_verdict([judge(seven, 0), judge([], 0)])
    assert verdict == "inconclusive" and [c["verdict"] for c in checks] == ["supported", "not run"]
    # A check missing a pair, likewise.
    verdict, _ = claim_verdict([judge(seven, 0), judge(seven, 0, missing=1)])
    assert verdict == "inconclusive"
    # One contradicted check contradicts the claim.
    negative = [-v for v in seven]
    verdict, _ = claim_verdict([judge(seven, 0), judge(negative, 0)])
    assert verdict == "contradicted"
    # "Equivalent" counts for a no-harm check.
    near = [0.01, -0.01, 0.0, 0.02, -0.02, 0.01, 0.0]
    verdict, checks = claim_verdict([judge(seven + [0.1] * 3, 0), judge(near * 2, 0, margin=0.05)])
    assert verdict == "supported" and checks[1]["verdict"] == "equivalent"
    assert claim_verdict([]) == ("inconclusive", [])


def _power(n, effect, std, alpha=0.05):
    """Exact power of the two-sided one-sample t test (noncentral t)."""
    df, critical = n - 1, stats.t.ppf(1 - alpha / 2, n - 1)
    nc = effect / std * math.sqrt(n)
    return stats.nct.sf(critical, df, nc) + stats.nct.cdf(-critical, df, nc)


def test_pairs_needed_for_80_percent_power():
    # d = 1 (effect = std): ~10 pairs; the noncentral t gives >= 0.8 there, < 0.8 two fewer.
    n = verdicts.pairs_needed(0.1, 0.1)
    assert n == 10
    assert _power(n, 0.1, 0.1) >= 0.79 and _power(n - 2, 0.1, 0.1) < 0.8
    for d in (0.3, 0.5, 2.0):
        n = verdicts.pairs_needed(d, 1.0)
        assert _power(n, d, 1.0) >= 0.79 and _power(n - 2, d, 1.0) < 0.8, d
    # A huge effect still needs the pairs for which the sign-flip test can reach alpha.
    assert verdicts.pairs_needed(10.0, 0.1) == 6
    assert verdicts.pairs_needed(10.0, 0.1, alpha=0.01) == 8
    assert verdicts.pairs_needed(10.0, 0.1, margin=20.0) == 5  # TOST: 2^-5 <= 0.05
    assert verdicts.pairs_needed(0.1, 0.0) == "not estimable (no spread)"
    assert verdicts.pairs_needed(0.0, 0.1) == "not estimable (effect 0)"
    assert verdicts.pairs_needed(0.05, 0.1, margin=0.05) == "not estimable (effect at margin)"
    # Equivalence at effect 0: at least the normal approximation's (z_.95 + z_.9)^2 s^2 / m^2.
    normal = (stats.norm.ppf(0.95) + stats.norm.ppf(0.9)) ** 2
    assert math.ceil(normal) <= verdicts.pairs_needed(0.0, 0.05, margin=0.05) <= normal + 3
    # Beyond the margin: the two-sided test at the distance past it.
    assert verdicts.pairs_needed(-0.2, 0.1, margin=0.05) == verdicts.pairs_needed(0.15, 0.1)
    # A claim's check: the strictest Holm level, alpha / hypotheses.
    _, checks = claim_verdict([judge([0.1, 0.3, 0.2], 0), judge([0.1, 0.3, 0.2], 0)])
    assert checks[0]["pairs_needed"] == verdicts.pairs_needed(0.2, 0.1, alpha=0.025)
    assert judge([0.9], 0)["pairs_needed"] == "not estimable (one pair)"


def test_values_that_are_not_finite_are_refused_not_tested():
    """A NaN compares false with every sum (p 0 both ways) and an infinite value reaches
    p 0 at any n: neither may become a verdict."""
    for bad in (math.nan, math.inf, -math.inf):
        with pytest.raises(ValueError, match="not finite"):
            verdicts.sign_flip_p([0.1, bad, 0.3])
        with pytest.raises(ValueError, match="not finite"):
            verdicts.sign_flip_p([0.1, 0.2, 0.3], center=bad)
        with pytest.raises(ValueError, match=r"judge: value 7 of 7 is .*; count it in missing"):
            judge([0.1] * 6 + [bad], 0)
        with pytest.raises(ValueError, match="judge: the threshold .* is not finite"):
            judge([0.1] * 6, bad)
    # An infinite margin would make any values "equivalent".
    with pytest.raises(ValueError, match="margin must be > 0 and finite"):
        judge([0.01] * 6, 0, margin=math.inf)


def test_power_line_at_an_effect_near_zero():
    """Student's t at huge degrees of freedom is the normal; an effect that is the mean's
    rounding (values symmetric about a threshold that is not 0) is effect 0."""
    for df in (1e6, 1e9, 1e12, 1e20, 1e300):
        for q in (0.8, 0.975, 0.99875):
            assert verdicts.student_t_quantile(q, df) == pytest.approx(stats.t.ppf(q, df), rel=1e-7)
    # The cdf too (it read 0.5 for P(T <= 0.5) = 0.69 at 1e20 degrees of freedom).
    for df in (1e6, 1e7, 1e9, 1e12, 1e20, 1e300):
        for t in (-3.0, -1.0, 0.5, 2.0, 4.0):
            assert verdicts.student_t_cdf(t, df) == pytest.approx(stats.t.cdf(t, df), abs=1e-12)
    # (z_.975 + z_.8)^2 / d^2 pairs at d = 1e-7: the normal approximation's figure.
    normal = (stats.norm.ppf(0.975) + stats.norm.ppf(0.8)) ** 2 / 1e-14
    assert verdicts.pairs_needed(1e-7, 1.0) == pytest.approx(normal, rel=1e-6)
    values = [0.1, 0.2, 0.3, 0.1, 0.2, 0.3]
    got = judge(values, 0.2)
    assert got["effect"] != 0.0 and abs(got["effect"]) < 1e-15  # the float mean's rounding
    assert got["verdict"] == "inconclusive"
    assert got["pairs_needed"] == "not estimable (effect 0)"
    at_margin = judge([0.05 + v for v in values], 0.2, margin=0.05)
    assert at_margin["pairs_needed"] == "not estimable (effect at margin)"


def _tost_power(n, effect, std, margin, alpha=0.05, reps=200_000):
    """TOST's power (Student t, both one-sided tests at alpha) by simulation, a fixed rng."""
    x = np.random.default_rng(0).normal(effect, std, size=(reps, n))
    mean, se = x.mean(axis=1), x.std(axis=1, ddof=1) / math.sqrt(n)
    t = stats.t.ppf(1 - alpha, n - 1)
    return float(np.mean((mean - t * se > -margin) & (mean + t * se < margin)))


def test_equivalence_power_line_counts_both_one_sided_tests():
    """Near effect 0 both one-sided tests can fail: the pairs do not drop from effect 0 to
    a small effect (8 at 1e-6 against 11 at 0 by the one-sided formula, power 0.64)."""
    at_zero = verdicts.pairs_needed(0.0, 0.05, margin=0.05)
    needed = [verdicts.pairs_needed(e, 0.05, margin=0.05) for e in (1e-6, 0.002, 0.005, 0.01)]
    assert needed[0] == at_zero and needed == sorted(needed)
    for effect, n in zip((1e-6, 0.002, 0.005, 0.01, 0.02), [*needed, None]):
        n = n or verdicts.pairs_needed(effect, 0.05, margin=0.05)
        assert _tost_power(n, effect, 0.05, 0.05) >= 0.8, (effect, n)
        assert _tost_power(n - 2, effect, 0.05, 0.05) < 0.8, (effect, n)
