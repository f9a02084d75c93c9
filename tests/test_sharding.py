"""Sharding over a JAX mesh: the same numbers on 1 device and on 8 simulated CPU devices.

The multi-device part runs in a subprocess with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` so the flag does not leak into the
other tests (JAX reads it once, at start-up).
"""

import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from policyopt import sharding

_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from policyopt import sharding
    from policyopt.models import Transformer, preset

    assert jax.device_count() == 8, jax.devices()
    config = preset("tiny_moe", vocab_size=64, num_experts=4, num_heads=4, num_kv_heads=2)
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

    for shape in ({"data": 8}, {"data": 2, "fsdp": 2, "tensor": 2}, {"fsdp": 2, "expert": 4},
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
    dense = Transformer(preset("tiny_dense"), rngs=nnx.Rngs(0))
    dense_graphdef, dense_params = nnx.split(dense, nnx.Param)
    hidden = jax.jit(lambda p, t: nnx.merge(dense_graphdef, p)(t, return_logits=False).hidden.sum())
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    with jax.set_mesh(mesh):
      out = hidden(sharding.shard_params(dense_params, mesh),
                   jax.device_put(tokens % 16, sharding.batch_sharding(mesh)))
    np.testing.assert_allclose(out, hidden(dense_params, tokens % 16), rtol=1e-5)
    """)


def test_sharded_forward_and_gradients_match_one_device():
    # Warnings on (conftest silences XLA's logs): the partitioner's are checked below.
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="1")
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("ok") == 4, proc.stdout
    # No resharding that XLA can only do by replicating a whole array (the embedding
    # lookup did, on data x fsdp x tensor, before the table was gathered along `embed`).
    assert "Involuntary full rematerialization" not in proc.stderr, proc.stderr[-3000:]


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
    assert fit((8, 6, 3), P(("data", "fsdp"), "tensor", "expert"), mesh) == P(("data", "fsdp"), "tensor")
    assert fit((6, 8), P(("data", "fsdp"), ("tensor", "expert")), mesh) == P(None, "tensor")  # 6 % 4
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
