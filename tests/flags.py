"""The suite's XLA flags, for its own processes and the subprocesses tests start.

XLA:CPU's compiler takes most of the suite's time: tiny models run in milliseconds, their
programs compile in seconds. ``--xla_cpu_use_fusion_emitters=false`` has XLA:CPU emit its
fusions with the LLVM IR emitters instead of the MLIR fusion emitters: the same HLO, the
same fusions, about half the compile time (a tiny MoE's gradient step 3.6-3.9 -> 1.5-1.9 CPU
s; ``tests/rl/test_learner.py`` 77 -> 36 CPU s, run times alike; benchmarks/HISTORY.md
"2026-12-02: the suite under 10 minutes"). ``--xla_cpu_parallel_codegen_split_count=1``
has LLVM generate each program's code as one module rather than several compiled on
threads: the same LLVM IR, ~9% less compile CPU time where two test processes already keep
two cores busy (``tests/rl/test_learner.py`` + ``tests/models/test_attention.py``: 42.4 -> 38.7
CPU s, medians of 3; "2026-12-02: the suite at 8-8.5 minutes"). The tests compare numbers
within their tolerances, which hold with either emitter. A flag of the same name already
in ``XLA_FLAGS`` wins.

``XLA_FLAGS`` is read once, when JAX starts a backend, so a test needing simulated devices
starts a subprocess: ``run_script(script, devices=8)``. Its simulated devices are threads of
one process that meet at every collective; XLA:CPU aborts the process when one of them
waits more than 40 s there, which a 2-core machine under a second load reaches (an
8-device RL run, benchmarks/HISTORY.md "2026-12-03: the critic as a reward model").
So ``COLLECTIVE_FLAGS`` give those waits 600 s: the tests' own subprocess timeouts still
stop a real hang.
"""

import atexit
import os
import shutil
import subprocess
import sys
import tempfile

COMPILE_FLAGS = (
    "--xla_cpu_use_fusion_emitters=false",
    "--xla_cpu_parallel_codegen_split_count=1",
)


# XLA:CPU's collective waits: warn after 60 s, abort after 600 s (the abort's default: 40 s).
COLLECTIVE_FLAGS = (
    "--xla_cpu_collective_call_warn_stuck_timeout_seconds=60",
    "--xla_cpu_collective_call_terminate_timeout_seconds=600",
    "--xla_cpu_collective_timeout_seconds=600",
)


def with_compile_flags(flags: str) -> str:
    """``flags`` (an ``XLA_FLAGS`` value) with the suite's compile flags it does not set."""
    given = flags.split()
    names = {f.split("=", 1)[0] for f in given}
    return " ".join(given + [f for f in COMPILE_FLAGS if f.split("=", 1)[0] not in names])


def xla_flags(devices: int = 1, *extra: str) -> str:
    """``XLA_FLAGS`` for a subprocess: the suite's compile flags, ``devices`` simulated CPU
    devices (when more than one, with ``COLLECTIVE_FLAGS``) and ``extra`` flags."""
    flags = list(extra)
    if devices > 1:
        flags.append(f"--xla_force_host_platform_device_count={devices}")
        flags += [f for f in COLLECTIVE_FLAGS if f.split("=", 1)[0] not in " ".join(extra)]
    return with_compile_flags(" ".join(flags))


def subprocess_env(devices: int = 1, *extra_flags: str, **variables: str) -> dict:
    """This process's environment for a test's subprocess, on the CPU, with
    ``xla_flags(devices, *extra_flags)`` and the given variables."""
    return dict(
        os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(devices, *extra_flags), **variables
    )


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_script(
    script: str, devices: int = 1, *extra_flags: str, timeout: int = 900, **variables: str
) -> subprocess.CompletedProcess:
    """Runs ``python -c script`` from the repository root on ``devices`` simulated CPU
    devices (``subprocess_env``; the repository on ``PYTHONPATH``) and checks that it
    exited 0, showing its output's tail if not. Returns the finished process (text
    ``stdout`` / ``stderr``)."""
    env = subprocess_env(devices, *extra_flags, **{"PYTHONPATH": ROOT, **variables})
    proc = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    return proc


def compilation_cache_dir() -> str:
    """A new, empty directory for JAX's persistent compilation cache, removed when this
    process exits. The first process of a run (pytest, or its xdist controller) makes it;
    the workers and the tests' subprocesses inherit ``JAX_COMPILATION_CACHE_DIR``, so a
    program compiled once in the run is not compiled again by another test or process."""
    path = tempfile.mkdtemp(prefix="policyopt-tests-jax-cache-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path
