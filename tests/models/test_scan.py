"""Scanned decoder layers (ModelConfig.scan_layers) and rematerialisation (ModelConfig.remat):
the stacked model equals the per-layer one (logits, routing, aux, gradients, KV-cache
decoding, greedy generation, HF round trip, checkpoints), every remat policy gives the
same gradients, and the scanned program does not grow with depth."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from policyopt import sampling
from policyopt.checkpoint import Checkpointer
from policyopt.models import ModelConfig, Transformer
from policyopt.models.transformer import stack_layers, unstack_layers
from policyopt.sharding import param_specs
from tests.flags import run_script
from tests.settings import TINY_MODEL

P = jax.sharding.PartitionSpec
BASE = TINY_MODEL  # each kind sets its number of layers
KINDS = {
    "dense": dict(num_layers=3),
    "moe": dict(num_layers=3, num_experts=4, moe_intermediate_size=16),
    # Runs: dense [0, 1), MoE [1, 3), dense [3, 4).
    "mixed": dict(num_layers=4, num_experts=4, moe_intermediate_size=16, moe_layers=(1, 2)),
}


def _config(kind, **overrides):
    return ModelConfig(**{**BASE, **KINDS[kind], **overrides})


def _models(kind, **overrides):
    """(per-layer model, scanned model) with the same weights, scaled up from the 0.02
    initialisation so that attention and routing are far from uniform."""
    config = _config(kind, **overrides)
    loop = Transformer(config, rngs=nnx.Rngs(0))
    state = nnx.state(loop, nnx.Param)
    nnx.update(loop, jax.tree.map(lambda x: np.asarray(x) * (8.0 if x.ndim > 1 else 1.0), state))
    scan = Transformer(config.replace(scan_layers=True), rngs=nnx.Rngs(1))
    nnx.update(scan, stack_layers(nnx.state(loop), config))
    return loop, scan


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _forward(state, tokens, *, graphdef, **kwargs):
    return nnx.merge(graphdef, state)(tokens, **kwargs)


def call(model, tokens, **kwargs):
    graphdef, state = nnx.split(model)
    return _forward(state, tokens, graphdef=graphdef, **kwargs)


def _tokens(shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, 40, size=shape), jnp.int32)


def _loss_fn(graphdef, rest, tokens, mask, routing=None):
    """A scalar that reaches every parameter (weighted logits plus the router losses),
    and the model's output."""
    weights = jnp.asarray(np.random.default_rng(5).normal(size=tokens.shape + (40,)), jnp.float32)

    def loss(params):
        out = nnx.merge(graphdef, params, rest)(tokens, attention_mask=mask, routing=routing)
        value = jnp.sum(out.logits * weights)
        if out.aux:
            value += out.aux["load_balancing_loss"] + 0.1 * out.aux["router_z_loss"]
        return value, out

    return loss


def _grads(model, tokens, mask, routing=None, *, count_dots=False):
    """((loss, ModelOutput), gradients), one compiled call; ``count_dots``: and the number
    of ``dot_general``s in the gradient's program (its jaxpr, traced once for both)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    loss = _loss_fn(graphdef, rest, tokens, mask, routing)
    traced = jax.jit(jax.value_and_grad(loss, has_aux=True)).trace(params)
    out = traced.lower().compile()(params)
    return (out, str(traced.jaxpr).count("dot_general")) if count_dots else out


def _assert_trees_close(a, b, tol=1e-5):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        x, y = np.asarray(x), np.asarray(y)
        assert x.shape == y.shape
        np.testing.assert_allclose(x, y, rtol=tol, atol=tol * max(1.0, np.abs(y).max()))


def test_layer_runs_and_config_errors():
    assert _config("dense").layer_runs == ((0, 3),)
    assert _config("moe").layer_runs == ((0, 3),)
    mixed = _config("mixed")
    assert mixed.layer_runs == ((0, 1), (1, 3), (3, 4))
    assert [mixed.layer_run(i) for i in range(4)] == [(0, 0), (1, 0), (1, 1), (2, 0)]
    assert _config("moe", num_layers=5, moe_layers=(1, 2)).layer_runs == ((0, 1), (1, 3), (3, 5))
    assert _config("moe", num_layers=4, moe_layers=(0, 3)).layer_runs == ((0, 1), (1, 3), (3, 4))
    with pytest.raises(ValueError, match=r"ModelConfig\.remat must be one of .* got 'dots'"):
        _config("dense", remat="dots")
    with pytest.raises(ValueError, match=r"ModelConfig\.scan_layers must be a bool, got 'yes'"):
        _config("dense", scan_layers="yes")


def test_same_seed_gives_the_same_weights_and_layouts_convert_both_ways():
    config = _config("mixed")
    loop = Transformer(config, rngs=nnx.Rngs(3))
    scan = Transformer(config.replace(scan_layers=True), rngs=nnx.Rngs(3))
    stacked = nnx.state(scan, nnx.Param)
    q = stacked["layers"][1]["attn"]["q_proj"]
    assert q.get_value().shape == (2, 32, 4, 8)
    assert q.get_metadata()["logical_axes"] == ("layers", "embed", "heads", "kv")
    assert stacked["layers"][1]["mlp"]["gate_proj"].get_value().shape == (2, 4, 32, 16)
    assert len(scan.layers) == 3 and [b.is_moe for b in scan.layers] == [False, True, False]
    converted = stack_layers(nnx.state(loop, nnx.Param), config)
    for a, b in zip(jax.tree.leaves(converted), jax.tree.leaves(stacked)):
        np.testing.assert_array_equal(a, b)
    # Layer 2 is slice 1 of run 1; back to the per-layer layout exactly.
    np.testing.assert_array_equal(
        stacked["layers"][1]["mlp"]["up_proj"][...][1], loop.layers[2].mlp.up_proj[...]
    )
    back = unstack_layers(stacked, config)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(nnx.state(loop, nnx.Param))):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("kind", ["dense", "mixed"])
def test_scan_equals_loop(kind):
    """Logits, hidden states, routing, aux losses and gradients, with and without replay.
    (The all-MoE model, one run, is the mixed model's MoE run at its full depth; it is
    compared in test_greedy_generation_equal and tests/models/test_hf.py.)"""
    loop, scan = _models(kind)
    tokens = _tokens((2, 9))
    mask = jnp.asarray(np.arange(9)[None, :] < np.array([[9], [6]]), jnp.int32)
    (loss_loop, want), grads_loop = _grads(loop, tokens, mask)
    (loss_scan, got), grads_scan = _grads(scan, tokens, mask)
    np.testing.assert_allclose(got.logits, want.logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got.hidden, want.hidden, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(loss_scan, loss_loop, rtol=1e-5)
    _assert_trees_close(grads_scan, stack_layers(grads_loop, loop.config))
    if kind == "dense":
        assert got.routing is None and got.aux == {}
        return
    num_moe = loop.config.num_moe_layers
    assert got.routing.shape == (num_moe, 2, 9, 2)
    np.testing.assert_array_equal(got.routing, want.routing)
    assert set(got.aux) == set(want.aux) and got.aux["tokens_per_expert"].shape == (num_moe, 4)
    _assert_trees_close(got.aux, want.aux)
    # Replay: another routing, layer by layer, enters the scan as its input.
    other = jnp.asarray(
        np.random.default_rng(2).permuted(
            np.broadcast_to(np.arange(4), (num_moe, 2, 9, 4)), axis=-1
        )[..., :2],
        jnp.int32,
    )
    (_, replay_loop), grads_loop = _grads(loop, tokens, mask, other)
    (_, replay_scan), grads_scan = _grads(scan, tokens, mask, other)
    np.testing.assert_array_equal(replay_scan.routing, other)
    np.testing.assert_allclose(replay_scan.logits, replay_loop.logits, rtol=1e-5, atol=1e-5)
    assert not np.allclose(replay_scan.logits, got.logits, atol=1e-3)
    _assert_trees_close(replay_scan.aux, replay_loop.aux)
    _assert_trees_close(grads_scan, stack_layers(grads_loop, loop.config))


@pytest.mark.parametrize("scan_layers", [False, True], ids=["loop", "scan"])
def test_every_remat_policy_gives_the_same_gradients(scan_layers):
    # A dense and an MoE layer (two runs when scanned): each kind of block under each policy.
    loop, scan = _models("mixed", num_layers=2, moe_layers=(1,))
    model = scan if scan_layers else loop
    tokens = _tokens((2, 7), seed=3)
    mask = jnp.ones((2, 7), jnp.int32)
    dots = {}
    ((reference_loss, _), reference), dots["none"] = _grads(model, tokens, mask, count_dots=True)
    _, state = nnx.split(model)
    for remat in ("full", "save_dots"):
        config = model.config.replace(remat=remat)
        rematted = nnx.merge(
            nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))[0], state
        )
        ((loss, _), grads), dots[remat] = _grads(rematted, tokens, mask, count_dots=True)
        np.testing.assert_allclose(loss, reference_loss, rtol=1e-5)
        _assert_trees_close(grads, reference)
    # The recomputation shows in the gradient's program: full remat recomputes every
    # forward matmul, save_dots only the attention's (batched) ones.
    assert dots["none"] < dots["save_dots"] < dots["full"], dots


@pytest.mark.parametrize("kind,per_layer", [("dense", False), ("mixed", False), ("mixed", True)])
def test_kv_cache_prefill_then_decode(kind, per_layer):
    loop, scan = _models(kind)
    tokens = _tokens((2, 9), seed=1)
    full = call(loop, tokens)
    cache = scan.init_cache(2, 12, per_layer=per_layer)
    loop_cache = loop.init_cache(2, 12)
    prefill = call(scan, tokens[:, :5], cache=cache)
    loop_prefill = call(loop, tokens[:, :5], cache=loop_cache)
    np.testing.assert_allclose(prefill.logits, full.logits[:, :5], rtol=1e-5, atol=1e-5)
    cache = prefill.cache
    assert cache.per_layer == per_layer and int(cache.index) == 5
    _assert_trees_close(cache.stack().k, loop_prefill.cache.k)
    _assert_trees_close(cache.stack().v, loop_prefill.cache.v)
    for step in range(5, 9):
        positions = jnp.full((2, 1), step, jnp.int32)
        out = call(scan, tokens[:, step : step + 1], positions=positions, cache=cache)
        np.testing.assert_allclose(out.logits[:, 0], full.logits[:, step], rtol=1e-5, atol=1e-5)
        if kind == "mixed":
            np.testing.assert_array_equal(out.routing[:, :, 0], full.routing[:, :, step])
        cache = out.cache
    assert int(cache.index) == 9 and cache.per_layer == per_layer


def test_greedy_generation_equal():
    """The sampler on the scanned MoE model (its stacked caches grown over two decode
    segments) generates the per-layer model's tokens, log-probs and routing. (The scanned
    dense model's decoding: test_kv_cache_prefill_then_decode.)"""
    loop, scan = _models("moe")
    prompts = np.array([[3, 7, 9, 2, 0], [5, 1, 0, 0, 0]], np.int32)
    lengths = np.array([4, 2], np.int32)
    kwargs = dict(max_new_tokens=6, rng=jax.random.key(0), temperature=0.0, decode_segments=2)
    want = sampling.generate(loop, prompts, lengths, **kwargs)
    got = sampling.generate(scan, prompts, lengths, **kwargs)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_allclose(got.log_probs, want.log_probs, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got.routing, want.routing)


def test_hf_round_trip_of_the_stacked_layout(tmp_path):
    from policyopt.models import from_pretrained, save_pretrained

    pytest.importorskip("safetensors")
    loop, scan = _models("mixed")
    save_pretrained(scan, str(tmp_path / "scan"))
    save_pretrained(loop, str(tmp_path / "loop"))
    from safetensors.numpy import load_file

    a = load_file(tmp_path / "scan" / "model.safetensors")
    b = load_file(tmp_path / "loop" / "model.safetensors")
    assert sorted(a) == sorted(b) and "model.layers.2.mlp.experts.3.down_proj.weight" in a
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])
    again = from_pretrained(str(tmp_path / "loop"), scan_layers=True)
    assert again.config.scan_layers and again.config.layer_runs == ((0, 1), (1, 3), (3, 4))
    for x, y in zip(
        jax.tree.leaves(nnx.state(again, nnx.Param)), jax.tree.leaves(nnx.state(scan, nnx.Param))
    ):
        np.testing.assert_array_equal(x, y)


def test_checkpoint_restores_the_stacked_state(tmp_path):
    _, scan = _models("mixed")
    params = nnx.state(scan, nnx.Param)
    Checkpointer(str(tmp_path / "ckpt")).save(1, {"params": params})
    target = nnx.state(Transformer(scan.config, rngs=nnx.Rngs(7)), nnx.Param)
    restored, _ = Checkpointer(str(tmp_path / "ckpt")).restore({"params": target})
    for x, y in zip(jax.tree.leaves(restored["params"]), jax.tree.leaves(params)):
        np.testing.assert_array_equal(x, y)


def test_stacked_parameters_shard_like_per_layer_ones():
    """On an fsdp x tensor x expert mesh the layer axis stays whole and every other
    dimension is split as the per-layer parameter's."""
    mesh = jax.sharding.AbstractMesh((2, 2, 2), ("fsdp", "tensor", "expert"))
    config = _config("mixed", hidden_size=64)
    scan = nnx.eval_shape(lambda: Transformer(config.replace(scan_layers=True), rngs=nnx.Rngs(0)))
    loop = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    stacked, per_layer = (param_specs(nnx.state(m, nnx.Param), mesh) for m in (scan, loop))
    assert stacked["layers"][1]["attn"]["q_proj"] == P(None, "fsdp", "tensor")
    assert stacked["layers"][1]["mlp"]["gate_proj"] == P(None, "expert", "fsdp", "tensor")
    assert stacked["layers"][0]["mlp"]["down_proj"] == P(None, "tensor", "fsdp")
    is_spec = lambda x: isinstance(x, P)
    flat_stacked = {
        tuple(k.key for k in path): spec
        for path, spec in jax.tree_util.tree_flatten_with_path(stacked, is_leaf=is_spec)[0]
    }
    flat_layers = jax.tree_util.tree_flatten_with_path(per_layer, is_leaf=is_spec)[0]
    assert len(flat_layers) > len(flat_stacked)
    for path, spec in flat_layers:
        path = tuple(k.key for k in path)
        if path[0] == "layers":
            run, _ = config.layer_run(path[1])
            want = (None,) + tuple(spec)
            while want and want[-1] is None:  # fit_spec drops trailing Nones
                want = want[:-1]
            assert tuple(flat_stacked[("layers", run) + path[2:]]) == want, path


def _lowered_size(config, layers):
    config = config.replace(num_layers=layers)
    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
    tokens = jax.ShapeDtypeStruct((2, 16), jnp.int32)

    def loss(params, tokens):
        out = nnx.merge(graphdef, params, rest)(tokens)
        return jnp.mean(out.logits) + (out.aux["load_balancing_loss"] if out.aux else 0.0)

    return len(jax.jit(jax.grad(loss)).lower(params, tokens).as_text())


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_scanned_program_does_not_grow_with_depth(kind):
    config = _config(kind, remat="full")
    scan2, scan8 = (_lowered_size(config.replace(scan_layers=True), n) for n in (2, 8))
    loop2, loop8 = (_lowered_size(config, n) for n in (2, 8))
    assert scan8 < 1.05 * scan2, (scan2, scan8)
    assert loop8 > 2.5 * loop2, (loop2, loop8)  # the unrolled program does grow


_MESH_SCRIPT = """
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from policyopt import sharding
from policyopt.models import Transformer, preset

config = preset("tiny_moe", vocab_size=64, num_layers=3, scan_layers=True, remat="full")
tokens = jax.random.randint(jax.random.key(1), (8, 12), 0, 64)
reference = Transformer(config, rngs=nnx.Rngs(0))
graphdef, ref_params = nnx.split(reference, nnx.Param)

def loss_fn(params, tokens):
    out = nnx.merge(graphdef, params)(tokens)
    log_probs = jax.nn.log_softmax(out.logits[:, :-1])
    target = jnp.take_along_axis(log_probs, tokens[:, 1:, None], axis=-1)
    return -target.mean() + out.aux["load_balancing_loss"], out.routing

step = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
(ref_loss, ref_routing), ref_grads = step(ref_params, tokens)
mesh = sharding.make_mesh({"fsdp": 4, "expert": 2})
with jax.set_mesh(mesh):     # born sharded: stacked on the host, each device its shard
    _, params = nnx.split(Transformer(config, rngs=nnx.Rngs(0)), nnx.Param)
q = params["layers"][0]["attn"]["q_proj"][...]
gate = params["layers"][0]["mlp"]["gate_proj"][...]
assert q.shape == (3, 64, 4, 16) and q.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp")
assert gate.sharding.spec == jax.sharding.PartitionSpec(None, "expert", "fsdp"), gate.sharding
assert q.addressable_shards[0].data.shape == (3, 16, 4, 16)
for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
    np.testing.assert_array_equal(a, b)
batch = jax.device_put(tokens, sharding.batch_sharding(mesh))
with jax.set_mesh(mesh):
    (loss, routing), grads = step(params, batch)
np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
np.testing.assert_array_equal(routing, ref_routing)
for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
    np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-6)
print("ok")
"""


def test_scanned_model_on_an_fsdp_expert_mesh():
    """Built under an 8-device mesh, the stacked parameters are born sharded (the layer
    axis whole, ``embed`` over fsdp, experts over expert); loss, routing and gradients
    equal one device's."""
    # Warnings on (conftest silences XLA's logs): the partitioner's are checked below.
    proc = run_script(_MESH_SCRIPT, 8, timeout=600, TF_CPP_MIN_LOG_LEVEL="1")
    assert proc.stdout.strip().endswith("ok"), proc.stdout
    assert "Involuntary full rematerialization" not in proc.stderr, proc.stderr[-3000:]
