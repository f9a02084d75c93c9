"""Code correctness: the completion's first fenced Python block run against tests in a sandbox.

Tests are an assert string (run after the program, or in a process of its own joined to
the program's by pipes: ``isolation="process"``, ``sandbox/isolation.py``) or stdin /
stdout cases; :func:`~policyopt.rewards.testcases.parse_tests` reads the datasets'
encodings. The program runs in :mod:`policyopt.rewards.sandbox`. The conventions, the
reward hacks that isolation stops and what honest programs lose: ``docs/rewards.md``.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Sequence
from typing import Any

from policyopt.rewards.format import first_code_block
from policyopt.rewards.math import answer_region
from policyopt.rewards.sandbox import run_isolated, run_sandboxed
from policyopt.rewards.sandbox.process import DEFAULT_DISK_MB, DEFAULT_MAX_PROCESSES
from policyopt.rewards.testcases import limit_tests, parse_tests, split_asserts

PYTHON_TAGS = ("python", "py", "python3")
ISOLATIONS = ("process", "none")


@dataclasses.dataclass(frozen=True)
class CodeResult:
    """Outcome of :func:`run_code_tests`.

    Attributes:
      passed: number of test cases passed.
      total: number of test cases (1 for an all-or-nothing assert string).
      status: "correct", "incorrect", "timeout" (a test hit the wall-clock limit),
        "no_code" (no Python block), "no_tests".
    """

    passed: int
    total: int
    status: str

    @property
    def pass_rate(self) -> float:
        return self.passed / self.total if self.total else 0.0

    @property
    def all_passed(self) -> bool:
        return self.total > 0 and self.passed == self.total


def _assert_harness(program: str, tests: str, marker: str) -> str:
    """The source run for assert tests: the program (its own ``SystemExit`` caught), then
    the tests, in a fresh namespace, then ``marker`` on a line of its own, written to a
    copy of the stdout descriptor. ``exec``, ``compile`` and the writer are bound before the
    program runs, so a program that replaces them (``exec = ...``, ``builtins.exec``,
    ``sys.stdout.close()``) neither skips the tests nor hides the marker."""
    return (
        "def _policyopt_run(program, tests, marker, exec=exec, compile=compile, "
        "SystemExit=SystemExit,\n"
        "                   write=__import__('os').write, fd=__import__('os').dup(1)):\n"
        "    namespace = {'__name__': '__main__', '__builtins__': __builtins__}\n"
        "    try:\n"
        "        exec(compile(program, 'program.py', 'exec'), namespace)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "    exec(compile(tests, 'tests.py', 'exec'), namespace)\n"
        "    write(fd, ('\\n' + marker + '\\n').encode())\n"
        f"_policyopt_run({program!r}, {tests!r}, {marker!r})\n"
    )


def run_code_tests(
    completion: str,
    tests: str | Sequence[dict[str, Any]],
    *,
    timeout_s: float = 4.0,
    memory_mb: int = 300,
    stop_at_first_failure: bool = True,
    max_processes: int = DEFAULT_MAX_PROCESSES,
    max_tests: int | None = None,
    isolation: str = "process",
    disk_mb: int = DEFAULT_DISK_MB,
) -> CodeResult:
    """Runs the first code block of ``completion`` against ``tests``; never raises on model output.

    Args:
      completion: model output; the block is searched after ``</think>`` when present.
      tests: assert string, or list of {"input", "output"} cases, or any encoding
        :func:`~policyopt.rewards.testcases.parse_tests` reads (a malformed one raises
        ``ValueError``).
      timeout_s: wall-clock (and CPU) limit per test process.
      memory_mb: memory per test process: each process's address space, and all its
        processes together where the sandbox has control groups (``docs/rewards.md``).
      stop_at_first_failure: stop once a case fails (binary reward needs no more).
      max_processes: RLIMIT_NPROC of the sandbox uid.
      max_tests: run only the first this many cases, or top-level asserts (Magistral runs
        20 tests per problem); None: all.
      isolation: where assert tests run: ``"process"`` (default) in a process of their
        own that talks to the program's process
        (:func:`~policyopt.rewards.sandbox.run_isolated`), or ``"none"``, after the
        program in its process (one interpreter instead of two, and open to the reward
        hacks of ``docs/rewards.md``). stdin / stdout cases run the program alone either
        way.
      disk_mb: size of each test process's working directory (and jail's ``/tmp``).
    """
    if isolation not in ISOLATIONS:
        raise ValueError(f"isolation must be one of {ISOLATIONS}, got {isolation!r}")
    tests = limit_tests(parse_tests(tests), max_tests)
    marker = secrets.token_hex(16)  # printed after the tests (assert strings), per call
    block = first_code_block(answer_region(str(completion)))
    if block is None or block[0] not in PYTHON_TAGS:
        return CodeResult(0, max(len(tests), 1) if not isinstance(tests, str) else 1, "no_code")
    program = block[1]
    limits = dict(
        timeout_s=timeout_s, memory_mb=memory_mb, max_processes=max_processes, disk_mb=disk_mb
    )
    if isinstance(tests, str):
        cases = [
            (test, "", None)
            for test in ([tests] if stop_at_first_failure else split_asserts(tests))
        ]
    else:
        cases = [(program, str(case["input"]), str(case["output"])) for case in tests]
    if not cases:
        return CodeResult(0, 0, "no_tests")
    passed, any_timeout = 0, False
    for source, stdin, expected in cases:
        if expected is None and isolation == "process":
            result = run_isolated(program, source, marker, **limits)
        elif expected is None:
            result = run_sandboxed(_assert_harness(program, source, marker), **limits)
        else:
            result = run_sandboxed(source, stdin=stdin, **limits)
        any_timeout |= result.timed_out
        if expected is None:  # assert tests: they must have run to their end
            ok = result.returncode == 0 and marker in result.stdout
        else:
            # Bytes that are not UTF-8 stay apart from any text (U+FFFD in `expected` is
            # the character, not a wildcard for an invalid byte).
            stdout = result.raw_stdout.decode("utf-8", errors="surrogateescape")
            ok = result.returncode == 0 and _normalise_output(stdout) == _normalise_output(expected)
        ok = ok and not result.disk_exceeded  # past reward.code_disk_mb: a failure
        passed += ok
        if not ok and stop_at_first_failure:
            break
    status = "correct" if passed == len(cases) else ("timeout" if any_timeout else "incorrect")
    return CodeResult(passed, len(cases), status)


def code_correctness(
    completion: str,
    tests: str | Sequence[dict[str, Any]],
    *,
    timeout_s: float = 4.0,
    memory_mb: int = 300,
    partial: bool = False,
    max_tests: int | None = None,
    isolation: str = "process",
) -> float:
    """1.0 if the completion's first code block passes every test (pass rate if ``partial``).

    The test conventions and the sandbox: ``docs/rewards.md``. Never raises on model
    output.
    """
    try:
        result = run_code_tests(
            completion,
            tests,
            timeout_s=timeout_s,
            memory_mb=memory_mb,
            stop_at_first_failure=not partial,
            max_tests=max_tests,
            isolation=isolation,
        )
    except (OSError, SyntaxError, ValueError, KeyError, TypeError):
        return 0.0
    return result.pass_rate if partial else float(result.all_passed)


def _normalise_output(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip().splitlines())
