"""Math reward throughput: 1,024 completions scored serially and in parallel, same run.

The batch imitates one RL step: 128 prompts x 8 samples; each completion is a few hundred
characters of reasoning in ``<think>...</think>`` and a boxed answer. Answers are a third
integers, a third fractions and decimals (``\\frac{3}{4}``, ``0.75``, ``3/4``), a third
LaTeX expressions (``2\\sqrt{2}`` vs ``\\sqrt{8}``, ``\\frac{\\pi}{3}``, intervals,
polynomials); about half are correct, each written in one of several equivalent forms,
and wrong answers vary, so answers repeat within a group only as often as they would in
RL. Rewards use Magistral's recipe (format gate, 0.1 / 0.9).

Rows, each the median of ``--repeats`` timed runs on fresh batches (new seeds, so verifier
caches filled by one run never serve another). The scorers of one batch run back to back
and speed ratios are medians of per-batch ratios, so machine load drifting during the
run biases no row. CPU time of the scoring process and of its math verifier process
(where serial scoring runs math-verify) is reported as a load-independent check of the
serial path against plain math-verify:

* ``serial``: ``score_batch(num_workers=0)`` in this process;
* ``parallel warm``: ``score_batch(num_workers=W)`` with the worker pool already started;
* ``parallel cold``: the first parallel call (another fresh batch), including starting the
  fork server (import and warm-up of SymPy / math-verify) and forking the workers;
* ``reference``: plain math-verify per sample (``parse`` + ``verify`` of every answer,
  no fast path, no gold cache), serially: what a naive scorer costs;
* ``integer answers only``: serial scoring of a batch of the synthetic arithmetic task's
  kind (integers: the exact fast path, no SymPy).

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

from policyopt.rewards import RewardSpec, killable, score_batch, shutdown_pools
from policyopt.rewards.math import load_math_verify

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
        value = rng.randint(10, 10**6)
        return str(value), [str(value)], lambda: str(value + rng.choice([-10, -1, 1, 9, 100]))
    if kind == 1:  # fraction / decimal
        den = rng.choice([2, 4, 5, 8, 10, 16, 20, 25, 40, 50, 80, 100])
        num = rng.randint(1, 1000 * den)
        forms = [
            f"{num / den:g}",
            rf"\frac{{{num}}}{{{den}}}",
            rf"\dfrac{{{2 * num}}}{{{2 * den}}}",
            f"{num}/{den}",
        ]
        return (
            rf"\frac{{{num}}}{{{den}}}",
            forms,
            lambda: rf"\frac{{{num + rng.randint(1, 9)}}}{{{den}}}",
        )
    # Wide parameter ranges: different batches (seeds) share almost no answers, so the
    # verifier caches only help within a group, as in RL.
    a, b = rng.randint(2, 2000), rng.randint(1, 2000)
    family = rng.randrange(4)
    if family == 0:
        return (
            rf"{a}\sqrt{{2}}",
            [rf"\sqrt{{{2 * a * a}}}", rf"{a}\sqrt{{2}}", rf"\sqrt{{2}} \cdot {a}"],
            lambda: rf"\sqrt{{{2 * a * a + rng.randint(1, 999)}}}",
        )
    if family == 1:
        return (
            rf"\frac{{\pi}}{{{a}}}",
            [rf"\frac{{2\pi}}{{{2 * a}}}", rf"\pi/{a}", rf"\frac{{\pi}}{{{a}}}"],
            lambda: rf"\frac{{\pi}}{{{a + rng.randint(1, 999)}}}",
        )
    if family == 2:
        return (
            rf"[{a}, {a + b})",
            [rf"[{a},{a + b})", rf"\left[{a}, {a + b}\right)"],
            lambda: rf"({a},{a + b + rng.randint(0, 999)})",
        )
    return (
        rf"x^2 + {2 * a}x + {a * a}",
        [rf"(x+{a})^2", rf"x^2+{2 * a}x+{a * a}", rf"(x + {a})(x + {a})"],
        lambda: rf"(x+{a + rng.randint(1, 999)})^2",
    )


def make_batch(
    n: int, seed: int = 0, kinds: tuple[int, ...] = (0, 1, 2)
) -> tuple[list[str], list[str]]:
    """n completions, GROUP_SIZE per prompt; ``kinds``: 0 integer, 1 fraction, 2 LaTeX."""
    rng = random.Random(seed)
    completions, references = [], []
    for prompt in range(-(-n // GROUP_SIZE)):
        reference, right_forms, wrong = _problem(rng, kinds[prompt % len(kinds)])
        for _ in range(GROUP_SIZE):
            reasoning = FILLER[: rng.randint(200, len(FILLER))] * rng.randint(1, 2)
            answer = rng.choice(right_forms) if rng.random() < 0.5 else wrong()
            completions.append(
                f"<think>{reasoning}</think> The final answer is \\boxed{{{answer}}}."
            )
            references.append(reference)
    return completions[:n], references[:n]


def reference_scorer(completions: list[str], references: list[str]) -> np.ndarray:
    """Plain math-verify, one parse + verify per sample (its own signal timeouts)."""
    math_verify = load_math_verify()
    scores = []
    for completion, reference in zip(completions, references):
        gold = math_verify.parse("\\boxed{" + reference + "}")
        answer = math_verify.parse(completion.split("</think>")[-1])
        scores.append(float(math_verify.verify(gold, answer)))
    return np.asarray(scores, np.float32)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=1024)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--out", default=str(Path(__file__).parent / "results" / "bench_rewards.json")
    )
    args = parser.parse_args()

    # A fresh batch (new seed) for every timed run, so that no run profits from the
    # verifier caches (gold parses, repeated answers) filled by an earlier one.
    batches = [make_batch(args.n, seed) for seed in range(args.repeats + 2)]
    spec = RewardSpec()
    load_math_verify()  # import and warm SymPy before timing anything

    def scoring_cpu_s() -> float:
        """CPU time of this process and of this thread's math verifier process (where
        serial scoring runs math-verify; ``policyopt.rewards.killable``)."""
        pid, cpu = killable.thread_worker("math").pid, time.process_time()
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            cpu += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, TypeError, IndexError, ValueError):
            pass  # not started yet
        return cpu

    def serial(completions, references):
        return score_batch(completions, references, [len(c) // 4 for c in completions], spec)

    def parallel(completions, references):
        lengths = [len(c) // 4 for c in completions]
        return score_batch(completions, references, lengths, spec, num_workers=args.workers)

    scorers = {"serial": serial, "parallel": parallel, "reference": reference_scorer}
    serial(*batches[0])  # warm-up batch, not timed
    start = time.perf_counter()
    parallel(*batches[1])  # first parallel call: starts the fork server and the pool
    cold_s = time.perf_counter() - start
    load_before = os.getloadavg()[0]
    # Interleaved: on a shared, noisy machine the three scorers of one batch run back to
    # back, and ratios are taken per batch before the median.
    seconds = {name: [] for name in scorers}
    cpu_seconds = {name: [] for name in scorers}
    outputs = {name: [] for name in scorers}
    for completions, references in batches[2:]:
        for name, score in scorers.items():
            start, start_cpu = time.perf_counter(), scoring_cpu_s()
            outputs[name].append(score(completions, references))
            seconds[name].append(time.perf_counter() - start)
            cpu_seconds[name].append(scoring_cpu_s() - start_cpu)
    shutdown_pools()
    # The synthetic arithmetic task: integer answers only (exact fast path).
    integer_batch = make_batch(args.n, seed=10_000, kinds=(0,))
    integer_times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        serial(*integer_batch)
        integer_times.append(time.perf_counter() - start)
    load_after = os.getloadavg()[0]

    def median_ratio(numerator, denominator):
        return statistics.median(a / b for a, b in zip(seconds[numerator], seconds[denominator]))

    median_s = {name: statistics.median(times) for name, times in seconds.items()}
    cpu_ms = {
        name: statistics.median(cpu_seconds[name]) / args.n * 1e3
        for name in ("serial", "reference")
    }
    agree_parallel = all(
        np.array_equal(s.rewards, p.rewards) for s, p in zip(outputs["serial"], outputs["parallel"])
    )
    agree_reference = float(
        np.mean([s.correct == (r == 1.0) for s, r in zip(outputs["serial"], outputs["reference"])])
    )
    accuracy = float(np.mean([s.metrics["accuracy"] for s in outputs["serial"]]))
    rows = [
        ("serial", median_s["serial"], 1.0),
        (
            f"parallel warm ({args.workers} workers)",
            median_s["parallel"],
            median_ratio("serial", "parallel"),
        ),
        (
            f"parallel cold ({args.workers} workers, incl. pool start)",
            cold_s,
            median_s["serial"] / cold_s,
        ),
        (
            "reference: plain math-verify, serial",
            median_s["reference"],
            median_ratio("serial", "reference"),
        ),
        (
            "serial, integer answers only (arithmetic task)",
            statistics.median(integer_times),
            median_s["serial"] / statistics.median(integer_times),
        ),
    ]
    print(
        f"math reward throughput, N={args.n}, medians over {args.repeats} fresh batches, "
        f"cpus={os.cpu_count()}"
    )
    print(f"{'scorer':50s} {'seconds':>8s} {'compl/s':>8s} {'speed vs serial':>16s}")
    for name, wall, speedup in rows:
        print(f"{name:50s} {wall:8.3f} {args.n / wall:8.0f} {speedup:15.2f}x")
    print(
        f"CPU time per completion (this process and its verifier process): "
        f"serial {cpu_ms['serial']:.2f} ms, "
        "plain math-verify "
        f"{cpu_ms['reference']:.2f} ms ({cpu_ms['reference'] / cpu_ms['serial']:.1f}x); "
        f"1-min load average {load_before:.1f} -> {load_after:.1f} on {os.cpu_count()} cpus"
    )
    print(
        f"accuracy {accuracy:.3f}; parallel == serial rewards: {agree_parallel}; "
        f"agreement with plain math-verify: {agree_reference:.4f}"
    )

    result = {
        "benchmark": "bench_rewards",
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "load_average_1min": [load_before, load_after],
        "n": args.n,
        "workers": args.workers,
        "repeats": args.repeats,
        "median_seconds": {name: wall for name, wall, _ in rows},
        "completions_per_second": {name: args.n / wall for name, wall, _ in rows},
        "speed_vs_serial_median_of_per_batch_ratios": {name: speedup for name, _, speedup in rows},
        "cpu_ms_per_completion": cpu_ms,
        "seconds_per_batch": seconds,
        "accuracy": accuracy,
        "parallel_equals_serial": agree_parallel,
        "agreement_with_plain_math_verify": agree_reference,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
