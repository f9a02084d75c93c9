"""Attention: packed segments through the model, every implementation of
``policyopt.models.attention_ops.attend`` against the einsum attention (values and
gradients on ragged, left-padded, packed and GQA inputs), config errors, memory."""

import functools
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from policyopt.models import ModelConfig, Transformer
from policyopt.models.attention_ops import (
    XLA_MAX_LENGTH,
    attend,
    check_implementation,
    choose_implementation,
    cudnn_attention,
)
from tests.flags import run_script
from tests.settings import TINY_MODEL as TINY


def _model(**overrides):
    model = Transformer(ModelConfig(**{**TINY, **overrides}), rngs=nnx.Rngs(0))
    # Larger weights than the 0.02 default make attention non-trivial.
    state = nnx.state(model, nnx.Param)
    # (In NumPy: an eager jnp multiply would compile a program per parameter shape.)
    state = jax.tree.map(
        lambda x: jnp.asarray(np.asarray(x) * (10.0 if x.ndim > 1 else 1.0)), state
    )
    nnx.update(model, state)
    return model


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _forward(state, tokens, *, graphdef, **kwargs):
    return nnx.merge(graphdef, state)(tokens, **kwargs)


def _call(model, tokens, **kwargs):
    graphdef, state = nnx.split(model)
    return _forward(state, tokens, graphdef=graphdef, **kwargs)


# One packed row of three sequences (lengths 3, 2, 4) and two padding tokens, and a
# second row of one sequence (length 6) and five padding tokens.
SEGMENTS = np.array(
    [[1, 1, 1, 2, 2, 3, 3, 3, 3, 0, 0], [1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0]], np.int32
)


def _positions(segment_ids):
    """Per-segment positions 0, 1, ... restarting at each segment's first token."""
    positions = np.zeros_like(segment_ids)
    for r, row in enumerate(segment_ids):
        for i in range(1, len(row)):
            positions[r, i] = positions[r, i - 1] + 1 if row[i] == row[i - 1] else 0
    return positions


@pytest.mark.parametrize("attention,moe", [("xla", True), ("blockwise", False)])
def test_packed_segments_equal_separate_rows(attention, moe):
    extra = dict(num_experts=4, num_experts_per_tok=2, moe_dispatch="ragged") if moe else {}
    model = _model(attention=attention, attention_block_size=4, **extra)
    tokens = np.random.default_rng(0).integers(0, TINY["vocab_size"], SEGMENTS.shape)
    packed = _call(
        model,
        jnp.asarray(tokens),
        positions=jnp.asarray(_positions(SEGMENTS)),
        segment_ids=jnp.asarray(SEGMENTS),
    )
    # Every segment alone in a row of its own, right-padded (one call for all).
    places = [np.nonzero(row == seg)[0] for row in SEGMENTS for seg in sorted(set(row) - {0})]
    rows = [r for r, row in enumerate(SEGMENTS) for _ in sorted(set(row) - {0})]
    alone_tokens = np.zeros((len(places), SEGMENTS.shape[1]), np.int64)
    alone_mask = np.zeros(alone_tokens.shape, np.int32)
    for i, (r, cols) in enumerate(zip(rows, places)):
        alone_tokens[i, : len(cols)] = tokens[r, cols]
        alone_mask[i, : len(cols)] = 1
    alone = _call(model, jnp.asarray(alone_tokens), attention_mask=jnp.asarray(alone_mask))
    # Compared in NumPy (eager jnp indexing would compile a program per index).
    packed, alone = jax.tree.map(np.asarray, (packed, alone))
    for i, (r, cols) in enumerate(zip(rows, places)):
        np.testing.assert_allclose(
            packed.logits[r, cols], alone.logits[i, : len(cols)], rtol=1e-5, atol=1e-5
        )
        if moe:
            np.testing.assert_array_equal(
                packed.routing[:, r, cols], alone.routing[:, i, : len(cols)]
            )


def test_segment_ids_refused_with_cache():
    model = _model()
    tokens = jnp.zeros((1, 3), jnp.int32)
    with pytest.raises(ValueError, match="segment_ids"):
        model(tokens, cache=model.init_cache(1, 8), segment_ids=jnp.ones((1, 3), jnp.int32))
    with pytest.raises(ValueError, match="segment_ids"):
        model(tokens, segment_ids=jnp.ones((1, 4), jnp.int32))


# ---- attend: every implementation against the einsum ----------------------------------


def _numpy_attention(q, k, v, key_mask, segment_ids):
    """Loop reference: causal GQA softmax attention, rows that see no key left at 0."""
    b, t, h, dh = q.shape
    group = h // k.shape[2]
    out = np.zeros(q.shape, np.float64)
    for r in range(b):
        for head in range(h):
            for i in range(t):
                seen = [
                    j
                    for j in range(i + 1)
                    if key_mask[r, j] and segment_ids[r, j] == segment_ids[r, i] != 0
                ]
                if not seen:
                    continue
                scores = np.array([q[r, i, head] @ k[r, j, head // group] for j in seen])
                p = np.exp(scores / np.sqrt(dh) - (scores / np.sqrt(dh)).max())
                out[r, i, head] = (p / p.sum()) @ v[r, seen, head // group]
    return out


T = 13
# Row 0: ragged (right padding after 9 tokens); row 1: left padding (3) and right padding
# (1), as policyopt.rl.batch lays out a prompt and its response; row 2: packed, three
# segments and padding.
KEY_MASK = np.array([[1] * 9 + [0] * 4, [0] * 3 + [1] * 9 + [0], [1] * 11 + [0] * 2], bool)
PACKED = np.array(
    [[1] * 9 + [0] * 4, [0] * 3 + [1] * 9 + [0], [1] * 4 + [2] * 2 + [3] * 5 + [0] * 2], np.int32
)


def _inputs(dtype=jnp.float32, heads=4, kv_heads=2, head_dim=8, seed=0):
    rng = np.random.default_rng(seed)
    b = KEY_MASK.shape[0]
    q, k, v = (
        jnp.asarray(rng.normal(size=(b, T, n, head_dim)), dtype)
        for n in (heads, kv_heads, kv_heads)
    )
    return q, k, v


@functools.lru_cache(maxsize=None)
def _einsum_values_and_grads(packed):
    """The einsum attention's output and its loss's gradients on ``_inputs()`` (weights of
    seed 1), computed once per layout and shared by the implementations' cases."""
    q, k, v = _inputs()
    segment_ids = PACKED if packed else None
    weights = _loss_weights(q.shape, packed)

    def loss(q, k, v):
        out = _implementation("xla")(q, k, v, KEY_MASK, segment_ids)
        return jnp.sum(out * weights), out

    (_, want), want_grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
        q, k, v
    )
    return np.asarray(want), [np.asarray(g) for g in want_grads]


def _sees(packed):
    """[B, T] queries that see a key (padding queries have no defined output)."""
    return KEY_MASK & ((PACKED if packed else KEY_MASK.astype(np.int32)) != 0)


def _loss_weights(shape, packed):
    sees = _sees(packed)
    return jnp.asarray(
        np.random.default_rng(1).normal(size=shape) * sees[..., None, None], jnp.float32
    )


def _implementation(name):
    """attend with one implementation; "cudnn" runs its masks' mapping through XLA
    (jax.nn.dot_product_attention(implementation="xla")), the kernel needing a GPU."""

    def fn(q, k, v, key_mask, segment_ids):
        key_mask = jnp.asarray(key_mask)
        segment_ids = None if segment_ids is None else jnp.asarray(segment_ids)
        if name == "cudnn":
            return cudnn_attention(q, k, v, key_mask, segment_ids, implementation="xla")
        return attend(
            q,
            k,
            v,
            key_mask=key_mask,
            segment_ids=segment_ids,
            implementation=name,
            block_size=4,
            interpret=name == "splash",
        )

    return fn


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("name", ["blockwise", "cudnn", "splash"])
def test_implementations_equal_einsum_values_and_gradients(name, packed):
    q, k, v = _inputs()
    segment_ids = PACKED if packed else None
    reference_ids = PACKED if packed else KEY_MASK.astype(np.int32)
    # Rows that see no key (padding queries) have no defined output: weighted 0.
    sees = _sees(packed)
    weights = _loss_weights(q.shape, packed)

    def loss(fn, q, k, v):
        out = fn(q, k, v, KEY_MASK, segment_ids)
        return jnp.sum(out * weights), out

    # The einsum's values and gradients: one program per layout, shared by the cases.
    want, want_grads = _einsum_values_and_grads(packed)
    np.testing.assert_allclose(
        want * sees[..., None, None],
        _numpy_attention(*map(np.asarray, (q, k, v)), KEY_MASK, reference_ids),
        atol=1e-5,
    )
    (_, got), got_grads = jax.jit(
        jax.value_and_grad(
            functools.partial(loss, _implementation(name)), argnums=(0, 1, 2), has_aux=True
        )
    )(q, k, v)
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(
        np.asarray(got) * sees[..., None, None], np.asarray(want) * sees[..., None, None], atol=1e-5
    )
    for g, w in zip(got_grads, want_grads):
        np.testing.assert_allclose(g, w, atol=1e-5)


@pytest.mark.parametrize("name", ["xla", "blockwise", "cudnn", "splash"])
def test_hand_worked(name):
    # H = Hkv = 1, Dh = 2, scale 1 / sqrt(2). q_1 = (sqrt(2) ln 3, 0), k_0 = (1, 0), every
    # other q and k 0: query 1's scores are (ln 3, 0), p = (3/4, 1/4); every other
    # query's scores are 0, a plain average of what it sees. v = (1, 2, 4, 8) in the
    # first dim. Segments (1, 1, 2, 2): out = (1, 3/4 + 2/4, 4, (4 + 8) / 2).
    q = np.zeros((1, 4, 1, 2), np.float32)
    q[0, 1, 0, 0] = np.sqrt(2) * np.log(3)
    k = np.zeros((1, 4, 1, 2), np.float32)
    k[0, 0, 0, 0] = 1
    v = np.zeros((1, 4, 1, 2), np.float32)
    v[0, :, 0, 0] = [1, 2, 4, 8]
    fn = jax.jit(_implementation(name))
    out = fn(
        jnp.asarray(q),
        jnp.asarray(k),
        jnp.asarray(v),
        np.ones((1, 4), bool),
        np.array([[1, 1, 2, 2]], np.int32),
    )
    np.testing.assert_allclose(np.asarray(out)[0, :, 0, 0], [1, 1.25, 4, 6], rtol=1e-6)
    # Unpacked, the last key masked: out_3 = (1 + 2 + 4) / 3.
    out = fn(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), np.array([[1, 1, 1, 0]], bool), None)
    np.testing.assert_allclose(np.asarray(out)[0, 2:3, 0, 0], [7 / 3], rtol=1e-6)


def test_blockwise_bfloat16_smoke():
    q, k, v = _inputs(jnp.bfloat16)
    sees = KEY_MASK[..., None, None]
    fn = _implementation("blockwise")
    got = jax.jit(fn)(q, k, v, KEY_MASK, PACKED)
    want = _numpy_attention(*(np.asarray(x, np.float32) for x in (q, k, v)), KEY_MASK, PACKED)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32) * sees, want * sees, atol=3e-2)
    grads = jax.jit(
        jax.grad(
            lambda *a: jnp.sum(fn(*a, KEY_MASK, PACKED).astype(jnp.float32)), argnums=(0, 1, 2)
        )
    )(q, k, v)
    assert all(
        g.dtype == jnp.bfloat16 and np.isfinite(np.asarray(g, np.float32)).all() for g in grads
    )


def test_blockwise_backward_holds_no_scores():
    """jit(grad) of blockwise attention at T = 4096 needs far less than one [T, T]
    float32 array of temporaries; the einsum needs several per head."""
    t, heads, head_dim = 4096, 2, 16
    q = jax.ShapeDtypeStruct((1, t, heads, head_dim), jnp.float32)
    k = jax.ShapeDtypeStruct((1, t, 1, head_dim), jnp.float32)
    mask = jax.ShapeDtypeStruct((1, t), bool)

    def temp_bytes(implementation):
        def loss(q, k, v, key_mask):
            return jnp.sum(
                attend(q, k, v, key_mask=key_mask, implementation=implementation, block_size=512)
            )

        grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        return grad.lower(q, k, k, mask).compile().memory_analysis().temp_size_in_bytes

    scores = t * t * 4
    einsum, blockwise = temp_bytes("xla"), temp_bytes("blockwise")
    assert einsum > heads * scores
    assert blockwise < scores / 4, (blockwise, einsum)


_MESH_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from policyopt import sharding
    from policyopt.models.attention_ops import attend

    assert jax.device_count() == 8, jax.devices()
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    rng = np.random.default_rng(0)
    b, t = 4, 20
    q = jnp.asarray(rng.normal(size=(b, t, 4, 8)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(b, t, 2, 8)), jnp.float32) for _ in range(2))
    mask = jnp.asarray(np.arange(t)[None] < np.array([[20], [15], [9], [20]]))
    real = np.asarray(mask)[..., None, None]
    w = jnp.asarray(rng.normal(size=q.shape) * real, jnp.float32)

    def run(name):
        def loss(q, k, v):
            out = attend(q, k, v, key_mask=mask, implementation=name, block_size=8,
                         interpret=True)
            return jnp.sum(out * w), out
        with jax.set_mesh(mesh):
            return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)

    (_, want), want_grads = run("xla")
    for name in ("splash", "blockwise"):
        (_, got), got_grads = run(name)
        np.testing.assert_allclose(np.asarray(got) * real, np.asarray(want) * real, atol=1e-5)
        for g, h in zip(got_grads, want_grads):
            np.testing.assert_allclose(g, h, atol=1e-5)
        print("ok", name)
    """)


def test_splash_and_blockwise_on_a_mesh():
    # Splash runs per device under shard_map (rows over data x fsdp, heads over tensor).
    proc = run_script(_MESH_SCRIPT, 8, timeout=600)
    assert proc.stdout.split() == ["ok", "splash", "ok", "blockwise"], proc.stdout


# ---- choice of implementation, errors --------------------------------------------------


def test_auto_choice():
    bf16 = dict(dtype=jnp.bfloat16, head_dim=128)
    choose = functools.partial(choose_implementation, "auto")
    assert choose(backend="gpu", length=8192, packed=False, **bf16) == "cudnn"
    assert choose(backend="gpu", length=8192, packed=True, **bf16) == "blockwise"
    assert (
        choose(backend="gpu", length=8192, packed=False, dtype=jnp.float32, head_dim=128)
        == "blockwise"
    )
    assert choose(backend="tpu", length=8192, packed=True, **bf16) == "splash"
    assert choose(backend="cpu", length=XLA_MAX_LENGTH - 1, packed=False, **bf16) == "xla"
    assert choose(backend="cpu", length=XLA_MAX_LENGTH, packed=True, **bf16) == "blockwise"
    assert choose_implementation("xla", backend="gpu", length=8192, packed=False, **bf16) == "xla"


def test_unavailable_implementation_is_a_config_error():
    with pytest.raises(ValueError, match="model.attention.*flash"):
        ModelConfig(**TINY, attention="flash")
    with pytest.raises(ValueError, match="attention_block_size"):
        ModelConfig(**TINY, attention_block_size=0)
    # At model build time, before anything is compiled.
    with pytest.raises(ValueError, match=r"model.attention='cudnn'.*'cpu'"):
        Transformer(ModelConfig(**TINY, attention="cudnn", dtype="bfloat16"), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"model.attention='splash' needs a TPU.*'cpu'"):
        Transformer(ModelConfig(**TINY, attention="splash"), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="bfloat16 or float16, got float32"):
        check_implementation("cudnn", backend="gpu", dtype=jnp.float32, head_dim=128)
    with pytest.raises(ValueError, match="multiple of 8 and at most 256, got 12"):
        check_implementation("cudnn", backend="gpu", dtype=jnp.bfloat16, head_dim=12)
    check_implementation("cudnn", backend="gpu", dtype=jnp.bfloat16, head_dim=128)
    check_implementation("splash", backend="tpu", dtype=jnp.float32, head_dim=128)
    assert ModelConfig(**TINY).resolved_attention() == "auto"
    # From the run config (configs/base.py's model.attention), as the trainers build it.
    from configs import base
    from policyopt.rl.loop import build

    config = base.get_config()
    config.model.attention = "splash"
    with pytest.raises(ValueError, match="model.attention='splash'"):
        build.make_model(config, vocab_size=32)
    config.model.attention, config.model.attention_block_size = "blockwise", 64
    assert build.make_model(config, vocab_size=32).config.attention_block_size == 64


# ---- the model with each implementation ------------------------------------------------


def test_model_blockwise_equals_einsum_logits_and_gradients():
    # Left- and right-padded rows (policyopt.rl.batch's layout), blocks of 4 for T = 13.
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, TINY["vocab_size"], (3, T)))
    attention_mask = jnp.asarray(KEY_MASK.astype(np.int32))
    positions = jnp.asarray(np.maximum(np.cumsum(KEY_MASK, axis=1) - 1, 0), jnp.int32)
    real = jnp.asarray(KEY_MASK[..., None])

    def logits_and_grads(attention):
        model = _model(attention=attention, attention_block_size=4)
        graphdef, params = nnx.split(model)

        @jax.jit
        def run(params):
            def loss(params):
                logits = nnx.merge(graphdef, params)(
                    tokens, positions=positions, attention_mask=attention_mask
                ).logits
                return jnp.sum(jax.nn.log_softmax(logits) * real * 0.01), logits

            return jax.grad(loss, has_aux=True)(params)

        grads, logits = run(params)
        return np.asarray(logits) * KEY_MASK[..., None], grads

    want_logits, want_grads = logits_and_grads("xla")
    got_logits, got_grads = logits_and_grads("blockwise")
    np.testing.assert_allclose(got_logits, want_logits, atol=1e-4, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-4)


def test_kv_cache_decode_equals_blockwise_forward():
    model = _model(attention="blockwise", attention_block_size=4)
    tokens = np.random.default_rng(3).integers(0, TINY["vocab_size"], (2, 9))  # NumPy slices
    full = _call(model, jnp.asarray(tokens)).logits
    out = _call(model, jnp.asarray(tokens[:, :5]), cache=model.init_cache(2, 9))
    steps, cache = [np.asarray(out.logits)], out.cache
    for i in range(5, 9):
        out = _call(model, jnp.asarray(tokens[:, i : i + 1]), cache=cache)
        steps.append(np.asarray(out.logits))
        cache = out.cache
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=1e-4, rtol=1e-5)
