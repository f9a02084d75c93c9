"""A synthetic verifiable arithmetic task, generated deterministically from a seed.

A record is a dict of strings: ``prompt`` ("471+853="), ``answer`` ("1324"), ``solution``
(a worked response, the SFT target: "<think>4,12,13</think>\\boxed{1324}") and
``wrong_answer`` (what a pupil's wrong procedure gives: no carry, no precedence, or one
subtraction too few for remainders). The train and test splits are disjoint for every seed
(decided by hashing the prompt). The traces, the wrong procedures and the splits:
docs/design.md, "The synthetic arithmetic task".
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import random
from typing import Iterator, Sequence

from policyopt.data.tokenizer import BOXED_CLOSE, BOXED_OPEN, THINK_CLOSE, THINK_OPEN

SPLITS = ("train", "test")
_OPERATORS = "+-*"


@dataclasses.dataclass(frozen=True)
class ArithmeticConfig:
    """Difficulty knobs of the synthetic task. The defaults are the demo's difficulty.

    Attributes:
      num_operands: operands per problem (>= 2); the least number when ``max_operands``
      is set.
    max_operands: None, or the most operands per problem: each problem then draws its
      number of operands uniformly in [num_operands, max_operands], so that the worked
      solutions' lengths vary (one binary step per operator in the step traces: with
      operators "+-", 2-3 digit operands and 2 to 24 operands, responses of ~20 to ~330
      tokens; each step must find its operand in the prompt, which the 4-layer testbed
      model does not learn: the length-variety task of experiments/reproduce.py is "mod").
      min_digits / max_digits: each operand has a uniformly drawn number of digits in
        [min_digits, max_digits] and a uniform value with that many digits (leading digit
        non-zero, except for 1-digit operands which may be 0). With two 3-digit operands
        about 70% of the additions carry below the top column (1 - 0.55^2).
      operators: the operators drawn from, uniformly per position, a subset of "+-*".
        "+" alone gives the column-sum traces and the forgotten-carry wrong procedure.
        "mod" instead: remainders by repeated subtraction (see the module docstring),
        whose divisor is uniform in [max(2, 10^(min_digits - 1)), 10^max_digits - 1].
      min_steps / max_steps: "mod" only: the quotient (the number of subtractions) is
        uniform in [min_steps, max_steps], the remainder uniform below the divisor.
      wrong_procedure_fraction: share of records whose `solution` follows the wrong
        procedure (exactly floor(n * fraction) of every first n records).
      test_fraction: share of the problem space that belongs to the test split.
    """

    num_operands: int = 2
    max_operands: int | None = None
    min_digits: int = 3
    max_digits: int = 3
    operators: str = "+"
    wrong_procedure_fraction: float = 0.0
    test_fraction: float = 0.1
    min_steps: int = 1
    max_steps: int = 16

    def __post_init__(self):
        if self.num_operands < 2:
            raise ValueError(f"ArithmeticConfig.num_operands must be >= 2, got {self.num_operands}")
        if self.max_operands is not None and self.max_operands < self.num_operands:
            raise ValueError(
                f"ArithmeticConfig.max_operands must be None or >= num_operands="
                f"{self.num_operands}, got {self.max_operands}"
            )
        if not 1 <= self.min_digits <= self.max_digits:
            raise ValueError(
                "ArithmeticConfig needs 1 <= min_digits <= max_digits, got "
                f"min_digits={self.min_digits}, max_digits={self.max_digits}"
            )
        if self.remainders:
            if not 1 <= self.min_steps <= self.max_steps:
                raise ValueError(
                    "ArithmeticConfig needs 1 <= min_steps <= max_steps, got "
                    f"min_steps={self.min_steps}, max_steps={self.max_steps}"
                )
            if self.max_operands is not None:
                raise ValueError(
                    'ArithmeticConfig.max_operands has no meaning with operators="mod" (its '
                    "lengths vary through min_steps / max_steps)"
                )
        elif not self.operators or any(op not in _OPERATORS for op in self.operators):
            raise ValueError(
                f"ArithmeticConfig.operators must be a non-empty subset of "
                f'{_OPERATORS!r} or "mod", got {self.operators!r}'
            )
        if not 0.0 <= self.wrong_procedure_fraction <= 1.0:
            raise ValueError(
                "ArithmeticConfig.wrong_procedure_fraction must be in [0, 1], got "
                f"{self.wrong_procedure_fraction}"
            )
        if not 0.0 < self.test_fraction < 1.0:
            raise ValueError(
                f"ArithmeticConfig.test_fraction must be in (0, 1), got {self.test_fraction}"
            )

    @property
    def remainders(self) -> bool:
        """Whether the task is remainders by repeated subtraction (``operators="mod"``)."""
        return self.operators == "mod"

    @property
    def column_traces(self) -> bool:
        """Whether solutions use column sums (pure addition) rather than step traces."""
        return set(self.operators) == {"+"}


# ---------------------------------------------------------------------------------------
# Procedures (pure functions of the operands; the tests check them on hand-worked cases).


def column_sums(operands: Sequence[int], carry: bool = True) -> list[int]:
    """Column sums of a multi-operand addition, units column first.

    c_j = sum_i digit_j(operand_i) + (floor(c_{j-1} / 10) if carry else 0), for columns
    j = 0 .. (digits of the longest operand) - 1.

    Args:
      operands: non-negative integers.
      carry: add the carry from the column below (the right procedure) or not (the
        forgotten-carry wrong procedure).
    Returns:
      the column sums, units column first.
    """
    if any(x < 0 for x in operands):
        raise ValueError(f"column_sums takes non-negative operands, got {list(operands)}")
    num_columns = max(len(str(x)) for x in operands)
    sums, carried = [], 0
    for j in range(num_columns):
        total = sum((x // 10**j) % 10 for x in operands) + (carried if carry else 0)
        sums.append(total)
        carried = total // 10
    return sums


def read_columns(sums: Sequence[int]) -> int:
    """The number a column trace spells: the top sum in full, then the units digit of each
    lower column, top-down. Equals the true sum when `sums` came with carries."""
    digits = str(sums[-1]) + "".join(str(s % 10) for s in reversed(sums[:-1]))
    return int(digits)


def add_without_carry(operands: Sequence[int]) -> int:
    """The forgotten-carry wrong answer: `read_columns(column_sums(operands, carry=False))`."""
    return read_columns(column_sums(operands, carry=False))


def _apply(left: int, op: str, right: int) -> int:
    return left + right if op == "+" else left - right if op == "-" else left * right


def evaluation_steps(
    operands: Sequence[int], operators: Sequence[str], precedence: bool = True
) -> list[tuple[int, str, int, int]]:
    """The binary steps (left, op, right, result) that evaluate the expression.

    With `precedence`, every `*` is done first (left to right), then `+`/`-` left to right:
    the usual rules. Without, strictly left to right (the wrong procedure).
    """
    values, ops = list(operands), list(operators)
    steps = []
    if precedence:
        i = 0
        while i < len(ops):
            if ops[i] == "*":
                result = values[i] * values[i + 1]
                steps.append((values[i], "*", values[i + 1], result))
                values[i : i + 2] = [result]
                del ops[i]
            else:
                i += 1
    while ops:
        result = _apply(values[0], ops[0], values[1])
        steps.append((values[0], ops[0], values[1], result))
        values[0:2] = [result]
        del ops[0]
    return steps


def evaluate(operands: Sequence[int], operators: Sequence[str]) -> int:
    """Exact integer value of the expression under the usual precedence."""
    steps = evaluation_steps(operands, operators)
    return steps[-1][3]


def remainder_steps(
    dividend: int, divisor: int, stop_early: bool = False
) -> list[tuple[int, int, int]]:
    """The subtractions (left, divisor, difference) that take ``dividend`` below
    ``divisor``: ``(17, 9) -> [(17, 9, 8)]``; none when it already is. With
    ``stop_early`` (the wrong procedure) they stop one subtraction sooner, once what is left
    is below twice the divisor: ``(30, 7) -> [(30, 7, 23), (23, 7, 16), (16, 7, 9)]``."""
    if dividend < 0 or divisor < 1:
        raise ValueError(
            f"remainder_steps takes dividend >= 0, divisor >= 1, got {dividend, divisor}"
        )
    bound = 2 * divisor if stop_early else divisor
    steps = []
    while dividend >= bound:
        steps.append((dividend, divisor, dividend - divisor))
        dividend -= divisor
    return steps


def solve_remainder(dividend: int, divisor: int, wrong: bool = False) -> tuple[str, int]:
    """The worked response of ``dividend mod divisor`` and the answer it ends with:
    ``(17, 9) -> ("<think>17-9=8</think>\\boxed{8}", 8)``; with ``wrong``, the procedure
    that stops one subtraction early (``remainder_steps``), whose answer is the remainder
    plus the divisor whenever the quotient is >= 1: ``(17, 9) -> ("<think></think>\\boxed{17}",
    17)``."""
    steps = remainder_steps(dividend, divisor, stop_early=wrong)
    answer = steps[-1][2] if steps else dividend
    reasoning = ",".join(f"{a}-{b}={c}" for a, b, c in steps)
    return format_response(reasoning, str(answer)), answer


# ---------------------------------------------------------------------------------------
# Rendering.


def render_expression(operands: Sequence[int], operators: Sequence[str]) -> str:
    """`[471, 853], ["+"]` -> `"471+853"`."""
    parts = [str(operands[0])]
    for op, x in zip(operators, operands[1:]):
        parts += [op, str(x)]
    return "".join(parts)


def format_response(reasoning: str, answer: str) -> str:
    """The response format of every task: `<think>REASONING</think>\\boxed{ANSWER}`."""
    return f"{THINK_OPEN}{reasoning}{THINK_CLOSE}{BOXED_OPEN}{answer}{BOXED_CLOSE}"


def solve(
    operands: Sequence[int], operators: Sequence[str], *, column_trace: bool, wrong: bool = False
) -> tuple[str, int]:
    """A worked response and the answer it ends with.

    Args:
      operands / operators: the problem.
      column_trace: write a column-sum trace (requires all operators "+").
      wrong: follow the wrong procedure (forgotten carry, or no precedence).
    Returns:
      (response text, its boxed answer).
    """
    if column_trace:
        if any(op != "+" for op in operators):
            raise ValueError(f"column traces need additions only, got operators {list(operators)}")
        sums = column_sums(operands, carry=not wrong)
        answer = read_columns(sums)
        reasoning = ",".join(str(s) for s in sums)
    else:
        steps = evaluation_steps(operands, operators, precedence=not wrong)
        answer = steps[-1][3]
        reasoning = ",".join(f"{a}{op}{b}={c}" for a, op, b, c in steps)
    return format_response(reasoning, str(answer)), answer


def prompt_text(record: dict) -> str:
    """The text the policy is conditioned on (the tokenizer adds BOS or a chat template).

    For the synthetic task this is the expression and `=`, e.g. `"471+853="`: the char
    tokenizer's `encode_prompt` makes it `[BOS] 4 7 1 + 8 5 3 =`.
    """
    return record["prompt"]


# ---------------------------------------------------------------------------------------
# Splits and generation.


def split_of(prompt: str, test_fraction: float) -> str:
    """ "test" if the prompt's hash falls in the first `test_fraction` of [0, 1), else
    "train". Independent of the seed, so every seed shares one partition."""
    digest = hashlib.sha256(b"policyopt/arithmetic/split/" + prompt.encode()).digest()
    u = int.from_bytes(digest[:8], "big") / 2.0**64
    return "test" if u < test_fraction else "train"


def is_wrong_procedure(index: int, fraction: float) -> bool:
    """Whether record `index` of a split gets the wrong procedure: exactly
    floor(n * fraction) of the first n records do, spread evenly."""
    return math.floor((index + 1) * fraction + 1e-9) > math.floor(index * fraction + 1e-9)


def _draw_remainder_problem(rng: random.Random, config: ArithmeticConfig) -> tuple[int, int]:
    divisor = rng.randint(max(2, 10 ** (config.min_digits - 1)), 10**config.max_digits - 1)
    quotient = rng.randint(config.min_steps, config.max_steps)
    return quotient * divisor + rng.randrange(divisor), divisor


def _remainder_record(dividend: int, divisor: int, wrong: bool) -> dict:
    solution, _ = solve_remainder(dividend, divisor, wrong=wrong)
    _, wrong_answer = solve_remainder(dividend, divisor, wrong=True)
    return {
        "prompt": f"{dividend}mod{divisor}=",
        "answer": str(dividend % divisor),
        "solution": solution,
        "wrong_answer": str(wrong_answer),
    }


def _draw_operand(rng: random.Random, config: ArithmeticConfig) -> int:
    digits = rng.randint(config.min_digits, config.max_digits)
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return rng.randint(low, 10**digits - 1)


def iter_arithmetic(
    config: ArithmeticConfig, *, split: str, seed: int, max_attempts: int | None = None
) -> Iterator[dict]:
    """Yields the distinct records of one split, in a fixed order given (config, seed).

    Args:
      config: difficulty knobs.
      split: "train" or "test".
      seed: integer seed; one independent stream per (seed, split).
      max_attempts: stop (raising `ValueError`) after this many draws without enough
        distinct problems of the split; default unlimited (the stream may then hang if the
        problem space is exhausted; `generate_arithmetic` always sets a bound).
    Yields:
      record dicts (see the module docstring).
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    rng = random.Random(f"policyopt/arithmetic/{seed}/{split}")
    seen: set[str] = set()
    attempts = 0
    while True:
        attempts += 1
        if max_attempts is not None and attempts > max_attempts:
            raise ValueError(
                f"only {len(seen)} distinct {split!r} problems found in {max_attempts} draws with "
                f"{config}; widen the difficulty knobs (digits, operands) or ask for fewer examples"
            )
        if config.remainders:
            dividend, divisor = _draw_remainder_problem(rng, config)
            prompt = f"{dividend}mod{divisor}="
            if prompt in seen or split_of(prompt, config.test_fraction) != split:
                continue
            wrong = is_wrong_procedure(len(seen), config.wrong_procedure_fraction)
            seen.add(prompt)
            yield _remainder_record(dividend, divisor, wrong)
            continue
        count = config.num_operands
        if config.max_operands is not None and config.max_operands > count:
            # Only then: a fixed number of operands keeps the stream it always had.
            count = rng.randint(config.num_operands, config.max_operands)
        operands = [_draw_operand(rng, config) for _ in range(count)]
        operators = [rng.choice(config.operators) for _ in range(count - 1)]
        prompt = render_expression(operands, operators) + "="
        if prompt in seen or split_of(prompt, config.test_fraction) != split:
            continue
        wrong = is_wrong_procedure(len(seen), config.wrong_procedure_fraction)
        seen.add(prompt)
        answer = evaluate(operands, operators)
        solution, _ = solve(operands, operators, column_trace=config.column_traces, wrong=wrong)
        _, wrong_answer = solve(operands, operators, column_trace=config.column_traces, wrong=True)
        yield {
            "prompt": prompt,
            "answer": str(answer),
            "solution": solution,
            "wrong_answer": str(wrong_answer),
        }


def generate_arithmetic(
    config: ArithmeticConfig, *, split: str, seed: int, num_examples: int
) -> list[dict]:
    """The first `num_examples` records of `iter_arithmetic` (deterministic).

    Raises `ValueError` if the split's problem space is too small for `num_examples`
    distinct problems (checked by a bound of 100 draws per example, plus 10,000).
    """
    stream = iter_arithmetic(
        config, split=split, seed=seed, max_attempts=100 * num_examples + 10_000
    )
    return [next(stream) for _ in range(num_examples)]
