"""experiments/vapo_lambda.py: the length-adaptive lambda's token mean and the rescaled alpha,
against hand-worked cases."""

import pytest

from experiments.vapo_lambda import PAPER_ALPHA, lambda_summary, rescaled_alpha


def test_lambda_summary_by_hand():
    # alpha 0.05: lambda = 1 - 20 / |y|, 0 at and below 20 tokens: 0, 0, 0.5, 0.8.
    summary = lambda_summary([10, 20, 40, 100], 0.05)
    # Over the 170 tokens: (10 x 0 + 20 x 0 + 40 x 0.5 + 100 x 0.8) / 170.
    assert summary["lambda_token_mean"] == pytest.approx(100 / 170, abs=1e-6)
    assert summary["lambda_zero_token_frac"] == pytest.approx(30 / 170)
    assert summary["lambda_at_median"] == pytest.approx(1 - 20 / 30, abs=1e-6)  # median 30
    # Equal lengths: the token mean is the one lambda.
    assert lambda_summary([50, 50], 0.1)["lambda_token_mean"] == pytest.approx(0.8, abs=1e-6)


def test_the_rescaled_alpha_gives_the_median_the_papers_lambda_at_the_reference():
    alpha = rescaled_alpha(100.0, reference_length=500.0)
    assert alpha == pytest.approx(0.25)
    paper = lambda_summary([500], PAPER_ALPHA)["lambda_at_median"]
    assert paper == pytest.approx(0.96, abs=1e-6)
    assert lambda_summary([60, 100, 180], alpha)["lambda_at_median"] == pytest.approx(paper)


def test_bad_lengths_are_refused():
    with pytest.raises(ValueError, match="lengths >= 1"):
        lambda_summary([], 0.05)
    with pytest.raises(ValueError, match="lengths >= 1"):
        lambda_summary([0, 5], 0.05)
    with pytest.raises(ValueError, match="must be > 0"):
        rescaled_alpha(0.0)
