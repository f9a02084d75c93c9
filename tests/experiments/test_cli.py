"""The command line and what a run tells its user: every config value checked on the final
config before anything is written, one-line errors, --print_config / --dry_run / --help,
warnings about settings that cannot act, the banner, ETA, sampled completions, a
checkpoint on SIGTERM, checkpoint shape errors, TensorBoard names and plots."""

import importlib
import io
import json
import os
import re
import select
import signal
import struct
import subprocess
import sys

import jax
import numpy as np
import pytest

from configs import base
from policyopt import losses
from policyopt.checkpoint import Checkpointer
from policyopt.metrics import MetricsWriter, Progress, read_jsonl
from policyopt.rl.loop import build, trainer
from policyopt.rl.reporting import plots, report
from policyopt.rl.update.learner import split_params
from tests.flags import ROOT

TINY = (
    "model=tiny_dense,model.num_layers=1,batch.n_prompts=2,batch.group_size=4,"
    "batch.n_minibatches=1,sampling.max_new_tokens=6,task.num_train=64,task.num_test=8,"
    "eval.num_prompts=8,eval.batch_size=8,train.eval_every=0,train.checkpoint_every=1,"
    "train.loggers=jsonl,optim.lr=0.01,batch.prompt_buckets=(16,),"
    "batch.response_buckets=(6,)"
)


def load(name, arg=None):
    return importlib.import_module(f"configs.{name}").get_config(arg)


def checked(name, **fields):
    """A recipe with fields changed after `finalize` (as `--config.X` overrides are), then
    `check`ed: what the command line does with the final config."""
    config = load(name)
    for path, value in fields.items():
        base.set_field(config, path.replace("__", "."), value)
    base.check(config)
    return config


# Each fault of the list, by the field the error must name.
BAD_VALUES = [
    (
        "algo__method",
        "grpo",
        r"config\.algo\.method must be one of \('ppo', 'gspo', 'gspo_token', 'sapo'\)",
    ),
    ("algo__aggregation", "mean", r"config\.algo\.aggregation must be one of"),
    ("batch__n_minibatches", 3, r"config\.batch\.n_minibatches \(3\) must divide n_prompts"),
    ("train__checkpoint_every", 0, r"config\.train\.checkpoint_every must be an int >= 1, got 0"),
    ("sampling__temperature", 0.0, r"config\.sampling\.temperature must be > 0"),
    (
        "batch__group_size",
        1,
        r"config\.batch\.group_size must be >= 2 with group-relative advantages",
    ),
    ("train__num_iterations", -5, r"config\.train\.num_iterations must be an int >= 1, got -5"),
    ("optim__lr", 0.0, r"config\.optim\.lr must be a finite number > 0\.0, got 0\.0"),
    ("optim__lr", -0.001, r"config\.optim\.lr must be a finite number > 0\.0, got -0\.001"),
    ("optim__lr", float("inf"), r"config\.optim\.lr must be a finite number > 0\.0, got inf"),
    ("optim__lr", float("nan"), r"config\.optim\.lr must be a finite number > 0\.0, got nan"),
    # Adam's eps below float32's smallest normal number is 0 on the device: every update
    # divides 0 by 0 and is skipped, and the run ends "successfully".
    ("optim__eps", 0.0, r"config\.optim\.eps must be a finite number >= 1\.17549\d*e-38"),
    ("optim__eps", 1e-45, r"config\.optim\.eps must be a finite number >= 1\.17549\d*e-38"),
    ("model__preset", "qwen3_9b", r"config\.model\.preset must be one of \(.*'qwen3_8b'"),
    ("reward__num_workers", -1, r"config\.reward\.num_workers must be an int >= 0, got -1"),
    (
        "batch__prompt_buckets",
        (),
        r"config\.batch\.prompt_buckets must be a non-empty tuple of ints >= 1, got \(\)",
    ),
    (
        "batch__response_buckets",
        (8, 0),
        r"config\.batch\.response_buckets must be a non-empty tuple of ints >= 1, got \(8, 0\)",
    ),
    (
        "reward__verifier",
        "my_rewards.score",
        r"config\.reward\.verifier must be 'package\.module:function', got 'my_rewards\.score'",
    ),
    ("optim__warmup_steps", -5, r"config\.optim\.warmup_steps must be an int >= 0, got -5"),
    ("critic__lr", -1e-5, r"config\.critic\.lr must be a finite number > 0"),
    ("sft__lr", 0.0, r"config\.sft\.lr must be a finite number > 0"),
    ("algo__tau_neg", 0.0, r"config\.algo\.tau_neg must be a finite number > 0"),
    ("eval__temperature", -1.0, r"config\.eval\.temperature must be a finite number > 0"),
    ("algo__clip_low", 1.5, r"config\.algo\.clip_low must be a finite number >= 0\.0 and <= 1\.0"),
    ("algo__dual_clip", 0.5, r"config\.algo\.dual_clip must be > 1"),
    ("sampling__top_p", 0.0, r"config\.sampling\.top_p must be a finite number > 0\.0 and <= 1\.0"),
    ("optim__b2", 1.5, r"config\.optim\.b2 must be a finite number >= 0\.0 and <= 1\.0"),
    ("train__sample_every", -1, r"config\.train\.sample_every must be an int >= 0"),
]


@pytest.mark.parametrize("field,value,message", BAD_VALUES)
def test_every_bad_value_is_named_on_the_final_config(field, value, message):
    with pytest.raises(ValueError, match=message):
        checked("grpo", **{field: value})


def test_group_size_one_is_allowed_without_group_statistics():
    # A critic's GAE advantages need no group: G = 1 is a valid PPO setting.
    config = checked("ppo", batch__group_size=1)
    assert config.batch.group_size == 1


def test_method_choices_come_from_the_objectives_registry():
    name = "test_cli_objective"
    losses.register_objective(name)(losses.OBJECTIVES["ppo"])
    try:
        assert checked("grpo", algo__method=name).algo.method == name
    finally:
        del losses.OBJECTIVES[name]
    with pytest.raises(ValueError, match="algo.method"):
        checked("grpo", algo__method=name)


def test_print_config_comments_every_commented_field():
    text = base.describe(load("sapo"))
    lines = text.splitlines()
    for field in (
        "algo.tau_neg",
        "optim.warmup_steps",
        "train.sample_every",
        "batch.n_minibatches",
    ):
        at = next(i for i, line in enumerate(lines) if line.startswith(f"{field} = "))
        assert lines[at - 1].startswith("# "), field
    assert "algo.tau_neg = 1.05" in lines and "batch.n_minibatches = 4" in lines
    # Every field of the config is listed.
    assert len([line for line in lines if " = " in line and not line.startswith("#")]) == len(
        build.config_record(load("sapo"))
    )


# Runs `python -m <module> <args>` commands, each in a fresh process forked from one server
# that has imported the command line's modules (JAX, the library) once: each command is a
# new process (its own flags, backend, exit status, stdout and stderr), without paying the
# imports again (~3 CPU s each). The server never starts a JAX backend (no fork after one).
_SERVER = r"""
import json, os, runpy, sys, traceback
import experiments.cli  # noqa: F401  the imports every command makes
for line in sys.stdin:
    module, args, out_path, err_path = json.loads(line)
    pid = os.fork()
    if pid == 0:
        for fd, path in ((1, out_path), (2, err_path)):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        sys.argv = [module, *args]
        code = 0
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as exit_:  # as the interpreter ends on one
            code = exit_.code
            if code is None:
                code = 0
            elif not isinstance(code, int):
                print(code, file=sys.stderr)
                code = 1
        except BaseException:  # an uncaught error: the traceback, status 1
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    print(os.waitstatus_to_exitcode(status), flush=True)
"""


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    """``cli(module, *args)``: the command's ``subprocess.CompletedProcess``, run as
    ``python -m module args`` would be, in a process forked from the module's server."""
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "3"}
    server = subprocess.Popen(
        [sys.executable, "-c", _SERVER],
        cwd=ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    logs = tmp_path_factory.mktemp("cli")
    calls = []

    def run(module, *args, timeout=120):
        calls.append(None)
        out, err = logs / f"{len(calls)}.out", logs / f"{len(calls)}.err"
        server.stdin.write(json.dumps([module, list(args), str(out), str(err)]) + "\n")
        server.stdin.flush()
        ready, _, _ = select.select([server.stdout], [], [], timeout)
        assert ready, f"{module} {args} did not finish in {timeout} s"
        status = server.stdout.readline()
        assert status, "the command server died"
        return subprocess.CompletedProcess(
            [sys.executable, "-m", module, *args],
            int(status),
            out.read_text(),
            err.read_text(),
        )

    yield run
    server.stdin.close()
    server.wait(timeout=60)


def test_command_line_errors_are_one_line_and_write_nothing(tmp_path, cli):
    workdir = tmp_path / "run"
    out = cli(
        "experiments.train",
        "--config",
        "configs/sapo.py",
        f"--workdir={workdir}",
        "--config.train.checkpoint_every=0",
    )
    assert out.returncode == 2, out.stderr
    first = out.stderr.splitlines()[0]
    assert first == "error: config.train.checkpoint_every must be an int >= 1, got 0"
    assert len(out.stderr.splitlines()) <= 2 and "Traceback" not in out.stderr
    assert not workdir.exists()
    out = cli(
        "experiments.train",
        "--config",
        "configs/sapo.py",
        f"--workdir={workdir}",
        "--config.algo.tau_ng=1.1",
    )
    assert out.returncode == 2
    assert out.stderr.splitlines()[0] == (
        "error: unknown config field 'algo.tau_ng' (did you mean 'algo.tau_neg'?)"
    )
    # A field given twice in the recipe string (the later value won silently).
    out = cli(
        "experiments.train",
        "--config",
        "configs/sapo.py:optim.lr=1e-3,algo.tau_neg=1.1,optim.lr=1e-2",
        f"--workdir={workdir}",
    )
    assert out.returncode == 2 and out.stderr.splitlines()[0] == (
        "error: config variant 'optim.lr=1e-3,algo.tau_neg=1.1,optim.lr=1e-2': optim.lr is "
        "given twice (name each field once)"
    )
    # A bad value in the recipe string: the check's line (this printed the usage, then
    # "error: flag --config=...: Error whilst parsing config file:" and "Traceback ...").
    out = cli(
        "experiments.train",
        "--config",
        "configs/sapo.py:batch.n_prompts=2",
        f"--workdir={workdir}",
    )
    assert out.returncode == 2 and out.stderr.splitlines()[0] == (
        "error: config.batch.n_minibatches (4) must divide n_prompts (2): minibatches hold "
        "whole groups"
    )
    assert "Traceback" not in out.stderr and "usage:" not in out.stderr
    # A section that does not exist (this printed "error: optimizer").
    out = cli(
        "experiments.train",
        "--config",
        "configs/sapo.py",
        f"--workdir={workdir}",
        "--config.optimizer.lr=1e-3",
    )
    assert out.returncode == 2 and out.stderr.splitlines()[0] == (
        "error: unknown config field 'optimizer.lr': no section 'optimizer' (did you mean 'optim'?)"
    )
    out = cli(
        "experiments.train",
        "--config",
        "configs/nope.py:model=tiny_dense",
        f"--workdir={workdir}",
        "--config.algo.tau_neg=1.1",
    )
    assert out.returncode == 2
    assert out.stderr.startswith("error: config file not found: 'configs/nope.py'")
    out = cli(
        "experiments.train",
        "--config",
        "configs/sapo.py",
        f"--workdir={workdir}",
        "--config.optim.lr=-0.001",
        "--verbose",
    )
    assert out.returncode != 0 and "Traceback" in out.stderr  # --verbose keeps it
    assert not workdir.exists()


def test_a_jsonl_without_the_named_fields_is_one_line_before_the_workdir(tmp_path, cli):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"q": "1+1?", "a": "#### 2"}) + "\n")
    variant = f"task.name=math_jsonl,task.train_file='{rows}',task.test_file='{rows}'"
    for module in ("experiments.sft", "experiments.train"):
        workdir = tmp_path / module
        out = cli(module, "--config", f"configs/grpo.py:{variant}", f"--workdir={workdir}")
        assert out.returncode == 1, out.stderr
        assert out.stderr.splitlines()[0] == (
            f"error: {rows}:1: missing question field: none of ['question', 'problem', "
            "'prompt'] present (fields: ['a', 'q'])"
        )
        assert "Traceback" not in out.stderr and not workdir.exists()


def test_list_outputs_fit_100_columns_with_dated_budgets(cli):
    ordinal = re.compile(r"(?i)\b(?:[a-z]+-)?(?:first|second|third|[a-z]+th)\s+session\b")
    listed = {}
    for module in ("experiments.reproduce", "experiments.ablate"):
        out = cli(module, "--list")
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert len(lines) > 30 and [line for line in lines if len(line) > 100] == [], module
        assert not ordinal.search(out.stdout)
        listed[module] = out.stdout
    # Each claim's budget (its continuation lines joined): a date, or not yet measured.
    text = listed["experiments.reproduce"]
    budgets = re.findall(r"\n    budget on 2 cores: (.*?)\n(?:\n|$)", text, re.S)
    assert len(budgets) == text.count("budget on 2 cores:") >= 10
    for budget in budgets:
        assert budget == "to be measured" or re.search(r"\b2026-\d\d-\d\d\b", budget), budget


def test_no_flags_prints_the_usage(cli):
    # This ended in "TypeError: 'NoneType' object is not subscriptable".
    for module in ("experiments.train", "experiments.sft"):
        out = cli(module)
        assert out.returncode == 2, out.stderr
        lines = out.stderr.splitlines()
        assert lines[0] == "usage:" and lines[1].startswith(f"    python -m {module} --config")
        assert lines[-2] == f"(python -m {module} --helpshort lists every flag)"
        assert lines[-1] == "error: --config is required (a recipe file, e.g. configs/sapo.py)"
        assert "Traceback" not in out.stderr and out.stdout == ""
    out = cli("experiments.eval")
    assert out.returncode == 2 and out.stderr.splitlines()[0] == "usage:"
    assert out.stderr.splitlines()[-1] == "error: --workdir is required (the run directory)"
    out = cli("experiments.train", "--config", "configs/sapo.py")
    assert out.returncode == 2 and out.stderr.splitlines()[0] == "usage:"
    assert out.stderr.splitlines()[-1] == "error: --workdir is required (the run directory)"


def test_help_print_config_and_dry_run_exit_zero(tmp_path, cli):
    out = cli("experiments.train", "--help")
    assert out.returncode == 0 and "--print_config" in out.stdout and "--dry_run" in out.stdout
    out = cli(
        "experiments.train",
        "--config",
        "configs/sapo.py",
        "--config.algo.tau_neg=1.1",
        "--print_config",
    )
    assert out.returncode == 0 and "\nalgo.tau_neg = 1.1\n" in out.stdout
    workdir = tmp_path / "run"
    out = cli(
        "experiments.train",
        "--config",
        f"configs/sapo.py:{TINY}",
        f"--workdir={workdir}",
        "--dry_run",
    )
    assert out.returncode == 0, out.stderr
    assert "random initialisation (seed 0)" in out.stdout and "44,128)" in out.stdout
    assert "warning: batch.epochs=1 and batch.n_minibatches=1" in out.stdout  # TINY: one update
    assert not workdir.exists()


def test_ratio_warning_and_the_sapo_recipe_default():
    one_update = load("sapo", "batch.n_minibatches=1")
    assert any(
        "ratio is 1 at every token" in w and "tau_pos / tau_neg" in w
        for w in report.advisories(one_update)
    )
    assert any("clip_low / clip_high" in w for w in report.advisories(load("grpo")))
    sapo = load("sapo")
    assert sapo.batch.n_minibatches > 1 and report.advisories(sapo) == []
    assert report.advisories(load("grpo", "batch.epochs=2")) == []


def test_readme_sapo_example_changes_the_update(tmp_path):
    """`--config.algo.tau_neg=1.1` on configs/sapo.py (its minibatches, 2 here) moves the
    parameters away from the default's after one iteration; a reward with informative
    groups from a random policy (`tests.verifiers.odd_length`) gives the updates a signal."""
    params = {}
    for tau in (1.05, 1.1):
        variant = (
            TINY.replace("batch.n_minibatches=1", "batch.n_minibatches=2")
            + f",algo.tau_neg={tau},reward.verifier='tests.verifiers:odd_length',"
            "eval.num_prompts=0,train.num_iterations=1,train.sample_every=0"
        )
        summary = trainer.run_rl(load("sapo", variant), str(tmp_path / str(tau)), quiet=True)
        assert summary["metrics"]["batch/informative_groups"] > 0
        params[tau] = [
            np.asarray(x) for x in jax.tree.leaves(summary["run"].run_state.policy.params)
        ]
    assert any(not np.array_equal(a, b) for a, b in zip(params[1.05], params[1.1]))


def test_informative_fraction_by_hand():
    rewards = np.array([0, 0, 0, 0, 1, 0, 1, 1, 1, 1, 1, 1], np.float32)  # 3 groups of 4
    assert report.informative_fraction(rewards, 4) == pytest.approx(1 / 3)
    scored = np.array([1, 1, 1, 1, 1, 0, 0, 0, 1, 1, 1, 1], bool)  # group 2: one scored sample
    assert report.informative_fraction(rewards, 4, scored) == 0.0


def test_eta_leaves_out_the_compiling_steps():
    now = [0.0]
    stream = io.StringIO()
    progress = Progress(10, stream=stream, clock=lambda: now[0])
    now[0] = 100.0  # step 1: compilation
    assert progress.update(1, {}).endswith("eta after compile")
    for step in (2, 3):
        now[0] += 2.0  # steady: 2 s per step
        line = progress.update(step, {})
    assert line.endswith("| 104s eta 14s")  # 7 steps left x 2 s, not x 104 / 3 s
    # Logging every 5 steps: the end of step 1 (compiled) marks the steady state.
    now[0] = 0.0
    progress = Progress(11, stream=stream, clock=lambda: now[0])
    now[0] = 100.0
    progress.start_steady(1)
    now[0] += 4 * 2.0
    assert progress.update(5, {}).endswith("| 108s eta 12s")  # 6 left x 2 s


def _events(directory):
    """Every Event of the TensorBoard files under ``directory`` (TFRecord framing: length,
    its crc, the record, its crc)."""
    from tensorboardX.proto.event_pb2 import Event

    events = []
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name), "rb") as f:
            data = f.read()
        at = 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at : at + 8])
            events.append(Event.FromString(data[at + 12 : at + 12 + length]))
            at += 12 + length + 4
    return events


def test_tensorboard_keeps_metric_names_and_writes_sample_text(tmp_path):
    writer = MetricsWriter(str(tmp_path), tensorboard=True)
    writer.write(3, {"eval/pass@1": 0.25, "reward/mean": 0.5})
    writer.write_text(
        3, "samples/train", [{"step": 3, "prompt": "1+1=", "completion": "a|b", "reward": 1.0}]
    )
    writer.close()
    values = {
        v.tag: v
        for e in _events(str(tmp_path / "tensorboard"))
        if e.HasField("summary")
        for v in e.summary.value
    }
    assert values["eval/pass@1"].simple_value == 0.25 and "eval/pass_1" not in values
    assert values["reward/mean"].simple_value == 0.5
    text = values["samples/train/text_summary"].tensor.string_val[0].decode()
    assert "| prompt | completion | reward |" in text and "a\\|b" in text


def _run(path, key, values, filename="metrics.jsonl"):
    writer = MetricsWriter(str(path), filename=filename, tensorboard=False)
    for step, value in enumerate(values, 1):
        writer.write(step, {key: value})
    writer.close()


def test_plots_refuse_missing_runs_and_draw_sft_runs(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    _run(tmp_path / "rl", "reward/mean", [0.1, 0.2])
    _run(tmp_path / "sft", "sft/nll", [2.0, 1.0])
    _run(tmp_path / "sft", "eval/pass@1", [0.5])  # SFT logs its evaluation in metrics.jsonl
    with pytest.raises(FileNotFoundError, match="nope"):
        plots.plot_runs([str(tmp_path / "rl"), str(tmp_path / "nope")], str(tmp_path / "a.png"))
    drawn = {}
    savefig = plt.Figure.savefig

    def record(fig, path, **kwargs):
        for ax in fig.axes:
            if ax.get_title():
                drawn[ax.get_title()] = {
                    line.get_label(): list(line.get_ydata()) for line in ax.get_lines()
                }
        return savefig(fig, path, **kwargs)

    monkeypatch.setattr(plt.Figure, "savefig", record)
    plots.plot_runs([str(tmp_path / "sft")], str(tmp_path / "sft.png"))
    assert drawn == {
        "SFT loss (NLL)": {"sft": [2.0, 1.0]},
        "held-out pass@1 (greedy)": {"sft": [0.5]},
    }


def test_equal_curves_get_distinct_styles():
    styles = plots.line_styles(4)
    assert len({(s["linestyle"], s["marker"]) for s in styles}) == 4
    grouped = plots.line_styles(3, ["a", "a", "b"])
    assert grouped[0]["color"] == grouped[1]["color"] != grouped[2]["color"]
    style = lambda s: (s["linestyle"], s["marker"])
    assert style(grouped[0]) != style(grouped[1])


def test_checkpoint_of_another_model_names_the_parameter_shapes_and_presets(tmp_path):
    configs = {
        name: load("sapo", f"model={name},model.num_layers=1")
        for name in ("tiny_moe", "tiny_dense")
    }
    params = {}
    for name, config in configs.items():
        model = build.make_model(config, 64)
        params[name] = split_params(model)[1]
    with Checkpointer(str(tmp_path / "ck")) as checkpointer:
        checkpointer.save(
            5,
            {"train": {"params": params["tiny_moe"]}},
            {"iteration": 5, "config": build.config_record(configs["tiny_moe"])},
        )
        # The same model passes.
        build.check_checkpoint_shapes(
            checkpointer, {"train": {"params": params["tiny_moe"]}}, configs["tiny_moe"]
        )
        with pytest.raises(ValueError) as error:
            build.check_checkpoint_shapes(
                checkpointer,
                {"train": {"params": params["tiny_dense"]}},
                configs["tiny_dense"],
                field="config.init_checkpoint",
            )
    lines = str(error.value).splitlines()
    assert len(lines) <= 6
    assert lines[0] == (
        f"config.init_checkpoint: {tmp_path / 'ck'} (step 5) holds another model than this run's"
    )
    assert "layers.0.mlp.down_proj: checkpoint (4, 64, 64), this run (128, 64)" in lines[1]
    assert lines[-1] == (
        "  saved with model.preset='tiny_moe', model.num_layers=1; this run: "
        "model.preset='tiny_dense', model.num_layers=1"
    )


def test_run_logs_samples_banner_and_stops_with_a_checkpoint_on_sigterm(
    tmp_path, capsys, monkeypatch
):
    workdir = str(tmp_path / "run")
    config = load(
        "sapo",
        TINY + ",train.num_iterations=3,train.sample_every=10,"
        "train.sample_prompts=1,train.checkpoint_every=100,train.eval_every=1,"
        "train.zero_variance_patience=1",
    )
    iterate = trainer.RLRun.step

    def iterate_then_sigterm(run):
        metrics = iterate(run)
        if run.run_state.iteration == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # what `kill` or a scheduler sends
        return metrics

    monkeypatch.setattr(trainer.RLRun, "step", iterate_then_sigterm)
    handler = signal.getsignal(signal.SIGTERM)
    summary = trainer.run_rl(config, workdir, recipe="configs/sapo.py:tiny")
    out = capsys.readouterr()
    assert summary["interrupted"] == "SIGTERM" and summary["iteration"] == 1
    assert summary["run"].checkpointer.latest_step() == 1  # saved although checkpoint_every=100
    assert "RL run: configs/sapo.py:tiny" in out.out and "random initialisation (seed 0)" in out.out
    assert "compiling the sampler and the update steps" in out.out
    assert "pass@1 0.000 (it 0)" in out.out  # the evaluation shown with its iteration
    assert f"SIGTERM: stopped at iteration 1; checkpoint {workdir}/checkpoints/1" in out.out
    assert "no informative group in the last 1 iterations" in out.err  # a random policy
    assert signal.getsignal(signal.SIGTERM) is handler  # restored
    # Samples at the first iteration, then every train.sample_every (10; a 3-iteration
    # run's samples.jsonl was empty).
    rows = [json.loads(line) for line in open(os.path.join(workdir, "samples.jsonl"))]
    assert len(rows) == 4 and {r["step"] for r in rows} == {1}  # 1 prompt x G = 4
    assert {"prompt", "completion", "reward", "correct", "status", "reference"} <= set(rows[0])
    assert len({r["prompt"] for r in rows}) == 1
    # The rows are the batch's first group (no dynamic sampling: the batch is the round).
    batch = summary["run"].last_round
    assert [r["reward"] for r in rows] == [float(x) for x in batch.rewards[:4]]
    assert [r["correct"] for r in rows] == [bool(x) for x in batch.correct[:4]]
    evals = [json.loads(line) for line in open(os.path.join(workdir, "eval_samples.jsonl"))]
    logged = read_jsonl(os.path.join(workdir, "eval.jsonl"))
    # Stopped before the evaluation of iteration 1: only iteration 0's, 8 held-out prompts.
    assert len(evals) == 8 and {e["step"] for e in evals} == {0}
    assert np.mean([e["correct"] for e in evals]) == logged[0]["eval/pass@1"]

    monkeypatch.setattr(trainer.RLRun, "step", iterate)
    summary = trainer.run_rl(config, workdir, recipe="configs/sapo.py:tiny")
    out = capsys.readouterr().out
    assert summary["iteration"] == 3 and summary["interrupted"] is None
    assert f"resuming from step 1 ({workdir}/checkpoints/1)" in out
    line = next(line for line in out.splitlines() if line.startswith("[2/3]"))
    assert "pass@1 0.000 (it 1)" in line  # the resumed run evaluated iteration 1 first
    evals = [json.loads(line) for line in open(os.path.join(workdir, "eval_samples.jsonl"))]
    assert [sum(e["step"] == step for e in evals) for step in (0, 1, 2, 3)] == [8, 8, 8, 8]
    rows = [json.loads(line) for line in open(os.path.join(workdir, "samples.jsonl"))]
    assert {r["step"] for r in rows} == {1}  # not at 2 or 3: the next is iteration 10


def test_reproduce_refusals_are_one_line(tmp_path, cli):
    """A claim asked for a setting it does not define names the settings it has, after the
    short usage (this printed the module's docstring and every flag, 40 lines); an error
    while running is one line (this was a traceback)."""
    out = cli("experiments.reproduce", "--claim", "magistral_async", "--setting", "testbed_long32")
    assert out.returncode == 2, out.stderr
    lines = out.stderr.splitlines()
    assert lines[0] == "usage:" and lines[1].startswith("    python -m experiments.reproduce")
    assert lines[-1] == (
        "error: claim 'magistral_async' has no setting 'testbed_long32'; its settings: testbed"
    )
    assert len(lines) <= 8 and "Traceback" not in out.stderr and out.stdout == ""
    out = cli("experiments.reproduce")
    assert out.returncode == 2
    assert out.stderr.splitlines()[-1].startswith("error: --claim is required (or --list)")
    # The SFT cache's directory cannot be made: a file stands where it goes.
    (tmp_path / "sft").write_text("")
    out = cli(
        "experiments.reproduce",
        "--claim",
        "magistral_async",
        f"--workdir={tmp_path / 'claims'}",
        f"--sft_root={tmp_path / 'sft'}",
    )
    assert out.returncode == 1, out.stderr
    first = out.stderr.splitlines()[0]
    assert first.startswith("error: ") and str(tmp_path / "sft") in first
    assert "Traceback (most recent call last)" not in out.stderr


def test_ablate_errors_are_one_line(tmp_path, cli):
    """An unknown ablation and a seed that is not an integer: one line, nothing written
    (each was a traceback)."""
    workdir = tmp_path / "sweep"
    out = cli("experiments.ablate", "--ablation", "nope", f"--workdir={workdir}")
    assert out.returncode == 1, out.stderr
    assert out.stderr.splitlines()[0].startswith("error: unknown ablation 'nope'")
    assert "Traceback (most recent call last)" not in out.stderr
    out = cli("experiments.ablate", "--ablation", "sapo_tau", f"--workdir={workdir}", "--seeds=x")
    assert out.returncode == 2, out.stderr
    assert out.stderr.splitlines()[-1] == "error: --seeds takes integers, e.g. 0,1; got x"
    assert "Traceback (most recent call last)" not in out.stderr and not workdir.exists()
    out = cli("experiments.ablate", "--workdir", str(workdir))
    assert out.returncode == 2 and out.stderr.splitlines()[0] == "usage:"
    assert out.stderr.splitlines()[-1] == "error: --ablation and --workdir are required (or --list)"
