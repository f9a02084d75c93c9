"""grain pipelines (shuffle, repeat, batch, length limits, iterator state) and tfds builders."""

import json

import numpy as np
import pytest

from policyopt.data import tfds_builders
from policyopt.data.jsonl import JsonlConfig, MalformedRowError
from policyopt.data.pipeline import make_pipeline, pad_to_bucket
from policyopt.data.synthetic import ArithmeticConfig, generate_arithmetic
from policyopt.data.tokenizer import CharTokenizer

TOKENIZER = CharTokenizer()


def _records(n=40, **knobs):
    config = ArithmeticConfig(wrong_procedure_fraction=0.5, **knobs)
    return generate_arithmetic(config, split="train", seed=0, num_examples=n)


def _indices(batches):
    return [list(b["index"]) for b in batches]


# ---------------------------------------------------------------------------------------
# Order: shuffle, repeat, batch


def test_unshuffled_single_epoch_keeps_order_and_partial_batch():
    records = _records(10)
    pipeline = make_pipeline(
        records, batch_size=4, seed=0, shuffle=False, num_epochs=1, drop_remainder=False
    )
    batches = list(pipeline)
    assert _indices(batches) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert batches[0]["prompt"] == [r["prompt"] for r in records[:4]]
    assert batches[2]["answer"] == [r["answer"] for r in records[8:]]
    assert pipeline.batches_per_epoch == 3
    dropped = make_pipeline(records, batch_size=4, seed=0, shuffle=False, num_epochs=1)
    assert _indices(list(dropped)) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_shuffle_is_a_fresh_permutation_each_epoch():
    records = _records(12)
    iterator = iter(make_pipeline(records, batch_size=4, seed=7))  # repeats forever
    epochs = [sum(_indices([next(iterator) for _ in range(3)]), []) for _ in range(3)]
    for epoch in epochs:
        assert sorted(epoch) == list(range(12))
    assert epochs[0] != epochs[1] != epochs[2]
    again = iter(make_pipeline(records, batch_size=4, seed=7))
    assert sum(_indices([next(again) for _ in range(3)]), []) == epochs[0]
    other = iter(make_pipeline(records, batch_size=4, seed=8))
    assert sum(_indices([next(other) for _ in range(3)]), []) != epochs[0]


def test_tokenized_batches_are_padded_to_buckets():
    records = _records(16, min_digits=1, max_digits=4)
    pipeline = make_pipeline(
        records,
        batch_size=8,
        seed=0,
        tokenizer=TOKENIZER,
        include_solution=True,
        length_buckets=(8, 12, 16, 24),
    )
    batch = next(iter(pipeline))
    for row, index in enumerate(batch["index"]):
        record = records[index]
        prompt = TOKENIZER.encode_prompt(record["prompt"])
        response = TOKENIZER.encode_response(record["solution"])
        assert batch["prompt_lengths"][row] == len(prompt)
        assert list(batch["prompt_tokens"][row, : len(prompt)]) == prompt
        assert (batch["prompt_tokens"][row, len(prompt) :] == TOKENIZER.pad_id).all()
        assert list(batch["response_tokens"][row, : len(response)]) == response
        assert batch["prompt"][row] == record["prompt"] and batch["answer"][row] == record["answer"]
    longest = max(batch["prompt_lengths"])
    assert batch["prompt_tokens"].shape[1] == min(b for b in (8, 12, 16, 24) if b >= longest)
    assert batch["prompt_tokens"].dtype == np.int32 and batch["prompt_lengths"].dtype == np.int32


def test_pad_to_bucket_hand_worked():
    tokens, lengths = pad_to_bucket([[5, 6, 7], [8]], buckets=(2, 4, 8), pad_id=0)
    np.testing.assert_array_equal(tokens, [[5, 6, 7, 0], [8, 0, 0, 0]])
    np.testing.assert_array_equal(lengths, [3, 1])
    with pytest.raises(ValueError, match="largest length bucket 8"):
        pad_to_bucket([[1] * 9], buckets=(2, 4, 8), pad_id=0)


# ---------------------------------------------------------------------------------------
# Iterator state


@pytest.mark.parametrize("num_threads", [0, 2])
def test_iterator_state_restores_the_exact_continuation(num_threads):
    records = _records(10)
    kwargs = dict(
        batch_size=4,
        seed=3,
        tokenizer=TOKENIZER,
        include_solution=True,
        num_threads=num_threads,
        prefetch_buffer_size=4 * num_threads,
    )
    iterator = iter(make_pipeline(records, **kwargs))
    for _ in range(4):  # 16 examples: into the second epoch
        next(iterator)
    state = json.loads(json.dumps(iterator.get_state()))
    expected = [next(iterator) for _ in range(6)]  # crosses two more epoch boundaries

    restored = iter(make_pipeline(records, **kwargs))
    restored.set_state(state)
    for want, got in zip(expected, (next(restored) for _ in range(6))):
        assert want.keys() == got.keys()
        for key in want:
            np.testing.assert_array_equal(np.asarray(want[key]), np.asarray(got[key]))


# ---------------------------------------------------------------------------------------
# Length limits: counted, never silent


def test_overlong_prompts_dropped_truncated_or_rejected():
    records = _records(60, min_digits=1, max_digits=4)
    lengths = [len(TOKENIZER.encode_prompt(r["prompt"])) for r in records]
    limit = 8
    over = sum(n > limit for n in lengths)
    assert 0 < over < len(records)

    dropped = make_pipeline(
        records,
        batch_size=4,
        seed=0,
        shuffle=False,
        num_epochs=1,
        drop_remainder=False,
        tokenizer=TOKENIZER,
        max_prompt_length=limit,
        overlong_prompt="drop",
    )
    assert dropped.report.dropped_prompts == over
    assert dropped.num_examples == dropped.report.kept_examples == len(records) - over
    kept = sum(_indices(list(dropped)), [])
    assert kept == [i for i, n in enumerate(lengths) if n <= limit]

    for side in ("truncate_right", "truncate_left"):
        truncated = make_pipeline(
            records,
            batch_size=60,
            seed=0,
            shuffle=False,
            num_epochs=1,
            tokenizer=TOKENIZER,
            max_prompt_length=limit,
            overlong_prompt=side,
        )
        assert truncated.report.truncated_prompts == over and truncated.num_examples == 60
        batch = next(iter(truncated))
        assert batch["prompt_lengths"].max() == limit
        for row, record in enumerate(records):
            text = TOKENIZER.encode(record["prompt"])
            kept_text = text[: limit - 1] if side == "truncate_right" else text[-(limit - 1) :]
            expected = [TOKENIZER.bos_id] + kept_text
            assert list(batch["prompt_tokens"][row, : batch["prompt_lengths"][row]]) == expected

    first_over = next(i for i, n in enumerate(lengths) if n > limit)
    with pytest.raises(
        ValueError, match=f"record {first_over}: prompt longer than max_prompt_length={limit}"
    ):
        make_pipeline(records, batch_size=4, seed=0, tokenizer=TOKENIZER, max_prompt_length=limit)


def test_overlong_responses_counted():
    records = _records(40)
    lengths = [len(TOKENIZER.encode_response(r["solution"])) for r in records]
    limit = 15
    over = sum(n > limit for n in lengths)
    assert 0 < over < len(records)
    dropped = make_pipeline(
        records,
        batch_size=4,
        seed=0,
        tokenizer=TOKENIZER,
        include_solution=True,
        max_response_length=limit,
        overlong_response="drop",
    )
    assert dropped.report.dropped_responses == over
    truncated = make_pipeline(
        records,
        batch_size=40,
        seed=0,
        tokenizer=TOKENIZER,
        include_solution=True,
        max_response_length=limit,
        overlong_response="truncate",
        length_buckets=(16,),
    )
    assert truncated.report.truncated_responses == over
    assert next(iter(truncated))["response_lengths"].max() == limit
    with pytest.raises(ValueError, match="solution longer than max_response_length=15"):
        make_pipeline(
            records,
            batch_size=4,
            seed=0,
            tokenizer=TOKENIZER,
            include_solution=True,
            max_response_length=limit,
        )


def test_pipeline_argument_errors():
    with pytest.raises(ValueError, match="overlong_prompt"):
        make_pipeline(_records(4), batch_size=2, seed=0, tokenizer=TOKENIZER, overlong_prompt="cut")
    with pytest.raises(ValueError, match="need a tokenizer"):
        make_pipeline(_records(4), batch_size=2, seed=0, max_prompt_length=4)
    with pytest.raises(ValueError, match="no examples left"):
        make_pipeline(
            _records(4),
            batch_size=2,
            seed=0,
            tokenizer=TOKENIZER,
            max_prompt_length=3,
            overlong_prompt="drop",
        )


# ---------------------------------------------------------------------------------------
# tfds builders (array_record, no TensorFlow), read through the pipeline


def test_arithmetic_builder_round_trip(tmp_path):
    task = ArithmeticConfig(wrong_procedure_fraction=0.6)
    builder = tfds_builders.build_arithmetic(tmp_path, task, seed=5, train_size=64, test_size=16)
    for split, size in (("train", 64), ("test", 16)):
        source = builder.as_data_source(split)
        expected = generate_arithmetic(task, split=split, seed=5, num_examples=size)
        assert len(source) == size
        assert [{k: v.decode() for k, v in source[i].items()} for i in range(size)] == expected

    # Same settings: the prepared files are reused; other settings: another directory.
    again = tfds_builders.build_arithmetic(tmp_path, task, seed=5, train_size=64, test_size=16)
    assert again.data_dir == builder.data_dir
    other = tfds_builders.build_arithmetic(tmp_path, task, seed=6, train_size=64, test_size=16)
    assert other.data_dir != builder.data_dir
    # download=False only opens prepared data (what the other processes of a job do).
    opened = tfds_builders.build_arithmetic(
        tmp_path, task, seed=5, train_size=64, test_size=16, download=False
    )
    assert opened.data_dir == builder.data_dir and len(opened.as_data_source("test")) == 16
    with pytest.raises(FileNotFoundError, match="not prepared"):
        tfds_builders.build_arithmetic(
            tmp_path, task, seed=7, train_size=64, test_size=16, download=False
        )

    source = builder.as_data_source("train")
    kwargs = dict(batch_size=8, seed=1, tokenizer=TOKENIZER, include_solution=True)
    iterator = iter(make_pipeline(source, **kwargs))
    first = next(iterator)
    assert isinstance(first["prompt"][0], str)
    assert first["prompt"] == [
        expected_record["prompt"]
        for expected_record in (
            generate_arithmetic(task, split="train", seed=5, num_examples=64)[i]
            for i in first["index"]
        )
    ]
    for _ in range(9):
        next(iterator)
    state = iterator.get_state()
    expected = [next(iterator)["index"] for _ in range(3)]
    restored = iter(make_pipeline(source, **kwargs))
    restored.set_state(state)
    assert [list(next(restored)["index"]) for _ in range(3)] == [list(e) for e in expected]


def test_math_jsonl_builder(tmp_path):
    rows = [json.dumps({"question": f"q{i}", "answer": f"work\n#### {i}"}) for i in range(5)]
    train = tmp_path / "train.jsonl"
    train.write_text("\n".join(rows[:3] + ['{"question": "no answer"}'] + rows[3:]) + "\n")
    test = tmp_path / "test.jsonl"
    test.write_text(json.dumps({"problem": "p", "solution": "\\boxed{\\frac{1}{2}}"}) + "\n")
    files = {"train": train, "test": test}

    with pytest.raises(MalformedRowError, match="train.jsonl:4: missing answer field"):
        tfds_builders.build_math_jsonl(tmp_path / "data", files)

    builder = tfds_builders.build_math_jsonl(
        tmp_path / "data", files, JsonlConfig(skip_malformed=True)
    )
    source = builder.as_data_source("train")
    assert [source[i]["answer"].decode() for i in range(len(source))] == ["0", "1", "2", "3", "4"]
    assert builder.as_data_source("test")[0]["answer"] == b"\\frac{1}{2}"
    report = builder.info.metadata["jsonl_reports"]["train"]
    assert report["loaded"] == 5 and len(report["skipped"]) == 1
    assert report["skipped"][0].endswith(
        "train.jsonl:4: missing answer field: none of "
        "['answer', 'solution'] present (fields: ['question'])"
    )

    # Edited file, new content hash, new prepared directory.
    train.write_text("\n".join(rows[:2]) + "\n")
    edited = tfds_builders.build_math_jsonl(
        tmp_path / "data", files, JsonlConfig(skip_malformed=True)
    )
    assert edited.data_dir != builder.data_dir and len(edited.as_data_source("train")) == 2
