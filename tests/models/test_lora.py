"""LoRA adapters on the model (``policyopt.models.lora``): every adapted product equals the
dense product plus the low-rank one (NumPy references: the MLP, attention through the
whole model, the MoE experts in every dispatch, their gradients under replay, the
expert-parallel and FSDP blocks on 8 simulated devices); zero-initialised B leaves the
logits bit-identical to the base's; the adapters do not depend on the layout; the config's
errors, one line each, before anything compiles."""

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from policyopt.models import Transformer, lora, preset
from policyopt.models.layers import MLP
from policyopt.models.lora import LoRAConfig
from policyopt.models.moe import MoE
from policyopt.models.transformer import stack_layers
from tests.flags import run_script
from tests.models.test_moe import (
    DISPATCHES,
    D,
    E,
    K,
    _config,
    _dispatch,
    _inputs,
    jax_loop_moe,
)

RANK, ALPHA = 3, 6.0


def _randomise_b(module, seed=0, std=0.3):
    """Every adapter's B drawn from N(0, std^2), in place (zero B hides the product)."""
    rng = np.random.default_rng(seed)
    for path, variable in nnx.to_flat_state(nnx.state(module, nnx.LoRAParam)):
        if path[-1] == "lora_b":
            shape = variable.get_value().shape
            variable.set_value(jnp.asarray(std * rng.normal(size=shape), jnp.float32))
    return module


def _np(x):
    return np.asarray(x, np.float64)


def _merged(module, name):
    """W + (alpha / r) A B of ``module``'s weight ``name`` in float64 (NumPy)."""
    w = _np(getattr(module, name)[...])
    adapter = getattr(module.lora, name, None) if module.lora is not None else None
    if adapter is None:
        return w
    a, b = _np(adapter.lora_a[...]), _np(adapter.lora_b[...])
    lead = a.ndim + b.ndim - 2 - w.ndim
    a2 = a.reshape(a.shape[:lead] + (-1, RANK))
    b2 = b.reshape(b.shape[:lead] + (RANK, -1))
    return w + (ALPHA / RANK) * np.matmul(a2, b2).reshape(w.shape)


def test_einsum_hand_worked():
    # W = 0, A = [[1], [2]], B alpha / r = [[3, 4]]: x = [1, 1] -> (x A) B = 3 * [3, 4].
    weight = lora.Adapted(jnp.zeros((2, 2)), jnp.array([[1.0], [2.0]]), jnp.array([[3.0, 4.0]]))
    np.testing.assert_allclose(lora.einsum("nd,df->nf", jnp.ones((1, 2)), weight), [[9.0, 12.0]])
    # A grouped matmul: group 0 (row 0) adapts, group 1 (row 1) has A = 0.
    rows = jnp.array([[1.0, 1.0], [5.0, 7.0]])
    grouped = lora.Adapted(
        jnp.stack([jnp.eye(2), 2 * jnp.eye(2)]),
        jnp.array([[[1.0], [2.0]], [[0.0], [0.0]]]),
        jnp.array([[[3.0, 4.0]], [[1.0, 1.0]]]),
    )
    out = lora.grouped(jax.lax.ragged_dot, rows, grouped, jnp.array([1, 1], jnp.int32))
    np.testing.assert_allclose(out, [[1 + 9.0, 1 + 12.0], [10.0, 14.0]])


def test_mlp_equals_dense_plus_low_rank_product():
    config = _config(
        num_experts=0, lora=LoRAConfig(rank=RANK, alpha=ALPHA, targets=("gate_proj", "down_proj"))
    )
    mlp = MLP(config, 8, rngs=nnx.Rngs(0))
    mlp.lora = lora.build_adapters(
        mlp, MLP.LORA_SLOTS, config.lora, ("gate_proj", "down_proj"), jax.random.key(1), (0,)
    )
    assert not hasattr(mlp.lora, "up_proj")
    _randomise_b(mlp)
    x = _inputs()
    gate, up, down = (_merged(mlp, n) for n in ("gate_proj", "up_proj", "down_proj"))
    h = _np(x) @ gate
    want = (h / (1 + np.exp(-h)) * (_np(x) @ up)) @ down
    np.testing.assert_allclose(mlp(x), want, rtol=1e-5, atol=1e-6)


def _moe(dispatch, targets=("experts", "router"), seed=0, **fields):
    config = _config(
        **_dispatch(dispatch),
        capacity_factor=E / K,
        moe_block_size=3,
        lora=LoRAConfig(rank=RANK, alpha=ALPHA, targets=targets),
        **fields,
    )
    moe = MoE(config, rngs=nnx.Rngs(seed))
    moe.lora = lora.build_adapters(
        moe, MoE.LORA_SLOTS, config.lora, config.lora.check(config), jax.random.key(7), (0,)
    )
    return _randomise_b(moe, seed=seed)


@pytest.mark.parametrize("dispatch", DISPATCHES)
def test_moe_experts_equal_loop_reference_with_merged_weights(dispatch):
    """One adapter per expert (and the router's): every dispatch equals the NumPy loop
    over tokens and experts with each expert's W + (alpha / r) A_e B_e, and the adapted
    router's choice."""
    from tests.models.test_moe import numpy_loop_moe

    moe = _moe(dispatch)
    x = _inputs()
    graphdef, state = nnx.split(moe)
    y, routing, _ = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x, jnp.ones(x.shape[:2], bool)))(
        state, x
    )
    weights = {n: _merged(moe, n) for n in ("router", "gate_proj", "up_proj", "down_proj")}
    want, chosen = numpy_loop_moe(x, weights, K, True)
    np.testing.assert_array_equal(routing.reshape(-1, K), chosen)
    np.testing.assert_allclose(y.reshape(-1, D), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dispatch", ["ragged", "blocked", "blocked-chunked", "dense", "capacity"])
def test_moe_adapter_gradients_match_merged_reference(dispatch):
    """Under a replayed routing, the gradients of A and B of every expert and of the router
    equal autodiff through the loop reference with W + (alpha / r) A B."""
    moe = _moe(dispatch, seed=1)
    x = _inputs(seed=1)
    forced = jnp.asarray(np.random.default_rng(3).integers(0, E, size=(2, 6, K)), jnp.int32)
    forced = jnp.where(forced[..., :1] == forced[..., 1:], (forced + 1) % E, forced)
    cotangent = jnp.asarray(np.random.default_rng(2).normal(size=(2, 6, D)), jnp.float32)
    graphdef, adapters, rest = nnx.split(moe, nnx.LoRAParam, ...)

    def fast(adapters):
        y, _, _ = nnx.merge(graphdef, adapters, rest)(x, jnp.ones((2, 6), bool), forced)
        return jnp.sum(y * cotangent)

    names = ("router", "gate_proj", "up_proj", "down_proj")
    base = tuple(getattr(moe, n)[...] for n in names)

    def reference(pairs):
        weights = [w + (ALPHA / RANK) * lora.delta(a, b, w.shape) for w, (a, b) in zip(base, pairs)]
        y = jax_loop_moe(x.reshape(-1, D), *weights, forced.reshape(-1, K), K, True)
        return jnp.sum(y.reshape(2, 6, D) * cotangent)

    grads = jax.jit(jax.grad(fast))(adapters)
    pairs = tuple(
        (getattr(moe.lora, n).lora_a[...], getattr(moe.lora, n).lora_b[...]) for n in names
    )
    want = jax.jit(jax.grad(reference))(pairs)
    for name, (grad_a, grad_b) in zip(names, want):
        np.testing.assert_allclose(grads["lora"][name]["lora_a"][...], grad_a, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(grads["lora"][name]["lora_b"][...], grad_b, rtol=1e-4, atol=1e-6)
        assert float(jnp.abs(grad_b).max()) > 1e-4, name


def _merged_model(model):
    """The base model (no adapters) holding W + (alpha / r) A B, merged in NumPy."""
    graphdef = lora.base_graphdef(model)
    _, _, frozen = lora.split(model)
    pairs = lora.adapter_pairs(nnx.state(model, nnx.LoRAParam))
    scale = model.config.lora.scale
    flat = []
    for path, variable in nnx.to_flat_state(frozen):
        if tuple(path) in pairs:
            a, b = (_np(v) for v in pairs[tuple(path)])
            w = _np(variable.get_value())
            lead = a.ndim + b.ndim - 2 - w.ndim
            rank = a.shape[-1]
            product = np.matmul(
                a.reshape(a.shape[:lead] + (-1, rank)), b.reshape(b.shape[:lead] + (rank, -1))
            )
            variable = variable.replace(jnp.asarray(w + scale * product.reshape(w.shape)))
        flat.append((path, variable))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


@pytest.mark.parametrize("name", ["tiny_dense", "tiny_moe"])
def test_model_equals_base_with_merged_weights(name):
    """Every target of the model adapted, B non-zero: the logits equal those of the model
    without adapters whose weights are W + (alpha / r) A B (attention, MLP, experts,
    router), and the routing too."""
    config = preset(name)
    adapters = LoRAConfig(rank=RANK, alpha=ALPHA, targets=("all",))
    model = Transformer(config.replace(lora=adapters), rngs=nnx.Rngs(0))
    _randomise_b(model, std=0.05)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 512, (2, 7)), jnp.int32)
    forward = nnx.jit(lambda model, tokens: model(tokens))  # one program, not op by op
    out = forward(model, tokens)
    want = forward(_merged_model(model), tokens)
    np.testing.assert_allclose(out.logits, want.logits, rtol=1e-4, atol=1e-5)
    assert float(jnp.abs(out.logits - forward(model_without(model), tokens).logits).max()) > 1e-3
    if config.is_moe:
        np.testing.assert_array_equal(out.routing, want.routing)


def model_without(model):
    """The same model's base (adapters dropped)."""
    _, _, frozen = lora.split(model)
    return nnx.merge(lora.base_graphdef(model), frozen)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_zero_b_logits_equal_the_base_exactly(scan_layers):
    """Zero-initialised B: the adapted model's logits and routing equal the model without
    adapters bit for bit, and its base weights are that model's (adapters drawn last)."""
    config = preset("tiny_moe", scan_layers=scan_layers)
    base = Transformer(config, rngs=nnx.Rngs(3))
    model = Transformer(
        config.replace(lora=LoRAConfig(rank=4, targets=("attention", "mlp"))), rngs=nnx.Rngs(3)
    )
    _, _, frozen = lora.split(model)
    for (path, got), (_, want) in zip(
        nnx.to_flat_state(frozen), nnx.to_flat_state(nnx.state(base, nnx.Param)), strict=True
    ):
        np.testing.assert_array_equal(got.get_value(), want.get_value(), err_msg=str(path))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 512, (3, 9)), jnp.int32)
    forward = nnx.jit(lambda model, tokens: model(tokens))  # one program, not op by op
    got, want = forward(model, tokens), forward(base, tokens)
    np.testing.assert_array_equal(got.logits, want.logits)
    np.testing.assert_array_equal(got.routing, want.routing)


def test_adapters_do_not_depend_on_the_layout():
    """A of every layer is the same per layer and stacked (scan_layers): stack_layers of
    the per-layer adapters equals the scanned model's."""
    config = preset("tiny_moe").replace(lora=LoRAConfig(rank=2, targets=("all",)))
    per_layer = nnx.state(Transformer(config, rngs=nnx.Rngs(0)), nnx.LoRAParam)
    stacked = nnx.state(
        Transformer(config.replace(scan_layers=True), rngs=nnx.Rngs(0)), nnx.LoRAParam
    )
    converted = stack_layers(per_layer, config)
    for (path, got), (_, want) in zip(
        nnx.to_flat_state(converted), nnx.to_flat_state(stacked), strict=True
    ):
        np.testing.assert_array_equal(got.get_value(), want.get_value(), err_msg=str(path))
        assert got.get_metadata()["logical_axes"] == want.get_metadata()["logical_axes"]


def test_merged_params_equal_numpy_merge():
    config = preset("tiny_moe").replace(lora=LoRAConfig(rank=RANK, alpha=ALPHA, targets=("all",)))
    model = _randomise_b(Transformer(config, rngs=nnx.Rngs(0)))
    graphdef, adapters, frozen = lora.split(model)
    merged = jax.jit(lambda f, a: lora.merged_params(f, a, config.lora.scale))(frozen, adapters)
    want = nnx.state(_merged_model(model), nnx.Param)
    for (path, got), (_, ref) in zip(
        nnx.to_flat_state(merged), nnx.to_flat_state(want), strict=True
    ):
        np.testing.assert_allclose(got.get_value(), ref.get_value(), rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- config errors


@pytest.mark.parametrize(
    "fields,message",
    [
        (dict(rank=-1), "model.lora.rank must be an int >= 0"),
        (dict(rank=2.0), "model.lora.rank must be an int >= 0"),
        (dict(rank=4, alpha=-1.0), "model.lora.alpha must be a finite number > 0"),
        (dict(rank=4, alpha=0.0), "model.lora.alpha must be a finite number > 0"),
        (dict(rank=4, targets=()), "model.lora.targets is empty"),
        (dict(rank=4, dtype="int8"), "model.lora.dtype must be one of"),
    ],
)
def test_config_field_errors(fields, message):
    with pytest.raises(ValueError, match=message) as info:
        LoRAConfig(**fields)
    assert "\n" not in str(info.value)


def test_unknown_target_lists_the_models_targets():
    with pytest.raises(ValueError) as info:
        preset("tiny_moe", lora=LoRAConfig(rank=2, targets=("attention", "qproj")))
    message = str(info.value)
    assert "'qproj' is not a target of this model" in message and "\n" not in message
    assert "q_proj, k_proj, v_proj, o_proj, experts.gate_proj" in message
    assert "router" in message and "groups: attention, mlp, experts, all" in message
    # The dense MLP's names on an all-MoE model, the experts on a dense one.
    with pytest.raises(ValueError, match="'gate_proj' is not a target"):
        preset("tiny_moe", lora=LoRAConfig(rank=2, targets="gate_proj"))
    with pytest.raises(ValueError, match="'experts' is not a target.*groups: attention, mlp, all"):
        preset("tiny_dense", lora=LoRAConfig(rank=2, targets="experts"))


def test_rank_above_a_targets_smaller_dimension():
    # tiny_moe: 4 experts, so the router [64, 4] takes rank <= 4.
    with pytest.raises(ValueError) as info:
        preset("tiny_moe", lora=LoRAConfig(rank=8, targets="all"))
    assert str(info.value) == (
        "model.lora.rank=8 is larger than router's smaller dimension (64 x 4, min 4); lower "
        "the rank or leave the target out of model.lora.targets"
    )
    preset("tiny_moe", lora=LoRAConfig(rank=8, targets="attention,mlp"))  # fits


def test_groups_resolve_to_the_models_targets():
    dense = preset("tiny_dense", lora=LoRAConfig(rank=2, targets="all")).lora
    assert dense.resolve(preset("tiny_dense")) == lora.ATTENTION + lora.MLP
    moe = preset("tiny_moe")
    assert LoRAConfig(rank=2, targets="mlp").resolve(moe) == lora.EXPERTS
    assert LoRAConfig(rank=2, targets="all").resolve(moe) == (
        lora.ATTENTION + lora.EXPERTS + (lora.ROUTER,)
    )
    assert LoRAConfig(rank=2, targets="v_proj,q_proj").resolve(moe) == ("q_proj", "v_proj")


# --------------------------------------------------------------------------- meshes

_MESH_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from policyopt import sharding
    from policyopt.models import Transformer, lora, preset
    from policyopt.models.lora import LoRAConfig

    assert jax.device_count() == 8
    tokens = jax.random.randint(jax.random.key(1), (8, 6), 0, 64)
    EP = ({"expert": 8}, {"fsdp": 2, "expert": 4})
    # blocked on every mesh; its chunks and the ragged dispatch (per device, inside the same
    # shard_map) on fsdp=2 x expert=4, which holds both the all-to-all and the fsdp gathers.
    CASES = (("blocked", None, EP + ({"fsdp": 8},)), ("blocked", 4, EP[1:]),
             ("ragged", None, EP[1:]))
    for dispatch, chunk_rows, shapes in CASES:
      config = preset("tiny_moe", vocab_size=64, num_experts=8, num_layers=1,
                      moe_dispatch=dispatch, moe_decode_dispatch=None, moe_chunk_rows=chunk_rows,
                      lora=LoRAConfig(rank=2, alpha=4.0, targets=("all",)))
      model = Transformer(config, rngs=nnx.Rngs(0))
      rng = np.random.default_rng(0)
      for path, v in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):
        if path[-1] == "lora_b":
          v.set_value(jnp.asarray(0.2 * rng.normal(size=v.get_value().shape), jnp.float32))
      graphdef, adapters, frozen = lora.split(model)

      def loss_fn(adapters, frozen, tokens):
        out = nnx.merge(graphdef, frozen, adapters)(tokens)
        log_probs = jax.nn.log_softmax(out.logits[:, :-1])
        loss = -jnp.take_along_axis(log_probs, tokens[:, 1:, None], axis=-1).mean()
        return loss + 0.1 * out.aux["load_balancing_loss"], out.routing

      step = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
      (ref_loss, ref_routing), ref_grads = step(adapters, frozen, tokens)
      for shape in shapes:
        mesh = sharding.make_mesh(shape)
        with jax.set_mesh(mesh):
          placed = [sharding.shard_params(s, mesh) for s in (adapters, frozen)]
          (loss, routing), grads = step(*placed, sharding.shard_rows(tokens))
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
        np.testing.assert_array_equal(routing, ref_routing)
        for (path, g), (_, r) in zip(nnx.to_flat_state(grads), nnx.to_flat_state(ref_grads)):
          np.testing.assert_allclose(g.get_value(), r.get_value(), rtol=2e-4, atol=1e-6,
                                     err_msg=f"{dispatch} {chunk_rows} {shape} {path}")
        print("ok", dispatch, chunk_rows, shape, flush=True)
""")


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="simulated CPU devices")
def test_adapters_on_expert_parallel_and_fsdp_meshes():
    """Adapters on every target, B non-zero: loss, routing and every adapter's gradient on
    expert=8, fsdp=2 x expert=4 and fsdp=8 (the expert-parallel block's shard_map, the
    FSDP gathers) equal one device's, blocked; on fsdp=2 x expert=4 also blocked in chunks
    of 4 padded rows (1 or 2 blocks) and ragged."""
    proc = run_script(_MESH_SCRIPT, devices=8, timeout=900)
    assert proc.stdout.count("ok ") == 5, proc.stdout
