"""What the three sides share: the geometry, the vocabulary, the prompts, the reward and
the result record (standard library only; each side imports it from its own environment).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time
from importlib import metadata
from pathlib import Path

# One GRPO iteration: 16 prompts x 8 samples, 31-token prompts, exactly 64 new tokens,
# one AdamW step on all 128 sequences, pi_old from the sampler (no separate forward).
GEOMETRY = {
    # The model: a dense Qwen3 of 2.4M parameters (policyopt's moe_7m preset without
    # experts): untied input and output embeddings, RMSNorm on queries and keys.
    "num_layers": 4,
    "hidden_size": 256,
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 64,
    "intermediate_size": 512,
    "vocab_size": 55,
    "rope_theta": 1e4,
    "rms_norm_eps": 1e-6,
    # The batch.
    "num_prompts": 16,
    "group_size": 8,
    "prompt_tokens": 31,  # <bos> + 30 characters: five 5-digit numbers summed
    "new_tokens": 64,  # no end token is drawn before the 64th (min_new_tokens = 64)
    "temperature": 1.0,
    # The optimiser: AdamW, global-norm clip 1, no KL term (no reference model).
    "lr": 1e-6,
    "b1": 0.9,
    "b2": 0.999,
    "eps": 1e-8,
    "weight_decay": 0.01,
    "max_grad_norm": 1.0,
    "clip_epsilon": 0.2,
}

# policyopt's character tokenizer (policyopt.data.tokenizer.CharTokenizer), 55 ids: the
# peers' tokenizer holds the same tokens in the same order.
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<think>", "</think>", "\\boxed{", "}")
ALPHABET = "0123456789+-*/=(),.:; abcdefghijklmnopqrstuvwxyz"
TOKENS = SPECIAL_TOKENS + tuple(ALPHABET)
assert len(TOKENS) == GEOMETRY["vocab_size"]

OPERANDS, DIGITS = 5, 5


def trace_thunks() -> None:
    """Turns on XLA:CPU's per-thunk trace events (``--xla_cpu_enable_xprof_traceme``), which
    the profiles read; only before jax initialises its CPU client."""
    os.environ.setdefault("XLA_FLAGS", "")
    if "xla_cpu_enable_xprof_traceme" not in os.environ["XLA_FLAGS"]:
        os.environ["XLA_FLAGS"] += " --xla_cpu_enable_xprof_traceme=true"


def prompts(count: int, seed: int) -> list[dict]:
    """``count`` problems ``a+b+c+d+e=`` of 5-digit numbers (30 characters, 31 tokens with
    <bos>), with their sums."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        numbers = [rng.randrange(10 ** (DIGITS - 1), 10**DIGITS) for _ in range(OPERANDS)]
        text = "+".join(map(str, numbers)) + "="
        assert len(text) + 1 == GEOMETRY["prompt_tokens"], text
        rows.append({"prompt": text, "answer": str(sum(numbers))})
    return rows


def reward(completion: str, answer: str) -> float:
    """1 when the completion's first line, up to <eos>, is the answer, else 0 (the check of
    policyopt's arithmetic verifier, for the peers)."""
    text = completion.split("<eos>")[0].strip()
    return 1.0 if text.split("\n")[0].strip() == answer else 0.0


def hf_tokenizer():
    """The character tokenizer as a transformers ``PreTrainedTokenizerFast`` (built here,
    nothing downloaded): single characters, the special tokens whole."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(TOKENS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>"
    )
    tokenizer.padding_side = "left"
    return tokenizer


def parse_args(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--old_log_probs", choices=("sampler", "trainer"), default="sampler")
    parser.add_argument("--json", required=True)
    return parser.parse_args(argv)


def versions(*packages: str) -> dict:
    found = {"python": platform.python_version()}
    for name in packages:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


class JaxCompileLog:
    """JAX's compilation events of this process (``jax.monitoring``): tracing, lowering to
    MLIR and XLA's compilation of each program, with the function's name and the seconds.

    ``mark()`` closes a span (the set-up, then each iteration); ``summary()`` gives per
    span the programs XLA compiled and the seconds of each stage."""

    STAGES = {
        "/jax/core/compile/jaxpr_trace_duration": "trace_s",
        "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
        "/jax/core/compile/backend_compile_duration": "xla_compile_s",
    }

    def __init__(self):
        import jax

        self.events: list[tuple[str, str, float]] = []
        self.marks: list[int] = []
        jax.monitoring.register_event_duration_secs_listener(self._listen)

    def _listen(self, event: str, duration: float, **kwargs) -> None:
        if event in self.STAGES:
            self.events.append((self.STAGES[event], str(kwargs.get("fun_name", "?")), duration))

    def mark(self) -> None:
        self.marks.append(len(self.events))

    def summary(self) -> list[dict]:
        spans, start = [], 0
        for end in self.marks:
            events = self.events[start:end]
            compiled = [(name, s) for stage, name, s in events if stage == "xla_compile_s"]
            span = {
                stage: sum(s for st, _, s in events if st == stage)
                for stage in self.STAGES.values()
            }
            span["programs"] = len(compiled)
            span["slowest"] = sorted(compiled, key=lambda x: -x[1])[:8]
            spans.append(span)
            start = end
        return spans


class CpuClock:
    """Process CPU seconds (every thread: ``time.process_time``) of named phases: the
    loaded machine slows a run's wall time by several times while its CPU time moves far
    less, so each side records both.

    ``wrap(owner, name, key)`` replaces ``owner.name`` by a wrapper that adds the CPU time
    of each call to ``key``'s current total (``block``, when given, waits for the call's
    output first: asynchronous dispatch would otherwise leave the work uncounted);
    ``take(key)`` returns that total and starts the next."""

    def __init__(self):
        self.totals: dict[str, float] = {}

    def wrap(self, owner, name: str, key: str, block=None) -> None:
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            start = time.process_time()
            out = original(*args, **kwargs)
            if block is not None:
                block(out)
            self.totals[key] = self.totals.get(key, 0.0) + time.process_time() - start
            return out

        setattr(owner, name, wrapper)

    def take(self, key: str) -> float:
        return self.totals.pop(key, 0.0)


def thread_cpu_seconds() -> dict[int, float]:
    """CPU seconds (user + system) of each thread of this process so far, by thread id
    (``/proc/self/task/<tid>/stat``; empty where there is no ``/proc``)."""
    tick = os.sysconf("SC_CLK_TCK")
    times = {}
    for task in Path("/proc/self/task").glob("*"):
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended
        times[int(task.name)] = (int(fields[11]) + int(fields[12])) / tick
    return times


def thread_split(before: dict[int, float], after: dict[int, float]) -> dict:
    """How the CPU time between two ``thread_cpu_seconds`` readings spread over threads:
    the total, each busy thread's seconds (largest first) and the busiest one's share.
    Load-independent, unlike wall time: a program that keeps two cores busy on an idle
    machine splits its CPU time about evenly over two threads."""
    used = sorted(
        (after[t] - before.get(t, 0.0) for t in after if after[t] - before.get(t, 0.0) > 0),
        reverse=True,
    )
    total = sum(used)
    return {
        "cpu_s": total,
        "threads_s": used[:8],
        "busiest_thread_share": used[0] / total if total else 0.0,
    }


def write_result(
    path: str,
    side: str,
    iterations: list[dict],
    warmup: int,
    *,
    setup_s: float,
    checks: dict,
    versions: dict,
    extra: dict | None = None,
) -> dict:
    """The record of one run: every iteration's times (wall ``<phase>_s`` and process CPU
    ``<phase>_cpu_s``), the medians of the measured ones (after ``warmup``), the first
    iteration (compilation included) and the checks that the work was the geometry's
    (rows, prompt and response lengths, parameters)."""
    measured = iterations[warmup:]
    keys = sorted({k for it in measured for k in it})
    result = {
        "side": side,
        "iterations": iterations,
        "median": {k: statistics.median(it[k] for it in measured if k in it) for k in keys},
        "first_iteration_s": iterations[0]["iteration_s"],
        "first_iteration_cpu_s": iterations[0].get("iteration_cpu_s"),
        "setup_s": setup_s,
        "checks": checks,
        "versions": versions,
        "geometry": GEOMETRY,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        **(extra or {}),
    }
    with open(path, "w") as f:
        json.dump(result, f, indent=2, sort_keys=True)
    return result
