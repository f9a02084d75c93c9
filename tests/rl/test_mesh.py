"""The RL trainer on a mesh of 8 simulated CPU devices: parameters, optimiser and critic
states really sharded, the same losses, metrics and parameters as on one device, one
compilation per jitted step across iterations and across save and restore, and
asynchronous generation on the mesh.

One subprocess (``tests/test_sharding.py``'s approach: JAX reads ``XLA_FLAGS`` once, at
start-up) with ``--xla_force_host_platform_device_count=8`` runs the mesh runs and their
checks first, then the reference runs on a mesh of its first device alone (the default
``config.mesh``, ``data=-1``, over one device: what a one-device process builds). One
process, not one per device count: a JAX start-up less, and no two processes competing
for the cores. It compiles with ``--xla_backend_optimization_level=0``, which halves
XLA:CPU's compile time (the bulk of these runs) and is the same for both, so the numbers
remain comparable.
"""

import os
import subprocess
import sys
import textwrap

import numpy as np

from tests.flags import ROOT, subprocess_env

# name -> (recipe, model, mesh of the 8-device run): GRPO (with its KL to a reference
# policy) on the dense model over data x fsdp x tensor and on the MoE model over
# data x tensor x expert. The critic (PPO) is checked for placement only, asynchronous
# generation on the dense mesh (its runs are not reproducible: thread timing).
CASES = {
    "dense": ("grpo", "tiny_dense", "mesh.data=2,mesh.fsdp=2,mesh.tensor=2"),
    "moe": ("grpo", "tiny_moe", "mesh.data=2,mesh.tensor=2,mesh.expert=2"),
}
# Rewards that differ between rows (-1 wrong, DAPO's overlong penalty), so that the
# gradients carry signal: Adam divides each gradient by its own magnitude, and a gradient
# of float noise alone (all advantages 0) would be sign noise of size lr. The larger eps
# keeps the near-zero gradient entries (noise either way) from being scaled up likewise.
COMMON = (
    "eval.num_prompts=0,train.checkpoint_every=2,reward.incorrect_value=-1.0,"
    "reward.overlong=dapo,optim.eps=1e-4,critic.lr=0.01"
)

_SCRIPT = textwrap.dedent("""
    import sys
    import jax, numpy as np, optax
    from jax.sharding import PartitionSpec as P
    from policyopt import sharding
    from policyopt.metrics import read_jsonl
    from policyopt.rl.loop import build, trainer
    from policyopt.rl.rollouts.async_generation import _group_rows_fn, _refill_fn, _segment_fn
    from policyopt.rl.loop.async_rl import run_async_rl
    from policyopt.sampling import generate_fn
    from tests.rl.test_trainer import tiny
    from tests.rl.test_mesh import CASES, COMMON

    out = sys.argv[1]
    assert jax.device_count() == 8, jax.devices()
    specs = lambda tree: [x.sharding.spec for x in jax.tree.leaves(tree)]

    def check_placement(state, params_axes):
        # Parameters by their logical axes, Adam's moments as the parameters, counters
        # replicated.
        params = specs(state.params)
        used = {axis for s in params for dim in s
                for axis in ((dim,) if isinstance(dim, str) else dim or ())}
        assert used == params_axes, (used, params)
        for moment in ("mu", "nu"):
            assert specs(optax.tree_utils.tree_get(state.opt_state, moment)) == params
        assert specs((state.step, state.skipped)) == [P(), P()]
        return params

    def run_cases(on_mesh, out):
        results = {}
        for name, (recipe, model, mesh) in CASES.items():
            config = tiny(recipe, model, extra=COMMON + ("," + mesh if on_mesh else ""))
            workdir = f"{out}/{name}"
            run = trainer.run_rl(config, workdir, num_iterations=2, quiet=True)["run"]
            params = run.run_state.policy.params
            devices = {d for x in jax.tree.leaves(params) for d in x.sharding.device_set}
            assert len(devices) == (8 if on_mesh else 1), devices
            for i, row in enumerate(read_jsonl(f"{workdir}/metrics.jsonl")):
                for key, value in row.items():
                    if not key.startswith("time/") and key != "step":
                        results[f"{name}/metrics{i}/{key}"] = value
            for i, leaf in enumerate(jax.tree.leaves(run.run_state.policy.params)):
                results[f"{name}/params/{i}"] = np.asarray(leaf)
            if not on_mesh:
                continue
            # (a) Sharded.
            check_placement(run.run_state.policy,
                            {"fsdp", "tensor"} if name == "dense" else {"tensor", "expert"})
            assert specs(run.run_state.rng) == [P()]
            # (c) One compilation of every jitted step in two iterations; the MoE model's
            # log-probs two: with its own routing, and replaying pi_old's (the routing
            # metrics' share of the ratio, rl.update.routing.ratio_share_metrics).
            want = {"log_probs": 2 if name == "moe" else 1, "update": 1}
            assert dict(run.spec.learner.trace_counts) == want, run.spec.learner.trace_counts
            # (d) Restored on the mesh: the same shardings and values; a third iteration
            # compiles nothing new (sampler included).
            resumed = trainer.build_run(config, workdir)
            assert resumed.run_state.iteration == 2
            saved = (run.run_state.policy, run.run_state.rng)
            restored = (resumed.run_state.policy, resumed.run_state.rng)
            assert [x.sharding for x in jax.tree.leaves(restored)] == [
                x.sharding for x in jax.tree.leaves(saved)]
            for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(saved)):
                np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
            compiled = (dict(run.spec.learner.trace_counts), generate_fn._cache_size())
            resumed.step()
            assert (dict(resumed.spec.learner.trace_counts), generate_fn._cache_size()) == compiled
            print("ok", name, flush=True)
        np.savez(f"{out}/results.npz", **results)

    # The mesh runs first, while every jitted step (the learners are shared per process,
    # policyopt.rl.update.learner.get_learner) has compiled only for the mesh: trace counts of 1.
    run_cases(True, f"{out}/mesh")

    recipe, model, mesh = CASES["dense"]
    # The critic (PPO) placed as the policy: its backbone as the policy's parameters,
    # its head (no logical axes) replicated.
    run = trainer.build_run(tiny("ppo", model, extra=COMMON + "," + mesh), f"{out}/critic")
    params = check_placement(run.run_state.policy, {"fsdp", "tensor"})
    check_placement(run.run_state.critic, {"fsdp", "tensor"})
    assert specs(run.run_state.critic.params["backbone"]) == params
    assert specs(run.run_state.critic.params["head"]) == [P(), P()]
    # Asynchronous generation on the mesh (its thread sets the mesh itself): two
    # batches of the dense run's shapes, so the trainer's steps compiled above serve,
    # and the slot state keeps its shardings from segment to segment (one compilation).
    config = tiny(recipe, model, extra=COMMON + "," + mesh + ",async_mode.enabled=True,"
                  "async_mode.segment_steps=2")
    learner = trainer.build_run(config, f"{out}/async").spec.learner
    compiled = dict(learner.trace_counts)
    summary = run_async_rl(config, f"{out}/async", num_iterations=2, quiet=True)
    assert summary["iteration"] == 2 and np.isfinite(summary["metrics"]["loss/loss"])
    assert dict(learner.trace_counts) == compiled, (learner.trace_counts, compiled)
    assert (_refill_fn._cache_size() == _segment_fn._cache_size()
            == _group_rows_fn._cache_size() == 1)
    check_placement(summary["run"].run_state.policy, {"fsdp", "tensor"})
    print("ok critic async", flush=True)

    # The reference: the same runs on one device (the default mesh, data=-1, over the
    # first device only, as a one-device process builds it).
    build.make_mesh = lambda config: sharding.make_mesh(
        {name: int(getattr(config.mesh, name)) for name in sharding.MESH_AXES},
        devices=jax.devices()[:1])
    run_cases(False, f"{out}/one")
    print("ok one device", flush=True)
    """)


def _start(out: str) -> subprocess.Popen:
    env = subprocess_env(8, "--xla_backend_optimization_level=0")
    os.makedirs(out, exist_ok=True)
    return subprocess.Popen(
        [sys.executable, "-c", _SCRIPT, out],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _finish(proc: subprocess.Popen) -> str:
    try:
        output, _ = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
    assert proc.returncode == 0, output[-6000:]
    return output


def test_rl_on_a_mesh_matches_one_device_and_compiles_once(tmp_path):
    output = _finish(_start(str(tmp_path)))
    oks = [line for line in output.splitlines() if line.startswith("ok ")]
    assert oks == [f"ok {name}" for name in CASES] + ["ok critic async", "ok one device"], output[
        -3000:
    ]
    want = np.load(tmp_path / "one" / "results.npz")
    got = np.load(tmp_path / "mesh" / "results.npz")
    assert sorted(got.files) == sorted(want.files)
    for key in want.files:
        # float32 sums in another order: metrics agree to ~1e-6; parameters after two
        # AdamW steps of lr 0.01 to ~3e-6 (1e-5 is 0.1% of a step).
        atol = 1e-5 if "/params/" in key else 2e-6
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=atol, err_msg=key)
