"""experiments/verdicts.py: the sign-flip test against enumeration by hand and in integers,
the sign test against binomial sums by hand (ties; the false-positive rates where the
sign-flip test lacks its symmetry; its power line against scipy's binomial), Holm's
correction (also across both tests) and Student's t against hand-worked cases and scipy,
judge's verdicts on hand-made inputs (zero spread, quantised values, too few pairs,
equivalence, missing pairs, disagreeing starts), a claim's verdict over its checks, and the
pairs a check needs."""

import itertools
import math

import numpy as np
import pytest

from configs.claims import Check
from experiments import verdicts
from experiments.verdicts import claim_verdict, judge

# scipy.stats (the reference) is imported in the tests that use it: at collection it cost
# every test process ~1 CPU s, the xdist worker that never runs this file included.


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
    from scipy import stats

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
    from scipy import stats

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
    """Either test (the sign-flip test here; the sign test gives the same p on values of
    one sign)."""
    got = judge([0.004, 0.004], 0, test="sign-flip")
    assert got["verdict"] == "inconclusive" and got["half_width"] == 0.0
    assert (got["p_above"], got["p"]) == (0.25, 0.5)
    # The old rule's "supported" at 3 seeds (mean 0.6 - h 0.248 > 0): p >= 2 / 8 here.
    three = judge([0.5, 0.6, 0.7], 0.0, test="sign-flip")
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
    at = judge([1 / 256] * 6, 1 / 256, test="sign-flip")
    assert at["verdict"] == "inconclusive" and at["p"] == 1.0
    assert at["pairs_needed"] == "not estimable (no spread)"
    at = judge([1 / 256] * 6, 1 / 256)  # the sign test: every pair a tie
    assert at["verdict"] == "inconclusive" and at["p"] == 1.0
    assert at["pairs_needed"] == "not estimable (every pair at the threshold)"
    one = judge([0.9], 0)
    assert one["verdict"] == "inconclusive" and one["half_width"] == math.inf
    assert judge([], 0) == {
        "n": 0,
        "missing": 0,
        "test": "sign",
        "threshold": 0,
        "margin": None,
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
    split = judge(d, 0, test="sign-flip", starts=[0] * 6 + [1] * 2)
    assert split["p_above"] == 4 / 256 and split["p"] == pytest.approx(8 / 256)
    assert split["start_means"] == pytest.approx({0: 1.0, 1: -0.1})
    assert split["verdict"] == "inconclusive"
    assert split["note"] == "start(s) 1 disagree; the test alone: supported"
    assert judge(d, 0, test="sign-flip")["verdict"] == "supported"  # one start: no disagreeing
    # Under the sign test a start's median decides: start 1's two pairs lie below.
    assert judge([1] * 9 + [-1], 0, starts=[0] * 8 + [1] * 2)["note"] == (
        "start(s) 1 disagree; the test alone: supported"
    )
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


def test_reported_checks_form_their_own_family_and_leave_the_claim_alone():
    """A dose-response's lower levels: reported, corrected among themselves, not required."""
    six = [0.1, 0.2, 0.05, 0.3, 0.1, 0.2]
    negative = [-v for v in six]

    def reported(check):
        return {**check, "reported": True}

    # One required check (p 2/64 alone) beside two reported: its family is itself.
    verdict, checks = claim_verdict(
        [judge(six, 0), reported(judge(negative, 0)), reported(judge([0.1, -0.1] * 3, 0))]
    )
    assert verdict == "supported"
    assert [c["verdict"] for c in checks] == ["supported", "inconclusive", "inconclusive"]
    assert checks[0]["p"] == pytest.approx(2 / 64)
    # The reported pair is corrected as two: 2/64 x 2 = 0.0625 for the contradicted one.
    assert checks[1]["p"] == pytest.approx(4 / 64) and checks[2]["p"] == 1.0
    # In one family of three the required check would fall: 2/64 x 3.
    _, together = claim_verdict([judge(six, 0), judge(negative, 0), judge([0.1, -0.1] * 3, 0)])
    assert together[0]["p"] == pytest.approx(6 / 64) and together[0]["verdict"] == "inconclusive"
    # A reported check that did not run, or is contradicted, does not decide the claim...
    seven = six + [0.15]
    verdict, checks = claim_verdict([judge(six, 0), reported(judge([], 0))])
    assert verdict == "supported" and checks[1]["verdict"] == "not run"
    verdict, checks = claim_verdict([judge(six, 0), reported(judge([-v for v in seven], 0))])
    assert verdict == "supported" and checks[1]["verdict"] == "contradicted"
    # ...and when every check is reported, they all count (one family).
    verdict, checks = claim_verdict([reported(judge(six, 0)), reported(judge(six, 0))])
    assert verdict == "inconclusive" and checks[0]["p"] == pytest.approx(4 / 64)


def _power(n, effect, std, alpha=0.05):
    """Exact power of the two-sided one-sample t test (noncentral t)."""
    from scipy import stats

    df, critical = n - 1, stats.t.ppf(1 - alpha / 2, n - 1)
    nc = effect / std * math.sqrt(n)
    return stats.nct.sf(critical, df, nc) + stats.nct.cdf(-critical, df, nc)


def test_pairs_needed_for_80_percent_power():
    from scipy import stats

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
    # Zero spread off the threshold: every pair alike, the exact test's fewest decide it.
    assert verdicts.pairs_needed(0.1, 0.0) == 6 and verdicts.pairs_needed(-0.1, 0.0) == 6
    assert verdicts.pairs_needed(0.1, 0.0, margin=0.5) == 5  # TOST: 2^-5 <= 0.05
    assert judge([0.004] * 3, 0, test="sign-flip")["pairs_needed"] == 6
    assert verdicts.pairs_needed(0.1, math.nan) == "not estimable (no spread)"
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
    from scipy import stats

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
    got = judge(values, 0.2, test="sign-flip")
    assert got["effect"] != 0.0 and abs(got["effect"]) < 1e-15  # the float mean's rounding
    assert got["verdict"] == "inconclusive"
    assert got["pairs_needed"] == "not estimable (effect 0)"
    at_margin = judge([0.05 + v for v in values], 0.2, margin=0.05, test="sign-flip")
    assert at_margin["pairs_needed"] == "not estimable (effect at margin)"


def _tost_power(n, effect, std, margin, alpha=0.05, reps=200_000):
    """TOST's power (Student t, both one-sided tests at alpha) by simulation, a fixed rng."""
    from scipy import stats

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


def _rejection_rate(draw, center, reps=2000, test="sign"):
    """The share of ``reps`` draws of values that ``test`` decides at two-sided 0.05 (fixed
    rng; judge's verdict for one check without a margin, its power line left out)."""
    one_sided = verdicts.sign_flip_p if test == "sign-flip" else verdicts.sign_test_p
    rng = np.random.default_rng(0)
    decided = 0
    for i in range(reps):
        values = draw(rng)
        rejects = 2 * min(one_sided(values, center)) <= verdicts.ALPHA
        if i < 5:  # judge decides as much
            verdict = judge(values, center, test=test)["verdict"]
            assert (verdict != "inconclusive") == rejects, (values, verdict)
        decided += rejects
    return decided / reps


#: Three standard errors of a rate of 0.05 over 2000 draws.
RATE_TOLERANCE = 3 * math.sqrt(0.05 * 0.95 / 2000)


def test_the_sign_flip_test_needs_symmetry_that_a_value_or_gain_lacks():
    """A single arm's figure against a fixed threshold has no symmetry by design: on skewed
    values whose mean (or median) sits at the threshold the sign-flip test decides far more
    often than its nominal 0.05. The sign test of the median is exact for any shape (at
    n = 10 its two-sided size is 2 x 11/1024), and a "value" or "gain" check uses it."""

    def exponential(rng):
        return rng.exponential(1.0, 10)

    def lognormal(rng):
        return rng.lognormal(0.0, 1.5, 10)

    flip = {"test": "sign-flip"}
    # The mean at the threshold: exponential 1 has mean 1; lognormal(0, 1.5) exp(1.125).
    assert _rejection_rate(exponential, 1.0, **flip) > 0.05 + RATE_TOLERANCE  # ~0.09
    assert _rejection_rate(lognormal, math.exp(1.125), **flip) > 0.2  # ~0.28
    # The median at the threshold: the sign-flip test is not exact for it either...
    assert _rejection_rate(lognormal, 1.0, **flip) > 0.05 + RATE_TOLERANCE  # ~0.11
    # ...the sign test is, whatever the shape (judge's default; Check chooses it).
    assert Check("", "value", "a", threshold=0.5).test == "sign"
    assert Check("", "gain", "a", threshold=0.1).test == "sign"
    for draw, median in ((exponential, math.log(2.0)), (lognormal, 1.0)):
        assert _rejection_rate(draw, median) <= 0.05 + RATE_TOLERANCE
        assert _rejection_rate(draw, median, test="sign") <= 0.05 + RATE_TOLERANCE
    # Symmetric by design: a paired difference at threshold 0 keeps the sign-flip test.
    assert Check("", "diff", "a", "b").test == "sign-flip"
    assert Check("", "log10_ratio", "a", "b", metric="m").test == "sign-flip"
    assert Check("", "diff_of_diffs", "a", "b", c="c", d="d").test == "sign-flip"
    # Not at threshold 0, or with a margin (TOST's nulls sit at +-margin, where the arms
    # differ): no symmetry by design, the sign test.
    assert Check("", "log10_ratio", "a", "b", metric="m", threshold=1.5).test == "sign"
    assert Check("", "diff", "a", "b", margin=0.05).test == "sign"


def test_sign_test_hand_worked():
    from scipy import stats

    # 9 of 10 above: P(X >= 9) = (10 + 1) / 1024 for X ~ Bin(10, 1/2); P(X <= 9) = 1023/1024.
    nine = [0.2] * 9 + [-0.1]
    assert verdicts.sign_test_p(nine) == (11 / 1024, 1023 / 1024)
    got = judge(nine, 0, test="sign")
    assert got["p"] == pytest.approx(2 * 11 / 1024) and got["verdict"] == "supported"
    assert got["test"] == "sign"
    # The magnitudes do not count: the sign-flip test finds 9 of 10 far less often
    # against one large negative value.
    heavy = [0.01] * 9 + [-1.0]
    assert verdicts.sign_test_p(heavy) == (11 / 1024, 1023 / 1024)
    assert judge(heavy, 0, test="sign-flip")["verdict"] == "inconclusive"
    # 8 of 10 above: P(X >= 8) = (45 + 10 + 1) / 1024, two-sided 0.109: inconclusive.
    assert judge([0.3] * 8 + [-0.2] * 2, 0)["p"] == pytest.approx(2 * 56 / 1024)
    # All above: the floor 2^-n, as the sign-flip test's.
    assert verdicts.sign_test_p([0.6] * 6, 0.5) == (1 / 64, 1.0)
    assert verdicts.sign_test_p([7.0]) == (0.5, 1.0)
    # Exact beyond the sign-flip test's enumeration: 30 values, 25 above.
    thirty = [1.0] * 25 + [-1.0] * 5
    tail = sum(math.comb(30, k) for k in range(25, 31)) / 2**30
    assert verdicts.sign_test_p(thirty)[0] == pytest.approx(tail, rel=1e-12)
    assert verdicts.sign_test_p(thirty)[0] == pytest.approx(stats.binom.sf(24, 30, 0.5))
    with pytest.raises(ValueError, match="at least one value"):
        verdicts.sign_test_p([])
    with pytest.raises(ValueError, match="not finite"):
        verdicts.sign_test_p([0.1, math.nan])
    with pytest.raises(ValueError, match="test must be one of sign-flip, sign, got 't'"):
        judge([0.1] * 6, 0, test="t")


def test_sign_test_counts_ties_against_each_direction():
    """A value at the threshold is evidence for neither side: it counts as a failure of
    both one-sided tests (n stays 10), which keeps the test of the median exact where the
    values have an atom at it. Dropping ties would test P(above) = P(below) instead."""
    # 8 above, 2 at the threshold: P(X >= 8) of Bin(10, 1/2) = 56/1024 (dropped: 1/256).
    tied = [0.6] * 8 + [0.5] * 2
    assert verdicts.sign_test_p(tied, 0.5) == (56 / 1024, 1.0)
    # Quantised: gains of exactly 0.10 as floats (0.6 - 0.5) tie with the threshold 0.10.
    gains = [0.6 - 0.5] * 4 + [0.7 - 0.5] * 6
    six_or_more = sum(math.comb(10, k) for k in range(6, 11)) / 1024
    assert verdicts.sign_test_p(gains, 0.10) == (six_or_more, 1.0)
    assert verdicts.sign_test_p([0.5] * 4, 0.5) == (1.0, 1.0)

    # The values' median is the threshold (P(at it) = 0.6, P(above) = 0.4): a true null,
    # decided at most 5% of the time. Dropping the ties would decide it whenever 6 or more
    # of the 20 values are not tied (all of those lie above: two-sided p 2^(1-n)).
    def atom(rng):
        return np.where(rng.random(20) < 0.6, 0.0, 1.0)

    assert _rejection_rate(atom, 0.0) <= 0.05
    rng = np.random.default_rng(0)
    dropped = np.mean([np.sum(atom(rng) > 0) >= 6 for _ in range(2000)])
    assert dropped > 0.8  # ~0.87


def test_holm_across_sign_and_sign_flip_checks():
    """A claim of a sign-flip check and a sign check: Holm over both tests' p-values."""
    diff = judge([0.1, 0.2, 0.05, 0.3, 0.1, 0.2, 0.15], 0, test="sign-flip")  # 2/128
    value = judge([0.6] * 9 + [0.4], 0.5)  # the sign test: 2 x 11/1024
    assert (diff["test"], value["test"]) == ("sign-flip", "sign")
    verdict, (d, v) = claim_verdict([diff, value])
    # Sorted 2/128 = 0.0156 x 2 = 0.031; 22/1024 = 0.0215 x 1, kept non-decreasing: 0.031.
    assert d["p"] == pytest.approx(4 / 128) and v["p"] == pytest.approx(4 / 128)
    assert verdict == "supported" and (d["test"], v["test"]) == ("sign-flip", "sign")
    # 8 of 10: 2 x 56/1024 = 0.109 alone; the claim is inconclusive, the diff still holds.
    weaker = judge([0.6] * 8 + [0.4] * 2, 0.5)
    verdict, (d, v) = claim_verdict([diff, weaker])
    assert (d["verdict"], v["verdict"], verdict) == ("supported", "inconclusive", "inconclusive")
    assert d["p"] == pytest.approx(4 / 128) and v["p"] == pytest.approx(112 / 1024)


def _sign_power(n, share, one_sided):
    """The sign test's power at n pairs when each lies above with probability ``share``."""
    from scipy import stats

    critical = next(k for k in range(n + 2) if stats.binom.sf(k - 1, n, 0.5) <= one_sided)
    return stats.binom.sf(critical - 1, n, share)


def test_pairs_needed_for_the_sign_test_from_the_observed_share():
    """The sign test's power line: the smallest n at which its exact power at the observed
    share of pairs on the decided side reaches 80% (scipy's binomial as the reference)."""
    for above, n in ((8, 10), (9, 10), (7, 10), (15, 20)):
        values = [1.0] * above + [-1.0] * (n - above)
        needed = judge(values, 0)["pairs_needed"]
        share = above / n
        assert _sign_power(needed, share, 0.025) >= 0.8, (above, n)
        assert all(_sign_power(m, share, 0.025) < 0.8 for m in range(2, needed)), (above, n)
    # Every pair above: the fewest pairs at which the test can reach alpha / 2 (2^-6).
    assert judge([1.0] * 10, 0)["pairs_needed"] == 6
    assert judge([1.0] * 5 + [-1.0] * 5, 0)["pairs_needed"] == "not estimable (half the pairs)"
    # Ties count against: 8 above and 2 at the threshold is a share of 0.8.
    tied = judge([1.0] * 8 + [0.0] * 2, 0)["pairs_needed"]
    assert tied == judge([1.0] * 8 + [-1.0] * 2, 0)["pairs_needed"]
    # A claim's check takes the strictest Holm level (alpha / hypotheses).
    _, (first, _) = claim_verdict([judge([1.0] * 8 + [-1.0] * 2, 0)] * 2)
    needed = first["pairs_needed"]
    assert _sign_power(needed, 0.8, 0.0125) >= 0.8
    assert all(_sign_power(m, 0.8, 0.0125) < 0.8 for m in range(2, needed))
    # Equivalence (TOST by two sign tests at alpha): 9 of 10 inside the margin, one above;
    # power P(first rejects) + P(second rejects) - 1 at the shares 1.0 and 0.9.
    near = judge([0.0] * 9 + [0.2], 0, margin=0.05)
    assert near["test"] == "sign"
    needed = near["pairs_needed"]

    def tost_power(m):
        return _sign_power(m, 1.0, 0.025) + _sign_power(m, 0.9, 0.025) - 1.0

    assert tost_power(needed) >= 0.8 and all(tost_power(m) < 0.8 for m in range(2, needed))


def test_sign_flip_counts_rounding_residues_as_ties():
    """A difference of differences that is 0 in exact arithmetic comes out of floats as
    -5.6e-17 at every pair ((0.7 - 0.4) - (0.5 - 0.2)): the sign test counts it at the
    threshold (p 1); the sign-flip test took its sign and found "contradicted" at 2^-10."""
    zero = (0.7 - 0.4) - (0.5 - 0.2)
    assert zero != 0.0 and abs(zero) < 1e-16
    assert verdicts.sign_flip_p([zero] * 10) == (1.0, 1.0)
    assert verdicts.sign_test_p([zero] * 10) == (1.0, 1.0)
    got = judge([zero] * 10, 0, test="sign-flip")
    assert got["verdict"] == "inconclusive" and got["p"] == 1.0
    # Mixed with real values, a residue counts as 0: the same p as an exact 0.
    mixed = [0.1, 0.2, 0.3, 0.15, zero, 0.25]
    assert verdicts.sign_flip_p(mixed) == verdicts.sign_flip_p([0.1, 0.2, 0.3, 0.15, 0.0, 0.25])
    # Beyond the exact range too (the drawn assignments).
    assert verdicts.sign_flip_p([zero] * 25) == (1.0, 1.0)


def test_a_start_whose_median_is_at_the_threshold_disagrees_after_rounding():
    """Start 1's median is 0.4 - 0.3 = 0.10000000000000003, the threshold 0.10 to the sign
    test (a tie): that start's median does not lie above it, so the check decides nothing;
    the float comparison let it agree and the check read "supported" (17 of 20 above)."""
    tie = 0.4 - 0.3
    values = [0.2] * 15 + [0.0, 0.05, tie, 0.2, 0.3]
    starts = [0] * 15 + [1] * 5
    got = judge(values, 0.1, starts=starts)
    assert got["counts"]["above"] == 17 and got["p"] == pytest.approx(2 * 1351 / 2**20)
    assert got["verdict"] == "inconclusive"
    assert got["note"] == "start(s) 1 disagree; the test alone: supported"
    # The same below: a start's median at threshold - 0 disagrees with "contradicted".
    mirrored = judge([-0.2] * 15 + [0.2, 0.15, 0.4 - 0.3, 0.0, -0.1], 0.1, starts=starts)
    assert mirrored["verdict"] == "inconclusive" and "start(s) 1 disagree" in mirrored["note"]
    # And an equivalence check: a start's median at the margin's end, 0.6 - 0.5 =
    # 0.09999999999999998 against 0.1 (inside to the float comparison).
    near = [0.0] * 15 + [0.0, 0.05, 0.6 - 0.5, 0.12, 0.2]
    within = judge(near, 0.0, margin=0.1, starts=starts)
    assert within["note"] == "start(s) 1 disagree; the test alone: equivalent"
    # A start's median really inside (1e-9 below the end) agrees.
    inside = judge([0.0] * 15 + [0.0, 0.05, 0.1 - 1e-9, 0.12, 0.2], 0.0, margin=0.1, starts=starts)
    assert inside["verdict"] == "equivalent" and inside["note"] == ""


def test_power_line_at_zero_spread_on_a_rounding_residue():
    """Ten pairs of (0.7 - 0.4) - (0.5 - 0.2) = -6e-17, no spread: the effect is 0 (the
    test counts each pair at the threshold), so no number of pairs decides it; the power
    line read 6, the floor for every pair alike off the threshold."""
    zero = (0.7 - 0.4) - (0.5 - 0.2)
    got = judge([zero] * 10, 0, test="sign-flip")
    assert got["pairs_needed"] == judge([0.0] * 10, 0, test="sign-flip")["pairs_needed"]
    assert got["pairs_needed"] == "not estimable (no spread)"
    assert verdicts.pairs_needed(zero, 0.0) == "not estimable (no spread)"
    assert verdicts.pairs_needed(1e-6, 0.0) == 6  # a real effect still has its floor


def test_sign_test_exact_from_one_pair_to_thousands():
    """P(X >= k) of Bin(n, 1/2) from integer sums (fractions as the reference) at n = 1, 2,
    25, 200: exact to the float, no overflow; at n = 1100 the all-above tail 2^-1100
    underflows to 0.0, never a NaN or an error; moving a value further above the threshold
    (or from below to above) never raises p_above."""
    from fractions import Fraction

    from scipy import stats

    def tail(k, n):
        return float(Fraction(sum(math.comb(n, j) for j in range(k, n + 1)), 2**n))

    for n, above, below in ((1, 1, 0), (2, 1, 1), (2, 0, 0), (25, 18, 5), (200, 117, 80)):
        values = [0.5] * above + [-0.5] * below + [0.0] * (n - above - below)
        assert verdicts.sign_test_p(values) == (tail(above, n), tail(below, n)), n
    assert verdicts.sign_test_p([0.5]) == (0.5, 1.0)
    assert verdicts.sign_test_p([0.5, -0.5]) == (0.75, 0.75)
    p_above, p_below = verdicts.sign_test_p([1.0] * 1100)
    assert (p_above, p_below) == (0.0, 1.0)
    p_above, _ = verdicts.sign_test_p([1.0] * 600 + [-1.0] * 500)
    assert p_above == pytest.approx(stats.binom.sf(599, 1100, 0.5), rel=1e-9)
    values = [0.3, -0.2, 0.1, -0.4, 0.0, 0.25]
    p = verdicts.sign_test_p(values)[0]
    for i in range(len(values)):
        for moved in (values[i] + 0.05, values[i] + 10.0, abs(values[i]) + 1e-3):
            bumped = [*values[:i], moved, *values[i + 1 :]]
            assert verdicts.sign_test_p(bumped)[0] <= p
