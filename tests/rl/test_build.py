"""The run's construction checks (policyopt.rl.loop.build): what a resumed checkpoint's config
may differ in."""

import os

import pytest

from tests.rl.test_trainer import tiny


def test_resume_check_skips_fields_added_since_the_checkpoint():
    from policyopt.rl.loop import build

    config = tiny("grpo")
    saved = build.config_record(config)
    del saved["reward.code_isolation"]  # a checkpoint of a library that did not have the field
    saved["a.removed_field"] = 1  # nor a field removed since
    build.check_resume_config(saved, config, "runs/x")
    saved["algo.clip_high"] = 0.3
    with pytest.raises(ValueError, match=r"another config \(algo.clip_high: 0.3 -> 0.2\)"):
        build.check_resume_config(saved, config, "runs/x")


def test_resume_check_reads_derived_values_and_paths_as_settings(tmp_path):
    """A checkpoint of an older library recorded the value the library now derives from None
    (``reward.answer_format``: the task's format); a file named through a symlink is the same
    file. Neither is a changed setting; another format or another file is."""
    from policyopt.data.tasks import TASKS
    from policyopt.rl.loop import build

    (tmp_path / "train.jsonl").write_text("")
    os.symlink(tmp_path, tmp_path / "link")
    config = tiny("grpo", extra=f"task.train_file={tmp_path / 'train.jsonl'}")
    assert config.reward.answer_format is None
    saved = build.config_record(config)
    saved["reward.answer_format"] = TASKS[config.task.name].answer_format
    saved["task.train_file"] = str(tmp_path / "link" / "train.jsonl")
    build.check_resume_config(saved, config, "runs/x")
    saved["reward.answer_format"] = "gsm8k"
    with pytest.raises(ValueError, match="reward.answer_format: 'gsm8k' -> "):
        build.check_resume_config(saved, config, "runs/x")
    saved["reward.answer_format"] = None
    saved["task.train_file"] = str(tmp_path / "other.jsonl")
    with pytest.raises(ValueError, match="task.train_file"):
        build.check_resume_config(saved, config, "runs/x")
