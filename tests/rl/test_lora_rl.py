"""RL with LoRA adapters (``config.model.lora``, ``policyopt.rl.update.adapters``): only the
adapters train and are in the optimiser state (the base bit-identical after updates, its
gradient identity dL/dB = (alpha / r) A^T dL/dW at B = 0); the KL reference from the base
with the adapters off equals a separate frozen model's log-probs, with no copy of the
parameters; every kind of method runs (KL, critic with adapters or full weights, the
engine, asynchronous generation publishing adapters only); checkpoints hold the adapters,
the optimiser state and the base's identity, not the base; the init-checkpoint pairings
and their one-line errors."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from policyopt.checkpoint import Checkpointer
from policyopt.models import Transformer, lora, preset
from policyopt.models.lora import LoRAConfig
from policyopt.rl import sft
from policyopt.rl.batch import Batch
from policyopt.rl.loop import iteration, trainer
from policyopt.rl.update import adapters, forwards
from policyopt.rl.update.learner import forward_log_probs
from tests.rl.test_trainer import tiny

LORA = "model.lora.rank=2,model.lora.targets='attention,mlp'"
GRPO = LORA + ",model.lora.sampler=unmerged,algo.entropy_coef=0.1"


def _base_model(run, config):
    """The run's model without adapters, built apart from the run (same preset and seed)."""
    model = preset("tiny_moe", num_layers=1, vocab_size=run.spec.tokenizer.vocab_size)
    return Transformer(model, rngs=nnx.Rngs(config.seed))


def _names(state) -> list[str]:
    return [".".join(map(str, path)) for path, _ in nnx.to_flat_state(state)]


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory):
    """GRPO (KL 0.04) with rank-2 adapters, 2 iterations, checkpointed, unmerged sampler;
    an entropy bonus, so that the adapters move although a random policy earns no reward."""
    workdir = str(tmp_path_factory.mktemp("grpo"))
    config = tiny("grpo", extra=GRPO)
    summary = trainer.run_rl(config, workdir, quiet=True)
    return config, workdir, summary


def test_only_the_adapters_train_and_hold_optimiser_state(grpo_run):
    config, _, summary = grpo_run
    run = summary["run"]
    trainable = _names(run.run_state.policy.params)
    assert trainable and all(".lora." in n and n.endswith(("lora_a", "lora_b")) for n in trainable)
    # Adam's moments are copies of the adapters' tree, nothing of the base.
    for moments in jax.tree.leaves(
        run.run_state.policy.opt_state, is_leaf=lambda x: isinstance(x, nnx.State)
    ):
        if isinstance(moments, nnx.State):
            assert _names(moments) == trainable
    leaves = [x.shape for x in jax.tree.leaves(run.run_state.policy.opt_state) if x.ndim]
    assert sorted(leaves) == sorted(
        [x.shape for x in jax.tree.leaves(run.run_state.policy.params)] * 2
    )
    # The base after two updates is the model's initialisation, bit for bit.
    base = _base_model(run, config)
    for (path, got), (_, want) in zip(
        nnx.to_flat_state(run.spec.weights.frozen),
        nnx.to_flat_state(nnx.state(base, nnx.Param)),
        strict=True,
    ):
        np.testing.assert_array_equal(got.get_value(), want.get_value(), err_msg=str(path))
    assert int(run.run_state.policy.step) == 2
    b = [
        np.asarray(v)
        for p, v in jax.tree_util.tree_leaves_with_path(run.run_state.policy.params)
        if "lora_b" in str(p)
    ]
    assert max(float(np.abs(x).max()) for x in b) > 0  # the adapters moved


def test_kl_reference_is_the_base_without_a_copy(grpo_run):
    """The reference log-probs (base graph, the adapters off, the same base arrays) equal
    those of a separately built model without adapters, while the policy's differ."""
    config, _, summary = grpo_run
    run = summary["run"]
    assert run.spec.ref_params is run.spec.weights.frozen  # no copy of the parameters
    rnd = run.last_round
    rows = Batch(
        *map(jnp.asarray, (rnd.tokens, rnd.positions, rnd.attention_mask, rnd.mask)),
        advantages=None,
        old_log_probs=None,
    )
    reference, _ = forwards.policy_log_probs(
        run.spec.ref_learner, run.spec.ref_params, rows, (None,)
    )
    base = _base_model(run, config)
    graphdef, params = nnx.split(base, nnx.Param)
    want = jax.jit(
        lambda p: (
            forward_log_probs(
                graphdef, p, rows.tokens, rows.positions, rows.attention_mask, rows.mask.shape[1]
            ).log_probs
        )
    )(params)
    mask = np.asarray(rnd.mask) > 0
    np.testing.assert_allclose(np.asarray(reference)[mask], np.asarray(want)[mask], rtol=1e-6)
    policy, _ = forwards.policy_log_probs(
        run.spec.learner,
        iteration.policy_params(run.spec, run.run_state.policy.params),
        rows,
        (None,),
    )
    assert np.abs(np.asarray(policy - reference)[mask]).max() > 1e-5


def test_checkpoint_holds_adapters_and_the_base_identity(grpo_run):
    config, workdir, summary = grpo_run
    with Checkpointer(os.path.join(workdir, "checkpoints")) as checkpoints:
        shapes = checkpoints.saved_shapes()
        meta = checkpoints.meta()
    params = [n for n in shapes if n.startswith("train.params.")]
    assert params and all(".lora." in n for n in params)
    assert not any(n.endswith(("q_proj", "embed", "router")) for n in shapes)
    record = meta["lora"]
    assert (record["rank"], record["targets"]) == (2, ["attention", "mlp"])
    assert record["base"]["source"] == {"kind": "init", "preset": "tiny_moe", "seed": 0}
    frozen = summary["run"].spec.weights.frozen
    assert record["base"]["fingerprint"] == adapters.fingerprint(frozen)


def test_resume_refuses_another_base_or_kind(grpo_run, tmp_path):
    config, workdir, _ = grpo_run
    # Another seed builds another base: the saved fingerprint does not match.
    other = tiny("grpo", extra=GRPO + ",seed=1")
    with pytest.raises(ValueError, match="trained on another base") as info:
        trainer.build_run(other, workdir, check_config=False)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="holds LoRA adapters .* trains full weights") as info:
        trainer.build_run(tiny("grpo"), workdir, check_config=False)
    assert "\n" not in str(info.value)


def test_gradient_identity_at_zero_b():
    """dL/dB = (alpha / r) A^T dL/dW and dL/dA = 0 at B = 0 (Hu et al. 2021), with dL/dW the
    base model's gradient, for the q projection and one expert's w_up."""
    config = preset("tiny_moe", num_layers=1)
    adapted = config.replace(lora=LoRAConfig(rank=2, alpha=4.0, targets=("q_proj", "experts")))
    model = Transformer(adapted, rngs=nnx.Rngs(0))
    graphdef, adapter_state, frozen = lora.split(model)
    base_graphdef = lora.base_graphdef(model)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 512, (2, 8)), jnp.int32)

    def loss(graphdef, state):
        logits = nnx.merge(graphdef, state)(tokens).logits
        return jnp.mean(jax.nn.log_softmax(logits)[..., 7])

    # Jitted: one program each, not an eager dispatch (and compile) per operation.
    d_adapters = jax.jit(jax.grad(lambda a: loss(graphdef, lora.combine(frozen, a))))(adapter_state)
    d_base = jax.jit(jax.grad(lambda f: loss(base_graphdef, f)))(frozen)
    s = adapted.lora.scale
    attn = d_adapters["layers"][0]["attn"]["lora"]["q_proj"]
    a = model.layers[0].attn.lora.q_proj.lora_a[...]
    want = s * jnp.einsum("dr,dnh->rnh", a, d_base["layers"][0]["attn"]["q_proj"][...])
    np.testing.assert_allclose(attn["lora_b"][...], want, rtol=1e-4, atol=1e-7)
    np.testing.assert_array_equal(attn["lora_a"][...], 0.0)
    up = d_adapters["layers"][0]["mlp"]["lora"]["up_proj"]
    a = model.layers[0].mlp.lora.up_proj.lora_a[...]
    want = s * jnp.einsum("edr,edf->erf", a, d_base["layers"][0]["mlp"]["up_proj"][...])
    np.testing.assert_allclose(up["lora_b"][...], want, rtol=1e-4, atol=1e-7)
    assert float(jnp.abs(want).max()) > 1e-6


@pytest.mark.parametrize(
    "recipe,extra",
    [
        ("ppo", "model.lora.critic=adapters,sampling.engine_kv_tokens=256"),
        ("vapo", "model.lora.critic=full,critic.pretrain_iterations=1"),
    ],
)
def test_critic_methods_with_adapters_or_full_weights(recipe, extra, tmp_path):
    config = tiny(recipe, extra=f"{LORA},{extra}")
    summary = trainer.run_rl(config, str(tmp_path), quiet=True)
    run, metrics = summary["run"], summary["metrics"]
    assert int(run.run_state.critic.step) == 2 and np.isfinite(metrics["critic/value_loss"])
    backbone = _names(run.run_state.critic.params["backbone"])
    if "adapters" in extra:
        assert run.spec.critic_frozen is run.spec.weights.frozen  # shared base
        assert backbone == _names(run.run_state.policy.params)
    else:
        assert run.spec.critic_frozen is None
        assert backbone == _names(run.spec.weights.frozen)
    assert int(run.run_state.policy.step) + int(run.run_state.policy.skipped) == 2 - (
        recipe == "vapo"
    )


def test_async_mode_publishes_adapters_only(tmp_path, monkeypatch):
    from policyopt.rl.loop import async_rl
    from policyopt.rl.rollouts import async_generation

    published = []
    original = async_generation.AsyncGenerator.publish

    def publish(self, params, version):
        published.append(_names(params))
        return original(self, params, version)

    monkeypatch.setattr(async_generation.AsyncGenerator, "publish", publish)
    config = tiny("magistral", extra=f"{LORA},async_mode.enabled=True")
    summary = async_rl.run_async_rl(config, str(tmp_path), quiet=True)
    run = summary["run"]
    assert published and all(p == _names(run.run_state.policy.params) for p in published)
    assert summary["iteration"] == 2


def test_sampler_merged_equals_unmerged_greedy(grpo_run):
    """Both sampler forms decode the same greedy tokens from the same adapters."""
    from policyopt.sampling import Greedy, SamplingConfig, generate_fn

    _, _, summary = grpo_run
    run = summary["run"]
    weights = run.spec.weights
    prompts = jnp.asarray(run.last_round.tokens[:4, :16])
    lengths = jnp.full((4,), 16, jnp.int32)
    config = SamplingConfig(max_new_tokens=6, method=Greedy(), pad_id=0)
    outs = []
    for form in ("merged", "unmerged"):
        graphdef, params = weights.__class__(
            weights.graphdef, weights.frozen, weights.base_graphdef, weights.scale, form
        ).for_sampler(run.run_state.policy.params)
        outs.append(
            generate_fn(graphdef, params, prompts, lengths, jax.random.key(0), config=config)
        )
    np.testing.assert_array_equal(outs[0].tokens, outs[1].tokens)
    np.testing.assert_allclose(outs[0].raw_log_probs, outs[1].raw_log_probs, atol=1e-4)


# --------------------------------------------------------------------------- init checkpoints


@pytest.fixture(scope="module")
def sft_checkpoint(tmp_path_factory):
    """A full-weight SFT checkpoint (a few steps; the model.lora.* fields do not reach it)."""
    workdir = str(tmp_path_factory.mktemp("sft"))
    config = tiny("grpo", extra=LORA)
    config.unlock()
    config.sft.steps, config.sft.batch_size, config.sft.checkpoint_every = 2, 8, 0
    config.sft.overlong_response = "truncate"
    config.lock()
    summary = sft.run_sft(config, workdir, quiet=True)
    assert summary["step"] == 2
    return summary["checkpoint_dir"]


def test_lora_from_a_full_checkpoint_needs_base(sft_checkpoint, tmp_path):
    config = tiny("grpo", extra=f"{LORA},init_checkpoint={sft_checkpoint!r}")
    with pytest.raises(ValueError) as info:
        trainer.build_run(config, str(tmp_path / "a"))
    assert "holds full weights (saved without LoRA)" in str(info.value)
    assert "model.lora.init_checkpoint='base'" in str(info.value) and "\n" not in str(info.value)
    config = tiny(
        "grpo",
        extra=f"{LORA},init_checkpoint={sft_checkpoint!r},model.lora.init_checkpoint=base",
    )
    run = trainer.build_run(config, str(tmp_path / "b"))
    want = adapters.restore_params(sft_checkpoint, run.spec.weights.frozen)
    for got, ref in zip(jax.tree.leaves(run.spec.weights.frozen), jax.tree.leaves(want)):
        np.testing.assert_array_equal(got, ref)
    assert run.spec.lora_record["base"]["source"]["kind"] == "checkpoint"


def test_full_run_from_a_lora_checkpoint_needs_merged(grpo_run, tmp_path):
    _, workdir, summary = grpo_run
    directory = os.path.join(workdir, "checkpoints")
    with pytest.raises(ValueError) as info:
        trainer.build_run(tiny("grpo", extra=f"init_checkpoint={directory!r}"), str(tmp_path / "a"))
    assert "holds LoRA adapters (rank 2) and this run trains full weights" in str(info.value)
    assert "\n" not in str(info.value)
    config = tiny("grpo", extra=f"init_checkpoint={directory!r},model.lora.init_checkpoint=merged")
    run = trainer.build_run(config, str(tmp_path / "b"))
    lora_run = summary["run"]
    want = lora.merged_params(
        lora_run.spec.weights.frozen, lora_run.run_state.policy.params, lora_run.spec.weights.scale
    )
    for got, ref in zip(jax.tree.leaves(run.run_state.policy.params), jax.tree.leaves(want)):
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-7)


def test_lora_continues_a_lora_checkpoint(grpo_run, tmp_path):
    _, workdir, summary = grpo_run
    directory = os.path.join(workdir, "checkpoints")
    config = tiny("grpo", extra=f"{LORA},init_checkpoint={directory!r}")
    run = trainer.build_run(config, str(tmp_path / "a"))
    for got, ref in zip(
        jax.tree.leaves(run.run_state.policy.params),
        jax.tree.leaves(summary["run"].run_state.policy.params),
    ):
        np.testing.assert_array_equal(got, ref)
    assert int(run.run_state.policy.step) == 0  # the adapters, not the optimiser's state
    other = tiny("grpo", extra=f"model.lora.rank=4,init_checkpoint={directory!r}")
    with pytest.raises(ValueError, match="holds adapters of rank 2 on attention,mlp"):
        trainer.build_run(other, str(tmp_path / "b"))


def test_sft_trains_full_weights_under_a_lora_config(sft_checkpoint):
    with Checkpointer(sft_checkpoint) as source:
        assert not any(".lora." in n for n in source.saved_shapes())
        assert "lora" not in source.meta()


def test_dry_run_checks_the_lora_pairing(sft_checkpoint, tmp_path):
    from policyopt.rl.reporting.dry_run import plan_run

    config = tiny("grpo", extra=f"{LORA},init_checkpoint={sft_checkpoint!r}")
    with pytest.raises(ValueError, match="model.lora.init_checkpoint='base'"):
        plan_run(config, str(tmp_path))
    config = tiny(
        "grpo",
        extra=f"{LORA},init_checkpoint={sft_checkpoint!r},model.lora.init_checkpoint=base",
    )
    text = plan_run(config, str(tmp_path))
    assert "LoRA rank 2 on attention,mlp" in text and "trainable" in text
