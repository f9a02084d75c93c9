"""The trainer's tasks from the config: the synthetic arithmetic task, local math JSONL
files (``task.name = "math_jsonl"``) and either one through tfds array_record files
(``task.tfds_dir``), with the prompt-length policy and the config's checks."""

import json

import jax
import numpy as np
import pytest

from configs import base
from policyopt.data import HFTokenizer
from policyopt.rewards import score_batch
from policyopt.rl.loop import build, iteration, trainer
from policyopt.rl.reporting import evaluate
from policyopt.rl.sft import make_sft_iterator
from tests.rl.test_trainer import tiny


def _with(config, **fields):
    """``config`` with ``task.<name>`` fields set (values may hold commas and slashes)."""
    config = config.copy_and_resolve_references()
    config.unlock()
    for name, value in fields.items():
        config.task[name] = value
    config.lock()
    base.check(config)
    return config


def _write_jsonl(path, records, **renamed):
    """Writes records, each field under ``renamed.get(field, field)``."""
    with open(path, "w") as f:
        for record in records:
            f.write(json.dumps({renamed.get(k, k): v for k, v in record.items()}) + "\n")
    return str(path)


def _as_jsonl(config, directory, **renamed):
    """The config's arithmetic task written as two JSONL files and read back as the task."""
    files = {
        split: _write_jsonl(
            directory / f"{split}.jsonl", build.task_records(config, split), **renamed
        )
        for split in ("train", "test")
    }
    return _with(config, name="math_jsonl", train_file=files["train"], test_file=files["test"])


def _first_batches(config, n=3):
    iterator = trainer.make_prompt_iterator(config, build.task_source(config, "train"), seed=0)
    return [next(iterator) for _ in range(n)]


def test_math_jsonl_task_trains_like_the_same_records_in_memory(tmp_path):
    """The arithmetic records written as GSM8K-style JSONL ("question" / "answer" fields)
    are read back as the same records, so one RL iteration on them is the same run."""
    config = tiny("grpo", extra="train.num_iterations=1")
    jsonl = _as_jsonl(config, tmp_path, prompt="question")
    for split in ("train", "test"):
        want = [
            {k: r[k] for k in ("prompt", "answer", "solution")}
            for r in build.task_records(config, split)
        ]
        assert build.task_records(jsonl, split) == want
    runs = [
        trainer.run_rl(c, str(tmp_path / name), num_iterations=1, quiet=True)
        for name, c in (("memory", config), ("jsonl", jsonl))
    ]
    memory, from_file = runs
    np.testing.assert_array_equal(
        from_file["run"].last_batch.tokens, memory["run"].last_batch.tokens
    )
    for key in ("reward/mean", "loss/loss"):
        assert from_file["metrics"][key] == memory["metrics"][key], key
    assert from_file["eval"]["eval/pass@1"] == memory["eval"]["eval/pass@1"]
    for got, want in zip(
        jax.tree.leaves(from_file["run"].run_state.policy.params),
        jax.tree.leaves(memory["run"].run_state.policy.params),
    ):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_jsonl_fields_template_and_extraction(tmp_path):
    """MATH-style rows: the problem under "problem", the reference extracted from the last
    box of "solution", the prompt built from the template; malformed rows raise with
    file:line unless skipped."""
    rows = [
        {"problem": f"{i}+{i}=?", "solution": f"{i}+{i} is \\boxed{{{2 * i}}}."} for i in range(6)
    ]
    train = _write_jsonl(tmp_path / "train.jsonl", rows)
    test = _write_jsonl(tmp_path / "test.jsonl", rows[:2])
    config = _with(
        tiny("grpo"),
        name="math_jsonl",
        train_file=train,
        test_file=test,
        prompt_template="Q: {question}",
        question_fields="problem",
        answer_fields="solution",
    )
    records = build.task_records(config, "train")
    assert [r["prompt"] for r in records] == [f"Q: {i}+{i}=?" for i in range(6)]
    assert [r["answer"] for r in records] == [str(2 * i) for i in range(6)]
    assert records[0]["solution"] == rows[0]["solution"]

    with open(train, "a") as f:
        f.write('{"problem": "no solution"}\n')
    with pytest.raises(ValueError, match="train.jsonl:7: missing answer field"):
        build.task_records(config, "train")
    skipping = _with(config, skip_malformed=True)
    assert len(build.task_records(skipping, "train")) == 6


def test_tfds_dir_gives_the_same_records_and_batches(tmp_path):
    """With task.tfds_dir the task is written as array_record files and read back by
    random access (bytes fields): the same records, RL prompt batches, SFT batches and
    held-out records as in memory, for both tasks."""
    arithmetic = tiny("grpo")
    arithmetic.unlock()
    arithmetic.batch.response_buckets = (6, 32)  # worked solutions of up to 17 tokens (SFT)
    arithmetic.lock()
    jsonl = _as_jsonl(arithmetic, tmp_path)
    for config in (arithmetic, jsonl):
        prepared = _with(config, tfds_dir=str(tmp_path / f"tfds_{config.task.name}"))
        assert not isinstance(build.task_source(prepared, "train"), (list, tuple))
        for split in ("train", "test"):
            assert build.task_records(prepared, split) == build.task_records(config, split)
        tokenizer = build.make_tokenizer(config)
        assert build.eval_records(prepared, tokenizer) == build.eval_records(config, tokenizer)
        for got, want in zip(_first_batches(prepared), _first_batches(config)):
            assert got["prompt"] == want["prompt"]
            np.testing.assert_array_equal(got["prompt_tokens"], want["prompt_tokens"])
        sft_got = next(make_sft_iterator(prepared, tokenizer, seed=0))
        sft_want = next(make_sft_iterator(config, tokenizer, seed=0))
        np.testing.assert_array_equal(sft_got["response_tokens"], sft_want["response_tokens"])


def test_overlong_prompts_raise_or_are_dropped(tmp_path):
    """A prompt longer than the largest prompt bucket raises when batched ("error"), or
    is left out of training and evaluation ("drop")."""
    rows = [{"question": f"{i}+1", "answer": str(i + 1)} for i in range(8)]
    long_row = {"question": "9" * 40 + "+1", "answer": "1" + "0" * 40}
    train = _write_jsonl(tmp_path / "train.jsonl", rows[:3] + [long_row] + rows[3:])
    test = _write_jsonl(tmp_path / "test.jsonl", [long_row] + rows[:2])
    config = _with(
        tiny("grpo", extra="batch.n_prompts=9"), name="math_jsonl", train_file=train, test_file=test
    )  # the prompt bucket is 16 tokens; one batch holds them all
    with pytest.raises(ValueError, match="record 3: prompt longer than max_prompt_length=16"):
        _first_batches(config, n=1)

    dropping = _with(
        tiny("grpo", extra="batch.n_prompts=4"),
        name="math_jsonl",
        train_file=train,
        test_file=test,
        overlong_prompt="drop",
    )
    batches = _first_batches(dropping, n=4)  # two epochs of the 8 short prompts
    seen = [p for b in batches for p in b["prompt"]]
    assert sorted(seen) == sorted(r["question"] for r in rows for _ in range(2))
    tokenizer = build.make_tokenizer(config)
    assert [r["prompt"] for r in build.eval_records(dropping, tokenizer)] == ["0+1", "1+1"]
    with pytest.raises(ValueError, match="held-out record 0: prompt of"):
        build.eval_records(config, tokenizer)  # "error": raises when the run is built


def test_sft_refuses_records_without_a_worked_solution(tmp_path):
    rows = [{"question": f"{i}+1", "final": str(i + 1)} for i in range(4)]
    train = _write_jsonl(tmp_path / "train.jsonl", rows)
    config = _with(
        tiny("grpo"), name="math_jsonl", train_file=train, test_file=train, answer_fields="final"
    )
    assert [r["answer"] for r in build.task_records(config, "train")] == ["1", "2", "3", "4"]
    with pytest.raises(ValueError, match="worked solution"):
        make_sft_iterator(config, build.make_tokenizer(config), seed=0)


def test_sft_solutions_longer_than_the_buckets_raise_or_are_dropped(tmp_path):
    """The SFT batch's longest bucket bounds the worked solutions when the data is built
    (they used to stop the run at the batch that held one)."""
    rows = [{"question": f"{i}+1", "solution": f"\\boxed{{{i + 1}}}"} for i in range(6)]
    rows.insert(2, {"question": "1+1", "solution": "2" * 40})
    train = _write_jsonl(tmp_path / "train.jsonl", rows)
    config = _with(
        tiny("grpo", extra="sft.batch_size=2"), name="math_jsonl", train_file=train, test_file=train
    )
    tokenizer = build.make_tokenizer(config)
    with pytest.raises(
        ValueError, match=r"record 2: solution longer than .*=16 .*sft.overlong_response"
    ):
        make_sft_iterator(config, tokenizer, seed=0)
    config.unlock()
    config.sft.overlong_response = "drop"
    config.lock()
    batches = [next(it) for it in [make_sft_iterator(config, tokenizer, seed=0)] for _ in range(3)]
    assert sorted(q for b in batches for q in b["prompt"]) == sorted(f"{i}+1" for i in range(6))


def test_empty_held_out_set_is_an_error(tmp_path):
    rows = [{"question": "9" * 40 + "+1", "answer": "1"}]
    test = _write_jsonl(tmp_path / "test.jsonl", rows)
    config = _with(
        tiny("grpo"), name="math_jsonl", train_file=test, test_file=test, overlong_prompt="drop"
    )
    with pytest.raises(ValueError, match="no held-out prompt to evaluate.*all longer than 16"):
        build.eval_records(config, build.make_tokenizer(config))


def test_config_checks_the_task_fields(tmp_path):
    config = tiny("grpo")
    config.unlock()
    config.task.name = "math_jsonl"
    with pytest.raises(ValueError, match="task.train_file is required"):
        base.check(config)
    config.task.train_file = config.task.test_file = str(tmp_path / "missing.jsonl")
    base.check(config)  # the files are opened when the run is built
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        build.task_records(config, "train")
    config.task.prompt_template = "no placeholder"
    with pytest.raises(ValueError, match="prompt_template must contain"):
        base.check(config)
    config.task.prompt_template = "Solve {{question}}"  # doubled: a literal, no placeholder
    with pytest.raises(ValueError, match="prompt_template must contain"):
        base.check(config)
    config.task.prompt_template = "{question} Put the answer in \\boxed{}."  # single braces
    with pytest.raises(ValueError, match="write literal braces twice"):
        base.check(config)
    config.task.prompt_template = "{question} Put the answer in \\boxed{{}}."
    base.check(config)
    config.task.name = "gsm8k"
    with pytest.raises(ValueError, match="task.name"):
        base.check(config)


def test_pretrained_model_and_tokenizer_train_on_a_jsonl_task(tmp_path):
    """docs/quickstart.md's recipe at toy scale: a HuggingFace Qwen3-MoE folder (weights and
    tokenizer.json) trains with RL on a math JSONL task and is evaluated on its test file."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tests.data.test_synthetic import _tiny_bpe

    _tiny_bpe(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]).save(
        str(tmp_path / "tokenizer.json")
    )
    # A base model's settings: EOS is <|endoftext|>, yet under ChatML <|im_end|> ends a turn.
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "<|endoftext|>"}')
    torch.manual_seed(0)
    hf_config = transformers.Qwen3MoeConfig(
        vocab_size=320,
        hidden_size=32,
        intermediate_size=40,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
    )
    transformers.Qwen3MoeForCausalLM(hf_config).save_pretrained(tmp_path)
    rows = [{"problem": f"What is {i}+35?", "solution": f"\\boxed{{{i + 35}}}"} for i in range(12)]
    train = _write_jsonl(tmp_path / "train.jsonl", rows[:8])
    test = _write_jsonl(tmp_path / "test.jsonl", rows[8:])
    config = tiny("grpo", extra="train.num_iterations=1")
    config.unlock()
    config.model.pretrained, config.model.num_layers = str(tmp_path), None
    config.batch.prompt_buckets = (32, 64)
    config.lock()
    config = _with(
        config,
        name="math_jsonl",
        train_file=train,
        test_file=test,
        prompt_template="{question} Put the final answer in \\boxed{{}}.",
    )
    summary = trainer.run_rl(config, str(tmp_path / "run"), num_iterations=1, quiet=True)
    run = summary["run"]
    tokenizer = run.spec.tokenizer
    im_end, endoftext = tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<|endoftext|>")
    assert tokenizer.chat_template == "chatml" and tokenizer.eos_id == endoftext
    assert run.spec.sampling_config.end_ids == (endoftext, im_end)
    assert [r["answer"] for r in run.eval_records] == ["43", "44", "45", "46"]
    assert run.eval_records[0]["prompt"] == "What is 8+35? Put the final answer in \\boxed{}."
    assert summary["eval"]["eval/num_prompts"] == 4 and np.isfinite(summary["metrics"]["loss/loss"])
    assert int(run.run_state.policy.step) == 1 and run.last_batch.tokens.shape[0] == 2 * 4
    # Evaluation stops on the tokenizer's stop ids too: with every token a stop token,
    # each completion is one token long.
    prompts = [r["prompt"] for r in run.eval_records]
    everything = HFTokenizer(
        tokenizer.tokenizer,
        eos_token="<|endoftext|>",
        stop_tokens=sorted(tokenizer.tokenizer.get_vocab()),
    )
    for tok, expected in ((tokenizer, None), (everything, 1)):
        _, lengths = evaluate.complete(
            run.spec.graphdef,
            run.run_state.policy.params,
            prompts,
            tok,
            max_new_tokens=6,
            batch_size=4,
            prompt_buckets=(32, 64),
            rng=jax.random.PRNGKey(0),
        )
        assert expected is None and lengths.max() > 1 or np.all(lengths == expected)


def test_custom_verifier_judges_rewards_and_evaluation(tmp_path):
    """config.reward.verifier replaces the math verifier in the training rewards and in
    the held-out pass@1 (a verifier that accepts everything: accuracy 1 everywhere)."""
    config = tiny(
        "grpo", extra="train.num_iterations=1,reward.verifier='tests.verifiers:always_correct'"
    )
    assert build.reward_spec(config).verifier == build.correctness_spec(config).verifier
    summary = trainer.run_rl(config, str(tmp_path), num_iterations=1, quiet=True)
    assert summary["metrics"]["reward/accuracy"] == 1.0 and summary["eval"]["eval/pass@1"] == 1.0
    with pytest.raises(ValueError, match="cannot import"):
        build.reward_spec(tiny("grpo", extra="reward.verifier='no_such_module:f'"))


def test_code_jsonl_task_trains_and_scores_programs_against_its_tests(tmp_path):
    """task.name=code_jsonl: rows of problems with stdin / stdout tests train and evaluate;
    the rewards run the response's Python block against the record's tests in the
    sandbox, with the config's limits (a hand-written program per record: the right one
    passes, a wrong one fails)."""
    config = tiny(
        "grpo",
        extra="train.num_iterations=1,eval.num_prompts=4,reward.code_timeout_s=2.0,"
        "reward.code_memory_mb=256,reward.code_partial=True",
    )
    files, answers = {}, build.task_records(config, "test")[:2]
    for split in ("train", "test"):
        rows = [
            {"question": r["prompt"], "tests": [{"input": "", "output": r["answer"]}]}
            for r in build.task_records(config, split)
        ]
        files[split] = _write_jsonl(tmp_path / f"{split}.jsonl", rows)
    config = _with(config, name="code_jsonl", train_file=files["train"], test_file=files["test"])
    spec = build.reward_spec(config)
    assert (
        spec.task == "code"
        and spec.code_timeout_s == 2.0
        and spec.code_memory_mb == 256
        and spec.code_partial
    )
    evaluation = build.correctness_spec(config)  # pass@1: all tests, stopping at the first failure
    assert (evaluation.task, evaluation.code_memory_mb, evaluation.code_partial) == (
        "code",
        256,
        False,
    )
    tests = [r["answer"] for r in build.task_records(config, "test")[:2]]  # JSON text
    assert [json.loads(t) for t in tests] == [
        [{"input": "", "output": r["answer"]}] for r in answers
    ]
    programs = [f"```python\nprint({r['answer']!r})\n```" for r in answers]
    wrong = [f"```python\nprint({r['answer']!r} + '0')\n```" for r in answers]
    scores = score_batch(programs + wrong + ["no code"], tests * 2 + tests[:1], [5] * 5, spec)
    assert scores.correct.tolist() == [True, True, False, False, False], scores.status
    assert scores.status[-1] == "no_code"
    summary = trainer.run_rl(config, str(tmp_path / "run"), num_iterations=1, quiet=True)
    assert summary["eval"]["eval/num_prompts"] == 4 and np.isfinite(summary["metrics"]["loss/loss"])
    assert summary["metrics"]["reward/worker_errors"] == 0
    with pytest.raises(ValueError, match="task.train_file is required with task.name='code_jsonl'"):
        _with(config, train_file=None)
    with pytest.raises(ValueError, match="reward.code_timeout_s must be > 0"):
        tiny("grpo", extra="reward.code_timeout_s=0.0")
    # Magistral's recipe runs 20 tests per problem; the others every test.
    magistral = _with(
        tiny("magistral"), name="code_jsonl", train_file=files["train"], test_file=files["test"]
    )
    assert build.reward_spec(magistral).code_max_tests == 20
    assert build.correctness_spec(magistral).code_max_tests is None  # pass@1 on every test
    assert spec.code_max_tests is None
    # Assert tests run in a process of their own unless reward.code_isolation says otherwise.
    assert (spec.code_isolation, evaluation.code_isolation) == ("process", "process")
    one_process = _with(
        tiny("grpo", extra="reward.code_isolation=none"),
        name="code_jsonl",
        train_file=files["train"],
        test_file=files["test"],
    )
    assert (
        build.reward_spec(one_process).code_isolation
        == build.correctness_spec(one_process).code_isolation
        == "none"
    )
    with pytest.raises(ValueError, match="reward.code_isolation must be one of"):
        tiny("grpo", extra="reward.code_isolation=thread")


def _mixed_files(config, directory):
    """The config's arithmetic task as one math and one code problem per record,
    interleaved, in one file per split (Magistral's math and code mixture); the code
    problems' prompts start with "py: "."""
    files = {}
    for split in ("train", "test"):
        rows = []
        for r in build.task_records(config, split):
            rows.append({"question": r["prompt"], "answer": r["answer"]})
            rows.append(
                {"question": "py: " + r["prompt"], "tests": [{"input": "", "output": r["answer"]}]}
            )
        files[split] = _write_jsonl(directory / f"mixed_{split}.jsonl", rows)
    return _with(config, name="mixed_jsonl", train_file=files["train"], test_file=files["test"])


def test_mixed_jsonl_checks_each_sample_with_its_own_task(tmp_path, monkeypatch):
    """task.name=mixed_jsonl: math rows and code rows in one file; every record says its
    task, the trainer and the evaluation pass it to score_batch with its sample (recorded
    on the way; the real function scores), log accuracy per task, and task.tfds_dir
    keeps the task field."""
    from policyopt.rl.reporting import evaluate as evaluate_lib

    seen = []

    def recording(*args, **kwargs):
        seen.append((kwargs.get("prompts"), kwargs["tasks"]))
        return score_batch(*args, **kwargs)

    config = tiny("grpo", extra="train.num_iterations=1,eval.num_prompts=4")
    answers = [r["answer"] for r in build.task_records(config, "test")[:2]]
    mixed = _mixed_files(config, tmp_path)
    records = build.task_records(mixed, "test")[:4]
    assert [r["task"] for r in records] == ["math", "code", "math", "code"]
    assert records[0]["answer"] == answers[0] and json.loads(records[1]["answer"]) == [
        {"input": "", "output": answers[0]}
    ]
    templated = _with(mixed, code_prompt_template="code: {question}")
    assert [r["prompt"][:6] for r in build.task_records(templated, "test")[:2]] == [
        records[0]["prompt"][:6],
        "code: ",
    ]
    with pytest.raises(ValueError, match="task.code_prompt_template must contain"):
        _with(mixed, code_prompt_template="code")
    prepared = _with(mixed, tfds_dir=str(tmp_path / "tfds"))
    assert build.task_records(prepared, "test") == build.task_records(mixed, "test")
    # A boxed answer is right for the math records only, a program for the code ones.
    boxed = [f"\\boxed{{{answers[0]}}}", f"\\boxed{{{answers[0]}}}"]
    program = [f"```python\nprint({answers[0]!r})\n```"] * 2
    tasks = [r["task"] for r in records[:2]] * 2
    scores = score_batch(
        boxed + program,
        [r["answer"] for r in records[:2]] * 2,
        [5] * 4,
        build.reward_spec(mixed),
        tasks=tasks,
    )
    assert scores.correct.tolist() == [True, False, False, True]
    assert scores.status[1] == "no_code" and scores.status[2] == "no_answer"
    monkeypatch.setattr(iteration, "score_batch", recording)
    monkeypatch.setattr(evaluate_lib, "score_batch", recording)
    summary = trainer.run_rl(mixed, str(tmp_path / "run"), num_iterations=1, quiet=True)
    metrics, evaluation = summary["metrics"], summary["eval"]
    training = [(p, t) for p, t in seen if p is not None]  # the evaluation passes no prompts
    assert training and all(
        t == ["code" if q.startswith("py: ") else "math" for q in p] for p, t in training
    )
    assert [t for p, t in seen if p is None][0] == ["math", "code", "math", "code"]  # held-out
    per_task = {k for k in metrics if k.startswith("reward/accuracy_")}  # the batch's tasks
    assert per_task and per_task <= {"reward/accuracy_math", "reward/accuracy_code"}
    assert {"eval/pass@1_math", "eval/pass@1_code"} <= set(evaluation)  # 2 + 2 held-out records
    assert evaluation["eval/pass@1"] == pytest.approx(
        (evaluation["eval/pass@1_math"] + evaluation["eval/pass@1_code"]) / 2
    )
    run = summary["run"]
    with_k = evaluate_lib.evaluate(
        run.spec.graphdef,
        run.run_state.policy.params,
        build.eval_records(mixed, run.spec.tokenizer),
        run.spec.tokenizer,
        max_new_tokens=6,
        prompt_buckets=(16,),
        k=2,
        spec=build.correctness_spec(mixed),
    )
    for name in ("mean@2", "pass@2"):
        assert with_k[f"eval/{name}"] == pytest.approx(
            (with_k[f"eval/{name}_math"] + with_k[f"eval/{name}_code"]) / 2
        ), name
    with pytest.raises(ValueError, match="task 'proof' is not one of"):
        score_batch(["x"], ["1"], [1], build.reward_spec(mixed), tasks=np.array(["proof"]))
    assert score_batch(
        ["x"], ["1"], [1], build.reward_spec(mixed), tasks=np.array(["math"])
    ).status == ["no_answer"]


def test_answer_format_reaches_rewards_and_evaluation():
    """reward.answer_format=answer_line (DAPO-Math-17k): the training reward and the
    held-out pass@1 both read the last "Answer:" line."""
    config = tiny("grpo", extra="reward.answer_format='answer_line'")
    for spec in (build.reward_spec(config), build.correctness_spec(config)):
        assert spec.answer_format == "answer_line"
        scores = score_batch(["Work\nAnswer: 7", "\\boxed{7}"], ["7", "7"], [3, 3], spec)
        assert scores.correct.tolist() == [True, False]
    assert build.correctness_spec(tiny("grpo")).answer_format == "boxed"
    config = tiny("grpo", extra="reward.answer_format='gsm8k'")  # GSM8K's "#### 7"
    for spec in (build.reward_spec(config), build.correctness_spec(config)):
        scores = score_batch(["<think>3+4</think>\n#### 7", "\\boxed{7}"], ["7", "7"], [3, 3], spec)
        assert scores.correct.tolist() == [True, False]
    with pytest.raises(ValueError, match="reward.answer_format"):
        tiny("grpo", extra="reward.answer_format='last_line'")


def test_verifier_health_and_the_scoring_deadline_reach_the_metrics(tmp_path):
    """A verifier that fails on every sample: reward/verifier_errors counts them all. A
    verifier that blocks past a deadline of a
    few milliseconds: the first sample times out (scored 0), the other 7 miss the deadline
    and are left out of the loss."""
    config = tiny(
        "grpo",
        extra="train.num_iterations=1,eval.num_prompts=0,reward.verifier='tests.verifiers:raises'",
    )
    metrics = trainer.run_rl(config, str(tmp_path / "errors"), num_iterations=1, quiet=True)[
        "metrics"
    ]
    assert (
        metrics["reward/verifier_errors"] == 8 and 0 <= metrics["reward/format_failure_rate"] <= 1
    )
    assert metrics["reward/verifier_timeouts"] == 0 and metrics["reward/deadline_missed"] == 0
    config = tiny(
        "grpo",
        extra="train.num_iterations=1,eval.num_prompts=0,"
        "reward.verifier='tests.verifiers:sleeps',reward.verifier_timeout_s=0.2,"
        "reward.deadline_s=0.05",
    )
    summary = trainer.run_rl(config, str(tmp_path / "deadline"), num_iterations=1, quiet=True)
    metrics = summary["metrics"]
    assert metrics["reward/verifier_timeouts"] == 1 and metrics["reward/deadline_missed"] == 7
    rows_in_loss = np.asarray(summary["run"].last_batch.mask).sum(axis=1) > 0
    assert rows_in_loss.sum() == 1  # the timed-out sample was scored (c = 0); the rest missed
    with pytest.raises(ValueError, match="deadline_s must be > 0"):
        tiny("grpo", extra="reward.deadline_s=0.0")


def test_missed_samples_count_in_no_group_statistic(tmp_path):
    """A sample that missed the scoring deadline has a stand-in reward: it is left out of
    its group's mean and std and gets advantage 0. Scored in order: 1 (correct), 0, a
    timeout at the deadline (0, scored), then five misses; so group 0 is [1, 0, 0, missed]
    and group 1 all missed. Magistral's minibatch advantages leave it out too (here they
    equal the group-normalised ones, so the two runs have the same gradient)."""
    from tests import verifiers

    def run_with(extra, name):
        verifiers.CALLS[0] = 0
        config = tiny(
            "grpo",
            extra="train.num_iterations=1,eval.num_prompts=0,"
            "reward.verifier='tests.verifiers:right_wrong_then_blocks',"
            "reward.verifier_timeout_s=10.0,reward.deadline_s=2.0" + extra,
        )
        return config, trainer.run_rl(config, str(tmp_path / name), num_iterations=1, quiet=True)

    config, summary = run_with("", "group")
    metrics, run = summary["metrics"], summary["run"]
    assert metrics["reward/verifier_timeouts"] == 1 and metrics["reward/deadline_missed"] == 5
    assert run.last_round.scored.tolist() == [True] * 3 + [False] * 5
    # Group [1, 0, 0]: mean 1/3, unbiased std sqrt(1/3); counting the missed sample's
    # stand-in reward (0) would give mean 1/4 and a non-zero advantage for it.
    std = np.sqrt(1 / 3) + config.algo.adv_eps
    np.testing.assert_allclose(
        np.asarray(run.last_batch.advantages),
        [(2 / 3) / std, -(1 / 3) / std, -(1 / 3) / std] + [0.0] * 5,
        rtol=1e-5,
    )
    rows_in_loss = np.asarray(run.last_batch.mask).sum(axis=1) > 0
    assert rows_in_loss[3:].sum() == 0
    # [1, 0, 0] centred, then normalised over the minibatch's scored samples of informative
    # groups: mean 0, std sqrt(1/3), the numbers above (with the stand-in: [1.5, -0.5 x 3]).
    _, minibatch = run_with(",algo.adv_scale='minibatch'", "minibatch")
    assert minibatch["metrics"]["reward/deadline_missed"] == 5
    np.testing.assert_allclose(
        minibatch["metrics"]["update/grad_norm"], metrics["update/grad_norm"], rtol=1e-4
    )
