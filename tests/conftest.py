"""Shared test settings: float32 everywhere, CPU only, deterministic.

XLA:CPU's backend compile is most of the suite's time (tiny models run in milliseconds,
their programs compile in seconds), so tests compile with JAX's
``jax_disable_most_optimizations`` (backend optimisation level 0, LLVM's expensive passes
off): a quarter less CPU time, the same programs. The environment variable reaches the
subprocesses that tests start (multi-device runs, the command line), which read it at
start-up; ``JAX_DISABLE_MOST_OPTIMIZATIONS=0`` turns it off. The suite's XLA flags
(``tests/flags.py``: the older, faster-compiling CPU fusion emitters) join ``XLA_FLAGS``
the same way, before JAX starts a backend. JAX's persistent compilation cache goes to one
new directory per run (``tests/flags.py``, removed at exit), shared by the xdist workers and
the tests' subprocesses, so a program compiled once in the run is loaded, not compiled
again, by another test or process; ``JAX_COMPILATION_CACHE_DIR`` set beforehand wins.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

from tests.flags import compilation_cache_dir, with_compile_flags  # noqa: E402

os.environ["XLA_FLAGS"] = with_compile_flags(os.environ.get("XLA_FLAGS", ""))
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = compilation_cache_dir()
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402  (after the environment it reads)

jax.config.update(
    "jax_disable_most_optimizations",
    os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"].lower() not in ("0", "false", "no", "off"),
)
# Read from the environment when JAX is imported, which may have happened already.
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update(
    "jax_persistent_cache_min_compile_time_secs",
    float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]),
)
jax.config.update(
    "jax_persistent_cache_min_entry_size_bytes",
    int(os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"]),
)

# The slowest files (CPU seconds of a full run, benchmarks/HISTORY.md "2026-12-02: the suite at
# 8-8.5 minutes"),
# first: pytest-xdist (`make test`: --dist loadfile --no-loadscope-reorder) hands each worker
# one file at a time in collection order, so starting with the longest lets the workers end
# together (longest-processing-time-first) instead of one running a long file alone at the
# end. The other files follow in their usual order.
SLOWEST_FIRST = (
    "test_rl_trainer.py",
    "test_micro_batches.py",
    "test_expert_parallel.py",
    "test_scan.py",
    "test_engine.py",
    "test_packing.py",
    "test_rl_mesh.py",
    "test_async_rl.py",
    "test_scale_sim.py",
    "test_multihost.py",
    "test_rewards_code.py",
    "test_async_engine.py",
    "test_rl_tasks.py",
    "test_sampling.py",
    "test_fsdp_grads.py",
)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: files whole
