"""The sections of a batch and its generation: ``batch``, ``sampling``,
``dynamic_sampling`` and ``async_mode``."""

from __future__ import annotations

import dataclasses

from policyopt.schema import buckets, choice, flag, integer, number, setting


@dataclasses.dataclass(frozen=True)
class Batch:
    """The geometry of one RL batch: prompts, samples per prompt, minibatches, epochs, the
    length buckets every step compiles for, packing and micro-batches."""

    n_prompts: int = setting(
        8, "Prompts per RL batch (after dynamic sampling, if on).", check=integer(1)
    )
    group_size: int = setting(8, "G: samples per prompt (a group).", check=integer(1))
    n_minibatches: int = setting(
        1,
        "Minibatches per batch: n_prompts * group_size / n_minibatches sequences per update.",
        paper="Magistral 2506.10910 §2.1: n_batch / n_minibatch",
        note="Groups are never split.",
        check=integer(1),
    )
    epochs: int = setting(1, "Passes over the batch (PPO epochs).", check=integer(1))
    prompt_buckets: tuple[int, ...] = setting(
        (16, 32, 64, 128, 256, 512, 1024, 2048),
        "Prompt lengths are padded up to the smallest of these that holds them.",
        note="Response lengths (the longest valid response of the batch) likewise, so each "
        "jitted step compiles at most len(prompt_buckets) * len(response_buckets) times.",
        check=buckets(),
    )
    response_buckets: tuple[int, ...] = setting(
        (8, 16, 24, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 20480),
        "Response lengths are padded up to the smallest of these that holds them.",
        note="The largest must be >= sampling.max_new_tokens.",
        check=buckets(),
    )
    pack: bool = setting(
        False,
        "Pack the real tokens of each minibatch's rows into rows of `pack_tokens` slots for "
        "the training forwards.",
        note="Old / reference log-probs, critic values and updates; first-fit decreasing, "
        "attention within each sequence only (policyopt.rl.update.packing). The losses are "
        "unchanged: the per-token results return to the padded rows before them. Logged: "
        "batch/padding_fraction (padded layout) and batch/packed_padding_fraction.",
        check=flag(),
    )
    pack_tokens: int | None = setting(
        None,
        "Slots per packed row, >= the longest row's real tokens; None: the batch's padded "
        "width (prompt bucket + response bucket), so packing never adds rows.",
        check=integer(1, none="the padded width"),
    )
    micro_batch_tokens: int | None = setting(
        None,
        "Gradient accumulation: each update runs as micro-batches of at most this many "
        "tokens; None or 0: one pass.",
        note="Rows x padded row length, over the whole mesh; their gradients summed in "
        "float32 inside the jitted step, then one optimiser step. The result is the "
        "minibatch's (its denominators; `policyopt.rl.update.micro_batches`), the memory one "
        "micro-batch's. At least the longest row, max(prompt_buckets) + max_new_tokens. "
        "With algo.load_balancing_coef > 0 and no routing replay, one more forward pass per "
        "update counts the minibatch's expert loads first.",
        check=integer(0, none="off"),
    )

    def validate(self, label: str) -> None:
        if self.n_prompts % self.n_minibatches:
            raise ValueError(
                f"{label}.n_minibatches ({self.n_minibatches}) must divide "
                f"n_prompts ({self.n_prompts}): minibatches hold whole groups"
            )
        if self.micro_batch_tokens and self.pack:
            raise ValueError(
                f"{label}.micro_batch_tokens and {label}.pack cannot be used together yet: "
                "a packed minibatch is not split into micro-batches (turn one of them off)"
            )


@dataclasses.dataclass(frozen=True)
class Sampling:
    """Generation: the token budget, temperature and truncation, decode loops, and the
    continuous-batching engine's KV budget."""

    max_new_tokens: int = setting(24, "N: most tokens generated per response.", check=integer(1))
    temperature: float = setting(
        1.0,
        "Rollout temperature; the trainer's log-probs use the same one.",
        paper="DAPO, GSPO, Magistral use 1.0",
        note="So that ratios compare like with like; greedy pass@1 is what the evaluation reports.",
    )
    top_k: int = setting(0, "Top-k truncation (0 = off).", check=integer(0))
    top_p: float = setting(
        1.0,
        "Top-p truncation (1.0 = off).",
        note="With truncation, old log-probs come from the trainer's untruncated forward and "
        "the ratio is biased (see `policyopt.sampling`).",
        check=number(0.0, 1.0, low_inclusive=False),
    )
    decode_segments: int = setting(
        1,
        "Decode loops over growing KV caches: loop k of K attends over P + (k+1) N/K slots "
        "instead of P + N.",
        note="`SamplingConfig.decode_segments`. The same tokens up to float rounding; each "
        "loop is one more compiled body. CPU, a 7M dense model, 16 prompts of 32 + 512 "
        "tokens: K = 4 -17%, K = 8 -22% per call (benchmarks/HISTORY.md, 2026-11-30); 1 for "
        "short responses like the demo's. Synchronous generation only (the async generator "
        "keeps its own windowed cache).",
    )
    engine_kv_tokens: int = setting(
        0,
        "Continuous batching (`policyopt.engine`) on a paged KV cache: the pool's KV token "
        "slots, shared by all rows (0 = off).",
        note="Instead of one `generate_fn` call over all B x G rows. Greedy tokens are "
        "generate's; sampled ones follow per-row keys (another draw of the same "
        "distribution). Both trainers (the async generator's rows are "
        "async_mode.num_slots; its pool must hold one group of P + N tokens alone); on a "
        "mesh one engine shard per device along the row axes (the budget and rows are per "
        "shard); records the routing for R3. The budget must admit one group of the longest "
        "prompt (its pages, a copy of its partly filled last page per other row, a page per "
        "row) and take one row to max_new_tokens: checked, the error names the smallest "
        "budget that works.",
    )
    engine_rows: int = setting(
        0, "Rows the engine decodes together, a multiple of batch.group_size (0 = all B x G)."
    )
    engine_page_size: int = setting(16, "Token slots per page of the engine's KV cache.")

    def validate(self, label: str) -> None:
        if not self.temperature > 0:
            raise ValueError(
                f"{label}.temperature must be > 0, got {self.temperature}: the trainer's "
                "log-probs are taken at the rollout temperature (greedy pass@1 is what the "
                "evaluation reports)"
            )
        max_new = self.max_new_tokens
        if not 1 <= self.decode_segments <= max_new:
            raise ValueError(
                f"{label}.decode_segments must be in [1, max_new_tokens={max_new}], "
                f"got {self.decode_segments}"
            )
        if self.engine_kv_tokens < 0 or self.engine_rows < 0 or self.engine_page_size < 1:
            raise ValueError(
                f"{label}.engine_kv_tokens ({self.engine_kv_tokens}) and engine_rows "
                f"({self.engine_rows}) must be >= 0, engine_page_size "
                f"({self.engine_page_size}) >= 1"
            )


@dataclasses.dataclass(frozen=True)
class DynamicSampling:
    """DAPO's and Magistral's filter of groups whose rewards all agree."""

    enabled: bool = setting(
        False,
        "Drop groups whose rewards all agree and sample more prompts until the batch is full.",
        paper="DAPO 2503.14476 eq. 11",
    )
    max_rounds: int = setting(
        4,
        "Most sampling rounds (of n_prompts prompts each) per batch.",
        note="If the batch is still not full, the remaining slots keep zero-variance groups "
        "(zero advantage) and the shortfall is reported in the metrics.",
        check=integer(1),
    )
    criterion: str = setting(
        "reward",
        'Which groups are dropped: "reward" (all G rewards equal) or "accuracy" (all correct '
        "or all wrong).",
        paper='"reward": Magistral 2506.10910; "accuracy": DAPO 2503.14476 eq. 11',
        note="A group whose rewards are equal has zero advantage; DAPO's reward also carries "
        "the overlong penalty.",
        check=choice("reward", "accuracy"),
    )


@dataclasses.dataclass(frozen=True)
class AsyncMode:
    """Magistral's asynchronous generation, for any recipe (`policyopt.rl.loop.async_rl`;
    docs/algorithms.md): generators never wait for the trainer, finished groups are scored
    at once, new weights reach the generators mid-generation."""

    enabled: bool = setting(
        False,
        "Run `run_async_rl` instead of the synchronous `run_rl` (experiments/train.py).",
        paper="Magistral 2506.10910",
    )
    n_async: int | None = setting(
        None,
        "Most completions started and not yet taken by the trainer; it bounds staleness. "
        "None: 2 * n_prompts * group_size.",
        paper="Magistral 2506.10910: best with n_async / n_batch <= 2",
        note="In generation or waiting. A multiple of batch.group_size. Magistral also keeps "
        "n_batch = n_minibatch, i.e. one update per batch.",
    )
    num_slots: int | None = setting(
        None,
        "Generation rows (slots); None: n_async.",
        note="The KV cache is [rows, P + N + segment_steps]. A multiple of batch.group_size; "
        "set it below n_async when memory is short.",
    )
    segment_steps: int = setting(
        8,
        "Decode steps between two pick-ups of new weights by the generator.",
        note="The push granularity; a completion is decoded under at most "
        "ceil(max_new_tokens / segment_steps) versions.",
    )
    prompt_width: int | None = setting(
        None,
        "Prompt width of the generator's slots; None: the prompt bucket of the longest "
        "training prompt (every prompt fits).",
        note="A longer prompt is an error naming this field.",
    )
    join_timeout_s: float = setting(
        60.0,
        "Seconds to wait for the scoring thread to stop at the end or on an error.",
        note="With reward.num_workers > 0 its worker pool is killed at once; in-process "
        "scoring finishes the group it is on, and after this long is left to finish in the "
        "background.",
        check=number(0.0, low_inclusive=False),
    )

    def validate(self, label: str) -> None:
        if self.segment_steps < 1:
            raise ValueError(f"{label}.segment_steps must be >= 1, got {self.segment_steps}")
        if self.prompt_width is not None and self.prompt_width < 1:
            raise ValueError(f"{label}.prompt_width must be >= 1, got {self.prompt_width}")
