"""Compile once: the persistent compilation cache of the experiments
(``policyopt.runtime.enable_compilation_cache``), no recompilation after the first
iteration of a phase, and an ETA from the iterations that compiled nothing."""

import io
import os
import re
import subprocess
import sys
import textwrap

import jax
import pytest

from policyopt.metrics import Progress
from policyopt.rl.loop import trainer
from policyopt.rl.reporting import report
from policyopt.rl.update import learner as learner_lib
from policyopt.runtime import compile_count
from tests.flags import ROOT, subprocess_env
from tests.rl.test_trainer import tiny

# In a fresh interpreter: turn the cache on as the experiments do, compile one program,
# print the directory in use, the compilations counted and the cache hits.
_PROBE = textwrap.dedent("""
    import jax, jax.numpy as jnp
    from jax import monitoring
    from policyopt import runtime
    hits = []
    monitoring.register_event_listener(
        lambda event, **kw: hits.append(1) if event.endswith("/cache_hits") else None)
    directory = runtime.enable_compilation_cache()
    import numpy as np
    x = jax.device_put(np.arange(3.0, dtype=np.float32))
    before = runtime.compile_count()
    jax.jit(lambda x: jnp.sin(x) * 3.0 + x)(x).block_until_ready()
    print(directory, runtime.compile_count() - before, len(hits))
""")


def _probe(**variables) -> list[str]:
    env = subprocess_env(PYTHONPATH=ROOT, **variables)
    for name in ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"):
        env.pop(name, None)  # the suite's own cache (tests/conftest.py) is not the default
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.split()


def test_second_process_loads_what_the_first_compiled(tmp_path):
    # The default directory is under XDG_CACHE_HOME: the first process compiles and stores
    # there; a second naming it in $POLICYOPT_COMPILATION_CACHE loads the program.
    home = tmp_path / "xdg"
    cache = str(home / "policyopt" / "jax")
    assert _probe(XDG_CACHE_HOME=str(home)) == [cache, "1", "0"]  # compiled, stored
    assert os.listdir(cache)
    assert _probe(POLICYOPT_COMPILATION_CACHE=cache) == [cache, "1", "1"]  # loaded
    # "off" leaves JAX without a cache.
    assert _probe(POLICYOPT_COMPILATION_CACHE="off", XDG_CACHE_HOME=str(home / "no")) == [
        "None",
        "1",
        "0",
    ]
    assert not (home / "no").exists()


def test_first_iteration_line_says_what_compiled_and_what_loaded():
    line = report.first_iteration_line
    assert line(54.04, 52, 0) == "first iteration: 54.0s with compilation (52 programs compiled)"
    assert line(20.0, 3, 49) == (
        "first iteration: 20.0s with compilation (3 programs compiled, 49 loaded from the "
        "compilation cache)"
    )
    assert line(4.2, 0, 52) == (
        "first iteration: 4.2s, nothing compiled (52 programs loaded from the compilation cache)"
    )
    assert line(1.0, 0, 0).endswith(
        "nothing compiled (the programs were compiled earlier in this process)"
    )


def test_a_warm_rerun_says_its_programs_came_from_the_cache(tmp_path):
    """A finished 1-iteration run's command rerun with 2 iterations (it resumes) loads every
    program of its first iteration from the cache; the console said "with compilation"."""
    env = subprocess_env(PYTHONPATH=ROOT, POLICYOPT_COMPILATION_CACHE=str(tmp_path / "cache"))
    for name in ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"):
        env.pop(name, None)  # the suite's shared cache may hold these programs already
    variant = (
        "model=tiny_dense,model.num_layers=1,batch.n_prompts=2,batch.group_size=4,"
        "sampling.max_new_tokens=6,task.num_train=64,eval.num_prompts=0,train.loggers=jsonl,"
        "batch.prompt_buckets=(16,),batch.response_buckets=(6,),train.checkpoint_every=1"
    )
    lines = []
    for iterations in (1, 2):
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "experiments.train",
                "--config",
                f"configs/grpo.py:{variant}",
                f"--config.train.num_iterations={iterations}",
                f"--workdir={tmp_path / 'run'}",
            ],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        (line,) = [x for x in proc.stdout.splitlines() if x.startswith("first iteration:")]
        lines.append(line)
    cold, warm = (re.fullmatch(r"first iteration: [0-9.]+s(.*)", x).group(1) for x in lines)
    compiled = int(re.fullmatch(r" with compilation \((\d+) programs compiled\)", cold).group(1))
    assert warm == f", nothing compiled ({compiled} programs loaded from the compilation cache)"


def test_eta_leaves_out_every_stretch_that_compiled():
    now, compiled = [0.0], [0]
    stream = io.StringIO()
    progress = Progress(10, stream=stream, clock=lambda: now[0], compiles=lambda: compiled[0])
    now[0], compiled[0] = 50.0, 40  # step 1: compilation
    assert progress.update(1, {}).endswith("eta after compile")
    now[0] += 2.0  # step 2: steady, 2 s
    assert progress.update(2, {}).endswith("| 52s eta 16s")
    now[0], compiled[0] = now[0] + 30.0, 41  # step 3 compiled a new shape: left out
    assert progress.update(3, {}).endswith("| 82s eta 14s")
    now[0] += 4.0  # step 4: 4 s; mean of the steady steps 3 s
    assert progress.update(4, {}).endswith("| 86s eta 18s")


def _compiles_per_iteration(config, workdir) -> list[int]:
    """XLA compilations (cache loads included) during each iteration of ``run_rl``."""
    counts = []
    iterate = trainer.RLRun.step

    def counted(run):
        before = compile_count()
        metrics = iterate(run)
        counts.append(compile_count() - before)
        return metrics

    trainer.RLRun.step = counted
    try:
        trainer.run_rl(config, str(workdir), quiet=True)
    finally:
        trainer.RLRun.step = iterate
    return counts


@pytest.mark.parametrize(
    "recipe,extra,phase_starts",
    [
        ("grpo", "", (0,)),
        # VAPO: the critic as a reward model, then value pretraining, then PPO updates.
        ("vapo", "critic.reward_model_iterations=1,critic.pretrain_iterations=1", (0, 1, 2)),
    ],
)
def test_no_compilation_after_the_first_iteration_of_a_phase(
    recipe, extra, phase_starts, tmp_path, monkeypatch
):
    # Fresh learners, forward passes and jit caches: a test that ran the same recipe earlier
    # in this process compiled its programs already (pytest-xdist runs several files in one
    # process), and the first iteration would compile nothing.
    monkeypatch.setattr(learner_lib, "_LEARNERS", {})
    monkeypatch.setattr(learner_lib, "_FORWARDS", {})
    jax.clear_caches()
    config = tiny(recipe, extra=extra)
    with config.unlocked():
        config.train.num_iterations = max(phase_starts) + 3
    counts = _compiles_per_iteration(config, tmp_path)
    assert counts[0] > 0
    assert [c for i, c in enumerate(counts) if i not in phase_starts] == [0] * (
        len(counts) - len(phase_starts)
    ), counts
