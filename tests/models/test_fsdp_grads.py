"""ZeRO-3 on 8 simulated CPU devices: the dense layers' weights (embedding, attention, MLP,
norms, output embedding; ``policyopt.sharding.fsdp_call``) and the MoE block's router and
experts (``policyopt.models.expert_parallel``, here without an ``expert`` axis) are
gathered inside a ``shard_map`` over the rows, so their gradients are reduce-scattered
onto their fsdp shards. Loss and gradients equal one device's for the dense model
(scanned layers, the untied output embedding through the logits and through the chunked
``token_log_probs``) under remat on fsdp=8 and without remat on data=2 x fsdp=4, and for
the MoE model (per-layer blocks, tied embeddings, padded tokens; its routing, tokens per
expert and aux losses too) on fsdp=8 and, with a replayed routing, on data=2 x fsdp=4
(both models on expert meshes: tests/models/test_expert_parallel.py). The compiled
gradient steps on those four meshes without an expert axis have a
reduce-scatter per fsdp-split weight (the router's and experts' included) and no
all-reduce of a full-size weight gradient, and no buffer of every scanned layer's
gathered weight (under remat and without); the chunked log-probs save only their inputs
for the backward pass; meshes without an fsdp axis, and rows the mesh cannot split,
compile the program of before (no ``shard_map``), dense and MoE.

One subprocess (JAX reads ``XLA_FLAGS`` once, at start-up) runs every case; it compiles
with ``--xla_backend_optimization_level=0`` (as tests/models/test_expert_parallel.py).
"""

import textwrap

import jax
import jax.numpy as jnp
from flax import nnx

from policyopt.models import Transformer, preset
from tests.flags import run_script

_SCRIPT = textwrap.dedent("""
    import re
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from policyopt import sharding
    from policyopt.logprobs import token_log_probs
    from policyopt.models import Transformer, preset

    assert jax.device_count() == 8, jax.devices()
    MESHES = ({"fsdp": 8}, {"data": 2, "fsdp": 4})
    tokens = jax.random.randint(jax.random.key(1), (8, 6), 0, 64)
    # Padding (mask 0) in two rows: the MoE's aux statistics count the valid tokens only.
    mask = jnp.ones((8, 6), jnp.int32).at[1, 4:].set(0).at[6, 5:].set(0)

    def make(config):
      graphdef, params = nnx.split(Transformer(config, rngs=nnx.Rngs(0)), nnx.Param)

      def loss_fn(params, tokens, routing=None):
        model = nnx.merge(graphdef, params)
        valid = mask[: tokens.shape[0]] if config.is_moe else None
        out = model(tokens, attention_mask=valid, routing=routing)
        # The output embedding twice: in the logits, and in the learner's chunked
        # log-probs of the hidden states (chunks of 4 tokens).
        log_probs = jax.nn.log_softmax(out.logits[:, :-1])
        nll = -jnp.take_along_axis(log_probs, tokens[:, 1:, None], axis=-1).mean()
        chunked = token_log_probs(
            out.hidden[:, :-1], model.output_embedding(), tokens[:, 1:], chunk_size=4)
        loss = nll - 0.5 * chunked.mean()
        if not config.is_moe:
          return loss, ()
        aux = out.aux
        loss = loss + 0.1 * aux["load_balancing_loss"] + 0.01 * aux["router_z_loss"]
        return loss, (out.routing, aux["tokens_per_expert"], aux["load_balancing_loss"],
                      aux["router_z_loss"])

      step = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
      return graphdef, params, step, loss_fn

    def ops(hlo, kind):
      return [l for l in hlo.splitlines() if f" {kind}(" in l]

    def has_shape(lines, dims):   # f32[a,b,...] exactly (not a prefix of a longer shape)
      pattern = re.compile(r"f32\\[" + ",".join(map(str, dims)) + r"\\]")
      return [l for l in lines if pattern.search(l)]

    def check_reduce_scattered(hlo, params, mesh, scanned):
      \"""Every fsdp-split weight: its shard's shape in a reduce-scatter, its whole (per
      layer) shape in no all-reduce and, stacked, in no buffer. Returns the paths.\"""
      n = mesh.shape["fsdp"]
      specs = sharding.param_specs(params, mesh)
      split = []
      for (path, leaf), spec in zip(jax.tree.leaves_with_path(params), jax.tree.leaves(specs)):
        where = jax.tree_util.keystr(path)
        if "fsdp" not in jax.tree.leaves(tuple(spec)):
          continue
        split.append(where)
        full = leaf.shape
        # Stacked layers [L, ...] (scan_layers): gathered and reduce-scattered one
        # layer at a time inside the scan's body.
        layer = full[1:] if scanned and "layers" in where else full
        axes = (tuple(spec) + (None,) * len(full))[len(full) - len(layer):len(full)]
        shard = tuple(d // n if a == "fsdp" else d for d, a in zip(layer, axes))
        assert has_shape(ops(hlo, "reduce-scatter"), shard), (where, shard)
        assert not has_shape(ops(hlo, "all-reduce"), layer), (where, layer)
        assert not has_shape(ops(hlo, "all-gather"), full) or full == layer, where
        if full != layer:   # no buffer holds every layer's whole weight or gradient
          assert not has_shape(hlo.splitlines(), full), (where, full)
      return split

    dense = preset("tiny_dense", vocab_size=64, scan_layers=True, remat="full")
    # Without remat, fsdp_call's own checkpoint keeps the whole weights out of the scan's
    # saved values (gathered again in the backward pass). The same numbers as with remat:
    # one reference for both.
    dense_no_remat = preset("tiny_dense", vocab_size=64, scan_layers=True, remat="none")
    # Per-layer blocks, no remat: on fsdp=8 and data=2 x fsdp=4 (no expert axis) the MoE
    # block runs per device under a shard_map that gathers its router and experts.
    moe = preset("tiny_moe", vocab_size=64, num_experts=8, moe_dispatch="blocked",
                 moe_block_size=4, tie_word_embeddings=True)
    replay = jax.random.randint(jax.random.key(2), (2, 8, 6, 2), 0, 8)   # [L, B, T, k]
    # (name, config, its one-device reference's config, mesh, replayed routing or None)
    CASES = (("dense", dense, dense, MESHES[0], None),
             ("dense remat=none", dense_no_remat, dense, MESHES[1], None),
             ("moe", moe, moe, MESHES[0], None),
             ("moe replay", moe, moe, MESHES[1], replay))
    # (The MoE model on fsdp=2 x expert=4, expert parallel: tests/models/test_expert_parallel.py.)
    built, refs = {}, {}
    for name, config, ref_config, shape, routing in CASES:
      for c in (config, ref_config):
        if c not in built:
          built[c] = make(c)
      if (ref_config, routing is None) not in refs:
        _, ref_params, ref_step, _ = built[ref_config]
        refs[ref_config, routing is None] = ref_step(ref_params, tokens, routing)
      (ref_loss, ref_metrics), ref_grads = refs[ref_config, routing is None]
      graphdef, params, step, loss_fn = built[config]
      mesh = sharding.make_mesh(shape)
      placed = sharding.shard_params(params, mesh)
      rows = sharding.shard_rows(tokens, mesh=mesh)
      replayed = None if routing is None else sharding.shard_rows(routing, 1, mesh=mesh)
      with jax.set_mesh(mesh):
        compiled = step.lower(placed, rows, replayed).compile()
        assert "shard_map" in str(jax.make_jaxpr(loss_fn)(placed, rows, replayed))
      (loss, metrics), grads = compiled(placed, rows, replayed)
      where = f"{name} {shape}"
      np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, err_msg=where)
      for (path, g), r in zip(jax.tree.leaves_with_path(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-6,
                                   err_msg=f"{where} {jax.tree_util.keystr(path)}")
      if config.is_moe:   # routing exact; tokens per expert exact; aux losses
        routes, counts, balance, z_loss = metrics
        np.testing.assert_array_equal(routes, ref_metrics[0], err_msg=where)
        if routing is not None:
          np.testing.assert_array_equal(routes, routing, err_msg=where)
        np.testing.assert_array_equal(counts, ref_metrics[1], err_msg=where)
        np.testing.assert_allclose(balance, ref_metrics[2], rtol=1e-5, err_msg=where)
        np.testing.assert_allclose(z_loss, ref_metrics[3], rtol=1e-5, err_msg=where)
      split = check_reduce_scattered(compiled.as_text(), params, mesh, config.scan_layers)
      if config.is_moe:   # embed (tied), final norm, 2 layers x (2 norms, q k v o, router,
        # 3 experts)
        assert len(split) == 2 + 2 * 10, split
        assert sum("mlp" in w for w in split) == 8, split
      else:   # embed, head, final norm, 9 stacked block weights
        assert len(split) == 12, split
      print("ok", where, flush=True)

    # What the backward pass of the chunked log-probs keeps from the forward pass: its
    # inputs (the output embedding as its shard), not the whole embedding or any chunk's
    # logits, as on one device (8 rows of 64 tokens, D = 64, V = 512, chunks of 16).
    mesh = sharding.make_mesh({"fsdp": 8})
    hidden, weight = jnp.ones((8, 64, 64)), jnp.ones((64, 512))
    targets = jnp.zeros((8, 64), jnp.int32)
    log_probs = lambda h, w: token_log_probs(h, w, targets, chunk_size=16).sum()
    with jax.set_mesh(mesh):
      saved = {x.shape for x in jax.tree.leaves(jax.vjp(log_probs, hidden, weight)[1])}
    assert saved == {(8, 64, 64), (64, 512), (8, 64)}, saved
    print("ok saved", flush=True)

    # Without an fsdp axis, or with rows the mesh cannot split, the program of before.
    for config in (dense, moe):
      graphdef, params, step, loss_fn = built[config]
      for shape, batch in (({"data": 8}, tokens), ({"fsdp": 8}, tokens[:3])):
        mesh = sharding.make_mesh(shape)
        placed = sharding.shard_params(params, mesh)
        with jax.set_mesh(mesh):
          assert "shard_map" not in str(jax.make_jaxpr(loss_fn)(placed, batch)), shape
    print("ok fallback", flush=True)
    """)


def test_gradients_reduce_scattered_and_equal_one_device():
    proc = run_script(_SCRIPT, 8, "--xla_backend_optimization_level=0")
    assert proc.stdout.count("ok") == 6, proc.stdout


def test_one_device_runs_no_shard_map():
    """One device (no mesh): the model's program has no shard_map; fsdp_call is
    ``fn(rows, weights)`` (tiny_moe and moe_7m keep their speed)."""
    model = Transformer(preset("tiny_moe", vocab_size=64), rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    tokens = jnp.zeros((2, 5), jnp.int32)
    loss = lambda p: nnx.merge(graphdef, p)(tokens).logits.sum()
    jaxpr = str(jax.make_jaxpr(jax.grad(loss))(params))
    assert "shard_map" not in jaxpr
