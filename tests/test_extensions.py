"""The registries reach the command line: a package outside `policyopt` registers an
objective with a setting of its own and an advantage estimator (docs/design.md's example,
run as written), a verifier and a task, and trains with them from `--config.imports=...`;
bad registrations and bad imports are one-line errors."""

import dataclasses
import json
import os
import re
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from configs import base, grpo, ppo
from policyopt import advantages, losses
from policyopt.config import typed
from policyopt.data import tasks
from policyopt.rewards import RewardSpec, score_batch
from policyopt.rewards import verifiers as verifiers_lib
from policyopt.rl.loop import build
from policyopt.schema import setting

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = (
    "model=tiny_dense,model.num_layers=1,batch.n_prompts=2,batch.group_size=4,"
    "sampling.max_new_tokens=6,task.num_train=64,task.num_test=8,eval.num_prompts=0,"
    "train.loggers=jsonl,train.sample_every=0,optim.lr=0.01,batch.prompt_buckets=(16,),"
    "batch.response_buckets=(6,)"
)
# A verifier and a task of the user's package: the synthetic sums, scored by the parity of the
# response's length (informative groups from a random policy: rewards that differ in a group).
SCORING = """
import os
from policyopt.data import tasks
from policyopt.rewards import verifiers


def odd_length(completion, reference, spec, time_left_s):
    with open(os.environ["PROBE_LOG"], "a") as f:
        f.write(f"odd_length {len(completion) % 2}\\n")
    return float(len(completion) % 2), "correct" if len(completion) % 2 else "incorrect"


verifiers.register_verifier("odd_length", odd_length)
tasks.register_task("sums", tasks.read_arithmetic, verifier="odd_length")
"""
# Wraps the example's registrations to log each call (the objective at trace time, with
# its setting), so the test sees that the run used them.
PROBE = """
import dataclasses, os
from policyopt import advantages, losses

def _log(text):
    with open(os.environ["PROBE_LOG"], "a") as f:
        f.write(text + "\\n")

_objective, _estimator = losses.OBJECTIVES["scaled_pg"], advantages.ESTIMATORS["centred"]

def gate(inputs, settings):
    _log(f"scaled_pg pg_scale={settings.pg_scale}")
    return _objective.gate(inputs, settings)

def estimator(rewards, group_size, **kwargs):
    _log("centred")
    return _estimator.fn(rewards, group_size, **kwargs)

losses.OBJECTIVES["scaled_pg"] = dataclasses.replace(_objective, gate=gate)
advantages.ESTIMATORS["centred"] = dataclasses.replace(_estimator, fn=estimator)
"""


def design_example() -> str:
    """The Python block of docs/design.md's "Extension points"."""
    with open(os.path.join(ROOT, "docs", "design.md"), encoding="utf-8") as f:
        text = f.read()
    section = text[text.index("## Extension points") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_a_users_objective_and_estimator_train_from_the_command_line(tmp_path):
    package = tmp_path / "pkgs" / "mypkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "rl.py").write_text(design_example())
    (package / "probe.py").write_text(PROBE)
    (package / "scoring.py").write_text(SCORING)
    workdir, log = tmp_path / "run", tmp_path / "probe.log"
    env = {
        **os.environ,
        "PYTHONPATH": f"{tmp_path / 'pkgs'}{os.pathsep}{ROOT}",
        "JAX_PLATFORMS": "cpu",
        "TF_CPP_MIN_LOG_LEVEL": "3",
        "PROBE_LOG": str(log),
    }
    command = [
        sys.executable,
        "-m",
        "experiments.train",
        f"--config=configs/grpo.py:{TINY}",
        f"--workdir={workdir}",
        "--config.imports=mypkg.rl,mypkg.scoring,mypkg.probe",
        "--config.task.name=sums",
        "--config.algo.method=scaled_pg",
        "--config.algo.pg_scale=0.5",
        "--config.algo.advantage=centred",
        "--config.train.num_iterations=1",
    ]
    out = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    with open(workdir / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert [r["step"] for r in records] == [1]
    # The gate is pg_scale on every token: the setting reached the objective.
    assert records[0]["loss/gate_mean"] == pytest.approx(0.5)
    assert records[0]["batch/informative_groups"] > 0 and np.isfinite(records[0]["loss/total"])
    calls = log.read_text().splitlines()
    assert "scaled_pg pg_scale=0.5" in calls and "centred" in calls
    # The package's verifier scored every sample of the round (2 prompts x 4), as the metrics say.
    verdicts = [int(c.split()[1]) for c in calls if c.startswith("odd_length ")]
    assert len(verdicts) == 8
    assert records[0]["reward/accuracy"] == pytest.approx(np.mean(verdicts))
    with open(workdir / "config.json") as f:
        saved = json.load(f)
    assert saved["imports"] == ["mypkg.rl", "mypkg.scoring", "mypkg.probe"]
    assert saved["task"]["name"] == "sums"
    assert (saved["algo"]["method"], saved["algo"]["pg_scale"]) == ("scaled_pg", 0.5)
    # The run's config.json rebuilds the config (eval, resume): imports first.
    sys.path.insert(0, str(tmp_path / "pkgs"))
    try:
        config = base.load_run_config(str(workdir / "config.json"))
        assert typed(config).algo.objective.pg_scale == 0.5
    finally:
        sys.path.remove(str(tmp_path / "pkgs"))
        for name in ("scaled_pg",):
            losses.OBJECTIVES.pop(name, None)
        advantages.ESTIMATORS.pop("centred", None)
        tasks.TASKS.pop("sums", None)
        verifiers_lib.VERIFIERS.pop("odd_length", None)
        for module in ("mypkg.probe", "mypkg.scoring", "mypkg.rl", "mypkg"):
            sys.modules.pop(module, None)


def test_an_import_that_fails_is_one_line_naming_it(tmp_path):
    with pytest.raises(ValueError) as error:
        base.check(grpo.get_config("imports=('no_such_module_xyz',)"))
    assert str(error.value) == (
        "config.imports: module 'no_such_module_xyz' does not import: "
        "ModuleNotFoundError: No module named 'no_such_module_xyz'"
    )
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.train",
            "--config=configs/grpo.py",
            f"--workdir={tmp_path / 'run'}",
            "--config.imports=no_such_module_xyz",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2
    assert out.stderr.splitlines()[0] == (
        "error: config.imports: module 'no_such_module_xyz' does not import: "
        "ModuleNotFoundError: No module named 'no_such_module_xyz'"
    )
    assert not (tmp_path / "run").exists()


def _gate(inputs, settings):
    ratio = jnp.exp(inputs.log_ratio)
    return losses.Surrogate(settings.scale * ratio * inputs.advantages, ratio, None, None, None)


@dataclasses.dataclass(frozen=True)
class _Scale:
    scale: float = setting(2.0, "A test's scale.")


def test_registering_a_name_twice_names_both_places():
    with pytest.raises(ValueError) as error:
        losses.register_objective("ppo", _gate)
    message = str(error.value)
    assert message.startswith("objective 'ppo' is already registered at ")
    assert "policyopt/losses.py:" in message and f"{__file__}:" in message
    with pytest.raises(ValueError, match=r"estimator 'gae' is already registered at .*"):
        advantages.register_estimator("gae", lambda *a, **k: None, kind="gae")
    with pytest.raises(ValueError, match=r"task 'arithmetic' is already registered at .*tasks"):
        tasks.register_task("arithmetic", lambda task, split: [])
    with pytest.raises(ValueError, match=r"verifier 'math' is already registered at "):
        verifiers_lib.register_verifier("math", lambda *a: (1.0, "ok"))


def test_a_settings_record_is_refused_at_registration_unless_every_field_has_a_default():
    @dataclasses.dataclass(frozen=True)
    class NoDefault:
        beta: float

    @dataclasses.dataclass
    class NotFrozen:
        beta: float = 0.1

    @dataclasses.dataclass(frozen=True)
    class OtherClip:  # "ppo"'s clip_low with another default: one config field for both
        clip_low: float = 0.1

    for record, message in (
        (NoDefault, r"setting NoDefault\.beta has no default"),
        (NotFrozen, r"settings must be a frozen dataclass type"),
        (OtherClip, r"setting 'clip_low' \(default 0\.1\) is also a setting of objective 'ppo'"),
    ):
        with pytest.raises(ValueError, match=message):
            losses.register_objective("test_refused", _gate, settings=record)
        assert "test_refused" not in losses.OBJECTIVES


def test_an_objectives_setting_is_a_config_field_with_its_check():
    losses.register_objective("test_scaled", _gate, settings=_Scale)
    try:
        config = grpo.get_config("algo.method=test_scaled,algo.scale=3.0")
        assert typed(config).algo.objective == _Scale(3.0)
        assert base.base_config().algo.scale == 2.0  # every config has the field
        assert "algo.scale = 2.0" in base.describe(base.get_config())
        ones = jnp.ones((2, 3))
        loss, _ = losses.policy_loss(ones, ones, ones, ones, method="test_scaled", scale=3.0)
        assert float(loss) == pytest.approx(-3.0)
        with pytest.raises(TypeError, match="unexpected setting scal=3.0"):
            losses.policy_loss(ones, ones, ones, ones, method="test_scaled", scal=3.0)
    finally:
        del losses.OBJECTIVES["test_scaled"]
    with pytest.raises(ValueError, match=r"config\.algo\.method must be one of \('ppo'"):
        grpo.get_config("algo.method=test_scaled")


def test_an_unregistered_estimator_is_a_config_error_and_a_registered_one_is_used():
    with pytest.raises(
        ValueError, match=r"config\.algo\.advantage must be one of \('outcome', 'gae'\)"
    ):
        grpo.get_config("algo.advantage=group_mean")
    calls = []

    def halves(rewards, group_size, *, valid=None, algo):
        calls.append(algo.advantage)
        return 0.5 * jnp.asarray(rewards, jnp.float32)

    advantages.register_estimator("test_halves", halves, kind="outcome")
    advantages.register_estimator(
        "test_values", "policyopt.rl.update.critic:gae_targets", kind="gae"
    )
    try:
        from policyopt.rl.update import methods

        config = typed(grpo.get_config("algo.advantage=test_halves"))
        assert not config.algo.uses_critic
        chosen = methods.choose(config, is_moe=False)
        out = chosen.advantages(None, None, None, None, np.array([1.0, 0.0]), None, False)
        np.testing.assert_allclose(out[0], [0.5, 0.0])
        assert calls == ["test_halves"]
        # A critic estimator: the run trains a critic, and its warm-up is allowed.
        critic = typed(ppo.get_config("algo.advantage=test_values,critic.pretrain_iterations=2"))
        assert critic.algo.uses_critic
        with pytest.raises(ValueError, match="pretrain_iterations > 0 needs a critic"):
            grpo.get_config("algo.advantage=test_halves,critic.pretrain_iterations=2")
        with pytest.raises(ValueError, match="adv_scale='minibatch'"):
            grpo.get_config("algo.advantage=test_halves,algo.adv_scale=minibatch")
    finally:
        del advantages.ESTIMATORS["test_halves"], advantages.ESTIMATORS["test_values"]
    with pytest.raises(ValueError, match="kind must be one of"):
        advantages.register_estimator("test_kind", halves, kind="critic")


def test_a_registered_task_and_verifier_reach_the_run():
    def read(task, split):
        n = 4 if split == "train" else 2
        return [
            {"prompt": f"{i}+1=", "answer": str(i + 1), "solution": f"#### {i + 1}"}
            for i in range(n)
        ]

    def last_word(completion, reference, spec, time_left_s):
        return float(completion.split()[-1:] == [str(reference)]), "ok"

    verifiers_lib.register_verifier("test_last_word", last_word)
    tasks.register_task("test_count", read, verifier="test_last_word", answer_format="gsm8k")
    try:
        config = grpo.get_config("task.name=test_count")
        assert [r["answer"] for r in build.task_records(config, "test")] == ["1", "2"]
        spec = build.reward_spec(config)
        assert (spec.task, spec.answer_format) == ("test_last_word", "gsm8k")  # the task's
        assert build.reward_spec(grpo.get_config("reward.answer_format=boxed")).answer_format == (
            "boxed"
        )
        rewards, correct, _ = score_batch(["so 2", "so 3"], ["2", "2"], [2, 2], spec)
        assert list(correct) == [True, False]
    finally:
        del tasks.TASKS["test_count"], verifiers_lib.VERIFIERS["test_last_word"]
    with pytest.raises(ValueError, match=r"config\.task\.name must be one of \('arithmetic'"):
        grpo.get_config("task.name=test_count")
    tasks.register_task("test_unscored", read, verifier="no_such_verifier")
    try:
        with pytest.raises(
            ValueError, match="its verifier 'no_such_verifier' .* is not registered"
        ):
            grpo.get_config("task.name=test_unscored")
    finally:
        del tasks.TASKS["test_unscored"]
    with pytest.raises(ValueError, match="RewardSpec.task must be one of"):
        RewardSpec(task="no_such_verifier")
