"""Own data without a checkpoint: the shipped GSM8K-style file and its generator, a BPE
tokenizer trained on a task's files (`experiments.tokenizer`) and loaded by
``model.tokenizer`` with any preset, SFT then RL on it; the format reward only where a
recipe asks for a format."""

import json
import os
import subprocess
import sys

import jax
import pytest
from tokenizers import Tokenizer, models

from configs import grpo, quickstart
from policyopt.data import load_tokenizer, read_math_jsonl
from policyopt.data.tokenizer import train_bpe
from policyopt.data.word_problems import jsonl_text, word_problem_splits
from policyopt.rewards import RewardSpec, score_batch
from policyopt.rewards.math import verify_math
from policyopt.rl.loop import build, trainer
from policyopt.rl.sft import make_sft_iterator, run_sft
from tests.flags import ROOT, subprocess_env

SHIPPED = os.path.join(ROOT, "data", "gsm8k_tiny")


def test_no_format_failures_without_a_format_gate():
    # GSM8K rows with correct `#### 16` answers: the format check (Magistral's <think>) is
    # not the recipe's, so nothing fails it (it reported 1.0 before).
    spec = RewardSpec(format_reward=False, answer_format="gsm8k")
    completions = ["He has 8 * 2 = <<8*2=16>>16 apples.\n#### 16", "#### 15"]
    scores = score_batch(completions, ["16", "16"], [12, 3], spec)
    assert scores.correct.tolist() == [True, False]
    assert scores.format_ok.tolist() == [True, True]
    assert scores.metrics["format_failure_rate"] == 0.0
    gated = score_batch(completions, ["16", "16"], [12, 3], RewardSpec(answer_format="gsm8k"))
    assert gated.metrics["format_failure_rate"] == 1.0 and gated.rewards.tolist() == [0.0, 0.0]


def test_shipped_file_is_the_generators_output_and_its_solutions_are_right():
    splits = word_problem_splits()
    for split, problems in splits.items():
        with open(os.path.join(SHIPPED, f"{split}.jsonl"), encoding="utf-8") as f:
            assert f.read() == jsonl_text(problems), "rerun python -m experiments.word_problems"
    train = {p.question for p in splits["train"]}
    assert len(train) == 3000 and not train & {p.question for p in splits["test"]}
    records, report = read_math_jsonl(os.path.join(SHIPPED, "train.jsonl"))
    assert report.loaded == 3000 and not report.skipped
    for record in records:
        # Every calculator annotation holds, and the worked solution verifies as correct.
        for note in record["solution"].split("<<")[1:]:
            expression, value = note.split(">>")[0].split("=")
            assert eval(expression.replace("/", "//")) == int(value), record  # noqa: S307
        assert verify_math(record["solution"], record["answer"], answer_format="gsm8k").score == 1


def _texts(records):
    return [text for r in records for text in (r["prompt"], r["solution"])]


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory):
    """The quickstart's tokenizer trained on the shipped training file, as the command does."""
    records, _ = read_math_jsonl(os.path.join(SHIPPED, "train.jsonl"))
    path = str(tmp_path_factory.mktemp("tokenizer") / "tokenizer.json")
    train_bpe(_texts(records), vocab_size=512).tokenizer.save(path)
    return path


def test_bpe_round_trips_splits_digits_and_speaks_chatml(tokenizer_path):
    tokenizer = load_tokenizer(tokenizer_path)
    assert tokenizer.chat_template == "chatml" and tokenizer.vocab_size <= 512
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_id == tokenizer.eos_id
    for text in (
        "Ana has 12 + 30 = <<12+30=42>>42 apples now.\n#### 42",
        "Ünïcode, 日本語 and tabs\tnever seen in training: 9876543210",
        "<think>reasoning</think> \\boxed{7}",
    ):
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text
    # One token per digit: a number's tokens spell it.
    pieces = [tokenizer.decode([i]) for i in tokenizer.encode(" 4096")]
    assert pieces == [" ", "4", "0", "9", "6"]
    # The reasoning markers are one token each, kept when decoding.
    assert len(tokenizer.encode("<think>")) == 1
    # The chat template around a prompt; a response ends with EOS.
    ids = tokenizer.encode_prompt("How many?")
    assert tokenizer.decode(ids, skip_special=False) == (
        "<|im_start|>user\nHow many?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokenizer.encode_response("#### 4")[-1] == tokenizer.eos_id
    # A folder holding it loads the same vocabulary.
    folder = os.path.dirname(tokenizer_path)
    assert load_tokenizer(folder).encode("Ben has 7 cards.") == tokenizer.encode("Ben has 7 cards.")


def test_a_tokenizer_that_does_not_load_is_one_line_naming_the_file(tmp_path):
    broken = tmp_path / "broken.json"
    broken.write_text('{"model": {"type": "BPE", "vocab": 3}}')
    not_json = tmp_path / "tokenizer.txt"
    not_json.write_bytes(b"\xff\xfe not text")
    plain = tmp_path / "plain.json"  # parses, but no ChatML tokens and no EOS named
    Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a")).save(str(plain))
    for path, expected in (
        (broken, "not a tokenizer.json the tokenizers library reads"),
        (not_json, "not a tokenizer file"),
        (plain, "needs eos_token"),
        (tmp_path / "missing.json", "no such tokenizer file"),
    ):
        with pytest.raises((ValueError, FileNotFoundError)) as error:
            grpo.get_config(f"model.tokenizer='{path}'")
        message = str(error.value)
        assert message.startswith("config.model.tokenizer: ") and str(path) in message
        assert expected in message and "\n" not in message, message
    with pytest.raises(ValueError, match="model.tokenizer and config.model.pretrained"):
        grpo.get_config(f"model.tokenizer='{broken}',model.pretrained='{tmp_path}'")


def _command(*args, cwd=ROOT):
    return subprocess.run(
        [sys.executable, "-m", "experiments.tokenizer", *args],
        env=subprocess_env(PYTHONPATH=ROOT),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_tokenizer_command_trains_keeps_and_refuses(tmp_path, tokenizer_path):
    out = str(tmp_path / "qs" / "tokenizer.json")
    config = ["--config", "configs/quickstart.py", "--out", out, "--vocab_size", "512"]
    first = _command(*config)
    assert first.returncode == 0, first.stderr[-2000:]
    assert f"wrote {out}" in first.stdout and "longest" in first.stdout
    with open(out) as f, open(tokenizer_path) as g:  # the same as train_bpe on the rows
        assert json.load(f)["model"] == json.load(g)["model"]
    again = _command(*config)
    assert again.returncode == 0 and f"kept {out}" in again.stdout
    other = _command(*config[:-1], "300")  # another vocabulary: refused, the file kept
    assert other.returncode == 2 and "--overwrite" in other.stderr
    # A JSONL without the named fields: one line naming the file and line; nothing written.
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"q": "1+1?", "a": "#### 2"}) + "\n")
    missing = str(tmp_path / "never.json")
    bad = _command(
        "--config",
        f"configs/quickstart.py:task.train_file='{rows}',task.test_file='{rows}'",
        "--out",
        missing,
    )
    assert bad.returncode == 1 and not os.path.exists(missing)
    (line,) = [line for line in bad.stderr.splitlines() if line.startswith("error:")]
    assert f"{rows}:1: missing question field" in line


def test_quickstart_buckets_hold_the_shipped_file(tokenizer_path):
    config = quickstart.get_config(f"model.tokenizer='{tokenizer_path}'")
    tokenizer = build.make_tokenizer(config)
    assert len(build.eval_records(config, tokenizer)) == 150  # every held-out prompt fits
    make_sft_iterator(config, tokenizer, seed=0)  # every worked solution fits, else raises
    trainer.make_prompt_iterator(config, build.task_source(config, "train"), seed=0)


def test_sft_then_rl_on_own_data_with_any_preset(tokenizer_path, tmp_path):
    # The smallest run of the path: a one-layer MoE preset takes the tokenizer's vocabulary.
    variant = (
        f"model.tokenizer='{tokenizer_path}',model=tiny_moe,model.num_layers=1,sft.steps=3,"
        "sft.batch_size=8,batch.n_prompts=2,batch.group_size=4,train.num_iterations=1,"
        "eval.num_prompts=4,eval.batch_size=4,train.loggers=jsonl"
    )
    config = quickstart.get_config(variant)
    sft = run_sft(config, str(tmp_path / "sft"), quiet=True)
    assert sft["step"] == 3 and 0 <= sft["eval"]["eval/pass@1"] <= 1
    rl_config = quickstart.get_config(f"{variant},init_checkpoint='{sft['checkpoint_dir']}'")
    summary = trainer.run_rl(rl_config, str(tmp_path / "grpo"), quiet=True)
    run = summary["run"]
    assert run.spec.graphdef is not None and summary["iteration"] == 1
    vocab = run.spec.tokenizer.vocab_size
    embedding = [x for x in jax.tree.leaves(run.run_state.policy.params) if x.shape[:1] == (vocab,)]
    assert embedding  # the preset's vocabulary is the tokenizer's
    assert summary["metrics"]["reward/format_failure_rate"] == 0.0
    assert 0 <= summary["eval"]["eval/pass@1"] <= 1
