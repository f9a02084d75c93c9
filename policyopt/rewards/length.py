"""Length shaping: DAPO's soft overlong punishment, Magistral's scaled variant, and the
overlong-filtering flag.

DAPO (arXiv 2503.14476, eq. 13), on the number of generated tokens |y|, with the maximum
length L_max and the punishment interval ("cache") L_cache:

    R_len(y) = 0                                  if |y| <= L_max - L_cache
             = ((L_max - L_cache) - |y|) / L_cache if L_max - L_cache < |y| <= L_max
             = -1                                 if |y| > L_max

added to the correctness reward. Magistral (arXiv 2506.10910, section 2.2.1) uses the same
ramp scaled by 0.1: 0, -0.1 (|y| - l_max + l_cache) / l_cache, -0.1. Both are continuous:
the ramp reaches -scale at |y| = L_max.

Overlong *filtering* (DAPO section 3.4) is separate: samples truncated at the generation
limit are masked out of the loss; :func:`truncated` gives the flag.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

OVERLONG_MODES = ("none", "dapo", "magistral")
# Penalty scale per mode: DAPO's ramp goes to -1, Magistral's to -0.1.
DEFAULT_SCALE = {"none": 0.0, "dapo": 1.0, "magistral": 0.1}


def _check(max_len: int, cache_len: int) -> None:
    if not 0 < cache_len <= max_len:
        raise ValueError(
            f"overlong shaping needs 0 < cache_len <= max_len, got cache_len={cache_len}, "
            f"max_len={max_len}"
        )


def overlong_penalty(length: int, max_len: int, cache_len: int, *, scale: float = 1.0) -> float:
    """DAPO soft overlong punishment (eq. 13) times ``scale`` (Magistral: 0.1) for one length.

    Args:
      length: number of generated tokens |y|.
      max_len: L_max.
      cache_len: L_cache (the ramp starts at L_max - L_cache).
      scale: 1.0 for DAPO, 0.1 for Magistral.

    Returns:
      A value in [-scale, 0].
    """
    _check(max_len, cache_len)
    threshold = max_len - cache_len
    if length <= threshold:
        return 0.0
    if length <= max_len:
        return scale * (threshold - length) / cache_len
    return -scale


def overlong_penalties(
    lengths: Sequence[int] | np.ndarray, max_len: int, cache_len: int, *, scale: float = 1.0
) -> np.ndarray:
    """Vectorised :func:`overlong_penalty`: float32 [N] from lengths [N]."""
    _check(max_len, cache_len)
    lengths = np.asarray(lengths, dtype=np.float64)
    threshold = max_len - cache_len
    ramp = (threshold - lengths) / cache_len
    penalty = np.where(lengths <= threshold, 0.0, np.where(lengths <= max_len, ramp, -1.0))
    return (scale * penalty).astype(np.float32)


def truncated(lengths: Sequence[int] | np.ndarray, max_len: int) -> np.ndarray:
    """bool [N]: the sample used the whole generation budget (``length >= max_len``).

    Without an EOS flag a sample of exactly ``max_len`` tokens is taken as truncated; pass
    the sampler's own flag to :func:`~policyopt.rewards.score_batch` when it has one.
    """
    return np.asarray(lengths) >= max_len
