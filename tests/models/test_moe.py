"""MoE block: ragged, blocked, dense and gathered (dropless) and capacity dispatch against a
plain loop over tokens and experts; gradients; routing replay; capacity drops and priority;
router statistics worked out by hand."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from policyopt.models import ModelConfig
from policyopt.models.experts import (
    capacity_experts,
    gathered_capacities,
    gathered_experts,
    megablox_matmul,
)
from policyopt.models.moe import MoE
from policyopt.models.router import route, router_aux

E, K, D, F = 4, 2, 8, 6


def _config(**overrides):
    fields = dict(
        vocab_size=16,
        hidden_size=D,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=4,
        intermediate_size=8,
        num_experts=E,
        num_experts_per_tok=K,
        moe_intermediate_size=F,
        initializer_range=0.5,
    )
    return ModelConfig(**{**fields, **overrides})


def _params(moe):
    return {
        name: np.asarray(getattr(moe, name)[...], np.float64)
        for name in ("router", "gate_proj", "up_proj", "down_proj")
    }


def numpy_loop_moe(x, params, k, norm_topk_prob, routing=None):
    """The MoE written as loops over tokens and chosen experts, in float64."""
    x = np.asarray(x, np.float64).reshape(-1, D)
    out = np.zeros_like(x)
    chosen = np.zeros((x.shape[0], k), np.int64)
    for n in range(x.shape[0]):
        logits = x[n] @ params["router"]
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        experts = np.argsort(-probs, kind="stable")[:k] if routing is None else routing[n]
        gates = probs[experts]
        if norm_topk_prob:
            gates = gates / gates.sum()
        for gate, e in zip(gates, experts):
            hidden = x[n] @ params["gate_proj"][e]
            hidden = hidden / (1 + np.exp(-hidden)) * (x[n] @ params["up_proj"][e])
            out[n] += gate * (hidden @ params["down_proj"][e])
        chosen[n] = experts
    return out, chosen


def jax_loop_moe(x, router, gate_proj, up_proj, down_proj, routing, k, norm_topk_prob):
    """Differentiable reference: every expert on every token, one expert at a time."""
    probs = jax.nn.softmax(x @ router, axis=-1)
    gates = jnp.take_along_axis(probs, routing, axis=-1)
    if norm_topk_prob:
        gates = gates / gates.sum(-1, keepdims=True)
    out = jnp.zeros_like(x)
    for e in range(router.shape[1]):
        weight = jnp.sum(gates * (routing == e), axis=-1)
        hidden = jax.nn.silu(x @ gate_proj[e]) * (x @ up_proj[e])
        out = out + weight[:, None] * (hidden @ down_proj[e])
    return out


@functools.partial(jax.jit, static_argnames="graphdef")
def _apply(state, x, mask, routing, graphdef):
    return nnx.merge(graphdef, state)(x, mask, routing)


def _run(moe, x, routing=None, mask=None):
    graphdef, state = nnx.split(moe)
    mask = jnp.ones(x.shape[:2], bool) if mask is None else mask
    return _apply(state, x, mask, routing, graphdef)


def _inputs(seed=0, shape=(2, 6)):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(*shape, D)), jnp.float32)


def test_route_hand_worked():
    # probs = (1, 2, 3, 1) / 7: top-2 = experts 2, 1.
    logits = jnp.log(jnp.array([[1.0, 2.0, 3.0, 1.0]]))
    ids, gates, probs = route(logits, 2, norm_topk_prob=True)
    np.testing.assert_array_equal(ids, [[2, 1]])
    np.testing.assert_allclose(gates, [[3 / 5, 2 / 5]], rtol=1e-6)
    _, gates, _ = route(logits, 2, norm_topk_prob=False)
    np.testing.assert_allclose(gates, [[3 / 7, 2 / 7]], rtol=1e-6)
    # Replay experts 0 and 3: gates from the same current probabilities.
    ids, gates, _ = route(logits, 2, norm_topk_prob=True, routing=jnp.array([[0, 3]]))
    np.testing.assert_array_equal(ids, [[0, 3]])
    np.testing.assert_allclose(gates, [[1 / 2, 1 / 2]], rtol=1e-6)
    _, gates, _ = route(logits, 2, norm_topk_prob=False, routing=jnp.array([[0, 3]]))
    np.testing.assert_allclose(gates, [[1 / 7, 1 / 7]], rtol=1e-6)


# Every dispatch, and the blocked one's weight gathers by one-hot and chunks (`_dispatch`).
DISPATCHES = (
    "ragged",
    "megablox",
    "blocked",
    "blocked-onehot",
    "blocked-chunked",
    "dense",
    "gathered",
    "capacity",
)


def _dispatch(name):
    """ "blocked-onehot" -> blocked dispatch with one-hot weight gathering; "blocked-chunked"
    -> blocked, the expert matmuls 7 padded rows (of blocks of 3 or 4: 2 or 1 blocks) at a
    time; else the name."""
    dispatch, _, variant = name.partition("-")
    if variant == "chunked":
        return dict(moe_dispatch=dispatch, moe_weight_gather="take", moe_chunk_rows=7)
    return dict(moe_dispatch=dispatch, moe_weight_gather=variant or "take")


@pytest.mark.parametrize(
    "dispatch,norm_topk_prob",
    [
        ("ragged", True),
        ("ragged", False),
        ("megablox", True),
        ("blocked", True),
        ("blocked-onehot", False),
        ("blocked-chunked", True),
        ("dense", True),
        ("dense", False),
        ("gathered", True),
        ("capacity", False),
    ],
)
def test_fast_paths_match_loop_reference(dispatch, norm_topk_prob):
    # capacity_factor = E / K: every expert can hold every token, nothing is dropped.
    # Block size 3: groups of every size modulo the block occur, some experts get none.
    moe = MoE(
        _config(
            **_dispatch(dispatch),
            norm_topk_prob=norm_topk_prob,
            capacity_factor=E / K,
            moe_block_size=3,
        ),
        rngs=nnx.Rngs(0),
    )
    x = _inputs()
    y, routing, aux = _run(moe, x)
    want, chosen = numpy_loop_moe(x, _params(moe), K, norm_topk_prob)
    np.testing.assert_array_equal(routing.reshape(-1, K), chosen)
    np.testing.assert_allclose(y.reshape(-1, D), want, rtol=1e-5, atol=1e-6)
    assert float(aux["dropped_tokens"]) == 0
    np.testing.assert_array_equal(
        aux["tokens_per_expert"], np.bincount(chosen.ravel(), minlength=E)
    )


@pytest.mark.parametrize("dispatch", DISPATCHES)
def test_gradients_match_loop_reference_under_replay(dispatch):
    """Replay a routing that differs from the natural one (the k *least* likely experts):
    output and every gradient equal the loop reference with those experts; the router
    gets a non-zero gradient through the recomputed gates."""
    moe = MoE(
        _config(**_dispatch(dispatch), capacity_factor=E / K, moe_block_size=4), rngs=nnx.Rngs(1)
    )
    x = _inputs(seed=1)
    natural, natural_routing, _ = _run(moe, x)
    # In NumPy: eager jnp ops would each compile a program.
    logits = np.asarray(x, np.float64).reshape(-1, D) @ np.asarray(moe.router[...], np.float64)
    forced = np.argsort(logits, axis=-1, kind="stable")[:, :K].astype(np.int32)  # least likely
    assert not np.array_equal(np.sort(forced, -1), np.sort(natural_routing.reshape(-1, K), -1))
    forced = jnp.asarray(forced.reshape(2, 6, K))
    cotangent = jnp.asarray(np.random.default_rng(2).normal(size=(2, 6, D)), jnp.float32)
    graphdef, state = nnx.split(moe)

    def fast(state, x):
        y, routing, _ = nnx.merge(graphdef, state)(x, jnp.ones((2, 6), bool), forced)
        return jnp.sum(y * cotangent), (y, routing)

    (_, (y, routing)), (grad_state, grad_x) = jax.jit(
        jax.value_and_grad(fast, argnums=(0, 1), has_aux=True)
    )(state, x)
    np.testing.assert_array_equal(routing, forced)
    want, _ = numpy_loop_moe(x, _params(moe), K, True, routing=np.asarray(forced).reshape(-1, K))
    np.testing.assert_allclose(y.reshape(-1, D), want, rtol=1e-5, atol=1e-6)
    assert not np.allclose(y, natural)

    names = ("router", "gate_proj", "up_proj", "down_proj")
    ref_weights, ref_x = _replay_reference_grads(
        tuple(getattr(moe, n)[...] for n in names), x, forced, cotangent
    )
    np.testing.assert_allclose(grad_x, ref_x, rtol=1e-4, atol=1e-6)
    for name, ref in zip(names, ref_weights):
        np.testing.assert_allclose(grad_state[name][...], ref, rtol=1e-4, atol=1e-6)
    assert float(np.abs(np.asarray(grad_state["router"][...])).max()) > 1e-3


@jax.jit  # one program for every dispatch's case (the routing is an argument)
def _replay_reference_grads(weights, x, forced, cotangent):
    def reference(weights, x):
        y = jax_loop_moe(x.reshape(-1, D), *weights, forced.reshape(-1, K), K, True)
        return jnp.sum(y.reshape(2, 6, D) * cotangent)

    return jax.grad(reference, argnums=(0, 1))(weights, x)


def test_capacity_drops_overflow_in_priority_order():
    """C = 1. Token 0 picks (e0, e1), token 1 picks (e1, e0): both first choices get the
    single slot of their expert, both second choices are dropped."""
    x = jnp.asarray(np.random.default_rng(3).normal(size=(2, D)), jnp.float32)
    weights = [
        jnp.asarray(np.random.default_rng(s).normal(size=shape), jnp.float32)
        for s, shape in ((4, (E, D, F)), (5, (E, D, F)), (6, (E, F, D)))
    ]
    ids = jnp.array([[0, 1], [1, 0]], jnp.int32)
    gates = jnp.array([[0.7, 0.3], [0.6, 0.4]], jnp.float32)
    experts = jax.jit(capacity_experts, static_argnames="capacity")  # one program, both calls
    y, dropped = experts(x, ids, gates, jnp.ones(2, bool), *weights, capacity=1)
    params = dict(zip(("gate_proj", "up_proj", "down_proj"), [np.asarray(w) for w in weights]))

    def expert(n, e):
        h = np.asarray(x[n]) @ params["gate_proj"][e]
        return (h / (1 + np.exp(-h)) * (np.asarray(x[n]) @ params["up_proj"][e])) @ params[
            "down_proj"
        ][e]

    np.testing.assert_allclose(y, [0.7 * expert(0, 0), 0.6 * expert(1, 1)], rtol=1e-5, atol=1e-6)
    assert float(dropped) == 2
    # Padding takes no slot: token 0 is padding, so token 1 gets expert 0's only slot.
    ids = jnp.array([[0, 1], [0, 1]], jnp.int32)
    y, dropped = experts(x, ids, gates, jnp.array([False, True]), *weights, capacity=1)
    np.testing.assert_allclose(y[1], 0.6 * expert(1, 0) + 0.4 * expert(1, 1), rtol=1e-5, atol=1e-6)
    assert float(dropped) == 0


def test_capacity_factor_one_drops_when_all_tokens_pick_the_same_experts():
    # Router that sends every token to experts 0 then 1: C = ceil(1.0 * 12 * 2 / 4) = 6,
    # so of 12 copies per expert 6 are kept and 12 dropped in all.
    moe = MoE(_config(moe_dispatch="capacity", capacity_factor=1.0), rngs=nnx.Rngs(0))
    moe.router[...] = jnp.zeros((D, E)).at[:, 0].set(10.0).at[:, 1].set(5.0)
    x = jnp.abs(_inputs()) + 0.1
    y, routing, aux = _run(moe, x)
    assert np.all(np.asarray(routing) == [0, 1])
    assert float(aux["dropped_tokens"]) == 12
    want, _ = numpy_loop_moe(x, _params(moe), K, True)
    np.testing.assert_allclose(y.reshape(-1, D)[:6], want[:6], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(y.reshape(-1, D)[6:], 0.0)


def test_router_statistics_hand_worked():
    # Uniform router (zero logits): top-2 ties resolve to experts 0 and 1 on every token.
    n = 5
    logits = jnp.zeros((n, E))
    ids, _, probs = route(logits, K, True)
    np.testing.assert_array_equal(ids, np.tile([0, 1], (n, 1)))
    aux = router_aux(logits, probs, ids, jnp.ones(n, bool), E)
    np.testing.assert_allclose(aux["tokens_per_expert"], [n, n, 0, 0])
    # E * sum_e f_e P_e = 4 * (0.5 * 0.25 + 0.5 * 0.25) = 1; z = logsumexp(0)^2 = log(4)^2.
    np.testing.assert_allclose(aux["load_balancing_loss"], 1.0, rtol=1e-6)
    np.testing.assert_allclose(aux["router_z_loss"], np.log(4.0) ** 2, rtol=1e-6)
    # Everything on one expert with probability ~1: f = (1/2, 1/2, 0, 0), P = (1, 0, 0, 0)
    # gives 4 * 1/2 = 2; padding rows do not count.
    logits = jnp.tile(jnp.array([[50.0, 0.0, 0.0, 0.0]]), (n, 1))
    ids, _, probs = route(logits, K, True)
    aux = router_aux(logits, probs, ids, jnp.array([True, True, False, True, False]), E)
    np.testing.assert_allclose(aux["load_balancing_loss"], 2.0, rtol=1e-6)
    assert float(aux["tokens_per_expert"][0]) == 3


@pytest.mark.parametrize("chunk_rows", [None, 16])
@pytest.mark.parametrize("gather", ["take", "onehot"])
@pytest.mark.parametrize("tokens", [1, 40])
def test_blocked_dispatch_any_token_count(tokens, gather, chunk_rows):
    """Decode-sized (1 token: block shrinks to 1 row) to many blocks per expert; whole or
    in chunks of 2 blocks (40 tokens: 10 + 4 blocks of 8 rows, 7 chunks)."""
    from policyopt.models.experts import blocked_experts

    rng = np.random.default_rng(tokens)
    x = jnp.asarray(rng.normal(size=(tokens, D)), jnp.float32)
    ids = jnp.asarray(np.stack([rng.choice(E, K, replace=False) for _ in range(tokens)]), jnp.int32)
    gates = jnp.asarray(rng.uniform(size=(tokens, K)), jnp.float32)
    weights = [
        jnp.asarray(rng.normal(size=shape), jnp.float32)
        for shape in ((E, D, F), (E, D, F), (E, F, D))
    ]
    got = jax.jit(blocked_experts, static_argnames=("block_size", "gather", "chunk_rows"))(
        x, ids, gates, *weights, block_size=8, gather=gather, chunk_rows=chunk_rows
    )
    want = numpy_loop_fixed_gates(x, ids, gates, *weights)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def numpy_loop_fixed_gates(x, ids, gates, gate_proj, up_proj, down_proj):
    out = np.zeros(x.shape, np.float64)
    x64 = np.asarray(x, np.float64)
    for n in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[n, j])
            hidden = x64[n] @ np.asarray(gate_proj[e], np.float64)
            hidden = hidden / (1 + np.exp(-hidden)) * (x64[n] @ np.asarray(up_proj[e], np.float64))
            out[n] += float(gates[n, j]) * (hidden @ np.asarray(down_proj[e], np.float64))
    return out


@pytest.mark.parametrize("tokens_per_row", [1, 5])
def test_decode_dispatch_applies_to_one_token_calls_only(tokens_per_row):
    """moe_decode_dispatch="ragged" under moe_dispatch="blocked": a call of one token per
    row (a decode step) goes through ragged_dot, a longer call through the blocks; both
    equal the loop reference (so the sampler and the trainer compute the same policy)."""
    moe = MoE(
        _config(moe_dispatch="blocked", moe_decode_dispatch="ragged", moe_block_size=2),
        rngs=nnx.Rngs(3),
    )
    x = _inputs(seed=3, shape=(6, tokens_per_row))
    graphdef, state = nnx.split(moe)
    jaxpr = str(
        jax.make_jaxpr(lambda s, x: nnx.merge(graphdef, s)(x, jnp.ones(x.shape[:2], bool)))(
            state, x
        )
    )
    assert ("ragged_dot" in jaxpr) == (tokens_per_row == 1)
    y, routing, _ = _run(moe, x)
    want, chosen = numpy_loop_moe(x, _params(moe), K, True)
    np.testing.assert_array_equal(routing.reshape(-1, K), chosen)
    np.testing.assert_allclose(y.reshape(-1, D), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="moe_decode_dispatch"):
        _config(moe_decode_dispatch="sparse")


def test_blocked_take_gradient_sums_in_the_parameter_dtype():
    """bfloat16 compute, float32 parameters, blocks of 4 rows: the "take" gather's
    gradient (a scatter-add of ~500 blocks per expert) sums in float32, so the expert
    weights' gradient error against a float32 loop reference (same bfloat16-rounded
    inputs, same routing) is the ragged dispatch's (0.57%; 0.60% blocked), not the 2.7%
    of a bfloat16 scatter-add."""
    dim, tokens = 64, (4, 1024)
    fields = dict(
        hidden_size=dim,
        moe_intermediate_size=dim,
        initializer_range=0.1,
        dtype="bfloat16",
        moe_block_size=4,
    )
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(*tokens, dim)), jnp.bfloat16)
    cotangent = jnp.asarray(rng.normal(size=(*tokens, dim)), jnp.float32)
    mask = jnp.ones(tokens, bool)
    names = ("gate_proj", "up_proj", "down_proj")

    def grads(**dispatch):
        moe = MoE(_config(**fields, **dispatch), rngs=nnx.Rngs(0))
        graphdef, state = nnx.split(moe)

        def loss(state):
            y, routing, _ = nnx.merge(graphdef, state)(x, mask)
            return jnp.sum(y.astype(jnp.float32) * cotangent), routing

        grad, routing = jax.jit(jax.grad(loss, has_aux=True))(state)
        return moe, routing, {n: np.asarray(grad[n][...], np.float64) for n in names}

    moe, routing, ragged = grads(moe_dispatch="ragged")
    _, blocked_routing, blocked = grads(moe_dispatch="blocked", moe_weight_gather="take")
    np.testing.assert_array_equal(routing, blocked_routing)

    def reference(weights):
        y = jax_loop_moe(
            x.reshape(-1, dim).astype(jnp.float32),
            moe.router[...],
            *weights,
            routing.reshape(-1, K),
            K,
            True,
        )
        return jnp.sum(y.reshape(*tokens, dim) * cotangent)

    want = jax.jit(jax.grad(reference))(tuple(getattr(moe, n)[...] for n in names))
    for name, ref in zip(names, want):
        ref = np.asarray(ref, np.float64)
        error = {
            k: np.linalg.norm(g[name] - ref) / np.linalg.norm(ref)
            for k, g in (("ragged", ragged), ("blocked", blocked))
        }
        assert error["ragged"] < 0.01, (name, error)
        assert error["blocked"] < 1.1 * error["ragged"], (name, error)


def test_megablox_matmul_matches_one_hot_products():
    """The megablox GMM kernel (Pallas interpret mode on the CPU) against the one-hot
    form out[r] = sum_e [e(r) = e] rows[r] @ W_e, values and both gradients: groups of
    sizes 5, 0, 9, 3 (one empty) over 19 rows, padded inside to the row tile (24), and
    two rows past the groups, which come out zero."""
    rng = np.random.default_rng(0)
    sizes = np.array([5, 0, 9, 3], np.int32)
    rows = jnp.asarray(rng.normal(size=(19, D)), jnp.float32)
    weights = jnp.asarray(rng.normal(size=(4, D, F)), jnp.float32)
    cotangent = jnp.asarray(rng.normal(size=(19, F)), jnp.float32)
    group = np.repeat(np.arange(4), sizes)  # e(r), 17 rows
    onehot = jnp.asarray(np.eye(4)[group], jnp.float32)  # [17, E]

    def one_hot_form(rows, weights):
        out = jnp.einsum("re,rd,edf->rf", onehot, rows[:17], weights)
        return jnp.concatenate([out, jnp.zeros((2, F))])

    def kernel(rows, weights):
        return megablox_matmul(rows, weights, jnp.asarray(sizes), interpret=True)

    @jax.jit  # values and gradients of both forms in one program, not op by op
    def run(rows, weights):
        grad = lambda f: jax.grad(lambda r, w: jnp.sum(f(r, w) * cotangent), argnums=(0, 1))
        return (
            kernel(rows, weights),
            one_hot_form(rows, weights),
            grad(kernel)(rows, weights),
            grad(one_hot_form)(rows, weights),
        )

    out, want_out, grads, want = jax.tree.map(np.asarray, run(rows, weights))
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out[17:], 0)
    for got, ref in zip(grads, want):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(grads[0][17:], 0)  # past the groups
    np.testing.assert_array_equal(grads[1][1], 0)  # the empty group


def test_gathered_capacities_hand_worked():
    # N = 64, k = 2, E = 8: mean load 16 copies; 1.5 x 16 = 24, 3 x 16 = 48.
    assert gathered_capacities(64, 2, 8) == (24, 48)
    # N = 32: mean 8 -> 12 -> 16 (rounded up to 8 rows) and 24.
    assert gathered_capacities(32, 2, 8) == (16, 24)
    # N = 12, E = 4: mean 6 -> 16 and 24, neither below N: dense only.
    assert gathered_capacities(12, 2, 4) == ()


@pytest.mark.parametrize("case", ["first buffer", "second buffer", "dense"])
def test_gathered_dispatch_every_buffer_matches_loop_reference(case):
    """32 tokens, 8 experts top-2 (buffers of 16 and 24 rows): replayed routings whose
    busiest expert takes 12 tokens, 22, or all 32 (beyond both buffers: the dense
    branch); each equals the float64 loop. In the buffered cases expert 7, which no token
    chose, has a NaN down projection: their outputs stay finite (the dense branch would
    spread it to every token with weight 0)."""
    n, e, k, f = 32, 8, 2, 6
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.normal(size=(n, D)), jnp.float32)
    w_gate, w_up, w_down = (
        np.asarray(rng.normal(size=s) * 0.5, np.float32) for s in ((e, D, f), (e, D, f), (e, f, D))
    )
    tokens = np.arange(n)
    if case == "first buffer":
        ids = np.stack([tokens % 6, (tokens + 1) % 6], 1)  # experts 0-5, <= 12 each
        ids[5] = [3, 3]  # an expert listed twice
    elif case == "second buffer":
        ids = np.stack([np.where(tokens < 20, 0, tokens % 6), (tokens % 5) + 1], 1)
    else:
        ids = np.stack([np.zeros(n, int), np.ones(n, int)], 1)  # 32 tokens on 0 and 1
    counts = np.array([np.sum(np.any(ids == j, 1)) for j in range(e)])
    low, high = {"first buffer": (0, 16), "second buffer": (16, 24), "dense": (24, n)}[case]
    assert low < counts.max() <= high
    gates = jnp.asarray(rng.uniform(0.1, 1.0, size=(n, k)), jnp.float32)
    if case != "dense":
        w_down[7] = np.nan
    y = jax.jit(gathered_experts)(x, jnp.asarray(ids, jnp.int32), gates, w_gate, w_up, w_down)
    want = np.zeros((n, D))
    x64 = np.asarray(x, np.float64)
    for t in range(n):
        for j in range(k):
            ex = ids[t, j]
            hidden = x64[t] @ w_gate[ex].astype(np.float64)
            hidden = hidden / (1 + np.exp(-hidden)) * (x64[t] @ w_up[ex].astype(np.float64))
            want[t] += float(gates[t, j]) * (hidden @ w_down[ex].astype(np.float64))
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
