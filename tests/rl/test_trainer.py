"""End-to-end RL loop on tiny models: every recipe runs, routing replay R2 / R3 feeds the
update the routing it should, resume equals an uninterrupted run, compile counts stop
growing after warm-up."""

import importlib
import json
import os
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from policyopt.metrics import read_jsonl
from policyopt.rl.batch import mask_fillers, round_from_rollout
from policyopt.rl.loop import iteration, trainer
from policyopt.rl.update import learner as learner_lib
from policyopt.rl.update import methods
from tests.settings import RL_RECIPES

CRITIC_RECIPES = ("ppo", "vc_ppo", "vapo")
# The metrics of a critic's update that every critic recipe logs.
CRITIC_METRICS = (
    "critic/value_loss",
    "critic/explained_variance",
    "critic/value_clip_frac",
    "critic/values_mean",
    "critic/grad_norm",
    "advantages/mean",
    "advantages/std",
)


def tiny(recipe, model="tiny_moe", extra=""):
    """A recipe shrunk to seconds: one-layer model, 2 prompts x 4 samples, 6 new tokens."""
    variant = (
        f"model={model},model.num_layers=1,batch.n_prompts=2,batch.group_size=4,"
        "batch.n_minibatches=1,sampling.max_new_tokens=6,task.num_train=64,task.num_test=8,"
        "eval.num_prompts=8,eval.batch_size=8,train.num_iterations=2,train.eval_every=0,"
        "train.checkpoint_every=1,train.loggers=jsonl,dynamic_sampling.max_rounds=2,"
        "optim.lr=0.01,batch.prompt_buckets=(16,),batch.response_buckets=(6,)"
    )
    # The buckets in the variant: the config's check sees them (the engine's budget is
    # checked against the largest prompt bucket), and ``extra`` may change them.
    return importlib.import_module(f"configs.{recipe}").get_config(
        variant + ("," + extra if extra else "")
    )


def _params(run):
    return [np.asarray(x) for x in jax.tree.leaves(run.run_state.policy.params)]


# The MoE model: routing metrics and replay on top of what the dense model runs (the dense
# model's RL runs: test_a_run_whose_updates_are_all_skipped_stops here, tests/rl/test_mesh.py).
@pytest.mark.parametrize("recipe,model", [(r, "tiny_moe") for r in RL_RECIPES])
def test_every_recipe_runs_a_few_iterations(recipe, model, tmp_path):
    # Critic recipes: iteration 1 value pretraining (VC-PPO, VAPO) or not (PPO), then PPO.
    pretrain = 1 if recipe in ("vc_ppo", "vapo") else 0
    config = tiny(
        recipe,
        model,
        extra=f"critic.pretrain_iterations={pretrain}" if recipe in CRITIC_RECIPES else "",
    )
    summary = trainer.run_rl(config, str(tmp_path), quiet=True)
    run = summary["run"]
    metrics = summary["metrics"]
    # Every policy iteration applies its update, or skips it as non-finite or as empty (a
    # batch of dynamic sampling's masked fillers: a tiny random policy solves nothing).
    empty = sum(
        row.get("update/empty", 0) for row in read_jsonl(os.path.join(tmp_path, "metrics.jsonl"))
    )
    assert (
        summary["iteration"] == 2
        and int(run.run_state.policy.step) + int(run.run_state.policy.skipped) + empty
        == 2 - pretrain
    )
    assert empty == 0 or recipe in ("dapo", "magistral")  # the recipes with dynamic sampling
    # An iteration with no update (only fillers) reports its update metrics as NaN.
    updated = metrics["update/empty"] == 0
    for key in (
        "reward/mean",
        "reward/accuracy",
        "response/length_mean",
        "loss/loss",
        "reward/format_failure_rate",
        "reward/verifier_errors",
        "reward/deadline_missed",
        "loss/clip_frac",
        "loss/gate_mean",
        "policy/entropy",
        "update/grad_norm",
        "update/lr",
        "update/skipped",
        "time/generate_s",
        "time/update_s",
    ):
        assert key in metrics, key
        assert np.isfinite(metrics[key]) or (
            not updated and key.split("/")[0] in ("loss", "policy", "update")
        ), key
    assert metrics["update/skipped"] == 0
    assert ("routing/volatility" in metrics) == (model == "tiny_moe")
    if model == "tiny_moe":
        assert 0 <= metrics["routing/volatility"] <= 1
        assert "routing/sampler_trainer_disagreement/layer_0" in metrics
    if config.algo.kl_beta > 0:
        assert "loss/kl_ref" in metrics
    if recipe in CRITIC_RECIPES:
        assert int(run.run_state.critic.step) + int(run.run_state.critic.skipped) == 2
        for key in CRITIC_METRICS:
            assert key in metrics and np.isfinite(metrics[key]), key
        assert ("loss/nll" in metrics) == (config.algo.nll_coef > 0)
    else:
        assert run.spec.critic is None and not any(k.startswith("critic/") for k in metrics)
    rows = read_jsonl(os.path.join(tmp_path, "metrics.jsonl"))
    assert [r["step"] for r in rows if "loss/loss" in r] == [1, 2][pretrain:]
    evals = read_jsonl(os.path.join(tmp_path, "eval.jsonl"))
    assert [e["step"] for e in evals] == [0, 2] and 0 <= evals[-1]["eval/pass@1"] <= 1
    with open(os.path.join(tmp_path, "config.json")) as f:
        assert json.load(f)["algo"]["method"] == config.algo.method
    assert run.checkpointer.latest_step() == 2


def test_decode_loops_train_like_one_loop(tmp_path):
    """config.sampling.decode_segments reaches the rollouts and the evaluation: two decode
    loops sample the same tokens (up to float rounding), so the run is the same."""
    runs = [
        trainer.run_rl(
            tiny("grpo", extra=f"sampling.decode_segments={k},train.num_iterations=1"),
            str(tmp_path / str(k)),
            num_iterations=1,
            quiet=True,
        )
        for k in (1, 2)
    ]
    one, two = runs
    assert two["run"].spec.sampling_config.decode_segments == 2
    np.testing.assert_array_equal(two["run"].last_batch.tokens, one["run"].last_batch.tokens)
    for key in ("reward/mean", "eval/pass@1"):
        got = two["metrics"].get(key, two["eval"].get(key))
        want = one["metrics"].get(key, one["eval"].get(key))
        assert got is not None and got == want, key
    for got, want in zip(_params(two["run"]), _params(one["run"])):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


def test_a_failed_final_evaluation_loses_no_training(tmp_path, monkeypatch):
    """Checkpoints are saved before the evaluation of their step (RL and SFT): a run whose
    final evaluation fails resumes at its last step and evaluates it, once."""
    from policyopt.rl import sft

    config = tiny(
        "grpo",
        extra="eval.num_prompts=4,sft.steps=2,sft.batch_size=4,sft.checkpoint_every=0,"
        "sft.overlong_response=drop,train.checkpoint_every=10",
    )
    evaluate_run = trainer.evaluate_run

    def fails_at_the_end(run, **kwargs):  # the RL run's evaluation at iteration 0 works
        if run.run_state.iteration == 2:
            raise RuntimeError("evaluation failed")
        return evaluate_run(run, **kwargs)

    def fails(*args, **kwargs):
        raise RuntimeError("evaluation failed")

    with monkeypatch.context() as patch:
        patch.setattr(sft, "evaluate_policy", fails)
        patch.setattr(trainer, "evaluate_run", fails_at_the_end)
        with pytest.raises(RuntimeError, match="evaluation failed"):
            sft.run_sft(config, str(tmp_path / "sft"), quiet=True)
        with pytest.raises(RuntimeError, match="evaluation failed"):
            trainer.run_rl(config, str(tmp_path / "rl"), quiet=True)
    assert os.listdir(tmp_path / "sft" / "checkpoints") == ["2"]
    assert os.listdir(tmp_path / "rl" / "checkpoints") == ["2"]
    assert "eval/pass@1" in sft.run_sft(config, str(tmp_path / "sft"), quiet=True)["eval"]
    resumed = trainer.run_rl(config, str(tmp_path / "rl"), quiet=True)
    assert [e["iteration"] for e in resumed["eval_history"]] == [2]
    assert [r["step"] for r in read_jsonl(tmp_path / "rl" / "eval.jsonl")] == [0, 2]
    assert trainer.run_rl(config, str(tmp_path / "rl"), quiet=True)["eval_history"] == []
    # Stopped during an evaluation mid-run (on the cadence, beside a checkpoint): the
    # resumed run evaluates that iteration first.
    cadence = tiny(
        "grpo",
        extra="eval.num_prompts=4,train.num_iterations=3,train.eval_every=1,"
        "train.checkpoint_every=1",
    )
    with monkeypatch.context() as patch:
        patch.setattr(trainer, "evaluate_run", fails_at_the_end)  # fails at iteration 2
        with pytest.raises(RuntimeError, match="evaluation failed"):
            trainer.run_rl(cadence, str(tmp_path / "mid"), quiet=True)
    resumed = trainer.run_rl(cadence, str(tmp_path / "mid"), quiet=True)
    assert [e["iteration"] for e in resumed["eval_history"]] == [2, 3]
    assert [r["step"] for r in read_jsonl(tmp_path / "mid" / "eval.jsonl")] == [0, 1, 2, 3]


@pytest.mark.parametrize("mode", ["R2", "R3"])
def test_routing_replay_feeds_the_update(mode, tmp_path):
    config = tiny(
        "grpo", extra=f"algo.routing_replay={mode},train.num_iterations=1,eval.num_prompts=0"
    )
    run = trainer.build_run(config, str(tmp_path))
    old_params = jax.tree.map(jnp.copy, run.run_state.policy.params)
    run.step()
    batch, sampled = run.last_batch, run.last_round
    assert batch.routing is not None
    if mode == "R2":
        # The old policy's own routing, recomputed independently, is what was replayed.
        natural = run.spec.learner.log_probs(
            old_params, batch.tokens, batch.positions, batch.attention_mask, batch.mask
        )[2]
        np.testing.assert_array_equal(np.asarray(batch.routing), np.asarray(natural))
    else:
        # The sampler's routing is replayed, and the old log-probs were computed with it.
        np.testing.assert_array_equal(np.asarray(batch.routing), sampled.routing)
        replayed, _, _ = run.spec.learner.log_probs(
            old_params,
            batch.tokens,
            batch.positions,
            batch.attention_mask,
            batch.mask,
            batch.routing,
        )
        np.testing.assert_allclose(np.asarray(batch.old_log_probs), np.asarray(replayed), atol=1e-6)
    # The update's loss at the old parameters is that of a forward with the replayed routing
    # (jitted: one compile, not one per eager op of the forward and the loss).
    loss, metrics = jax.jit(run.spec.learner.loss)(old_params, batch)
    assert float(metrics["loss/ratio_max"]) == pytest.approx(1.0, abs=1e-5)


def test_rollout_correction_reaches_the_batch(tmp_path, monkeypatch):
    """Sequence-level truncated IS, token-level rejection and the veto between the sampler's
    and the trainer's log-probs, against NumPy loops over the iteration's own arrays. On the
    CPU the two agree to ~1e-7, so the sampler's log-probs are perturbed (by a fixed noise)
    on their way into the round, as a sampler in another precision would."""
    noise = np.random.default_rng(0)

    def perturbed(*args, **kwargs):
        rnd = round_from_rollout(*args, **kwargs)
        shift = 0.05 * noise.normal(size=rnd.behaviour_log_probs.shape).astype(np.float32)
        return rnd._replace(behaviour_log_probs=rnd.behaviour_log_probs + shift)

    monkeypatch.setattr(iteration, "round_from_rollout", perturbed)
    config = tiny(
        "grpo",
        extra="algo.tis_cap=1.1,algo.tis_level=sequence,algo.rs_level=token,"
        "algo.rs_upper=1.05,algo.rs_veto=0.93,train.num_iterations=1,"
        "eval.num_prompts=0",
    )
    run = trainer.build_run(config, str(tmp_path))
    metrics = run.step()
    batch, sampled = run.last_batch, run.last_round
    old, behaviour = (
        np.asarray(batch.old_log_probs, np.float64),
        sampled.behaviour_log_probs.astype(np.float64),
    )
    mask = np.asarray(batch.mask)
    weights, keep = np.zeros_like(mask), np.zeros_like(mask)
    for i in range(mask.shape[0]):
        log_rhos = [old[i, t] - behaviour[i, t] for t in range(mask.shape[1]) if mask[i, t]]
        vetoed = any(x < np.log(0.93) for x in log_rhos)
        for t in range(mask.shape[1]):
            if mask[i, t]:
                weights[i, t] = min(np.exp(sum(log_rhos)), 1.1)
                keep[i, t] = float(
                    not vetoed and 1 / 1.05 <= np.exp(old[i, t] - behaviour[i, t]) <= 1.05
                )
    np.testing.assert_allclose(np.asarray(batch.importance_weights), weights, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(batch.loss_mask), keep)
    assert 0 < keep.sum() < mask.sum() and 0 < (weights == 1.1).sum() < mask.sum()
    for key in ("kl_k1", "kl_k3", "ppl_ratio", "chi2_token", "chi2_seq", "log_ratio_abs_max"):
        assert np.isfinite(metrics[f"offpolicy/{key}"]) and metrics[f"offpolicy/{key}"] != 0, key
    assert metrics["offpolicy/rs_rejected_token_frac"] == pytest.approx(1 - keep.sum() / mask.sum())
    assert metrics["offpolicy/is_truncated_frac"] == pytest.approx(
        (weights == 1.1).sum() / mask.sum()
    )
    assert metrics["offpolicy/rs_rejected_seq_frac"] == pytest.approx(np.mean(keep.sum(1) == 0))
    # The policy loss covered the kept tokens only.
    assert metrics["loss/num_tokens"] == keep.sum()
    # The same shapes trace the correction once.
    compiled = methods.rollout_correction._cache_size()
    run.step()
    assert methods.rollout_correction._cache_size() == compiled


def test_routing_metrics_run_in_minibatch_chunks(tmp_path, monkeypatch):
    """The forwards of the routing metrics (volatility, routing share) run in the
    minibatch's shape, as the old log-probs do (not the whole batch: memory, and a compile
    of its own): the old and reference (KL) passes, then the updated policy's natural and
    replayed passes."""
    config = tiny(
        "grpo",
        extra="batch.n_minibatches=2,train.routing_metrics=True,train.num_iterations=1,"
        "eval.num_prompts=0",
    )
    run = trainer.build_run(config, str(tmp_path))
    rows, log_probs = [], run.spec.learner.log_probs
    monkeypatch.setattr(
        run.spec.learner,
        "log_probs",
        lambda params, tokens, *args: (
            rows.append(tokens.shape[0]) or log_probs(params, tokens, *args)
        ),
    )
    metrics = run.step()
    assert rows == [4] * 8  # 2 x 4 samples in 2 chunks, 4 passes
    assert 0 <= metrics["routing/volatility"] <= 1 and 0 <= metrics["routing/ratio_share"] <= 1


def _train_on(run, rnd) -> dict:
    """The training half of an iteration (``prepare``, ``update_epochs``) on the host round
    ``rnd``; the run's state replaced. Returns the step's metrics."""
    with jax.set_mesh(run.spec.mesh):
        prepared = iteration.prepare(run.spec, run.run_state, rnd)
        run.run_state, metrics = iteration.update_epochs(
            run.spec, run.run_state, prepared, jax.random.PRNGKey(0)
        )
    return {**prepared.metrics, **metrics}


def test_empty_minibatches_do_not_dilute_the_update_metrics(tmp_path):
    """A minibatch of fillers only is no update; the iteration's update metrics are means
    over the minibatches that were updates (NaN when none was), not pulled toward 0."""
    config = tiny("grpo", extra="batch.n_minibatches=2,train.num_iterations=1,eval.num_prompts=0")
    run = trainer.build_run(config, str(tmp_path))
    run.step()
    merged = run.last_round
    # The same batch with its second group as a filler: one minibatch of the two is empty.
    metrics = _train_on(run, mask_fillers(merged, 1, 4))
    assert metrics["update/empty"] == 1 and metrics["update/skipped"] == 0
    # The one update ran at the batch's old parameters (the empty one changed nothing).
    assert metrics["loss/ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["policy/entropy"] > 1.0 and metrics["loss/num_tokens"] == merged.mask[:4].sum()
    metrics = _train_on(run, mask_fillers(merged, 2, 4))
    assert metrics["update/empty"] == 2
    assert np.isnan(metrics["loss/loss"]) and np.isnan(metrics["policy/entropy"])


def test_compile_count_stops_growing_after_warm_up(tmp_path, monkeypatch):
    # Fresh learners and forward passes: the process-wide ones are shared with every test
    # of the same model and temperature that ran before in this process (their traces of
    # other shapes, e.g. test_async_rl's, counted here and made this order-dependent).
    monkeypatch.setattr(learner_lib, "_LEARNERS", {})
    monkeypatch.setattr(learner_lib, "_FORWARDS", {})
    config = tiny("sapo", extra="eval.num_prompts=0,train.num_iterations=6")
    config.unlock()
    config.batch.response_buckets = (4, 6)
    config.lock()
    run = trainer.build_run(config, str(tmp_path))
    widths = set()
    for _ in range(6):
        widths.add(run.step()["batch/response_width"])
    counts = run.spec.learner.trace_counts
    # One compilation per response bucket seen, never more.
    assert counts["update"] == len(widths) <= 2
    assert counts["log_probs"] <= 2
    # With one bucket, no compilation at all after the first iteration (sampler included):
    # tests/test_compile_once.py.


@pytest.mark.parametrize("field", ["moe_dispatch", "moe_decode_dispatch"])
def test_capacity_dispatch_is_refused_for_rl(tmp_path, field):
    # Capacity drops depend on the rows batched together: sampler, old-log-prob pass and
    # minibatches would compute different policies (ratio != 1 at the first update).
    config = tiny("grpo", extra=f"model.{field}=capacity")
    with pytest.raises(ValueError, match="dropless"):
        trainer.build_run(config, str(tmp_path))


def test_skipped_update_streaks_are_counted_per_model_by_hand():
    """Counters (step, skipped) after each iteration, by hand: the policy applies 1 and
    skips 1 (streak 0: it applied one), then skips 2 (2), then 1 (3 = limit: stop); the
    critic's own count is separate and an applied update resets it."""
    from types import SimpleNamespace as State

    streaks = trainer.SkippedUpdates(
        3, {"update": State(step=0, skipped=0), "critic": State(step=0, skipped=0)}
    )
    streaks.update(1, {"update": State(step=1, skipped=1), "critic": State(step=0, skipped=2)})
    assert streaks.streak == {"update": 0, "critic": 2}
    streaks.update(2, {"update": State(step=1, skipped=3), "critic": State(step=1, skipped=2)})
    assert streaks.streak == {"update": 2, "critic": 0}
    with pytest.raises(
        trainer.UpdatesSkipped,
        match=r"^stopping at iteration 3: the last 3 policy "
        r"updates were skipped .*max_skipped_updates=3\)$",
    ):
        streaks.update(3, {"update": State(step=1, skipped=4), "critic": State(step=1, skipped=2)})


def test_a_run_whose_updates_are_all_skipped_stops(tmp_path):
    """optim.lr=1e30: the first update is finite but blows the parameters up, and every later
    update is non-finite and skipped. The run used to go on to the end and exit 0; it stops
    after train.max_skipped_updates of them, with every iteration's metrics written."""
    config = tiny(
        "grpo",
        model="tiny_dense",
        extra="optim.lr=1e30,train.max_skipped_updates=2,"
        "train.num_iterations=8,eval.num_prompts=0,batch.n_minibatches=2",
    )
    with pytest.raises(trainer.UpdatesSkipped, match="max_skipped_updates=2"):
        trainer.run_rl(config, str(tmp_path), quiet=True)
    rows = read_jsonl(str(tmp_path / "metrics.jsonl"))
    assert 1 < len(rows) < 8 and rows[-1]["update/skipped"] == 2
    assert not any(key.startswith("routing/") for key in rows[0])  # a dense model: no routing
    assert rows[-1]["update/step"] == rows[-2]["update/step"]  # nothing applied since


# A plain script, as a user writes one (no __main__ guard): a long generation through the
# engine (256 prompts, one group of 2 rows at a time), announcing its third decode call; one
# run per signal in turn (argv[3:]) in one process, the second on the programs of the first.
_STOPPED_SCRIPT = textwrap.dedent(r"""
    import sys
    from policyopt import engine
    from policyopt.rl.loop import trainer
    from tests.rl.test_trainer import tiny

    decode_steps, calls = engine.decode_steps, []

    def announced(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            print("decoding", flush=True)
        return decode_steps(*args, **kwargs)

    engine.decode_steps = announced
    for name in sys.argv[3:]:
        calls.clear()
        summary = trainer.run_rl(
            tiny("grpo", extra=sys.argv[2]), f"{sys.argv[1]}/{name}", recipe="grpo"
        )
        print("summary", summary["interrupted"], summary["iteration"], len(calls), flush=True)
    """)
STOPPED_EXTRA = (
    "batch.n_prompts=256,batch.group_size=2,sampling.engine_kv_tokens=128,"
    "sampling.engine_rows=2,sampling.engine_page_size=4,sampling.max_new_tokens=64,"
    "batch.response_buckets=(64,),eval.num_prompts=0,"
    "train.num_iterations=1"
)
SIGNALS = ("SIGTERM", "SIGINT")


def test_a_signal_stops_a_generation_in_progress(tmp_path):
    """The issue's fault: a SIGTERM during a long generation printed "stopping after this
    iteration" and was acted on only after it (an engine that never ended never stopped).
    Now the signal reaches the engine's host loop: the run ends within seconds with a
    checkpoint of the last complete iteration (0), at the data position before the
    iteration cut short (a rerun draws the same prompts again). SIGTERM, then SIGINT, each
    stopping a run of its own in one process (which then exits 0)."""
    import signal
    import subprocess
    import sys
    import time

    from policyopt.checkpoint import Checkpointer
    from policyopt.rl.loop import build
    from tests.flags import ROOT, subprocess_env

    workdir = str(tmp_path / "run")
    process = subprocess.Popen(
        [sys.executable, "-c", _STOPPED_SCRIPT, workdir, STOPPED_EXTRA, *SIGNALS],
        env=subprocess_env(PYTHONPATH=ROOT),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines, summaries, seconds = [], [], []
    try:
        for signal_name in SIGNALS:
            for line in process.stdout:  # this run's third decode call
                lines.append(line)
                if line.strip() == "decoding":
                    break
            else:
                raise AssertionError("".join(lines) + process.stderr.read()[-3000:])
            sent = time.perf_counter()
            process.send_signal(getattr(signal, signal_name))
            for line in process.stdout:  # the run's end
                lines.append(line)
                if line.startswith("summary"):
                    summaries.append(line.split())
                    break
            seconds.append(time.perf_counter() - sent)
        out, err = process.communicate(timeout=300)
        out = "".join(lines) + out
    finally:
        process.kill()
    assert process.returncode == 0, (out + err)[-3000:]
    assert [s[:3] for s in summaries] == [["summary", name, "0"] for name in SIGNALS], out
    config = tiny("grpo", extra=STOPPED_EXTRA)
    fresh = trainer.make_prompt_iterator(
        config, build.task_source(config, "train"), seed=config.seed
    )
    for signal_name, summary, took in zip(SIGNALS, summaries, seconds):
        calls = int(summary[3])  # decode calls run: far from the 256 groups' (>= 4 each)
        assert 3 <= calls < 100, out
        assert f"{signal_name}: stopped during iteration 1 (its generation cut short)" in out
        assert took < 60, took  # the checkpoint and the run's end; under load
        run = os.path.join(workdir, signal_name)
        assert not os.path.exists(os.path.join(run, "metrics.jsonl")) or not read_jsonl(
            os.path.join(run, "metrics.jsonl")
        )
        with Checkpointer(os.path.join(run, "checkpoints")) as checkpointer:
            assert checkpointer.all_steps() == [0]
            meta = checkpointer.meta()
        assert meta["iteration"] == 0 and meta["data"] == fresh.get_state()
