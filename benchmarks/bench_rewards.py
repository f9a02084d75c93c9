"""Math reward throughput: 1,024 completions scored serially and in parallel, same run.

The batch imitates one RL step: 128 prompts x 8 samples; each completion is a few hundred
characters of reasoning in ``<think>...</think>`` and a boxed answer. Answers are a third
integers, a third fractions and decimals (``\\frac{3}{4}``, ``0.75``, ``3/4``), a third
LaTeX expressions (``2\\sqrt{2}`` vs ``\\sqrt{8}``, ``\\frac{\\pi}{3}``, intervals,
polynomials); about half are correct, each written in one of several equivalent forms,
and wrong answers vary, so answers repeat within a group only as often as they would in RL. Rewards use Magistral's recipe (format gate, 0.1 / 0.9).

Rows, each the median of ``--repeats`` timed runs on fresh batches (new seeds, so verifier
caches filled by one run never serve another):

* ``serial``: ``score_batch(num_workers=0)`` in this process;
* ``parallel warm``: ``score_batch(num_workers=W)`` with the worker pool already started;
* ``parallel cold``: the first parallel call, including spawning the pool (one run);
* ``reference``: plain math-verify per sample (``parse`` + ``verify`` of every answer,
  no fast path, no gold cache), serially: what a naive scorer costs.

Run: ``python -m benchmarks.bench_rewards [--n 1024] [--workers 2] [--repeats 3]``.
Writes ``benchmarks/results/bench_rewards.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time
from pathlib import Path

import numpy as np

from policyopt.rewards import RewardSpec, score_batch, shutdown_pools
from policyopt.rewards.math import _math_verify

GROUP_SIZE = 8
FILLER = (
    "First I restate the problem and name the quantities involved. Then I set up the "
    "equation carefully, simplify both sides, and check each step against the original "
    "statement. Substituting back confirms that the value satisfies every condition, so "
    "the computation is consistent. "
)


def _problem(rng: random.Random, kind: int):
    """(reference, correct surface forms, function giving a wrong answer) for one prompt."""
    if kind == 0:  # integer
        value = rng.randint(10, 99999)
        return str(value), [str(value)], lambda: str(value + rng.choice([-10, -1, 1, 9, 100]))
    if kind == 1:  # fraction / decimal
        den = rng.choice([2, 4, 5, 8, 10, 20, 25])
        num = rng.randint(1, 4 * den)
        forms = [f"{num / den:g}", rf"\frac{{{num}}}{{{den}}}", rf"\dfrac{{{2 * num}}}{{{2 * den}}}", f"{num}/{den}"]
        return rf"\frac{{{num}}}{{{den}}}", forms, lambda: rf"\frac{{{num + rng.randint(1, 9)}}}{{{den}}}"
    a = rng.randint(2, 9)
    family = rng.randrange(4)
    if family == 0:
        return (rf"{a}\sqrt{{2}}", [rf"\sqrt{{{2 * a * a}}}", rf"{a}\sqrt{{2}}", rf"\sqrt{{2}} \cdot {a}"],
                lambda: rf"\sqrt{{{2 * a * a + rng.randint(1, 9)}}}")
    if family == 1:
        return (rf"\frac{{\pi}}{{{a}}}", [rf"\frac{{2\pi}}{{{2 * a}}}", rf"\pi/{a}", rf"\frac{{\pi}}{{{a}}}"],
                lambda: rf"\frac{{\pi}}{{{a + rng.randint(1, 9)}}}")
    if family == 2:
        return (rf"[{a}, {a + 3})", [rf"[{a},{a + 3})", rf"\left[{a}, {a + 3}\right)"],
                lambda: rf"({a},{a + rng.randint(1, 9)})")
    return (rf"x^2 + {2 * a}x + {a * a}", [rf"(x+{a})^2", rf"x^2+{2 * a}x+{a * a}", rf"(x + {a})(x + {a})"],
            lambda: rf"(x+{a + rng.randint(1, 9)})^2")


def make_batch(n: int, seed: int = 0) -> tuple[list[str], list[str]]:
    rng = random.Random(seed)
    completions, references = [], []
    for prompt in range(-(-n // GROUP_SIZE)):
        reference, right_forms, wrong = _problem(rng, prompt % 3)
        for _ in range(GROUP_SIZE):
            reasoning = FILLER[: rng.randint(200, len(FILLER))] * rng.randint(1, 2)
            answer = rng.choice(right_forms) if rng.random() < 0.5 else wrong()
            completions.append(f"<think>{reasoning}</think> The final answer is \\boxed{{{answer}}}.")
            references.append(reference)
    return completions[:n], references[:n]


def reference_scorer(completions: list[str], references: list[str]) -> np.ndarray:
    """Plain math-verify, one parse + verify per sample (its own signal timeouts)."""
    math_verify = _math_verify()
    scores = []
    for completion, reference in zip(completions, references):
        gold = math_verify.parse("\\boxed{" + reference + "}")
        answer = math_verify.parse(completion.split("</think>")[-1])
        scores.append(float(math_verify.verify(gold, answer)))
    return np.asarray(scores, np.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=1024)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_rewards.json"))
    args = parser.parse_args()

    # A fresh batch (new seed) for every timed run, so that no run profits from the
    # verifier caches (gold parses, repeated answers) filled by an earlier one; serial,
    # parallel and reference runs see the same sequence of batches.
    batches = [make_batch(args.n, seed) for seed in range(args.repeats + 2)]
    spec = RewardSpec()
    _math_verify()  # import and warm SymPy before timing anything

    def lengths_of(completions):
        return [len(c) // 4 for c in completions]

    def run_all(score):
        times, outputs = [], []
        for completions, references in batches[2:]:
            start = time.perf_counter()
            outputs.append(score(completions, references))
            times.append(time.perf_counter() - start)
        return statistics.median(times), outputs

    def serial(completions, references):
        return score_batch(completions, references, lengths_of(completions), spec)

    def parallel(completions, references):
        return score_batch(completions, references, lengths_of(completions), spec, num_workers=args.workers)

    serial(*batches[0])  # warm-up batch, not timed
    start = time.perf_counter()
    parallel(*batches[1])  # first parallel call: spawns the pool
    cold_s = time.perf_counter() - start
    serial_s, serial_outs = run_all(serial)
    parallel_s, parallel_outs = run_all(parallel)
    reference_s, reference_outs = run_all(reference_scorer)
    shutdown_pools()

    agree_parallel = all(np.array_equal(s.rewards, p.rewards) for s, p in zip(serial_outs, parallel_outs))
    agree_reference = float(np.mean([s.correct == (r == 1.0) for s, r in zip(serial_outs, reference_outs)]))
    accuracy = float(np.mean([s.metrics["accuracy"] for s in serial_outs]))
    rows = [
        ("serial", serial_s),
        (f"parallel warm ({args.workers} workers)", parallel_s),
        (f"parallel cold ({args.workers} workers, incl. spawn)", cold_s),
        ("reference: plain math-verify, serial", reference_s),
    ]
    print(f"math reward throughput, N={args.n}, median of {args.repeats} fresh batches, cpus={os.cpu_count()}")
    print(f"{'scorer':48s} {'seconds':>8s} {'compl/s':>9s} {'vs serial':>9s}")
    for name, seconds in rows:
        print(f"{name:48s} {seconds:8.3f} {args.n / seconds:9.0f} {serial_s / seconds:8.2f}x")
    print(f"accuracy {accuracy:.3f}; parallel == serial rewards: {agree_parallel}; "
          f"agreement with plain math-verify: {agree_reference:.4f}")

    result = {
        "benchmark": "bench_rewards",
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "n": args.n,
        "workers": args.workers,
        "repeats": args.repeats,
        "seconds": {name: seconds for name, seconds in rows},
        "completions_per_second": {name: args.n / seconds for name, seconds in rows},
        "parallel_over_serial": serial_s / parallel_s,
        "serial_over_reference": reference_s / serial_s,
        "accuracy": accuracy,
        "parallel_equals_serial": agree_parallel,
        "agreement_with_plain_math_verify": agree_reference,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
