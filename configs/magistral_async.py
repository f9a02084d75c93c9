"""Magistral (arXiv 2506.10910) with its asynchronous generation: generators never wait
for the trainer, finished completions are scored at once, a batch is a fixed number of
completions, new weights reach the generators mid-generation without recomputing the KV
cache (PAPERS.md "Asynchronous generation"). Runs `policyopt.rl.async_rl.run_async_rl`.

    python -m experiments.train --config configs/magistral_async.py[:model=tiny_dense,async_mode.n_async=128]

Every field and variant of `configs/magistral.py`, plus `async_mode`.
"""

import ml_collections

from configs import base, magistral


def async_fields() -> ml_collections.ConfigDict:
    """The `async_mode` block (read by `policyopt.rl.async_rl.AsyncConfig`)."""
    a = ml_collections.ConfigDict()
    # Run `run_async_rl` instead of the synchronous `run_rl` (experiments/train.py).
    a.enabled = True
    # n_async: most completions started and not yet taken by the trainer (in generation
    # or waiting); it bounds staleness. A multiple of batch.group_size.
    # None: 2 * n_batch, n_batch = n_prompts * group_size (Magistral: best with
    # n_async / n_batch <= 2, and n_batch = n_minibatch, i.e. one update per batch).
    a.n_async = base.placeholder(int)
    # Generation rows (slots; the KV cache is [rows, P + N + segment_steps]); None: n_async.
    # A multiple of batch.group_size; set it below n_async when memory is short.
    a.num_slots = base.placeholder(int)
    # Decode steps between two pick-ups of new weights by the generator (the push
    # granularity; a completion spans up to ceil(max_new_tokens / segment_steps) pushes).
    a.segment_steps = 8
    # Prompt width of the generator's slots; None: the prompt bucket of the longest
    # training prompt (every prompt fits). A longer prompt is an error naming this field.
    a.prompt_width = base.placeholder(int)
    # Seconds to wait for the generator thread to stop at the end or on an error.
    a.join_timeout_s = 60.0
    return a


def check_async(config: ml_collections.ConfigDict) -> None:
    """Raises a ValueError naming the first impossible `async_mode` field."""
    a, group = config.async_mode, config.batch.group_size
    if a.n_async is not None and (a.n_async < group or a.n_async % group):
        raise ValueError(f"config.async_mode.n_async ({a.n_async}) must be a positive multiple of "
                         f"batch.group_size ({group})")
    if a.num_slots is not None and (a.num_slots < group or a.num_slots % group):
        raise ValueError(f"config.async_mode.num_slots ({a.num_slots}) must be a positive multiple "
                         f"of batch.group_size ({group})")
    if a.segment_steps < 1:
        raise ValueError(f"config.async_mode.segment_steps must be >= 1, got {a.segment_steps}")
    if a.prompt_width is not None and a.prompt_width < 1:
        raise ValueError(f"config.async_mode.prompt_width must be >= 1, got {a.prompt_width}")


def get_config(arg=None):
    items = [item for item in (arg or "").split(",") if item.strip()]
    async_items = [item for item in items if item.strip().startswith("async_mode.")]
    c = magistral.get_config(",".join(item for item in items if item not in async_items) or None)
    c.unlock()
    c.async_mode = async_fields()
    base.apply_variant(c, ",".join(async_items))
    check_async(c)
    c.lock()
    return c
