"""The verdict of a claim's checks (`experiments/reproduce.py`; the rule in docs/claims.md).

A check's values are paired per (SFT start, seed), each tested against its threshold by an
exact test that the check's kind chooses (``configs.claims.Check.test``): the sign-flip
test where "no effect" makes the values symmetric about the threshold by design (a paired
difference of interchangeable arms against 0), otherwise the sign test of their median
(exact for any shape). Neither can decide on few pairs (smallest p 2^-n). With a margin,
TOST (both one-sided tests against threshold -+ margin) can find "equivalent". Holm's
correction runs over the hypotheses of a claim's checks (family-wise alpha 0.05). A
decided check needs every pair present and every SFT start's centre (mean or median) on
the decided side. The claim is supported when every check is supported or equivalent, and
contradicted when one is contradicted. A t interval and a power line are reported, not used.
"""

from __future__ import annotations

import functools
import math
import statistics
from typing import Sequence

import numpy as np

#: Family-wise error rate of a claim's verdicts (Holm over its checks' hypotheses).
ALPHA = 0.05
#: The power the "pairs needed" line is computed for.
POWER = 0.8
#: Up to this many pairs the sign-flip test enumerates all 2^n assignments; beyond, it
#: draws ``MONTE_CARLO_DRAWS`` of them (a fixed rng: the same p at every call).
EXACT_MAX_N = 20
MONTE_CARLO_DRAWS = 200_000
#: The exact tests a check can be decided by (``judge``'s ``test``): "sign-flip" (the
#: values symmetric about the threshold under the null) and "sign" (their median).
TESTS = ("sign-flip", "sign")


def sign_flip_p(values: Sequence[float], center: float = 0.0) -> tuple[float, float]:
    """One-sided p-values of the sign-flip test of the values against ``center``.

    With d_i = values_i - center and S = sum d_i, ``p_above`` is the share of sign
    assignments s in {-1, 1}^n with sum s_i |d_i| >= S (evidence that the values lie above
    ``center``), ``p_below`` the share with sum <= S. Ties count towards both (conservative),
    so values all at ``center`` (within ``TIE_RTOL``, as ``sign_counts``) give 1 and 1.
    Exact up to ``EXACT_MAX_N`` values; beyond, (1 + hits) / (1 + draws) over
    ``MONTE_CARLO_DRAWS`` random assignments. A value or ``center`` that is not finite is
    a ValueError (a NaN would give p 0 both ways).

    Returns:
      ``(p_above, p_below)``.
    """
    _finite(values, center, "sign_flip_p")
    # A difference that is 0 up to float rounding ((0.7 - 0.4) - (0.5 - 0.2) = -6e-17) is
    # a tie, as in the sign test: n such residues of one sign would decide at 2^-n.
    d = _residuals(values, center)
    magnitude = np.abs(d)
    observed = float(d.sum())
    # Sums that equal the observed one up to rounding are ties.
    tol = 1e-9 * float(magnitude.sum())
    if d.size <= EXACT_MAX_N:
        sums = np.zeros(1)
        for a in magnitude:
            sums = np.concatenate([sums + a, sums - a])
        return float(np.mean(sums >= observed - tol)), float(np.mean(sums <= observed + tol))
    rng = np.random.default_rng(0)
    above = below = 0
    for start in range(0, MONTE_CARLO_DRAWS, 10_000):
        signs = rng.choice((-1.0, 1.0), size=(min(10_000, MONTE_CARLO_DRAWS - start), d.size))
        sums = signs @ magnitude
        above += int(np.sum(sums >= observed - tol))
        below += int(np.sum(sums <= observed + tol))
    return (1 + above) / (1 + MONTE_CARLO_DRAWS), (1 + below) / (1 + MONTE_CARLO_DRAWS)


def _finite(values: Sequence[float], center: float, test: str) -> np.ndarray:
    """``values - center`` as float64, refusing none or any that is not finite."""
    d = np.asarray(values, dtype=np.float64) - center
    if d.size == 0:
        raise ValueError(f"{test} needs at least one value")
    if not np.all(np.isfinite(d)):
        raise ValueError(f"{test}: values or center {center} not finite: {list(values)}")
    return d


#: A value within this much of a threshold, relative to the larger of 1, it and the
#: threshold, is at it (both tests, and a start's centre): float rounding, not evidence.
TIE_RTOL = 1e-12


def _residuals(values: Sequence[float], center: float) -> np.ndarray:
    """``values - center`` as float64 with the values at ``center`` (``TIE_RTOL``) 0."""
    values = np.asarray(values, dtype=np.float64)
    scale = np.maximum(1.0, np.maximum(np.abs(values), abs(center)))
    return np.where(np.abs(values - center) <= TIE_RTOL * scale, 0.0, values - center)


def sign_counts(values: Sequence[float], center: float = 0.0) -> tuple[int, int]:
    """How many values lie above and below ``center``; a value within ``TIE_RTOL``
    (relative to the larger of 1, it and ``center``) is at it: pass@1 differences in
    1/256 rounded as floats (0.6 - 0.5 against 0.1) tie."""
    d = _residuals(values, center)
    return int(np.sum(d > 0)), int(np.sum(d < 0))


def _binomial_half_sf(k: int, n: int) -> float:
    """P(X >= k) for X ~ Bin(n, 1/2), from the integers (exact to the float)."""
    if k <= 0:
        return 1.0
    return sum(math.comb(n, j) for j in range(k, n + 1)) / 2**n


def sign_test_p(values: Sequence[float], center: float = 0.0) -> tuple[float, float]:
    """One-sided p-values of the exact sign test of the values' median against ``center``.

    Of n values, k_above lie above ``center`` and k_below below (``sign_counts``).
    ``p_above`` = P(X >= k_above) and ``p_below`` = P(X >= k_below), X ~ Bin(n, 1/2):
    the evidence that the median lies above (below) ``center``. A value at ``center``
    counts against both (n keeps it), so the test stays exact for H0 "median <=
    ``center``" (resp. >=) when the values have an atom there; dropping it would test
    P(above) = P(below) instead. Exact for any n; its smallest p is 2^-n. A value or
    ``center`` that is not finite is a ValueError.

    Returns:
      ``(p_above, p_below)``.
    """
    d = _finite(values, center, "sign_test_p")
    above, below = sign_counts(values, center)
    return _binomial_half_sf(above, d.size), _binomial_half_sf(below, d.size)


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values: the i-th smallest of m is multiplied by m - i
    (i from 0), made non-decreasing and capped at 1; a hypothesis is rejected at family-wise
    level alpha where its adjusted p <= alpha."""
    order = sorted(range(len(p_values)), key=lambda i: p_values[i])
    adjusted = [1.0] * len(p_values)
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(p_values) - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted


def _betainc(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta function I_x(a, b) (continued fraction, Lentz)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    if x > (a + 1.0) / (a + b + 2.0):  # the fraction converges fast below the mode
        return 1.0 - _betainc(b, a, 1.0 - x)
    log_front = a * math.log(x) + b * math.log1p(-x) - math.log(a)
    log_front -= math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    fraction = d
    for m in range(1, 500):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            fraction *= c * d
        if abs(c * d - 1.0) < 1e-15:
            break
    return math.exp(log_front) * fraction


#: From this many degrees of freedom on, Student's t is the normal with its expansion in
#: 1 / df (quantile: Cornish-Fisher to 1 / df^3; cdf: to 1 / df^2; errors < 1e-12): the
#: incomplete beta loses digits there (df / (df + t^2) rounds towards 1).
CORNISH_FISHER_DF = 1e4


def student_t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom (beyond
    ``CORNISH_FISHER_DF``, the normal's with its terms to 1 / df^2)."""
    if df >= CORNISH_FISHER_DF:
        normal, g = statistics.NormalDist(), 1.0 / df
        correction = (t**3 + t) / 4 * g + (3 * t**7 - 7 * t**5 - 5 * t**3 - 3 * t) / 96 * g * g
        return normal.cdf(t) - normal.pdf(t) * correction
    tail = 0.5 * _betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


def student_t_quantile(q: float, df: float) -> float:
    """The ``q`` quantile of Student's t with ``df`` degrees of freedom (bisection on the
    cdf, to 1e-10; beyond ``CORNISH_FISHER_DF`` the normal's expansion)."""
    if not 0.0 < q < 1.0:
        raise ValueError(f"a quantile needs 0 < q < 1, got {q}")
    if df >= CORNISH_FISHER_DF:
        z, g = statistics.NormalDist().inv_cdf(q), 1.0 / df
        return (
            z
            + (z**3 + z) / 4 * g
            + (5 * z**5 + 16 * z**3 + 3 * z) / 96 * g * g
            + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384 * g * g * g
        )
    if q < 0.5:
        return -student_t_quantile(1.0 - q, df)
    low, high = 0.0, 1.0
    while student_t_cdf(high, df) < q:
        low, high = high, 2.0 * high
    while high - low > 1e-10 * max(1.0, high):
        mid = 0.5 * (low + high)
        low, high = (mid, high) if student_t_cdf(mid, df) < q else (low, mid)
    return 0.5 * (low + high)


def _iterated_pairs(one_sided: float, power: float, std: float, distance: float) -> float:
    """n = ((t_{1-one_sided} + t_{power}) std / distance)^2, t at n - 1 degrees of freedom
    (iterated from the normal quantiles)."""
    normal = statistics.NormalDist()
    z = normal.inv_cdf(1 - one_sided) + normal.inv_cdf(power)
    n = (z * std / distance) ** 2
    for _ in range(50):
        df = max(n - 1.0, 1.0)
        t = student_t_quantile(1 - one_sided, df) + student_t_quantile(power, df)
        n, previous = (t * std / distance) ** 2, n
        if abs(n - previous) < 1e-6:
            break
    return n


def _tost_pairs(alpha: float, std: float, effect: float, margin: float) -> float:
    """The n at which TOST at ``alpha`` has ``POWER`` for |effect| < margin: F(near) +
    F(far) - 1 = POWER, F Student's t cdf at n - 1 degrees of freedom, near / far =
    (margin -+ |effect|) sqrt(n) / std - t_{1-alpha} (both one-sided tests must reject).
    Between the n of F(near) = POWER (the far test ignored) and F(near) = 1 - (1 - POWER)
    / 2 (reached at effect 0), by bisection."""
    near, far = margin - abs(effect), margin + abs(effect)

    def power(n):
        df = max(n - 1.0, 1.0)
        t, root = student_t_quantile(1 - alpha, df), math.sqrt(n) / std
        return student_t_cdf(near * root - t, df) + student_t_cdf(far * root - t, df) - 1.0

    low = _iterated_pairs(alpha, POWER, std, near)
    high = _iterated_pairs(alpha, 1.0 - (1.0 - POWER) / 2, std, near)
    if power(high) <= POWER:  # effect 0: the upper end is the answer
        return high
    while high - low > 1e-6 * high:
        mid = 0.5 * (low + high)
        low, high = (mid, high) if power(mid) < POWER else (low, mid)
    return high


def pairs_needed(
    effect: float, std: float, margin: float | None = None, alpha: float = ALPHA
) -> int | str:
    """The sign-flip test's power line: the (start, seed) pairs for ``POWER`` at the
    observed ``effect`` (mean - threshold) and spread, or why that is not estimable
    (``sign_pairs_needed`` serves the sign test).

    Without a margin: the two-sided test at ``alpha`` of effect != 0, n = ((t_{1-alpha/2} +
    t_{POWER}) std / |effect|)^2 with t at n - 1 degrees of freedom (iterated from the
    normal quantiles). With one: the test that finds what the effect shows, TOST at
    ``alpha`` when |effect| < margin (both one-sided tests' power, ``_tost_pairs``; at
    effect 0 distance margin at power 1 - (1 - POWER) / 2 each) or the two-sided test
    beyond the margin (distance |effect| - margin). At least the fewest pairs for which
    the exact sign-flip test can reach ``alpha``, which is the answer at zero spread (every
    pair alike, off the threshold by more than ``TIE_RTOL``). A distance within 1e-9
    standard deviations of 0 is not estimable (the mean's rounding).
    """
    one_sided, distance = alpha / 2, abs(effect)
    if margin is not None:
        distance = abs(margin - abs(effect))
        if abs(effect) < margin:  # equivalence: two one-sided tests at alpha
            one_sided = alpha
    # The sign-flip test's smallest one-sided p is 2^-n.
    exact = max(math.ceil(math.log2(1.0 / one_sided) - 1e-12), 2)
    # Every pair alike, off the threshold (beyond the tests' tie tolerance: a mean of
    # rounding residues, -6e-17, is at it): the exact floor.
    if std == 0.0 and distance > TIE_RTOL:
        return exact
    if not (math.isfinite(std) and std > 0):
        return "not estimable (no spread)"
    # A distance below 1e-9 standard deviations (> 10^18 pairs) is the mean's rounding:
    # values symmetric about a threshold of 0.2 give an effect of ~1e-17, not 0.
    if distance <= 1e-9 * std:
        return "not estimable (effect 0)" if margin is None else "not estimable (effect at margin)"
    if margin is not None and abs(effect) < margin:
        n = _tost_pairs(alpha, std, effect, margin)
    else:
        n = _iterated_pairs(one_sided, POWER, std, distance)
    return max(math.ceil(n - 1e-9), exact)


def _binomial_sf_all(n: int, share: float) -> np.ndarray:
    """P(X >= k) for k = 0..n + 1, X ~ Bin(n, ``share``) (log-space pmf, summed from the
    tail)."""
    k = np.arange(n + 1)
    if share >= 1.0 or share <= 0.0:
        pmf = (k == (n if share >= 1.0 else 0)).astype(np.float64)
    else:
        log_comb = np.concatenate([[0.0], np.cumsum(np.log((n - k[1:] + 1) / k[1:]))])
        pmf = np.exp(log_comb + k * math.log(share) + (n - k) * math.log1p(-share))
    return np.concatenate([np.cumsum(pmf[::-1])[::-1], [0.0]])


def _sign_power(n: int, shares: Sequence[float], one_sided: float) -> float:
    """The sign test's power at ``n`` pairs: each of its one-sided tests (level
    ``one_sided``, critical count k the smallest with P(Bin(n, 1/2) >= k) <= it) rejects
    with P(Bin(n, share) >= k); with two (TOST), both must: P(first) + P(second) - 1, a
    lower bound."""
    null = _binomial_sf_all(n, 0.5)
    critical = int(np.argmax(null <= one_sided))  # null[n + 1] = 0 always qualifies
    powers = [float(_binomial_sf_all(n, q)[critical]) for q in shares]
    return sum(powers) - (len(powers) - 1)


#: Beyond this many pairs the sign test's power line is the normal approximation's.
SIGN_SEARCH_MAX = 5000


def sign_pairs_needed(counts: dict, margin: float | None = None, alpha: float = ALPHA) -> int | str:
    """The (start, seed) pairs for ``POWER`` of the sign test at the observed shares of
    pairs on each side, or why that is not estimable.

    ``counts``: of ``n`` pairs, how many lie ``above`` and ``below`` the threshold (beyond
    the margin with one: above threshold + margin, below threshold - margin) and, with a
    margin, ``above_low`` (above threshold - margin) and ``below_high``; a pair at a
    boundary counts against it (``sign_test_p``). Without a margin: the two-sided test at
    ``alpha`` on the side most pairs lie, share q = max(above, below) / n, at the smallest
    n where P(Bin(n, q) >= k_n) >= ``POWER``. With one: TOST at ``alpha`` when more than
    half the pairs lie inside each end (``_sign_power``), else the two-sided test beyond
    the margin. The shares are the observed ones (a share of 1 gives the fewest pairs at
    which the test can reach its level); beyond ``SIGN_SEARCH_MAX`` pairs the normal
    approximation's n.
    """
    n = counts["n"]
    if counts["above"] == counts["below"] == 0 and margin is None:
        return "not estimable (every pair at the threshold)"
    if margin is not None and min(counts["above_low"], counts["below_high"]) * 2 > n:
        shares, one_sided = (counts["above_low"] / n, counts["below_high"] / n), alpha
    elif max(counts["above"], counts["below"]) * 2 > n:
        shares, one_sided = (max(counts["above"], counts["below"]) / n,), alpha / 2
    else:
        return (
            "not estimable (half the pairs)"
            if margin is None
            else ("not estimable (half the pairs at the margin)")
        )
    return _sign_search(shares, one_sided)


@functools.lru_cache(maxsize=1024)
def _sign_search(shares: tuple[float, ...], one_sided: float) -> int:
    """``sign_pairs_needed``'s n for the shares (one, or TOST's two) at ``one_sided``."""
    normal, q = statistics.NormalDist(), min(shares)
    z = normal.inv_cdf(1 - one_sided) * 0.5 + normal.inv_cdf(POWER) * math.sqrt(q * (1 - q))
    approx = (z / (q - 0.5)) ** 2
    if approx > SIGN_SEARCH_MAX:
        return math.ceil(approx)
    n = max(2, math.ceil(math.log2(1.0 / one_sided) - 1e-12))  # 2^-n <= the level
    while _sign_power(n, shares, one_sided) < POWER:
        n += 1
    return n


def _tests(values: Sequence[float], threshold: float, margin: float | None, test: str) -> dict:
    """The hypotheses a check's values can reject: ``[(verdict, p), ...]`` with the
    one-sided p-values they come from (``test``'s), and for the sign test the counts its
    power line reads."""
    one_sided = sign_flip_p if test == "sign-flip" else sign_test_p
    m = margin or 0.0
    counts = {"n": len(values)}
    counts["above"] = sign_counts(values, threshold + m)[0]
    counts["below"] = sign_counts(values, threshold - m)[1]
    if margin is None:
        above, below = one_sided(values, threshold)
        direction = ("supported", above) if above <= below else ("contradicted", below)
        return {
            "p_above": above,
            "p_below": below,
            "tests": [(direction[0], min(1.0, 2 * direction[1]))],
            "counts": counts,
        }
    if not (math.isfinite(margin) and margin > 0):
        raise ValueError(f"an equivalence margin must be > 0 and finite, got {margin}")
    above_low, below_low = one_sided(values, threshold - margin)
    above_high, below_high = one_sided(values, threshold + margin)
    counts["above_low"] = sign_counts(values, threshold - margin)[0]
    counts["below_high"] = sign_counts(values, threshold + margin)[1]
    # Beyond the margin: above threshold + margin, or below threshold - margin.
    direction = (
        ("supported", above_high) if above_high <= below_low else ("contradicted", below_low)
    )
    return {
        "p_above": above_high,
        "p_below": below_low,
        "p_equivalent": max(above_low, below_high),
        "tests": [
            ("equivalent", max(above_low, below_high)),
            (direction[0], min(1.0, 2 * direction[1])),
        ],
        "counts": counts,
    }


def _on_side(centre: float, verdict: str, threshold: float, margin: float | None) -> bool:
    """Whether a centre (mean or median) lies where ``verdict`` puts the check's; a centre
    at a bound (``TIE_RTOL``, as the tests count a value) lies on neither side of it."""
    m = margin or 0.0
    above = sign_counts([centre], threshold + m)[0] == 1  # beyond the upper bound
    below = sign_counts([centre], threshold - m)[1] == 1
    if verdict == "supported":
        return above
    if verdict == "contradicted":
        return below
    # Equivalent: above the lower bound and below the upper one.
    return (
        sign_counts([centre], threshold - m)[0] == 1
        and sign_counts([centre], threshold + m)[1] == 1
    )


def judge(
    values: Sequence[float],
    threshold: float,
    margin: float | None = None,
    *,
    test: str = "sign",
    starts: Sequence[int] | None = None,
    missing: int = 0,
) -> dict:
    """The verdict of one check from its per-pair values, judged alone (``claim_verdict``
    judges a claim's checks together: Holm's correction across them).

    Args:
      values: one per (SFT start, seed) pair, e.g. a paired difference between two arms.
      threshold: the check is "supported" when the values lie above it, "contradicted"
        when below (``test``, two-sided at ``ALPHA``).
      margin: with one, "equivalent" when TOST shows the values within threshold -+
        margin; "supported" / "contradicted" then mean beyond the margin.
      test: "sign" (default: the sign test of the median, exact for any values) or
        "sign-flip" (exact only where the null makes the values symmetric about the
        threshold: a paired difference of interchangeable arms against 0;
        ``configs.claims.Check.test`` chooses).
      starts: the SFT start of each value (for the per-start centres: a decided
        direction that a start's mean, or median under the sign test, does not share
        is no verdict).
      missing: pairs of the sweep without a value (not logged, or not finite): a check
        with any is not decided. ``values`` themselves must be finite (a ValueError).

    Returns:
      ``{"n", "missing", "test", "threshold", "margin", "verdict", "note", ...}``; with
      values also "mean", "median", "std", "half_width" (95% Student t), "effect" (the
      test's centre, the mean or under the sign test the median, minus the threshold),
      "start_effects" ({start: its centre - threshold}), "start_means" ({start: mean -
      threshold}), "p_above" / "p_below" (one-sided, against threshold or beyond the
      margin), "p_equivalent" (with a margin), "tests" ([(verdict, p)]), "counts" (pairs
      above / below), "p" (the decisive hypothesis's p after Holm) and "pairs_needed"
      (``pairs_needed`` or ``sign_pairs_needed``). ``verdict`` is "supported",
      "contradicted", "equivalent", "inconclusive", or "not run" when no pair has a value.
    """
    if test not in TESTS:
        raise ValueError(f"judge: test must be one of {', '.join(TESTS)}, got {test!r}")
    values = [float(v) for v in values]
    for i, value in enumerate(values):
        if not math.isfinite(value):
            raise ValueError(
                f"judge: value {i + 1} of {len(values)} is {value}; count it in missing="
            )
    if not math.isfinite(threshold):
        raise ValueError(f"judge: the threshold {threshold} is not finite")
    if starts is not None and len(starts) != len(values):
        raise ValueError(f"judge: {len(values)} values but {len(starts)} starts")
    n = len(values)
    if n == 0:
        return {
            "n": 0,
            "missing": missing,
            "test": test,
            "threshold": threshold,
            "margin": margin,
            "verdict": "not run",
            "note": "no pair has a value",
        }
    centre = statistics.fmean if test == "sign-flip" else statistics.median
    mean = statistics.fmean(values)
    std = statistics.stdev(values) if n > 1 else math.nan
    half = student_t_quantile(0.975, n - 1) * std / math.sqrt(n) if n > 1 else math.inf
    by_start: dict[int, list[float]] = {}
    for start, value in zip(starts if starts is not None else [0] * n, values):
        by_start.setdefault(int(start), []).append(value)
    result = {
        "n": n,
        "missing": missing,
        "test": test,
        "threshold": threshold,
        "margin": margin,
        "mean": mean,
        "median": statistics.median(values),
        "std": std,
        "half_width": half,
        "effect": centre(values) - threshold,
        "start_effects": {s: centre(v) - threshold for s, v in sorted(by_start.items())},
        "start_means": {s: statistics.fmean(v) - threshold for s, v in sorted(by_start.items())},
        **_tests(values, threshold, margin, test),
    }
    (decided,) = _decide([result])
    return decided


def _power_line(check: dict, alpha: float) -> int | str:
    """The check's pairs for ``POWER`` at ``alpha`` by the power of its own test."""
    if check["n"] < 2:
        return "not estimable (one pair)"
    if check["test"] == "sign":
        return sign_pairs_needed(check["counts"], check["margin"], alpha)
    return pairs_needed(check["effect"], check["std"], check["margin"], alpha)


def _decide(checks: Sequence[dict]) -> list[dict]:
    """The checks with their verdicts after Holm's correction across all their hypotheses."""
    family = [(i, verdict, p) for i, c in enumerate(checks) for verdict, p in c.get("tests", ())]
    adjusted = holm([p for _, _, p in family])
    out = []
    for i, check in enumerate(checks):
        check = dict(check)
        if not check.get("tests"):
            out.append({**check, "verdict": "not run", "note": "no pair has a value"})
            continue
        own = [(a, verdict) for (j, verdict, _), a in zip(family, adjusted) if j == i]
        p, verdict = min(own)
        check["p"] = p
        check["pairs_needed"] = _power_line(check, ALPHA / len(family))
        notes = []
        if p > ALPHA:
            verdict = "inconclusive"
        if check["missing"]:
            notes.append(f"{check['missing']} of {check['missing'] + check['n']} pairs missing")
        off = [
            s
            for s, effect in check["start_effects"].items()
            if verdict != "inconclusive"
            and not _on_side(
                effect + check["threshold"], verdict, check["threshold"], check["margin"]
            )
        ]
        if off:
            notes.append(f"start(s) {', '.join(map(str, off))} disagree")
        if notes and verdict != "inconclusive":
            notes.append(f"the test alone: {verdict}")
            verdict = "inconclusive"
        check["verdict"], check["note"] = verdict, "; ".join(notes)
        out.append(check)
    return out


def claim_verdict(checks: Sequence[dict]) -> tuple[str, list[dict]]:
    """A claim's verdict from its checks (``judge`` results), judged together.

    Holm's correction runs over the hypotheses of every check with values, at family-wise
    ``ALPHA``; each check's verdict and "p" are replaced by the corrected ones, and its
    "pairs_needed" takes the correction's strictest level (``ALPHA`` / hypotheses). Checks
    marked ``"reported": True`` (findings the claim reports but does not rest on, e.g. a
    dose-response's lower levels) form a family of their own and leave the claim's
    verdict alone; when every check is reported, all count.

    Returns:
      ``(verdict, checks)``: "supported" when every check it rests on is supported or
      equivalent (none "not run", none missing a pair), "contradicted" when any is
      contradicted, "inconclusive" otherwise (also with no checks).
    """
    reported = [bool(c.get("reported")) for c in checks]
    if all(reported):
        reported = [False] * len(checks)
    decided: list[dict] = [{}] * len(checks)
    for role in (False, True):
        index = [i for i, r in enumerate(reported) if r == role]
        for i, check in zip(index, _decide([checks[i] for i in index])):
            decided[i] = check
    verdicts = [c["verdict"] for c, r in zip(decided, reported) if not r]
    if "contradicted" in verdicts:
        return "contradicted", decided
    if verdicts and all(v in ("supported", "equivalent") for v in verdicts):
        return "supported", decided
    return "inconclusive", decided
