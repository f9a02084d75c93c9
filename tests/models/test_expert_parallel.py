"""Expert parallelism (``policyopt.models.expert_parallel``, ``jax.shard_map``) on 8 simulated CPU
devices: loss, gradients, routing and the tokens each expert received equal one device's
on the meshes expert=8, fsdp=2 x expert=4 and data=2 x expert=4 for the MoE and the dense
model, and with a replayed routing on fsdp=2 x expert=4; the MoE weights' gradients
reduce-scattered onto their fsdp shards; the bounded buffer's overflow fallback; the
ragged_all_to_all transport's offsets (against a reference implementation of the
collective's semantics: XLA:CPU does not compile ragged-all-to-all); and the config
errors of a mesh that expert parallelism cannot use; MoE blocks inside a ``lax.scan``
over layers; the megablox kernel (Pallas interpret mode) on the local experts of
fsdp=2 x expert=4.

One subprocess (JAX reads ``XLA_FLAGS`` once, at start-up) runs the cases of both
multi-device tests, megablox first, and prints a line per case that each test checks; it
compiles with ``--xla_backend_optimization_level=0`` (as tests/rl/test_mesh.py) to halve
XLA:CPU's compile time.
"""

import textwrap

import jax
import pytest

from tests.flags import run_script

# Shared by the scripts below: the meshes, the tokens, a jitted loss-and-gradient step of a
# one-layer model, the comparison with one device's step, and the run of a step on a mesh.
_PRELUDE = textwrap.dedent("""
    import dataclasses
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from policyopt import sharding
    from policyopt.models import Transformer, expert_parallel, experts, moe, preset

    assert jax.device_count() == 8, jax.devices()
    MESHES = ({"expert": 8}, {"fsdp": 2, "expert": 4}, {"data": 2, "expert": 4})
    tokens = jax.random.randint(jax.random.key(1), (8, 6), 0, 64)

    def make(config):
      graphdef, params = nnx.split(Transformer(config, rngs=nnx.Rngs(0)), nnx.Param)

      def loss_fn(params, tokens, routing):
        out = nnx.merge(graphdef, params)(tokens, routing=routing)
        log_probs = jax.nn.log_softmax(out.logits[:, :-1])
        target = jnp.take_along_axis(log_probs, tokens[:, 1:, None], axis=-1)
        loss = -target.mean()
        if config.is_moe:   # the aux losses' gradients too
          loss = loss + 0.1 * out.aux["load_balancing_loss"] + 0.01 * out.aux["router_z_loss"]
        return loss, (out.routing, out.aux)

      return params, jax.jit(jax.value_and_grad(loss_fn, has_aux=True))

    def compare(got, want, what):
      (loss, (routing, aux)), grads = got
      (ref_loss, (ref_routing, ref_aux)), ref_grads = want
      np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, err_msg=what)
      np.testing.assert_array_equal(routing, ref_routing, err_msg=what)
      for key in ref_aux:   # tokens_per_expert: the copies each expert received
        np.testing.assert_allclose(aux[key], ref_aux[key], rtol=1e-5, err_msg=f"{what} {key}")
      for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-6, err_msg=what)

    def on_mesh(step, params, shape, *args):
      mesh = sharding.make_mesh(shape)
      placed = sharding.shard_params(params, mesh)
      rows = [sharding.shard_rows(a, axis=1 if a.ndim == 4 else 0, mesh=mesh)
              for a in args if a is not None]
      split = rows[0].sharding.spec[0]   # rows over data x fsdp x expert
      assert ((split,) if isinstance(split, str) else split) == tuple(
          a for a in ("data", "fsdp", "expert") if a in shape), split
      with jax.set_mesh(mesh):
        return step(placed, *rows, *([None] * (len(args) - len(rows)))), step, placed, rows, mesh
    """)

_SCRIPT = textwrap.dedent("""
    moe_config = preset("tiny_moe", vocab_size=64, num_layers=1, num_experts=8,
                        moe_dispatch="blocked", moe_block_size=4)
    params, step = make(moe_config)
    free = step(params, tokens, None)
    # Replay: a routing that top-k would not choose (the next expert of each choice).
    replay = (free[0][1][0] + 1) % 8
    replayed = step(params, tokens, replay)
    np.testing.assert_array_equal(replayed[0][1][0], replay)
    for shape in MESHES:
      # The replayed routing on fsdp=2 x expert=4 (rows split over both axes, the experts'
      # weights gathered over fsdp inside the block): it enters the shard_map as the
      # tokens' rows do on every mesh, so one mesh shows it reaches the experts.
      replays = ((None, free), (replay, replayed)) if shape == MESHES[1] else ((None, free),)
      for routing, want in replays:
        got, _, placed, rows, mesh = on_mesh(step, params, shape, tokens, routing)
        compare(got, want, f"moe {shape} replay={routing is not None}")
        if shape == MESHES[0] and routing is None:
          # Tokens travel by all-to-all.
          with jax.set_mesh(mesh):
            hlo = step.lower(placed, *rows, None).compile().as_text()
          assert "all-to-all" in hlo
        if shape == MESHES[1] and routing is None:
          # FSDP inside the block: the expert weights' and the router's gradients are
          # reduce-scattered onto their fsdp shards, never all-reduced at full size
          # (local experts [2, D=64, F=64], D split over fsdp=2; router [D=64, E=8]).
          with jax.set_mesh(mesh):
            hlo = step.lower(placed, *rows, None).compile().as_text()
          ops = lambda kind: [l for l in hlo.splitlines() if f" {kind}(" in l]
          scattered = " ".join(ops("reduce-scatter"))
          for shard in ("f32[2,32,64]", "f32[2,64,32]", "f32[32,8]"):
            assert shard in scattered, (shard, scattered)
          for full in ("f32[2,64,64]", "f32[64,8]"):
            assert not [l for l in ops("all-reduce") if full in l], full
      print("ok moe", shape, flush=True)

    # The bounded buffer: the largest load of a device pair computed here from the
    # routing (row r of the batch on device r of expert=8; 12 copies each, expert e on
    # device e); buffers of exactly that load (one pass) and of one copy (as many passes
    # as the load).
    ids = np.asarray(free[0][1][0]).reshape(8, -1)            # [device, copies]
    load = max(np.bincount(row, minlength=8).max() for row in ids)
    assert 1 < load < 12, load
    for bound in (load, 1):
      cfg = dataclasses.replace(moe_config, moe_ep_buffer_factor=(bound - 0.5) * 8 / 12)
      p, s = make(cfg)
      compare(on_mesh(s, p, {"expert": 8}, tokens, None)[0], free, f"buffer {bound}")
    print("ok buffer", flush=True)

    # ragged_all_to_all's offsets, against the collective's documented semantics: device
    # i writes operand[input_offsets[j] : + send_sizes[j]] at output_offsets[j] on j.
    def ragged_reference(operand, output, input_offsets, send_sizes, output_offsets,
                         recv_sizes, *, axis_name):
      gathered = jax.lax.all_gather(operand, axis_name)
      in_off, sizes, out_off = (jax.lax.all_gather(a, axis_name)
                                for a in (input_offsets, send_sizes, output_offsets))
      me = jax.lax.axis_index(axis_name)
      rows = jnp.arange(output.shape[0])
      for i in range(gathered.shape[0]):
        start, size = out_off[i, me], sizes[i, me]
        inside = (rows >= start) & (rows < start + size)
        source = jnp.clip(in_off[i, me] + rows - start, 0, operand.shape[0] - 1)
        output = jnp.where(inside[:, None], gathered[i][source], output)
      # recv_sizes must be what the sources send: else poison the result.
      return jnp.where(jnp.all(recv_sizes == sizes[:, me]), output, jnp.full_like(output, -1))

    # The real collective traces and lowers (XLA:CPU cannot compile it).
    cfg = dataclasses.replace(moe_config, moe_ep_transport="ragged_all_to_all")
    p, s = make(cfg)
    mesh = sharding.make_mesh({"expert": 8})
    with jax.set_mesh(mesh):
      lowered = s.lower(sharding.shard_params(p, mesh), sharding.shard_rows(tokens, mesh=mesh),
                        None)
    assert "ragged_all_to_all" in lowered.as_text()

    expert_parallel._RAGGED_ALL_TO_ALL = ragged_reference
    # fsdp=2 x expert=4: row 4 f + j on device (f, j); device (f, j) receives the copies
    # of experts 2j, 2j + 1 from rows 4f ... 4f + 3 (12 copies sent per device). A receive
    # buffer of exactly the largest load, and one less (the step takes the all_to_all
    # passes instead).
    received = max(np.bincount(ids[4 * f:4 * f + 4].reshape(-1) // 2, minlength=4).max()
                   for f in range(2))
    assert 12 < received < 48, received
    for bound in (received, received - 1):
      cfg = dataclasses.replace(moe_config, moe_ep_transport="ragged_all_to_all",
                                moe_ep_buffer_factor=(bound - 0.5) / 12, moe_dispatch="ragged")
      p, s = make(cfg)
      compare(on_mesh(s, p, {"fsdp": 2, "expert": 4}, tokens, None)[0], free, f"ragged {bound}")
    print("ok ragged", flush=True)

    dense_config = preset("tiny_dense", vocab_size=64, num_layers=1)
    params, step = make(dense_config)
    want = step(params, tokens, None)
    for shape in MESHES:
      compare(on_mesh(step, params, shape, tokens, None)[0], want, f"dense {shape}")
      print("ok dense", shape, flush=True)

    # MoE blocks in a lax.scan over layers (scanned transformers): the shard_map,
    # while loops and custom backward pass inside the scan body.
    layers = [moe.MoE(moe_config, rngs=nnx.Rngs(i)) for i in range(2)]
    stack = jax.tree.map(lambda *a: jnp.stack(a), *[nnx.state(l, nnx.Param) for l in layers])
    layer_def = nnx.graphdef(layers[0])
    x = jax.random.normal(jax.random.key(2), (8, 6, 64))

    def scanned(stack, x):
      def body(h, p):
        y, routing, aux = nnx.merge(layer_def, p)(h, jnp.ones(h.shape[:2], bool))
        return h + y, (routing, aux["load_balancing_loss"])
      h, (routing, lb) = jax.lax.scan(body, x, stack)
      return jnp.sum(h ** 2) + lb.sum(), (routing, {})

    grad = jax.jit(jax.value_and_grad(scanned, has_aux=True, argnums=(0, 1)))
    want = grad(stack, x)
    mesh = sharding.make_mesh({"fsdp": 2, "expert": 4})
    with jax.set_mesh(mesh):
      compare(grad(stack, sharding.shard_rows(x, mesh=mesh)), want, "scan")
    print("ok scan", flush=True)

    # Bad input: an expert axis that does not divide the experts, refused when traced.
    bad = preset("tiny_moe", vocab_size=64, num_layers=1, num_experts=4)
    p, s = make(bad)
    try:
      on_mesh(s, p, {"expert": 8}, tokens, None)
    except ValueError as error:
      assert "mesh.expert=8" in str(error) and "num_experts=4" in str(error), error
      print("ok refused", flush=True)
    """)

# The megablox kernel (Pallas interpret mode) on the local experts inside the shard_map,
# forward and backward (gmm, and tgmm for the weights), against one device's step with
# jax.lax.ragged_dot, an independent grouped matmul (tests/models/test_moe.py checks one device's
# megablox against the loop MoE). Tiny: every kernel call is an interpreted loop over its
# tiles.
_MEGABLOX_SCRIPT = textwrap.dedent("""
    from jax.sharding import PartitionSpec as P

    config = preset("tiny_moe", vocab_size=64, num_layers=1, num_experts=8,
                    moe_dispatch="ragged")
    params, step = make(config)
    want = step(params, tokens, None)
    _, step = make(dataclasses.replace(config, moe_dispatch="megablox"))
    # fsdp=2 x expert=4: the all-to-all between the expert devices and the fsdp gathers of
    # the local experts' weights around the kernels (expert=8 alone: the all-to-all only).
    for shape in MESHES[1:2]:
      got, _, placed, rows, mesh = on_mesh(step, params, shape, tokens, None)
      compare(got, want, f"megablox {shape}")
      # The kernels run inside the expert-parallel shard_map: gmm forward and backward,
      # tgmm for the weights' gradient.
      with jax.set_mesh(mesh):
        jaxpr = str(jax.make_jaxpr(step)(placed, *rows, None))
      inner = jaxpr[jaxpr.index("shard_map"):]
      for name in ("all_to_all", "pallas_call", "name=gmm", "name=tgmm"):
        assert name in inner, (shape, name)
      print("ok megablox", shape, flush=True)

    # Weights the same on every device (invariant over the mesh) times rows that vary:
    # the weights' gradient is the sum of every device's (the psum in the kernel's VJP).
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(8 * 16, 8)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(2, 8, 16)), jnp.float32)
    sizes = jnp.array([5, 9], jnp.int32)
    mesh = jax.make_mesh((8,), ("expert",), axis_types=(jax.sharding.AxisType.Explicit,))

    def loss(matmul):
      product = jax.shard_map(lambda x, w: matmul(x, w, sizes), mesh=mesh,
                              in_specs=(P("expert"), P()), out_specs=P("expert"))
      return lambda x, w: jnp.sum(jnp.sin(product(x, w)))

    with jax.set_mesh(mesh):
      x = jax.device_put(x, jax.NamedSharding(mesh, P("expert")))
      got = jax.jit(jax.value_and_grad(loss(experts.megablox_matmul), argnums=(0, 1)))(x, w)
      ref = jax.jit(jax.value_and_grad(loss(jax.lax.ragged_dot), argnums=(0, 1)))(x, w)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
      np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)
    print("ok megablox invariant weights", flush=True)
    """)


@pytest.fixture(scope="module")
def stdout():
    """Both tests' cases in one subprocess on 8 simulated CPU devices: its stdout. The
    megablox cases run first, before the ragged cases replace the collective."""
    return run_script(
        _PRELUDE + _MEGABLOX_SCRIPT + _SCRIPT,
        8,
        "--xla_backend_optimization_level=0",
        TF_CPP_MIN_LOG_LEVEL="3",
    ).stdout


def test_expert_parallel_matches_one_device(stdout):
    for line in ("ok moe", "ok buffer", "ok ragged", "ok dense", "ok scan", "ok refused"):
        assert line in stdout, stdout


def test_megablox_expert_parallel_matches_one_device(stdout):
    for case in ("{'fsdp': 2, 'expert': 4}", "invariant weights"):
        assert f"ok megablox {case}" in stdout, stdout


def _config(**mesh):
    from tests.rl.test_trainer import tiny

    config = tiny("grpo", "tiny_moe")
    config.unlock()
    for name, size in mesh.items():
        config.mesh[name] = size
    config.lock()
    return config


@pytest.mark.parametrize(
    "mesh,experts,message",
    [
        ({"expert": 4}, 6, "config.mesh.expert=4 does not divide the model's num_experts=6"),
        ({"data": 3, "expert": 2}, 4, "= 8 rows are not divisible by the 6 row shards"),
    ],
)
def test_a_mesh_expert_parallelism_cannot_use_is_a_config_error(mesh, experts, message):
    from policyopt.rl.loop import build
    from policyopt.sharding import MESH_AXES

    # An abstract mesh (no devices needed): the check reads the axis sizes only.
    abstract = jax.sharding.AbstractMesh(tuple(mesh.get(a, 1) for a in MESH_AXES), MESH_AXES)
    with pytest.raises(ValueError, match=message):
        build.check_mesh(_config(**mesh), abstract, experts)
    build.check_mesh(_config(**mesh), abstract, 0)  # a dense model: nothing to check
