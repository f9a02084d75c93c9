"""Own data without a checkpoint: a BPE tokenizer trained on a task's files, loaded by
``model.tokenizer``; the format reward only where a recipe asks for a format."""

from policyopt.rewards import RewardSpec, score_batch


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
