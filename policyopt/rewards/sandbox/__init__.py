"""Runs untrusted Python programs with limits and reports how they ended.

``run_sandboxed(program, stdin=..., timeout_s=..., memory_mb=..., ...) -> SandboxResult``;
``run_isolated(program, tests, marker, ...)``: a program and its assert tests in two
sandboxes joined by pipes (``isolation.py``); ``remove_stale_sandboxes()``: what dead
scorers left. What a sandbox contains, and where it falls short: ``docs/rewards.md``.
"""

from policyopt.rewards.sandbox.process import Limits, SandboxResult
from policyopt.rewards.sandbox.run import remove_stale_sandboxes, run_isolated, run_sandboxed

__all__ = ["Limits", "SandboxResult", "remove_stale_sandboxes", "run_isolated", "run_sandboxed"]
