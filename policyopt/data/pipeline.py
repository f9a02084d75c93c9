"""grain input pipelines: shuffle, repeat, tokenize, limit lengths, batch to bucketed shapes.

```
pipeline = make_pipeline(source, batch_size=64, seed=0, tokenizer=tokenizer,
                         max_prompt_length=32, overlong_prompt="drop")
iterator = iter(pipeline)
batch = next(iterator)        # dict: prompt_tokens int32 [B, P], prompt_lengths int32 [B],
                              #       prompt / answer: lists of B strings, index int64 [B]
state = iterator.get_state()  # a small JSON-able dict: save it with the checkpoint
...
iterator = iter(make_pipeline(...same arguments...))
iterator.set_state(state)     # continues with exactly the batches that would have come
```

`source` is any random-access sequence of records (dicts of text): a list from
`generate_arithmetic` or `read_math_jsonl`, or `builder.as_data_source(split)` of a tfds
builder (whose text comes back as bytes and is decoded here).

The order is `source -> shuffle(seed) -> repeat(num_epochs) -> tokenize -> batch`: every
epoch is a fresh deterministic permutation, batches run across epoch boundaries, and the
iterator's state is the index of the next batch, so a restored iterator reproduces the
continuation exactly (grain `MapDataset` semantics).

Lengths. Prompts longer than `max_prompt_length` tokens (template included) are
- "error": rejected when the pipeline is built (the record index and length named),
- "drop": left out of the pipeline,
- "truncate_right" / "truncate_left": the prompt *text* is cut to fit, keeping its start
  or its end, the chat template kept whole;
and the same for SFT responses with `max_response_length` ("error", "drop", "truncate":
keep the first tokens, which loses EOS). Every limit is applied by one pass over the
source when the pipeline is built, so the counts in `pipeline.report` are exact and
nothing is dropped silently (they are logged too). Batches are right-padded with the
tokenizer's PAD id to the smallest of `length_buckets` that fits, so a training step
compiles once per bucket, not once per length.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import grain
import numpy as np
from absl import logging

DEFAULT_BUCKETS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
PROMPT_POLICIES = ("error", "drop", "truncate_right", "truncate_left")
RESPONSE_POLICIES = ("error", "drop", "truncate")


def _text(value: Any) -> Any:
    """tfds returns Text features as bytes; records elsewhere hold str."""
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, np.ndarray) and value.dtype.kind in "SO" and value.ndim == 0:
        return _text(value.item())
    return value


def as_record(example: dict) -> dict:
    """A record with every text field as `str` (tfds data sources give bytes)."""
    return {key: _text(value) for key, value in example.items()}


def bucket_length(length: int, buckets: Sequence[int]) -> int:
    """The smallest bucket >= length; `ValueError` if none."""
    for bucket in sorted(buckets):
        if length <= bucket:
            return bucket
    raise ValueError(
        f"length {length} exceeds the largest length bucket {max(buckets)}; "
        "add a bucket or limit the length (max_prompt_length / max_response_length)"
    )


def pad_to_bucket(
    sequences: Sequence[Sequence[int]], buckets: Sequence[int], pad_id: int
) -> tuple[np.ndarray, np.ndarray]:
    """Right-pads token lists to one bucketed length.

    Args:
      sequences: B lists of token ids.
      buckets: allowed padded lengths.
      pad_id: the PAD id.
    Returns:
      tokens int32 [B, L] (L the smallest bucket >= the longest sequence), lengths int32 [B].
    """
    lengths = np.array([len(s) for s in sequences], np.int32)
    width = bucket_length(int(lengths.max(initial=0)), buckets)
    tokens = np.full((len(sequences), width), pad_id, np.int32)
    for row, sequence in enumerate(sequences):
        tokens[row, : len(sequence)] = sequence
    return tokens, lengths


@dataclasses.dataclass
class LengthReport:
    """What the length limits did to the source (exact counts, from the build-time pass)."""

    source_examples: int = 0
    kept_examples: int = 0
    dropped_prompts: int = 0
    truncated_prompts: int = 0
    dropped_responses: int = 0
    truncated_responses: int = 0

    def summary(self) -> str:
        return (
            f"{self.kept_examples}/{self.source_examples} examples kept; prompts: "
            f"{self.dropped_prompts} dropped, {self.truncated_prompts} truncated; responses: "
            f"{self.dropped_responses} dropped, {self.truncated_responses} truncated"
        )


@dataclasses.dataclass(frozen=True)
class _Tokenize:
    """Record -> example with token lists, lengths limited by the configured policies."""

    tokenizer: Any
    max_prompt_length: int | None
    overlong_prompt: str
    include_solution: bool
    max_response_length: int | None
    overlong_response: str

    def prompt_tokens(self, prompt: str) -> tuple[list[int], bool]:
        """(prompt ids with template, whether it was over the limit)."""
        text_ids = self.tokenizer.encode(prompt)
        ids = self.tokenizer.wrap_prompt(text_ids)
        if self.max_prompt_length is None or len(ids) <= self.max_prompt_length:
            return ids, False
        if self.overlong_prompt.startswith("truncate"):
            budget = self.max_prompt_length - (len(ids) - len(text_ids))
            if budget <= 0:
                raise ValueError(
                    f"max_prompt_length={self.max_prompt_length} leaves no room for text "
                    f"after the {len(ids) - len(text_ids)} tokens of the chat template"
                )
            kept = (
                text_ids[:budget]
                if self.overlong_prompt == "truncate_right"
                else text_ids[-budget:]
            )
            ids = self.tokenizer.wrap_prompt(kept)
        return ids, True

    def response_tokens(self, solution: str) -> tuple[list[int], bool]:
        ids = self.tokenizer.encode_response(solution)
        if self.max_response_length is None or len(ids) <= self.max_response_length:
            return ids, False
        if self.overlong_response == "truncate":
            ids = ids[: self.max_response_length]
        return ids, True

    def __call__(self, item: tuple[int, dict]) -> dict:
        index, record = item
        example = dict(as_record(record), index=index)
        example["prompt_tokens"], _ = self.prompt_tokens(example["prompt"])
        if self.include_solution:
            example["response_tokens"], _ = self.response_tokens(example["solution"])
        return example


class _Indexed:
    """Random-access view of `source[indices]` whose items are (source index, record)."""

    def __init__(self, source: Sequence, indices: np.ndarray):
        self.source, self.indices = source, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> tuple[int, dict]:
        index = int(self.indices[i])
        return index, self.source[index]


def _check_lengths(source: Sequence, tokenize: _Tokenize) -> tuple[np.ndarray, LengthReport]:
    """The build-time pass: indices kept, and exact counts of what the limits did."""
    report = LengthReport(source_examples=len(source))
    keep = np.ones(len(source), bool)
    for index in range(len(source)):
        record = as_record(source[index])
        _, prompt_over = tokenize.prompt_tokens(record["prompt"])
        if prompt_over:
            if tokenize.overlong_prompt == "error":
                raise ValueError(
                    f"record {index}: prompt longer than max_prompt_length="
                    f"{tokenize.max_prompt_length} tokens ({record['prompt'][:60]!r}...); "
                    "set overlong_prompt to 'drop' or 'truncate_right'/'truncate_left'"
                )
            if tokenize.overlong_prompt == "drop":
                report.dropped_prompts += 1
                keep[index] = False
                continue
            report.truncated_prompts += 1
        if tokenize.include_solution:
            _, response_over = tokenize.response_tokens(record["solution"])
            if response_over:
                if tokenize.overlong_response == "error":
                    raise ValueError(
                        f"record {index}: solution longer than max_response_length="
                        f"{tokenize.max_response_length} tokens; set overlong_response to "
                        "'drop' or 'truncate'"
                    )
                if tokenize.overlong_response == "drop":
                    report.dropped_responses += 1
                    keep[index] = False
                    continue
                report.truncated_responses += 1
    report.kept_examples = int(keep.sum())
    return np.flatnonzero(keep), report


def _collate_records(examples: Sequence[dict]) -> dict:
    """Batch of records: text fields as lists of str, numbers as arrays."""
    batch = {}
    for key in examples[0]:
        values = [example[key] for example in examples]
        batch[key] = values if isinstance(values[0], str) else np.asarray(values)
    return batch


@dataclasses.dataclass(frozen=True)
class _CollateTokens:
    """Batch of tokenized examples, right-padded to bucketed lengths."""

    pad_id: int
    buckets: tuple[int, ...]

    def __call__(self, examples: Sequence[dict]) -> dict:
        batch = {}
        for key in examples[0]:
            values = [example[key] for example in examples]
            if key.endswith("_tokens"):
                stem = key[: -len("_tokens")]
                batch[key], batch[stem + "_lengths"] = pad_to_bucket(
                    values, self.buckets, self.pad_id
                )
            elif isinstance(values[0], str):
                batch[key] = values
            else:
                batch[key] = np.asarray(values)
        return batch


@dataclasses.dataclass
class Pipeline:
    """A configured pipeline: iterate it for a checkpointable grain iterator.

    Attributes:
      dataset: the grain `IterDataset` of batches.
      report: what the length limits did.
      num_examples: examples per epoch (after drops).
      batches_per_epoch: len of one epoch in batches (partial last batch counted only when
        `drop_remainder` is False); with repeat, batches straddle epochs.
    """

    dataset: grain.IterDataset
    report: LengthReport
    num_examples: int
    batches_per_epoch: int

    def __iter__(self) -> grain.DatasetIterator:
        return iter(self.dataset)


def make_pipeline(
    source: Sequence,
    *,
    batch_size: int,
    seed: int,
    shuffle: bool = True,
    num_epochs: int | None = None,
    tokenizer=None,
    max_prompt_length: int | None = None,
    overlong_prompt: str = "error",
    include_solution: bool = False,
    max_response_length: int | None = None,
    overlong_response: str = "error",
    length_buckets: Sequence[int] = DEFAULT_BUCKETS,
    drop_remainder: bool = True,
    num_threads: int = 0,
    prefetch_buffer_size: int = 0,
) -> Pipeline:
    """Builds the grain pipeline of batches over `source` (see the module docstring).

    Args:
      source: random-access sequence of records (`prompt`, `answer`, `solution` text).
      batch_size: examples per batch B.
      seed: shuffle seed (each epoch is reshuffled from it deterministically).
      shuffle: shuffle (training) or keep the source order (evaluation).
      num_epochs: passes over the data; None repeats forever.
      tokenizer: a `CharTokenizer` / `HFTokenizer`; None batches the records as text.
      max_prompt_length / overlong_prompt: prompt limit in tokens (template included) and
        what to do beyond it: "error", "drop", "truncate_right", "truncate_left".
      include_solution: also tokenize `solution` as the response (`encode_response`, with
        EOS) for SFT: adds `response_tokens` [B, R] and `response_lengths` [B].
      max_response_length / overlong_response: response limit; "error", "drop", "truncate".
      length_buckets: padded lengths allowed for prompts and responses.
      drop_remainder: drop a final partial batch (only happens with finite `num_epochs`).
      num_threads / prefetch_buffer_size: grain read threads and buffer (0: read in the
        calling thread, best for in-memory data).
    Returns:
      a `Pipeline`; `iter(pipeline)` has `get_state()` (JSON-able dict) and `set_state`.
      Batches: `index` int64 [B] (position in `source`), the text fields as lists of B
      strings, and with a tokenizer `prompt_tokens` int32 [B, P] right-padded with PAD,
      `prompt_lengths` int32 [B] (and the response pair).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if overlong_prompt not in PROMPT_POLICIES:
        raise ValueError(
            f"overlong_prompt must be one of {PROMPT_POLICIES}, got {overlong_prompt!r}"
        )
    if overlong_response not in RESPONSE_POLICIES:
        raise ValueError(
            f"overlong_response must be one of {RESPONSE_POLICIES}, got {overlong_response!r}"
        )
    if tokenizer is None and (max_prompt_length or include_solution or max_response_length):
        raise ValueError(
            "max_prompt_length / include_solution / max_response_length need a tokenizer"
        )

    if tokenizer is not None:
        tokenize = _Tokenize(
            tokenizer,
            max_prompt_length,
            overlong_prompt,
            include_solution,
            max_response_length,
            overlong_response,
        )
        if max_prompt_length is not None or max_response_length is not None:
            indices, report = _check_lengths(source, tokenize)
        else:
            indices = np.arange(len(source))
            report = LengthReport(source_examples=len(source), kept_examples=len(source))
        transform: Callable = tokenize
        collate: Callable = _CollateTokens(tokenizer.pad_id, tuple(length_buckets))
    else:
        indices = np.arange(len(source))
        report = LengthReport(source_examples=len(source), kept_examples=len(source))
        transform = lambda item: dict(as_record(item[1]), index=item[0])
        collate = _collate_records
    if (
        report.kept_examples < report.source_examples
        or report.truncated_prompts
        or (report.truncated_responses)
    ):
        logging.warning("data pipeline: %s", report.summary())
    if len(indices) == 0:
        raise ValueError(f"no examples left to batch: {report.summary()}")

    dataset = grain.MapDataset.source(_Indexed(source, indices))
    if shuffle:
        dataset = dataset.shuffle(seed=seed)
    if num_epochs != 1:
        dataset = dataset.repeat(num_epochs)
    dataset = dataset.map(transform).batch(
        batch_size, drop_remainder=drop_remainder, batch_fn=collate
    )
    read_options = grain.ReadOptions(
        num_threads=num_threads, prefetch_buffer_size=prefetch_buffer_size
    )
    batches_per_epoch = (
        len(indices) // batch_size if drop_remainder else -(-len(indices) // batch_size)
    )
    return Pipeline(
        dataset=dataset.to_iter_dataset(read_options),
        report=report,
        num_examples=len(indices),
        batches_per_epoch=batches_per_epoch,
    )
