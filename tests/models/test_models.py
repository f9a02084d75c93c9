"""Transformer: hand-worked layers, KV-cache decoding equals the full forward, padding,
routing capture / replay plumbing, mixed precision, config errors, presets, jit."""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from policyopt.models import (
    Architecture,
    Cache,
    Kernels,
    KVCache,
    ModelConfig,
    ModelOutput,
    PolicyModel,
    Transformer,
    preset,
)
from policyopt.models.layers import RMSNorm, apply_rope, rope_cos_sin
from policyopt.models.paged import PagedKVCache
from policyopt.sharding import logical_to_mesh_axes, param_partition_specs
from tests.settings import TINY_MODEL as TINY


def _model(**overrides):
    cfg = ModelConfig(**{**TINY, **overrides})
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    # Larger weights than the 0.02 default make attention and routing non-trivial.
    state = nnx.state(model, nnx.Param)
    state = jax.tree.map(
        lambda x: jnp.asarray(np.asarray(x) * (10.0 if x.ndim > 1 else 1.0)), state
    )
    nnx.update(model, state)
    return model


@functools.partial(jax.jit, static_argnames=("graphdef", "return_logits"))
def _forward(state, tokens, *, graphdef, return_logits=True, **kwargs):
    return nnx.merge(graphdef, state)(tokens, return_logits=return_logits, **kwargs)


def call(model, tokens, **kwargs):
    """model(tokens, **kwargs), jitted (eager op-by-op dispatch is slow on the CPU)."""
    graphdef, state = nnx.split(model)
    return _forward(state, tokens, graphdef=graphdef, **kwargs)


def test_rmsnorm_hand_worked():
    norm = RMSNorm(2, eps=0.0, param_dtype=jnp.float32)
    # x = (3, 4): rms = sqrt((9 + 16) / 2) = 5 / sqrt 2.
    np.testing.assert_allclose(
        norm(jnp.array([3.0, 4.0])), [3 * np.sqrt(2) / 5, 4 * np.sqrt(2) / 5], rtol=1e-6
    )


def test_rope_hand_worked():
    # Dh = 2: one frequency (theta^0 = 1); position p rotates (a, b) by angle p.
    x = jnp.array([1.0, 2.0]).reshape(1, 1, 1, 2)
    cos, sin = rope_cos_sin(jnp.array([[3]]), 2, 1e4)
    got = apply_rope(x, cos, sin).reshape(2)
    want = [np.cos(3) * 1 - np.sin(3) * 2, np.sin(3) * 1 + np.cos(3) * 2]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    cos0, sin0 = rope_cos_sin(jnp.zeros((1, 1), jnp.int32), 8, 1e4)
    x8 = jnp.arange(8.0).reshape(1, 1, 1, 8)
    np.testing.assert_allclose(apply_rope(x8, cos0, sin0), x8)


@pytest.fixture(scope="module")
def models():
    return {"dense": _model(), "moe": _model(num_experts=4, moe_intermediate_size=16)}


def _tokens(shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(1, 40, size=shape), jnp.int32)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_output_shapes(models, kind):
    model = models[kind]
    tokens = _tokens((2, 9))
    out = call(model, tokens)
    assert isinstance(out, ModelOutput)
    assert out.logits.shape == (2, 9, 40) and out.logits.dtype == jnp.float32
    assert out.hidden.shape == (2, 9, 32)
    np.testing.assert_allclose(
        out.logits, out.hidden @ model.output_embedding(), rtol=1e-5, atol=1e-5
    )
    if kind == "moe":
        assert out.routing.shape == (2, 2, 9, 2) and out.routing.dtype == jnp.int32
        assert out.aux["tokens_per_expert"].shape == (2, 4)
        np.testing.assert_allclose(out.aux["tokens_per_expert"].sum(-1), [36, 36])
        assert float(out.aux["dropped_tokens"]) == 0
        # Replaying the model's own routing changes nothing.
        np.testing.assert_array_equal(call(model, tokens, routing=out.routing).logits, out.logits)
    else:
        assert out.routing is None and out.aux == {}


@pytest.mark.parametrize("per_layer", [False, True], ids=["stacked", "per_layer"])
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_kv_cache_prefill_then_decode_equals_full_forward(models, kind, per_layer):
    model = models[kind]
    tokens = _tokens((2, 9), seed=1)
    full = call(model, tokens)
    cache = model.init_cache(2, 12, per_layer=per_layer)
    prefill = call(model, tokens[:, :5], cache=cache)
    np.testing.assert_allclose(prefill.logits, full.logits[:, :5], rtol=1e-5, atol=1e-5)
    cache = prefill.cache
    assert int(cache.index) == 5
    for step in range(5, 9):
        if kind == "moe":
            positions = jnp.full((2, 1), step, jnp.int32)
            out = call(model, tokens[:, step : step + 1], positions=positions, cache=cache)
        else:  # default positions continue from the cache index
            out = call(model, tokens[:, step : step + 1], cache=cache)
        np.testing.assert_allclose(out.logits[:, 0], full.logits[:, step], rtol=1e-5, atol=1e-5)
        if kind == "moe":
            np.testing.assert_array_equal(out.routing[:, :, 0], full.routing[:, :, step])
        cache = out.cache
    assert int(cache.index) == 9
    np.testing.assert_array_equal(cache.key_mask, np.arange(12)[None, :].repeat(2, 0) < 9)
    assert cache.per_layer == per_layer


def test_kv_cache_layout_and_forms(models):
    """Keys are stored transposed [L, B, Hkv, Dh, S], values [L, B, Hkv, S, Dh]; slot s
    holds the rotated key / value of token s; the stacked and per-layer forms hold the
    same arrays, and roll_slots / put_rows move slots and rows as documented."""
    model = models["dense"]
    cfg = model.config
    tokens = _tokens((2, 5), seed=4)
    stacked = call(model, tokens, cache=model.init_cache(2, 7)).cache
    per_layer = call(model, tokens, cache=model.init_cache(2, 7, per_layer=True)).cache
    shape_k = (cfg.num_layers, 2, cfg.num_kv_heads, cfg.head_dim, 7)
    assert stacked.k.shape == shape_k and stacked.v.shape == shape_k[:3] + (7, cfg.head_dim)
    assert isinstance(per_layer.k, tuple) and len(per_layer.k) == cfg.num_layers
    for a, b in ((stacked, per_layer.stack()), (stacked.unstack().stack(), stacked)):
        np.testing.assert_array_equal(a.k, b.k)
        np.testing.assert_array_equal(a.v, b.v)
    # Layer 0's values: v_proj of the first block's normed input, at slots 0..4.
    x = jnp.take(model.embed[...], tokens, axis=0)
    v = jnp.einsum("btd,dnh->bnth", model.layers[0].input_norm(x), model.layers[0].attn.v_proj[...])
    np.testing.assert_allclose(stacked.v[0, :, :, :5], v, rtol=1e-5, atol=1e-6)
    assert not np.any(stacked.k[:, :, :, :, 5:]) and not np.any(stacked.v[:, :, :, 5:])
    rolled = stacked.roll_slots(2)
    np.testing.assert_array_equal(rolled.k[..., 2:7], stacked.k[..., :5])
    np.testing.assert_array_equal(rolled.v[:, :, :, 2:7], stacked.v[:, :, :, :5])
    np.testing.assert_array_equal(rolled.key_mask[:, 2:7], stacked.key_mask[:, :5])
    small = call(model, tokens[:1, :3], cache=model.init_cache(1, 3)).cache
    put = stacked.put_rows(small, 1, 4)
    np.testing.assert_array_equal(put.k[:, 1:, ..., 4:7], small.k)
    np.testing.assert_array_equal(put.v[:, 1:, :, 4:7], small.v)
    np.testing.assert_array_equal(put.k[:, :1], stacked.k[:, :1])
    np.testing.assert_array_equal(put.k[:, 1:, ..., :4], stacked.k[:, 1:, ..., :4])
    with pytest.raises(ValueError, match="stacked"):
        per_layer.roll_slots(1)
    # resize: empty slots appended (or the last ones dropped), the rest unchanged, both forms.
    for cache in (stacked, per_layer):
        grown, shrunk = cache.resize(10).stack(), cache.resize(5).stack()
        assert grown.max_length == 10 and shrunk.max_length == 5 and cache.resize(7) is cache
        assert grown.per_layer == shrunk.per_layer == False  # noqa: E712 (stacked again)
        np.testing.assert_array_equal(grown.k[..., :7], stacked.k)
        np.testing.assert_array_equal(grown.v[:, :, :, :7], stacked.v)
        assert not np.any(grown.k[..., 7:]) and not np.any(grown.v[:, :, :, 7:])
        np.testing.assert_array_equal(grown.key_mask, np.pad(stacked.key_mask, ((0, 0), (0, 3))))
        np.testing.assert_array_equal(shrunk.k, stacked.k[..., :5])
        np.testing.assert_array_equal(shrunk.v, stacked.v[:, :, :, :5])
        assert int(grown.index) == int(shrunk.index) == 5
    # Decoding on into a grown cache equals decoding into one that was long from the start
    # (up to float rounding: the softmax sums over another number of empty slots).
    nxt = _tokens((2, 1), seed=5)
    long = call(model, nxt, cache=stacked).logits
    np.testing.assert_allclose(
        call(model, nxt, cache=stacked.resize(5).resize(9)).logits, long, rtol=1e-5, atol=1e-6
    )


def test_right_padded_prompts_decode_like_unpadded(models):
    """Row 0 has a 3-token prompt padded to 5, row 1 a full 5-token prompt; decoding with
    per-row positions gives, on every row, the logits of that row's unpadded sequence."""
    model = models["moe"]
    prompts = _tokens((2, 5), seed=2)
    lengths = np.array([3, 5])
    new_tokens = _tokens((2, 4), seed=3)
    mask = jnp.asarray(np.arange(5)[None, :] < lengths[:, None], jnp.int32)
    out = call(model, prompts, attention_mask=mask, cache=model.init_cache(2, 12))
    cache = out.cache
    batched = []
    for step in range(4):
        positions = jnp.asarray(lengths[:, None] + step, jnp.int32)
        out = call(model, new_tokens[:, step : step + 1], positions=positions, cache=cache)
        batched.append(out.logits[:, 0])
        cache = out.cache
    # Unpadded sequences, filled at the end to a common length 9 (causality hides the fill).
    unpadded = np.ones((2, 9), np.int32)
    for row in range(2):
        seq = np.concatenate(
            [np.asarray(prompts[row, : lengths[row]]), np.asarray(new_tokens[row])]
        )
        unpadded[row, : len(seq)] = seq
    alone = call(model, jnp.asarray(unpadded))
    for row in range(2):
        for step in range(4):
            np.testing.assert_allclose(
                batched[step][row], alone.logits[row, lengths[row] + step], rtol=1e-5, atol=1e-5
            )


def test_padding_tokens_excluded_from_router_statistics(models):
    mask = jnp.asarray(np.arange(9)[None, :] < np.array([[7], [4]]), jnp.int32)
    out = call(models["moe"], _tokens((2, 9)), attention_mask=mask)
    np.testing.assert_allclose(out.aux["tokens_per_expert"].sum(-1), [22, 22])


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_out_of_range_padding_ids_cannot_poison_real_tokens(models, kind):
    """Left padding holding ids >= V or < 0 (attention_mask 0): the real tokens' logits
    equal those of the unpadded sequence. An out-of-range lookup used to give a NaN
    embedding, which reached every real token of the row (probability 0 times NaN)."""
    model = models[kind]
    real = _tokens((1, 5), seed=4)
    alone = np.asarray(call(model, real).logits)
    pad = 3
    positions = jnp.asarray(np.maximum(np.arange(pad + 5) - pad, 0)[None], jnp.int32)
    mask = jnp.asarray((np.arange(pad + 5) >= pad)[None], jnp.int32)
    for pad_id in (40, 10**6, -1, -(10**6)):
        tokens = jnp.concatenate([jnp.full((1, pad), pad_id, jnp.int32), real], axis=1)
        out = call(model, tokens, positions=positions, attention_mask=mask)
        assert np.isfinite(np.asarray(out.logits)).all(), pad_id
        np.testing.assert_allclose(out.logits[:, pad:], alone, rtol=1e-5, atol=1e-5)


def test_moe_layer_subset_and_routing_shape_errors():
    model = _model(num_layers=3, num_experts=4, moe_intermediate_size=16, moe_layers=(1,))
    tokens = jnp.ones((1, 4), jnp.int32)
    out = call(model, tokens)
    assert out.routing.shape == (1, 1, 4, 2)
    np.testing.assert_allclose(call(model, tokens, routing=out.routing).logits, out.logits)
    with pytest.raises(ValueError, match="L_moe"):
        call(model, tokens, routing=jnp.zeros((3, 1, 4, 2), jnp.int32))
    with pytest.raises(ValueError, match="dense"):
        call(_model(), tokens, routing=out.routing)


def test_tied_embeddings():
    model = _model(tie_word_embeddings=True, num_layers=1)
    assert not hasattr(model, "lm_head")
    np.testing.assert_array_equal(model.output_embedding(), model.embed[...].T)


def test_bfloat16_compute(models):
    model = models["moe"]
    tokens = _tokens((2, 9))
    ref = call(model, tokens).logits
    model_bf16 = Transformer(model.config.replace(dtype="bfloat16"), rngs=nnx.Rngs(0))
    nnx.update(model_bf16, nnx.state(model, nnx.Param))
    out = call(model_bf16, tokens)
    assert out.logits.dtype == jnp.float32 and out.hidden.dtype == jnp.bfloat16
    assert model_bf16.init_cache(1, 4).k.dtype == jnp.bfloat16
    rel = float(jnp.linalg.norm(out.logits - ref) / jnp.linalg.norm(ref))
    assert rel < 0.05


def test_split_merge_jit_compiles_once(models):
    model = models["moe"]
    graphdef, state = nnx.split(model)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def forward(state, tokens, cache):
        out = nnx.merge(graphdef, state)(
            tokens, cache=cache, positions=jnp.zeros_like(tokens) + cache.index
        )
        return out.logits, out.cache, out.routing

    cache = model.init_cache(2, 4)
    for step in range(3):
        logits, cache, routing = forward(state, jnp.full((2, 1), step, jnp.int32), cache)
    assert int(cache.index) == 3 and isinstance(cache, KVCache)


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="num_kv_heads"):
        ModelConfig(**{**TINY, "num_kv_heads": 3})
    with pytest.raises(ValueError, match="moe_dispatch"):
        ModelConfig(**TINY, num_experts=4, moe_dispatch="sparse")
    with pytest.raises(ValueError, match="moe_weight_gather"):
        ModelConfig(**TINY, num_experts=4, moe_weight_gather="scatter")
    for rows in (0, -4, 2.5):
        with pytest.raises(ValueError, match="moe_chunk_rows"):
            ModelConfig(**TINY, num_experts=4, moe_chunk_rows=rows)
    assert ModelConfig(**TINY, moe_weight_gather="onehot").resolved_weight_gather() == "onehot"
    auto = ModelConfig(**TINY).resolved_weight_gather()
    assert auto == ("take" if jax.default_backend() == "cpu" else "onehot")
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelConfig(**TINY, num_experts=4, num_experts_per_tok=5)
    with pytest.raises(ValueError, match="moe_layers"):
        ModelConfig(**TINY, num_experts=4, moe_layers=(2,))
    with pytest.raises(ValueError, match="unknown model preset"):
        preset("tiny")


def _param_count(config):
    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    return sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))


@pytest.mark.parametrize(
    "name,expected_millions",
    [
        ("moe_7m", 7.351),
        ("moe_0p5b", 514.223),
        ("qwen3_30b_a3b", 30532.123),
        # By hand: embed and head 2 x 512 x 64; per layer attention 12,288 + norms 160, router
        # 64 x 32, experts 32 x 3 x 64 x 16 = 98,304 (112,800); 4 layers, final norm 64.
        ("moe_volatile", 0.5168),
    ],
)
def test_preset_parameter_counts(name, expected_millions):
    # Embeddings + L identical layers: count 1 and 2 layers, extrapolate (cheap to trace).
    config = preset(name)
    one = _param_count(config.replace(num_layers=1))
    two = _param_count(config.replace(num_layers=2))
    total = one + (config.num_layers - 1) * (two - one)
    assert abs(total / 1e6 - expected_millions) < 0.01
    assert preset("tiny_moe", vocab_size=77, num_layers=3).vocab_size == 77


def test_logical_axes_and_rules(models):
    model = models["moe"]
    specs = param_partition_specs(nnx.state(model, nnx.Param))
    moe = specs["layers"][0]["mlp"]
    assert moe["gate_proj"] == jax.sharding.PartitionSpec("expert", "fsdp", "tensor")
    assert specs["embed"] == jax.sharding.PartitionSpec("tensor", "fsdp")
    assert logical_to_mesh_axes(
        ("embed", "mlp"), mesh_axis_names=("fsdp",)
    ) == jax.sharding.PartitionSpec("fsdp", None)


def test_config_halves_architecture_and_kernels():
    """Every field of ModelConfig but the adapters is in exactly one half; the halves
    rebuild the config; a kernel changes no architecture and is checked on its own."""
    names = lambda kind: {f.name for f in dataclasses.fields(kind)}
    assert not names(Architecture) & names(Kernels)
    assert names(Architecture) | names(Kernels) | {"lora"} == names(ModelConfig)
    assert {"vocab_size", "num_experts", "rope_theta", "rms_norm_eps"} <= names(Architecture)
    assert {"attention", "moe_dispatch", "remat", "scan_layers", "dtype"} <= names(Kernels)
    config = preset("tiny_moe", vocab_size=16)
    assert ModelConfig.of(config.architecture, config.kernels, config.lora) == config
    other = config.replace(moe_dispatch="ragged", remat="full", dtype="bfloat16")
    assert other.architecture == config.architecture and other.kernels != config.kernels
    with pytest.raises(ValueError, match="moe_dispatch"):
        Kernels(moe_dispatch="sparse")
    with pytest.raises(ValueError, match="num_kv_heads"):
        Architecture(**{**TINY, "num_kv_heads": 3})


def test_the_model_and_its_caches_offer_the_interface():
    """Transformer is a PolicyModel, both caches are Caches (paged or not, as attention
    reads it); an object lacking a method is not."""
    config = ModelConfig(**TINY, num_experts=4)
    model = Transformer(config, rngs=nnx.Rngs(0))
    assert isinstance(model, PolicyModel)
    dense = model.init_cache(2, 8)
    paged = PagedKVCache.create(config, rows=2, num_pages=4, page_size=4, max_pages=2)
    assert isinstance(dense, Cache) and isinstance(paged, Cache)
    assert (dense.paged, paged.paged) == (False, True)

    class NoEmbedding:
        def __init__(self, config):
            self.config = config

        def __call__(self, tokens, **kwargs): ...

        def init_cache(self, batch_size, max_length, dtype=None, *, per_layer=False): ...

    assert not isinstance(NoEmbedding(config), PolicyModel)
