"""Preloaded by the scoring pool's fork server: importing it imports and warms the verifiers.

:func:`policyopt.rewards.score_batch` starts its workers with the ``forkserver`` method:
a fresh, single-threaded server process (started by exec, never forked from the caller,
which may run JAX threads) imports this module once, and every worker is then forked from
it with SymPy and math-verify imported and warmed up, and the language-id model loaded.
Replacing a pool killed at a deadline therefore costs a fork, not seconds of imports per
worker.
"""

from policyopt.rewards import language as language_lib
from policyopt.rewards import math as math_lib

math_lib.load_math_verify()
language_lib.load_language_identifier()
