"""Sequence packing: the packer against a hand-worked case and a brute-force check; log-probs,
values, losses and gradients on packed rows equal the padded layout's (dense and MoE, with
routing replay); a trainer iteration with ``batch.pack`` on equals one with it off."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from policyopt.models import Transformer, preset
from policyopt.rl.batch import Batch, layout
from policyopt.rl.update.critic import critic_loss, forward_values, init_critic_params
from policyopt.rl.update.learner import forward_log_probs, rl_loss, split_params
from policyopt.rl.update.packing import gather_slots, pack_layout, packed_rows
from tests.flags import run_script
from tests.settings import critic_settings, loss_settings

VOCAB = 16


def test_hand_worked_first_fit_decreasing():
    # Real tokens: row 0 columns 1-4 (4), row 1 all 6, row 2 columns 2-3 (2), row 3
    # columns 1-3 (3). T = 8, longest first: row 1 opens packed row 0 (2 free), row 0
    # opens packed row 1 (4 free), row 3 fits packed row 1 at 4 (1 free), row 2 fits
    # packed row 0 at 6 (0 free).
    mask = np.array(
        [[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 0, 0], [0, 1, 1, 1, 0, 0]]
    )
    packed = pack_layout(mask, 8)
    np.testing.assert_array_equal(
        packed.segment_ids, [[2, 2, 2, 2, 2, 2, 3, 3], [1, 1, 1, 1, 4, 4, 4, 0]]
    )
    # source: r * 6 + s; row 1 is 6..11, row 2's columns 2, 3 are 14, 15, row 3's 19..21.
    np.testing.assert_array_equal(
        packed.source, [[6, 7, 8, 9, 10, 11, 14, 15], [1, 2, 3, 4, 19, 20, 21, -1]]
    )
    np.testing.assert_array_equal(
        packed.target,
        [
            [-1, 8, 9, 10, 11, -1],
            [0, 1, 2, 3, 4, 5],
            [-1, -1, 6, 7, -1, -1],
            [-1, 12, 13, 14, -1, -1],
        ],
    )
    assert packed.num_real == 15 and packed.padding_fraction == pytest.approx(1 / 16)
    # Two row shards: the 2 packed rows stay 2; three shards: rounded up to 3.
    assert pack_layout(mask, 8, row_multiple=2).segment_ids.shape == (2, 8)
    assert pack_layout(mask, 8, row_multiple=3).segment_ids.shape == (3, 8)


def test_packed_rows_bucket():
    assert [packed_rows(n) for n in (0, 1, 2, 3, 5, 9)] == [1, 1, 2, 4, 8, 16]
    assert [packed_rows(n, 4) for n in (1, 4, 5, 9)] == [4, 4, 8, 16]
    # Never above the padded row count (rounded to the multiple) when the rows fit there.
    assert packed_rows(5, 1, padded=6) == 6 and packed_rows(7, 1, padded=6) == 8
    assert packed_rows(5, 4, padded=6) == 8


def _random_mask(rng, rows, prompt_width, response_width):
    mask = np.zeros((rows, prompt_width + response_width), np.int32)
    for r in range(rows):
        p = rng.integers(1, prompt_width + 1)
        n = rng.integers(0, response_width + 1)
        mask[r, prompt_width - p : prompt_width + n] = 1
    return mask


# One compiled program per shape, not one per eager operation inside gather_slots.
_gather_positions = jax.jit(lambda positions, source: gather_slots(positions, source, fill=-1))


@pytest.mark.parametrize("seed", range(20))
def test_brute_force_every_token_placed_once(seed):
    rng = np.random.default_rng(seed)
    rows, pw, rw = int(rng.integers(1, 12)), int(rng.integers(1, 6)), int(rng.integers(1, 9))
    mask = _random_mask(rng, rows, pw, rw)
    width = pw + rw
    row_length = int(rng.integers(mask.sum(1).max(), 2 * width + 1))
    packed = pack_layout(mask, row_length, row_multiple=int(rng.integers(1, 4)))
    seg, source, target = packed
    # Every real padded slot appears exactly once in source, nothing else does.
    placed = np.sort(source[source >= 0])
    np.testing.assert_array_equal(placed, np.flatnonzero(mask.reshape(-1)))
    # target inverts source.
    for r in range(rows):
        for s in range(width):
            if mask[r, s]:
                p, t = divmod(int(target[r, s]), row_length)
                assert source[p, t] == r * width + s and seg[p, t] == r + 1
            else:
                assert target[r, s] == -1
    # Segments are contiguous, in column order, never split across packed rows.
    for r in range(rows):
        where = np.argwhere(seg == r + 1)
        if mask[r].sum() == 0:
            assert where.size == 0
            continue
        assert len(set(where[:, 0])) == 1
        slots = where[:, 1]
        np.testing.assert_array_equal(slots, slots[0] + np.arange(len(slots)))
        np.testing.assert_array_equal(
            source[where[0, 0], slots] - r * width, np.flatnonzero(mask[r])
        )
    assert np.all((seg == 0) == (source == -1))
    # First fit decreasing, replayed: rows longest first (ties by index), each at the end
    # of the first packed row that had room for it then.
    lengths = mask.sum(1)
    fill = np.zeros(seg.shape[0], int)
    for r in np.argsort(-lengths, kind="stable"):
        if lengths[r] == 0:
            continue
        p, t = divmod(int(target[r, np.argmax(mask[r])]), row_length)
        assert t == fill[p] and np.all(row_length - fill[:p] < lengths[r])
        fill[p] += lengths[r]
    if row_length >= width:
        assert (fill > 0).sum() <= rows
    # Positions: packing the padded positions restarts each segment at its row's start.
    positions = layout(
        [[1] * int(np.sum(mask[r, :pw])) for r in range(rows)],
        [[1] * int(np.sum(mask[r, pw:])) for r in range(rows)],
        0,
        pw,
        rw,
    )["positions"]
    packed_positions = np.asarray(_gather_positions(positions, source))
    for r in range(rows):
        got = packed_positions[seg == r + 1]
        np.testing.assert_array_equal(got, np.arange(len(got)))


def test_too_small_bucket_names_the_row():
    mask = np.array([[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 0]])
    with pytest.raises(
        ValueError,
        match=r"row 1 has 4 real tokens .* packed row length 3 "
        r"\(config\.batch\.pack_tokens\)",
    ):
        pack_layout(mask, 3)
    # A minibatch's rows are named by their number in the batch.
    with pytest.raises(ValueError, match=r"row 7 has 4 real tokens"):
        pack_layout(mask, 3, row_ids=[5, 7, 9])
    with pytest.raises(ValueError, match="row 0: its real tokens .* not contiguous"):
        pack_layout(np.array([[1, 0, 1]]), 3)


def test_gather_slots_round_trip_and_axis():
    rng = np.random.default_rng(0)
    mask = _random_mask(rng, 5, 3, 4)
    packed = pack_layout(mask, 9)
    x = rng.normal(size=(2, 5, 7, 3)).astype(np.float32)  # [L, R, S, k]-like
    there = gather_slots(x, packed.source, axis=1, fill=-7.0)
    assert there.shape == (2,) + packed.source.shape + (3,)
    back = np.asarray(gather_slots(there, packed.target, axis=1, fill=0.0))
    np.testing.assert_array_equal(back, np.where(mask[None, :, :, None] > 0, x, 0.0))
    assert np.all(np.asarray(there)[:, packed.segment_ids == 0] == -7.0)


# ---- The model on packed rows --------------------------------------------------------------


def _batch(rng, rows, prompt_width, response_width):
    prompts = [list(rng.integers(3, VOCAB, rng.integers(1, prompt_width + 1))) for _ in range(rows)]
    responses = [
        list(rng.integers(3, VOCAB, rng.integers(1, response_width + 1))) for _ in range(rows)
    ]
    arrays = layout(prompts, responses, 0, prompt_width, response_width)
    mask = arrays["mask"]
    mask[-1] = 0  # a row left out of the loss (e.g. overlong filtering): still packed
    return Batch(
        tokens=jnp.asarray(arrays["tokens"]),
        positions=jnp.asarray(arrays["positions"]),
        attention_mask=jnp.asarray(arrays["attention_mask"]),
        mask=jnp.asarray(mask),
        advantages=jnp.asarray(rng.normal(size=rows), jnp.float32),
        old_log_probs=jnp.asarray(-rng.random((rows, response_width)) * mask, jnp.float32),
        ref_log_probs=jnp.asarray(-rng.random((rows, response_width)) * mask, jnp.float32),
        old_values=jnp.asarray(rng.normal(size=mask.shape) * mask, jnp.float32),
        returns=jnp.asarray(rng.normal(size=mask.shape) * mask, jnp.float32),
    )


def _assert_trees_close(got, want, tol=1e-5):
    """Every leaf within ``tol`` of ``want``'s, relative to the leaf's largest entry (>= 1)."""
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        scale = max(1.0, float(np.max(np.abs(b))))
        np.testing.assert_allclose(a, b, atol=tol * scale, rtol=0)


def _packed(batch, row_length=None):
    layout_ = pack_layout(np.asarray(batch.attention_mask), row_length or batch.tokens.shape[1])
    return batch._replace(packing=jax.tree.map(jnp.asarray, layout_))


# One-layer models: every layer reads the same segment ids and positions, so a token
# attending across segments or a misplaced position already shows in one layer's outputs
# and gradients; more layers add compile time, not cases.


@pytest.mark.parametrize("name", ["tiny_dense", "tiny_moe"])
def test_log_probs_losses_gradients_equal_padded(name):
    model = Transformer(preset(name, vocab_size=VOCAB, num_layers=1), rngs=nnx.Rngs(0))
    graphdef, params = split_params(model)
    rng = np.random.default_rng(1)
    batch = _batch(rng, rows=6, prompt_width=5, response_width=7)
    packed = _packed(batch)
    assert packed.packing.segment_ids.shape[0] < 6  # rows did share packed rows
    fwd = jax.jit(
        lambda p, b: forward_log_probs(
            graphdef,
            p,
            b.tokens,
            b.positions,
            b.attention_mask,
            b.num_response,
            temperature=0.7,
            routing=b.routing,
            packing=b.packing,
        )
    )
    want, got = fwd(params, batch), fwd(params, packed)
    real = np.asarray(batch.attention_mask)[:, 5:] > 0
    np.testing.assert_allclose(
        np.where(real, got.log_probs, 0), np.where(real, want.log_probs, 0), atol=1e-5
    )
    np.testing.assert_allclose(
        np.where(real, got.entropy, 0), np.where(real, want.entropy, 0), atol=1e-5
    )
    if name == "tiny_moe":
        # Routing recorded on packed rows maps back to [L, R, S, k] on every real token,
        # and replaying it (R2) on packed rows gives the padded replay's log-probs.
        real_slots = np.asarray(batch.attention_mask) > 0
        np.testing.assert_array_equal(
            np.asarray(got.routing)[:, real_slots], np.asarray(want.routing)[:, real_slots]
        )
        np.testing.assert_allclose(
            got.aux["load_balancing_loss"], want.aux["load_balancing_loss"], rtol=1e-5
        )
        # k distinct random experts per token (not the model's own choice).
        e, k = model.config.num_experts, want.routing.shape[-1]
        choice = np.argsort(rng.random(want.routing.shape[:-1] + (e,)), axis=-1)[..., :k]
        replay = jnp.asarray(choice, jnp.int32)
        batch, packed = batch._replace(routing=replay), packed._replace(routing=replay)
        want, got = fwd(params, batch), fwd(params, packed)
        np.testing.assert_allclose(
            np.where(real, got.log_probs, 0), np.where(real, want.log_probs, 0), atol=1e-5
        )
        np.testing.assert_array_equal(
            np.asarray(got.routing)[:, real_slots], np.asarray(replay)[:, real_slots]
        )
    # Sequence-level ratios and per-sequence means (GSPO) on the dense model, the token
    # clip with a token-mean over the minibatch and the MoE terms on the MoE one.
    cases = {
        "tiny_dense": [("gspo", "seq_mean_token_mean"), ("sapo", "seq_mean_token_sum_norm")],
        "tiny_moe": [("ppo", "token_mean")],
    }[name]
    for method, aggregation in cases:
        settings = loss_settings(
            method=method,
            aggregation=aggregation,
            temperature=0.7,
            group_size=2,
            max_len=7,
            kl_beta=0.05,
            entropy_coef=0.01,
            load_balancing_coef=0.01 if name == "tiny_moe" else 0.0,
        )
        grad = jax.jit(
            jax.value_and_grad(lambda p, b: rl_loss(graphdef, p, b, settings), has_aux=True)
        )
        (loss_p, metrics_p), grads_p = grad(params, batch)
        (loss_k, metrics_k), grads_k = grad(params, packed)
        assert float(loss_k) == pytest.approx(float(loss_p), abs=1e-5), method
        for key in metrics_p:
            np.testing.assert_allclose(metrics_k[key], metrics_p[key], atol=1e-5, err_msg=key)
        _assert_trees_close(grads_k, grads_p)


def test_critic_values_and_loss_equal_padded():
    model = Transformer(preset("tiny_moe", vocab_size=VOCAB, num_layers=1), rngs=nnx.Rngs(0))
    graphdef, policy_params = split_params(model)
    params = init_critic_params(policy_params, model.config.hidden_size)
    params["head"]["kernel"] = jax.random.normal(jax.random.PRNGKey(3), (model.config.hidden_size,))
    rng = np.random.default_rng(4)
    batch = _batch(rng, rows=5, prompt_width=4, response_width=6)
    packed = _packed(batch, row_length=16)
    values = jax.jit(
        lambda p, b: forward_values(
            graphdef, p, b.tokens, b.positions, b.attention_mask, b.num_response, packing=b.packing
        )
    )
    real = np.asarray(batch.attention_mask)[:, 4:] > 0
    np.testing.assert_allclose(
        np.where(real, values(params, packed), 0),
        np.where(real, values(params, batch), 0),
        atol=1e-5,
    )
    settings = critic_settings(value_clip=0.2, load_balancing_coef=0.01)
    grad = jax.jit(
        jax.value_and_grad(lambda p, b: critic_loss(graphdef, p, b, settings), has_aux=True)
    )
    (loss_p, _), grads_p = grad(params, batch)
    (loss_k, _), grads_k = grad(params, packed)
    assert float(loss_k) == pytest.approx(float(loss_p), abs=1e-5)
    _assert_trees_close(grads_k, grads_p)


# ---- The trainer -------------------------------------------------------------------------


def test_trainer_iteration_packed_equals_padded(tmp_path):
    """One PPO iteration (critic, GAE, KL to a reference, R2 replay, 2 minibatches) with
    ``batch.pack`` on gives the parameters and metrics of the padded iteration. Wrong
    answers score -1, so the value loss and the GAE advantages are not zero; Adam's larger eps
    keeps entries whose gradient is float noise (either way) from being scaled up to lr."""
    from policyopt.rl.loop import trainer
    from tests.rl.test_trainer import tiny

    runs = {}
    for pack in (False, True):
        config = tiny(
            "ppo",
            "tiny_moe",
            extra="algo.routing_replay=R2,batch.n_minibatches=2,"
            f"algo.kl_beta=0.01,critic.pretrain_iterations=0,batch.pack={pack},"
            "batch.pack_tokens=44,reward.incorrect_value=-1.0,optim.eps=1e-4",
        )
        run = trainer.build_run(config, str(tmp_path / str(pack)))
        runs[pack] = (run, run.step())
    (padded, want), (packed, got) = runs[False], runs[True]
    np.testing.assert_array_equal(packed.last_round.tokens, padded.last_round.tokens)
    assert got["batch/padding_fraction"] == want["batch/padding_fraction"] > 0
    # The packed rows held every real token: their slots are whole rows of 44, at least
    # one per minibatch.
    real = int(np.sum(packed.last_round.attention_mask))
    slots = real / (1 - got["batch/packed_padding_fraction"])
    assert slots == pytest.approx(round(slots / 44) * 44) and slots >= 2 * 44
    assert "batch/packed_padding_fraction" not in want
    assert want["update/grad_norm"] > 1e-3 and want["critic/value_loss"] > 1e-3  # a real update
    for key in (
        "loss/total",
        "loss/kl_ref",
        "critic/value_loss",
        "update/grad_norm",
        "critic/grad_norm",
        "logprob/sampler_trainer_abs_diff",
        "advantages/mean",
    ):
        assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-5), key
    assert int(packed.run_state.policy.step) == int(padded.run_state.policy.step) == 2
    _assert_trees_close(packed.run_state.policy.params, padded.run_state.policy.params)
    _assert_trees_close(packed.run_state.critic.params, padded.run_state.critic.params)


_MESH_SCRIPT = """
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from policyopt import sharding
from policyopt.models import Transformer, preset
from policyopt.rl.update import forwards
from policyopt.rl.batch import shard_batch
from policyopt.rl.update.learner import forward_log_probs, rl_loss, split_params
from tests.settings import critic_settings, loss_settings
from tests.rl.test_packing import _batch
from tests.rl.test_trainer import tiny

assert jax.device_count() == 8
config = tiny("gspo", "tiny_moe", extra="batch.pack=True")
mesh = sharding.make_mesh({"data": 4, "fsdp": 2})
with jax.set_mesh(mesh):
    model = Transformer(preset("tiny_moe", vocab_size=16, num_layers=1), rngs=nnx.Rngs(0))
    graphdef, params = split_params(model)
    batch = _batch(np.random.default_rng(5), rows=8, prompt_width=4, response_width=6)
    layout = forwards.pack_rows(config, np.asarray(batch.attention_mask))
    assert layout.segment_ids.shape[0] % 8 == 0, layout.segment_ids.shape
    padded = shard_batch(batch)
    packed = shard_batch(batch._replace(packing=layout))
    assert packed.packing.segment_ids.sharding.spec[0] == ("data", "fsdp")
    settings = loss_settings(method="gspo", aggregation="seq_mean_token_mean", group_size=4)
    step = jax.jit(jax.value_and_grad(lambda p, b: rl_loss(graphdef, p, b, settings)[0]))
    (want, grads_p), (got, grads_k) = step(params, padded), step(params, packed)
    assert abs(float(got) - float(want)) < 1e-5, (got, want)
    for a, b in zip(jax.tree.leaves(grads_k), jax.tree.leaves(grads_p)):
        scale = max(1.0, float(jnp.max(jnp.abs(b))))
        np.testing.assert_allclose(a, b, atol=1e-5 * scale, rtol=0)
print("OK")
"""


def test_packed_update_on_a_mesh_equals_padded():
    """8 simulated devices, rows over data x fsdp: packed rows split over them too (their
    count a multiple of 8), the GSPO loss and its gradient those of the padded rows."""

    result = run_script(_MESH_SCRIPT, 8, "--xla_backend_optimization_level=0")
    assert "OK" in result.stdout, result.stdout[-3000:]
