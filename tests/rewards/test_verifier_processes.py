"""The verifiers' processes: started from the library (never re-running the caller's
script), paid for once, stopped at their limits, gone with their threads; custom
verifiers' exits, interrupts and C loops counted as their errors or timeouts."""

import json
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from policyopt.rewards import RewardSpec, score_batch
from tests.flags import ROOT
from tests.processes import marked_script, start_script


def run_script(tmp_path, source: str, timeout_s: float = 240.0) -> subprocess.CompletedProcess:
    """Runs ``source`` as a plain script file (no ``__main__`` guard), as users do."""
    script = tmp_path / "plain.py"
    script.write_text(textwrap.dedent(source))
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    return subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
        cwd=tmp_path,
    )


# The equivalences, new numbers for each round (verdicts are cached per process).
GRADE = r"""
import json, time
print("the script ran", flush=True)
from policyopt.rewards import math_correctness, start_workers
from tests.processes import in_thread

def pairs(k):
    return [
        (rf"{k}\sqrt{{3}}", rf"\sqrt{{{3 * k * k}}}"),
        (str(2 ** (10 + k)), f"2^{{{10 + k}}}"),
        (f"x={5 + k}", str(5 + k)),
        (f"{k},000", str(1000 * k)),
        (rf"\{{{k},{k + 1}\}}", rf"\{{{k + 1},{k}\}}"),
        (rf"\pi/{k}", rf"\frac{{\pi}}{{{k}}}"),
    ]

def grade(k):
    scores, seconds = [], []
    for answer, reference in pairs(k):
        start = time.perf_counter()
        scores.append(math_correctness("\\boxed{" + answer + "}", reference, timeout_s=2.0))
        seconds.append(time.perf_counter() - start)
    return {"scores": scores, "seconds": seconds}

def warm_then_grade(k):
    start_workers(0)  # this thread's verifier process, before any answer's clock
    return grade(k)

results = {"main": [grade(2), grade(3), grade(4)], "thread": in_thread(lambda: grade(5))}
results["warm_thread"] = in_thread(lambda: warm_then_grade(6))
print(json.dumps(results), flush=True)
"""


def test_an_unguarded_script_runs_once_and_scores_like_a_guarded_one(tmp_path):
    """A script without ``if __name__ == "__main__":`` that grades answers three times in a
    row, then from a thread: it runs once (its verifier processes never import it), every
    equivalence scores 1 (the first call's limit does not pay the processes' start-up),
    and after a warm-up (``start_workers(0)``) a thread's first answer takes less than its
    2 s limit."""
    done = run_script(tmp_path, GRADE)
    assert done.stdout.count("the script ran") == 1, done.stdout + done.stderr
    results = json.loads(done.stdout.splitlines()[-1])
    for run in results["main"] + [results["thread"], results["warm_thread"]]:
        assert run["scores"] == [1.0] * 6, (results, done.stderr)
    assert results["warm_thread"]["seconds"][0] < 2.0, results


def test_the_guarded_script_agrees(tmp_path):
    guarded = 'if __name__ == "__main__":\n' + textwrap.indent(GRADE, "    ")
    done = run_script(tmp_path, guarded)
    assert done.stdout.count("the script ran") == 1, done.stdout + done.stderr
    results = json.loads(done.stdout.splitlines()[-1])
    for run in results["main"] + [results["thread"], results["warm_thread"]]:
        assert run["scores"] == [1.0] * 6, (results, done.stderr)


# Scores a batch with two scoring workers three times in a row, then from a thread, then
# from four threads at once, then past a deadline that kills the pool and again on the new
# pool: the equivalences, a wrong answer, a format failure, the language bonus and
# a custom verifier, next to the same batches scored serially.
SCORE = r"""
import json, threading
print("the script ran", flush=True)
from policyopt.rewards import RewardSpec, score_batch
from tests.processes import in_thread

english = "The number of apples is the sum of both baskets, so we add them together."
completions = [
    "<think>" + english + "</think> " + text
    for text in (
        r"\boxed{2\sqrt{3}}",
        r"\boxed{2^{10}}",
        r"\boxed{x=5}",
        r"\boxed{\{1,2\}}",
        r"\boxed{\pi/2}",
        r"\boxed{7}",
        "no box",
        r"Le résultat est donc \boxed{12}, comme annoncé.",
    )
]
references = [r"\sqrt{12}", "1024", "5", r"\{2,1\}", r"\frac{\pi}{2}", "8", "3", "12"]
prompts = ["How many apples are there in the two baskets together?"] * len(completions)
specs = {
    "math": RewardSpec(language_bonus=0.1),
    "custom": RewardSpec(format_reward=False, verifier="tests.verifiers:last_word"),
}

def score(workers):
    out = {}
    for name, spec in specs.items():
        scores = score_batch(
            completions, references, [5] * len(completions), spec, prompts=prompts,
            num_workers=workers,
        )
        out[name] = {"rewards": scores.rewards.tolist(), "status": scores.status}
        out[name]["worker_errors"] = scores.metrics["worker_errors"]
    return out

def concurrently(count):
    out = [None] * count
    threads = [
        threading.Thread(target=lambda i=i: out.__setitem__(i, score(2))) for i in range(count)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return out

def past_deadline():
    # Every worker stuck in a program (code tests keep their own limit) at the deadline:
    # the pool is killed, its sandboxes with it; the next call forks a new one.
    from policyopt.rewards import scoring
    from policyopt.rewards.worker import wait_gone

    before = scoring._POOLS[("default", 2)].pids
    loop = "<think>plan</think>\n```python\nwhile True:\n    pass\n```"
    stuck = RewardSpec(task="code", code_timeout_s=5.0)
    missed = score_batch(
        [loop] * 4, ["assert True"] * 4, [1] * 4, stuck, num_workers=2, deadline_s=0.5
    )
    gone = wait_gone(before)
    after = score(2)
    return {
        "status": missed.status, "gone": gone, "after": after,
        "new_pids": not set(scoring._POOLS[("default", 2)].pids) & set(before),
    }

results = {"serial": score(0), "workers": [score(2) for _ in range(3)]}
results["thread"] = in_thread(lambda: score(2))
results["concurrent"] = concurrently(4)  # four callers of one pool at once
results["deadline"] = past_deadline()
print(json.dumps(results), flush=True)
"""


@pytest.mark.parametrize("guarded", [False, True])
def test_a_script_scoring_with_workers_runs_once(tmp_path, guarded):
    """A plain script without ``if __name__ == "__main__":`` that scores with
    ``num_workers=2`` three times in a row, from a thread, from four threads at once, and
    past a deadline (the stuck workers killed, a new pool forked): it runs once (the
    scoring workers never import it) and every batch scores as serial scoring does, as in
    the guarded script."""
    source = 'if __name__ == "__main__":\n' + textwrap.indent(SCORE, "    ") if guarded else SCORE
    done = run_script(tmp_path, source)
    assert done.stdout.count("the script ran") == 1, done.stdout + done.stderr
    results = json.loads(done.stdout.splitlines()[-1])
    serial = results["serial"]
    assert serial["math"]["status"] == ["correct"] * 5 + ["incorrect", "format", "correct"]
    np.testing.assert_allclose(serial["math"]["rewards"], [1.1] * 5 + [0.2, 0.0, 1.0], rtol=1e-6)
    assert serial["custom"]["status"] == ["incorrect"] * 8
    for run in results["workers"] + [results["thread"]] + results["concurrent"]:
        assert run == serial, (results, done.stderr)
    deadline = results["deadline"]
    assert deadline["status"] == ["deadline"] * 4 and deadline["gone"], (results, done.stderr)
    assert deadline["new_pids"] and deadline["after"] == serial, (results, done.stderr)


# Scores with workers (a custom verifier: each worker's verifier process too), then waits
# to be killed ("wait") or for a line on stdin, then exits ("exit"); every process it
# started carries MARK in its environment.
LINGER = r"""
import sys, time
from policyopt.rewards import RewardSpec, score_batch
spec = RewardSpec(format_reward=False, verifier="tests.verifiers:always_correct")
scores = score_batch(["a"] * 8, ["1"] * 8, [1] * 8, spec, num_workers=2)
assert scores.status == ["correct"] * 8, scores.status
print("scored", flush=True)
if sys.argv[1] == "wait":
    time.sleep(600)
sys.stdin.readline()
"""


def marked_processes(mark: str, leaders: bool = False) -> list[int]:
    """Live processes (not zombies) whose environment holds ``mark``; with ``leaders``,
    only those that lead a session of their own (a verifier server does; its forks, the
    workers and their verifier processes, belong to its session)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if mark.encode() not in f.read():
                    continue
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        state, session = fields[0], int(fields[3])
        if state not in "ZX" and (not leaders or session == int(name)):
            found.append(int(name))
    return found


@pytest.mark.parametrize("ending", ["exit", "sigkill"])
def test_no_scoring_process_outlives_its_caller(tmp_path, ending):
    """The scoring workers (and their verifier processes) are gone within 5 s of their
    caller's exit, or of its SIGKILL. The workers fork their verifier processes
    themselves: the caller's verifier server is the only one."""
    mark, script, env = marked_script(tmp_path, LINGER, ending)
    caller = start_script(script, "wait" if ending == "sigkill" else "exit", env, tmp_path)
    try:
        line = caller.stdout.readline()
        assert line.strip() == "scored", line + caller.stderr.read()
        # The caller, its server, two workers and their verifier processes.
        assert len(marked_processes(mark)) >= 6, marked_processes(mark)
        assert len(marked_processes(mark, leaders=True)) == 1  # one server
        if ending == "sigkill":
            caller.kill()
        else:
            caller.stdin.write("exit\n")
            caller.stdin.flush()
        caller.wait(timeout=60)
    finally:
        caller.kill()
        caller.communicate()
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and marked_processes(mark):
        time.sleep(0.05)
    assert not marked_processes(mark), marked_processes(mark)


THREADS = r"""
import gc, json, os, threading
from policyopt.rewards import math_correctness
from tests.processes import descendants

release = threading.Event()
def grade(k):
    math_correctness(rf"\boxed{{{k}\sqrt{{2}}}}", rf"\sqrt{{{2 * k * k}}}", timeout_s=30.0)
    release.wait()

threads = [threading.Thread(target=grade, args=(k,)) for k in range(2, 10)]
for thread in threads:
    thread.start()
import time
deadline = time.monotonic() + 120
while time.monotonic() < deadline and len(descendants()) < 8:
    time.sleep(0.1)
during = len(descendants())
release.set()
for thread in threads:
    thread.join()
del threads, thread
gc.collect()
deadline = time.monotonic() + 5
while time.monotonic() < deadline and len(descendants()) > 2:
    time.sleep(0.05)
print(json.dumps({"during": during, "after": len(descendants())}), flush=True)
"""


def test_verifier_processes_end_with_their_threads(tmp_path):
    """Eight threads grade an answer each (a verifier process each); once they have ended,
    their processes are gone within 5 s (the issue: 16 threads left 16 processes)."""
    done = run_script(tmp_path, 'if __name__ == "__main__":\n' + textwrap.indent(THREADS, "    "))
    counts = json.loads(done.stdout.splitlines()[-1])
    assert counts["during"] >= 8, (counts, done.stderr)
    assert counts["after"] <= 2, (counts, done.stderr)  # at most a server to fork them


@pytest.mark.parametrize("name", ["exits", "interrupts"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_verifier_that_exits_or_interrupts_is_a_verifier_error(name, num_workers):
    """``sys.exit(3)`` or ``raise KeyboardInterrupt`` inside a custom verifier scores c = 0
    with status "verifier_error", counted; the batch, and the run, go on."""
    spec = RewardSpec(format_reward=False, verifier=f"tests.verifiers:{name}")
    scores = score_batch(["a", "b", "c"], ["1", "2", "3"], [1] * 3, spec, num_workers=num_workers)
    assert scores.status == ["verifier_error"] * 3
    assert scores.metrics["verifier_errors"] == 3 and scores.metrics["worker_errors"] == 0
    np.testing.assert_array_equal(scores.rewards, [0.0] * 3)
    after = score_batch(
        ["x"],
        ["x"],
        [1],
        RewardSpec(format_reward=False, verifier="tests.verifiers:always_correct"),
    )
    assert after.status == ["correct"]


# The verifier's limit in BLOCKS: each sample's C loop keeps a core busy until it is killed
# (6 samples in all).
LIMIT = 0.5
BLOCKS = (
    r"""
import json, threading, time
from policyopt.rewards import RewardSpec, score_batch, start_workers

LIMIT = %r

spec = RewardSpec(
    format_reward=False, verifier="tests.verifiers:blocks_in_c", verifier_timeout_s=LIMIT
)
warm = RewardSpec(format_reward=False, verifier="tests.verifiers:always_correct")
start_workers(2)
results = {}
for mode in ("serial", "thread", "workers"):
    # Each scoring process's verifier server starts once (seconds; no sample's limit).
    score_batch(["a"] * 8, ["1"] * 8, [1] * 8, warm, num_workers=2 if mode == "workers" else 0)
    start = time.perf_counter()
    if mode == "thread":
        out = []
        grade = lambda: out.append(score_batch(["a", "b"], ["1", "2"], [1, 1], spec))
        thread = threading.Thread(target=grade)
        thread.start()
        thread.join()
        scores = out[0]
    else:
        workers = 2 if mode == "workers" else 0
        scores = score_batch(["a", "b"], ["1", "2"], [1, 1], spec, num_workers=workers)
    results[mode] = {"status": scores.status, "seconds": time.perf_counter() - start}
print(json.dumps(results), flush=True)
"""
    % LIMIT
)


def test_a_verifier_that_blocks_in_c_is_stopped_at_its_limit_in_every_mode(tmp_path):
    """A C loop that no signal interrupts (the issue: 25-30 s past a 1 s limit in every mode
    but a batch deadline): a timeout about its limit (LIMIT) after it started, serially in
    the main thread, in another thread and in scoring workers."""
    done = run_script(tmp_path, BLOCKS, timeout_s=120.0)
    results = json.loads(done.stdout.splitlines()[-1])
    for mode, result in results.items():
        assert result["status"] == ["timeout", "timeout"], (mode, results, done.stderr)
        assert result["seconds"] < 2 * (LIMIT + 2.0), (mode, results)  # two samples, limit + grace
