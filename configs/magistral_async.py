"""Magistral (arXiv 2506.10910) with its asynchronous generation: generators never wait
for the trainer, finished completions are scored at once, a batch is a fixed number of
completions, new weights reach the generators mid-generation without recomputing the KV
cache (docs/algorithms.md "Asynchronous generation").
Runs `policyopt.rl.loop.async_rl.run_async_rl`.

    python -m experiments.train --config \
        configs/magistral_async.py[:model=tiny_dense,async_mode.n_async=128]

Every field and variant of `configs/magistral.py`, with `async_mode.enabled = True`. Any
other recipe trains asynchronously the same way with `async_mode.enabled=True` in its
variant string (the `async_mode` block of `configs/base.py`).

Off-policy correction: like the paper, none by default. Measured on the demo task
(benchmarks/HISTORY.md "2026-11-30: the papers' ablations", `async_offpolicy`): at lr 1e-4
asynchronous runs match synchronous ones, but at lr 1e-3, where one version moves the policy a lot,
samples ~1.5 versions old stop learning without a correction; `algo.tis_cap=2.0`
(truncated importance weights; `algo.tis_level=sequence` as well) or
`algo.old_log_probs=sampler` (clip the ratio against the sampler's log-probs) restore it;
rejection sampling alone (`algo.rs_level`) does not.
"""

from configs import magistral


def get_config(arg=None):
    return magistral.get_config("async_mode.enabled=True" + ("," + arg if arg else ""))
