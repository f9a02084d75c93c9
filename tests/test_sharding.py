"""Sharding over a JAX mesh: the same numbers on 1 device and on 8 simulated CPU devices.

The multi-device part runs in one subprocess (both tests' scripts, one after the other) with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` so the flag does not leak into the
other tests (JAX reads it once, at start-up).
"""

import textwrap

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from policyopt import sharding
from tests.flags import run_script

_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from policyopt import sharding
    from policyopt.models import Transformer, preset

    assert jax.device_count() == 8, jax.devices()
    # One layer: every parameter (and its sharding rule) of a layer is there; a second layer
    # would repeat the same ops and double the compile time.
    config = preset("tiny_moe", vocab_size=64, num_experts=4, num_heads=4, num_kv_heads=2,
                    num_layers=1)
    model = Transformer(config, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    tokens = jax.random.randint(jax.random.key(1), (8, 12), 0, 64)

    def loss_fn(params, tokens):
      out = nnx.merge(graphdef, params)(tokens)
      log_probs = jax.nn.log_softmax(out.logits[:, :-1])
      target = jnp.take_along_axis(log_probs, tokens[:, 1:, None], axis=-1)
      return -target.mean(), out.routing

    step = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
    (ref_loss, ref_routing), ref_grads = step(params, tokens)

    # (The MoE on fsdp=2 x expert=4 and other expert meshes: tests/models/test_expert_parallel.py.)
    for shape in ({"data": 8}, {"data": 2, "fsdp": 2, "tensor": 2},
                  {"tensor": 2, "expert": 2, "data": 2}):
      mesh = sharding.make_mesh(shape)
      sharded = sharding.shard_params(params, mesh)
      specs = [leaf.sharding.spec for leaf in jax.tree.leaves(sharded)]
      assert any(any(a is not None for a in s) for s in specs) or shape == {"data": 8}, specs
      batch = jax.device_put(tokens, sharding.batch_sharding(mesh))
      with jax.set_mesh(mesh):
        (loss, routing), grads = step(sharded, batch)
      np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
      np.testing.assert_array_equal(routing, ref_routing)
      for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-6)
      print("ok", shape)

    # Hidden states alone (no output projection) of a dense model on data x fsdp x tensor:
    # the embedding lookup must not need a full rematerialisation (checked on stderr).
    dense = Transformer(preset("tiny_dense", num_layers=1), rngs=nnx.Rngs(0))
    dense_graphdef, dense_params = nnx.split(dense, nnx.Param)
    hidden = jax.jit(lambda p, t: nnx.merge(dense_graphdef, p)(t, return_logits=False).hidden.sum())
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    with jax.set_mesh(mesh):
      out = hidden(sharding.shard_params(dense_params, mesh),
                   jax.device_put(tokens % 16, sharding.batch_sharding(mesh)))
    np.testing.assert_allclose(out, hidden(dense_params, tokens % 16), rtol=1e-5)
    """)


# A model built, or loaded from a HuggingFace folder, under a mesh of 8 devices: the values
# of the one-device build bit for bit, each parameter with the sharding shard_params gives
# it (which then returns it without a copy), and no device ever receiving a parameter
# that this sharding splits whole: neither put there by jnp.asarray / jax.device_put of
# the host array (what param() and from_pretrained did before placing shards directly)
# nor left whole on a device after the build.
_BUILD_SCRIPT = textwrap.dedent("""
    import contextlib, tempfile
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from policyopt import sharding
    from policyopt.models import Transformer, from_pretrained, preset, save_pretrained
    from policyopt.rl.loop import build
    from tests.rl.test_trainer import tiny

    assert jax.device_count() == 8, jax.devices()
    config = preset("tiny_moe")
    meshes = [sharding.make_mesh(shape)
              for shape in ({"fsdp": 4, "tensor": 2}, {"fsdp": 2, "tensor": 2, "expert": 2})]

    whole = []  # shapes of the host arrays put whole on a device by jnp.asarray / device_put
    def recording(put):
      def wrapped(x, *args, **kwargs):
        out = put(x, *args, **kwargs)
        if isinstance(x, np.ndarray) and not isinstance(out, jax.core.Tracer):  # eval_shape
          whole.append(x.shape)
        return out
      return wrapped
    jnp.asarray, jax.device_put = recording(jnp.asarray), recording(jax.device_put)

    # The parameters of build_fn() (run under jax.set_mesh(mesh) if set_mesh), checked to
    # be placed as shard_params places them and no parameter that the placement splits
    # ever whole on a device (none of the arrays the build made and left, nor any it put).
    def built_on(mesh, build_fn, set_mesh=True):
      whole.clear()
      before = jax.live_arrays()
      with jax.set_mesh(mesh) if set_mesh else contextlib.nullcontext():
        params = nnx.state(build_fn(), nnx.Param)
      existing = {id(x) for x in before}
      created = [x for x in jax.live_arrays() if id(x) not in existing]
      leaves = jax.tree.leaves(params)
      wants = jax.tree.leaves(sharding.param_shardings(params, mesh))
      split = {leaf.shape for leaf, want in zip(leaves, wants) if not want.is_fully_replicated}
      assert len(split) >= 5, split
      assert not split & set(whole), (split, whole)
      for x in created:
        if x.shape in split:
          assert all(s.data.size < x.size for s in x.addressable_shards), (x.shape, x.sharding)
      assert [leaf.sharding for leaf in leaves] == wants
      # shard_params returns born-sharded parameters as they are (no copy).
      assert all(a is b for a, b in zip(
          jax.tree.leaves(sharding.shard_params(params, mesh)), leaves))
      return params

    def same_values(got, want):
      assert jax.tree.structure(got) == jax.tree.structure(want)
      for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert a.dtype == b.dtype and np.asarray(a).tobytes() == np.asarray(b).tobytes()

    # (1) A Transformer built under the mesh.
    built = [built_on(mesh, lambda: Transformer(config, rngs=nnx.Rngs(0))) for mesh in meshes]
    model = Transformer(config, rngs=nnx.Rngs(0))
    reference = nnx.state(model, nnx.Param)
    for params in built:
      same_values(params, reference)
    print("ok build", flush=True)

    # (2) from_pretrained on an explicit mesh and on the one set; float32 and bfloat16.
    path = tempfile.mkdtemp()
    save_pretrained(model, path)
    for dtype in ("float32", "bfloat16"):
      load = lambda **mesh: from_pretrained(path, param_dtype=dtype, **mesh)
      want = nnx.state(load(), nnx.Param)
      for mesh in meshes:
        same_values(built_on(mesh, lambda: load(mesh=mesh), set_mesh=False), want)
      same_values(built_on(meshes[1], load), want)
    print("ok from_pretrained", flush=True)

    # (3) The trainers' make_model + init_params: the values and shardings of the model
    # built off the mesh and placed by init_params.
    run_config = tiny("grpo", "tiny_moe", extra="mesh.fsdp=2,mesh.tensor=2,mesh.expert=2")
    mesh = build.make_mesh(run_config)
    vocab_size = build.make_tokenizer(run_config).vocab_size
    _, born = build.init_params(run_config, build.make_model(run_config, vocab_size, mesh), mesh)
    _, placed = build.init_params(run_config, build.make_model(run_config, vocab_size), mesh)
    same_values(born, placed)
    assert [x.sharding for x in jax.tree.leaves(born)] == [
        x.sharding for x in jax.tree.leaves(placed)]

    # (4) A one-device mesh: the parameters placed by default (jnp.asarray) as before,
    # which on one device is also shard_params' placement.
    one_mesh = sharding.make_mesh({"data": 1}, devices=jax.devices()[:1])
    with jax.set_mesh(one_mesh):
      one = nnx.state(Transformer(config, rngs=nnx.Rngs(0)), nnx.Param)
    same_values(one, reference)
    assert ([x.sharding for x in jax.tree.leaves(one)]
            == jax.tree.leaves(sharding.param_shardings(one, one_mesh)))
    print("ok init_params", flush=True)
    """)


# Printed to both streams between the two scripts, to tell each one's output apart.
_SEPARATOR = "=== build ==="


@pytest.fixture(scope="module")
def outputs():
    """Both scripts in one subprocess on 8 devices: ``{script: (stdout, stderr)}``."""
    separate = textwrap.dedent(f"""
        import sys
        print({_SEPARATOR!r}, flush=True)
        print({_SEPARATOR!r}, file=sys.stderr, flush=True)
        """)
    # Warnings on (conftest silences XLA's logs): the forward's test checks the partitioner's.
    proc = run_script(_SCRIPT + separate + _BUILD_SCRIPT, 8, timeout=600, TF_CPP_MIN_LOG_LEVEL="1")
    stdout, stderr = proc.stdout.split(_SEPARATOR + "\n"), proc.stderr.split(_SEPARATOR + "\n")
    assert len(stdout) == len(stderr) == 2, (proc.stdout, proc.stderr[-3000:])
    return {"forward": (stdout[0], stderr[0]), "build": (stdout[1], stderr[1])}


def test_sharded_forward_and_gradients_match_one_device(outputs):
    stdout, stderr = outputs["forward"]
    assert stdout.count("ok") == 3, stdout
    # No resharding that XLA can only do by replicating a whole array (the embedding
    # lookup did, on data x fsdp x tensor, before the table was gathered along `embed`).
    assert "Involuntary full rematerialization" not in stderr, stderr[-3000:]


def test_make_mesh_sizes_and_errors():
    devices = jax.devices()[:1]
    mesh = sharding.make_mesh({"data": -1}, devices=devices)
    assert dict(mesh.shape) == {"data": 1, "fsdp": 1, "tensor": 1, "expert": 1}
    with pytest.raises(ValueError, match="unknown axes"):
        sharding.make_mesh({"model": 1}, devices=devices)
    with pytest.raises(ValueError, match="needs 4 devices"):
        sharding.make_mesh({"data": 2, "tensor": 2}, devices=devices)
    with pytest.raises(ValueError, match="at most one axis"):
        sharding.make_mesh({"data": -1, "tensor": -1}, devices=devices)


def test_specs_are_fitted_and_in_the_canonical_form_of_jit_outputs():
    # jit reports its outputs' shardings without size-1 axes or trailing replicated
    # dimensions; specs written the same way compare equal, so no step compiles twice.
    mesh = jax.sharding.AbstractMesh((2, 2, 2, 1), sharding.MESH_AXES)
    fit = sharding.fit_spec
    assert fit((8, 6, 3), P(("data", "fsdp"), "tensor", "expert"), mesh) == P(
        ("data", "fsdp"), "tensor"
    )
    assert fit((6, 8), P(("data", "fsdp"), ("tensor", "expert")), mesh) == P(
        None, "tensor"
    )  # 6 % 4
    assert fit((4, 4), P(("fsdp", "expert"), None), mesh) == P("fsdp")
    assert sharding.row_spec((5, 8, 3), mesh, axis=1) == P(None, ("data", "fsdp"))
    assert sharding.row_spec((6, 8), mesh) == P() and sharding.row_spec((), mesh) == P()
    assert sharding.logical_spec((64, 8, 16), ("embed", "heads", "kv"), mesh) == P("fsdp", "tensor")


def test_shard_rows_without_a_mesh_and_on_one_device():
    rows = np.arange(12).reshape(4, 3)
    assert sharding.shard_rows(None) is None
    plain = sharding.shard_rows(rows)
    assert isinstance(plain, jax.Array) and not plain.committed
    mesh = sharding.make_mesh({"data": -1}, devices=jax.devices()[:1])
    with jax.set_mesh(mesh):
        placed = sharding.shard_rows(rows, axis=1)
    assert placed.committed and placed.sharding == NamedSharding(mesh, P())
    np.testing.assert_array_equal(placed, rows)


def test_models_are_built_and_loaded_straight_onto_the_mesh(outputs):
    stdout = outputs["build"][0]
    assert stdout.split() == ["ok", "build", "ok", "from_pretrained", "ok", "init_params"], stdout
