"""Code reward throughput: completions run against their tests in the sandbox, same run.

The batch imitates one RL step on code problems: ``--n`` completions (default 128: 16
prompts x 8 samples), each a ``<think>...</think>`` part and a fenced Python program.
Half the problems have MBPP-style assert tests (5 asserts), half stdin / stdout cases (5
cases); about half of the programs are right, and the wrong ones fail at a random test
(so all-or-nothing scoring stops early on them, as it does in training). Rewards use
Magistral's recipe (format gate, 0.1 / 0.9, all-or-nothing, 4 s and 300 MB per test).

Rows, each the median of ``--repeats`` runs on fresh batches, the scorers of one batch
back to back (ratios are medians of per-batch ratios, so load drifting during the run
biases no row):

* ``serial``: ``score_batch(num_workers=0)`` in this process (the sandbox: a fresh
  interpreter per test process, resource limits, a throw-away uid when root; assert
  tests in a process of their own beside the program's, ``code_isolation="process"``);
* ``serial, one process``: the same with ``code_isolation="none"`` (assert tests after
  the program in its process: one interpreter instead of two, open to reward hacks);
* ``serial, no groups``: ``serial`` without the sandboxes' control groups (what a host
  that cannot make them gets: per-process memory limits, no group kill), for their cost;
* ``parallel warm``: ``score_batch(num_workers=W)`` with the worker pool started;
* ``reference``: a naive scorer, ``subprocess.run([python, "-c", program + tests])`` per
  test with a timeout and nothing else (no limits, no uid, no harness): the floor of
  "one interpreter per test".

Run: ``python -m benchmarks.bench_code_rewards [--n 128] [--workers 2] [--repeats 3]``.
Writes ``benchmarks/results/bench_code_rewards.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from policyopt.rewards import RewardSpec, score_batch, start_workers
from policyopt.rewards.sandbox import cgroup
from policyopt.rewards.testcases import parse_tests

RESULTS = Path(__file__).parent / "results" / "bench_code_rewards.json"
SPEC = RewardSpec(task="code")  # Magistral's recipe: format gate, 0.1 / 0.9, 4 s, 300 MB
ONE_PROCESS = RewardSpec(task="code", code_isolation="none")


def _completion(program: str) -> str:
    return f"<think>Work it out, then write the program.</think>\n```python\n{program}\n```\n"


def make_batch(n: int, seed: int) -> tuple[list[str], list[object]]:
    """``n`` completions and their tests: assert tests for even problems, stdin / stdout
    cases for odd ones; each program right with probability 1/2, else wrong at one test."""
    rng = random.Random(seed)
    completions, references = [], []
    for i in range(n):
        a = rng.randint(1, 9)
        wrong_at = rng.randrange(5) if rng.random() < 0.5 else None
        if (i // 8) % 2 == 0:  # a group of 8 samples shares a problem kind
            tests = "\n".join(f"assert scale({x}) == {a * x}" for x in range(5))
            body = (
                f"    return {a} * x"
                if wrong_at is None
                else f"    return {a} * x + (x == {wrong_at})"
            )
            completions.append(_completion(f"def scale(x):\n{body}"))
            references.append(tests)
        else:
            cases = [{"input": f"{x}\n", "output": f"{a * x}\n"} for x in range(5)]
            expr = f"{a} * x" if wrong_at is None else f"{a} * x + (x == {wrong_at})"
            completions.append(_completion(f"x = int(input())\nprint({expr})"))
            references.append(cases)
    return completions, references


@contextlib.contextmanager
def without_control_groups():
    """Sandboxes as on a host where no control group can be made."""
    probed = cgroup.support
    cgroup.support = cgroup.Support
    try:
        yield
    finally:
        cgroup.support = probed


def reference_scorer(completions: list[str], references: list[object]) -> list[bool]:
    """One plain ``python -c`` per test, stopping at the first failure; no sandbox."""
    results = []
    for completion, tests in zip(completions, references):
        program = completion.split("```python\n", 1)[1].rsplit("```", 1)[0]
        tests = parse_tests(tests)
        cases = (
            [(program + "\n" + tests, "", None)]
            if isinstance(tests, str)
            else [(program, c["input"], c["output"]) for c in tests]
        )
        ok = True
        for source, stdin, expected in cases:
            run = subprocess.run(
                [sys.executable, "-c", source],
                input=stdin,
                capture_output=True,
                text=True,
                timeout=4,
            )
            ok = run.returncode == 0 and (
                expected is None or run.stdout.strip() == expected.strip()
            )
            if not ok:
                break
        results.append(ok)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=128)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    start_workers(args.workers)
    names = ["serial", "serial, one process", "serial, no groups", "parallel warm", "reference"]
    times = {name: [] for name in names}
    ratios = {name: [] for name in names[1:]}
    for repeat in range(args.repeats):
        completions, references = make_batch(args.n, seed=repeat)
        lengths = [len(c) for c in completions]
        elapsed = {}
        start = time.perf_counter()
        serial = score_batch(completions, references, lengths, SPEC)
        elapsed["serial"] = time.perf_counter() - start
        start = time.perf_counter()
        one_process = score_batch(completions, references, lengths, ONE_PROCESS)
        elapsed["serial, one process"] = time.perf_counter() - start
        with without_control_groups():
            start = time.perf_counter()
            ungrouped = score_batch(completions, references, lengths, SPEC)
            elapsed["serial, no groups"] = time.perf_counter() - start
        start = time.perf_counter()
        parallel = score_batch(completions, references, lengths, SPEC, num_workers=args.workers)
        elapsed["parallel warm"] = time.perf_counter() - start
        start = time.perf_counter()
        naive = reference_scorer(completions, references)
        elapsed["reference"] = time.perf_counter() - start
        if not (
            serial.correct.tolist()
            == parallel.correct.tolist()
            == one_process.correct.tolist()
            == ungrouped.correct.tolist()
            == naive
        ):
            raise AssertionError("the scorers disagree on which programs are correct")
        for key, value in elapsed.items():
            times[key].append(value)
        for key in ratios:
            ratios[key].append(elapsed[key] / elapsed["serial"])
    accuracy = float(serial.correct.mean())
    rows = []
    print(
        f"{args.n} completions (accuracy {accuracy:.2f}), {args.workers} workers, "
        f"{os.cpu_count()} CPUs"
    )
    print(f"{'scorer':20s} {'median s':>9s} {'samples/s':>10s} {'x serial':>9s}")
    for key, values in times.items():
        seconds = statistics.median(values)
        ratio = 1.0 if key == "serial" else statistics.median(ratios[key])
        rows.append(
            dict(
                scorer=key,
                seconds=round(seconds, 3),
                samples_per_s=round(args.n / seconds, 1),
                x_serial=round(ratio, 2),
            )
        )
        print(f"{key:20s} {seconds:9.3f} {args.n / seconds:10.1f} {ratio:9.2f}")
    result = dict(
        benchmark="bench_code_rewards",
        n=args.n,
        workers=args.workers,
        repeats=args.repeats,
        accuracy=accuracy,
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        python=platform.python_version(),
        cpu_count=os.cpu_count(),
        root=os.geteuid() == 0,
        control_groups=dict(
            kill=cgroup.support().kills, memory_limit=cgroup.support().limits_memory
        ),
        load_average=os.getloadavg(),
        rows=rows,
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
