"""The decoder: embedding, pre-norm blocks (attention + MLP or MoE), final norm, output
projection; returns logits or hidden states, the updated KV cache, the routing of every
MoE layer and the auxiliary router losses.

The blocks are held per layer (``model.layers[i]``, run in a Python loop: one copy of the
block per layer in the compiled program) or, with ``ModelConfig.scan_layers``, stacked:
``model.layers[r]`` is one Block for run r of ``config.layer_runs`` (consecutive layers
of one kind) whose parameters carry a leading ``layers`` axis, run with
``jax.lax.scan`` (one copy of the block per run). ``stack_layers`` / ``unstack_layers``
convert a model's state between the two layouts; a model built from the same
``nnx.Rngs`` in either layout holds the same weights. ``ModelConfig.remat`` wraps each
block (or the scanned body) in ``jax.checkpoint``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from policyopt import sharding
from policyopt.models import lora
from policyopt.models.attention import Attention, KVCache
from policyopt.models.config import ModelConfig
from policyopt.models.layers import MLP, RMSNorm, param, rope_cos_sin
from policyopt.models.moe import MoE
from policyopt.sharding import constrain, fsdp_call

# Logical axes of the embedding table [V, D] and of the output embedding [D, V].
_EMBED_AXES = ("vocab", "embed")
_HEAD_AXES = ("embed", "vocab")


@struct.dataclass
class ModelOutput:
    """What one forward pass returns (a pytree, so it can leave a jit).

    Attributes:
      logits: float32 [B, T, V], or None when called with return_logits=False.
      hidden: [B, T, D] final hidden states (after the final norm), the input of the
        vocabulary projection (see policyopt.logprobs.token_log_probs).
      cache: the updated KVCache, or None when no cache was passed.
      routing: int32 [L_moe, B, T, k] experts chosen (or replayed) per MoE layer; None for
        a dense model.
      aux: dict with "load_balancing_loss", "router_z_loss", "dropped_tokens" (float32
        scalars, mean over MoE layers for the losses, sum for dropped),
        "tokens_per_expert" and "router_prob_sum" (the router probabilities summed over
        the valid tokens) float32 [L_moe, E]; empty for a dense model. The
        load-balancing loss is 1 at perfect balance, 1 / k of transformers' aux_loss
        for one MoE layer (policyopt.models.moe.router_aux).
    """

    logits: jax.Array | None
    hidden: jax.Array
    cache: KVCache | None
    routing: jax.Array | None
    aux: dict


class Block(nnx.Module):
    """x + Attn(RMSNorm(x)), then h + FFN(RMSNorm(h)), FFN = SwiGLU MLP or MoE."""

    def __init__(self, config: ModelConfig, layer: int, *, rngs: nnx.Rngs):
        self.layer = layer
        self.is_moe = layer in config.moe_layer_indices
        pdt = config.weight_dtype
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, param_dtype=pdt)
        self.attn = Attention(config, rngs=rngs)
        self.post_attention_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, param_dtype=pdt)
        if self.is_moe:
            self.mlp = MoE(config, rngs=rngs)
        else:
            self.mlp = MLP(config, config.intermediate_size, rngs=rngs)

    def __call__(self, x, cos, sin, token_mask, cache, routing, segment_ids=None, layer=None):
        """``segment_ids``: int32 [B, T] of packed rows, or None. ``layer``: the block's
        index in the cache; default ``self.layer`` (a traced int32 scalar inside the layer
        scan)."""
        layer = self.layer if layer is None else layer
        attn_out, cache = self.attn(
            self.input_norm(x), cos, sin, token_mask, cache, layer, segment_ids
        )
        x = x + attn_out.astype(x.dtype)
        h = self.post_attention_norm(x)
        if self.is_moe:
            ffn_out, routing, aux = self.mlp(h, token_mask, routing)
        else:
            ffn_out, routing, aux = self.mlp(h), None, None
        x = x + ffn_out.astype(x.dtype)
        return constrain(x, ("batch", "length", "embed")), cache, routing, aux

    def add_adapters(self, config: lora.LoRAConfig, targets, key, layers: tuple[int, ...]):
        """LoRA adapters on this block's chosen ``targets`` (``lora.build_adapters``; the
        block's layers: one, or its run when stacked)."""
        for module in (self.attn, self.mlp):
            module.lora = lora.build_adapters(
                module, type(module).LORA_SLOTS, config, targets, key, layers
            )


class Transformer(nnx.Module):
    """Qwen3 / Qwen3-MoE decoder-only language model (see ModelConfig), with LoRA
    adapters when ``config.lora.rank > 0`` (``add_adapters``)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        pdt, std = config.weight_dtype, config.initializer_range
        self.embed = param(
            rngs, (config.vocab_size, config.hidden_size), _EMBED_AXES, std=std, dtype=pdt
        )
        blocks = [Block(config, i, rngs=rngs) for i in range(config.num_layers)]
        if config.scan_layers:
            blocks = [_stack_blocks(blocks[start:stop]) for start, stop in config.layer_runs]
        self.layers = nnx.List(blocks)
        self.final_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, param_dtype=pdt)
        if not config.tie_word_embeddings:
            self.lm_head = param(
                rngs,
                (config.hidden_size, config.vocab_size),
                _HEAD_AXES,
                std=std,
                dtype=pdt,
            )
        if config.lora.enabled:
            # Drawn last, from a key of their own, so the base weights are those of the
            # same config without LoRA (bit for bit), in either layout.
            add_adapters(self, config.lora, rngs.params())

    def init_cache(
        self, batch_size: int, max_length: int, dtype=None, *, per_layer: bool = False
    ) -> KVCache:
        """An empty KVCache for ``batch_size`` rows and ``max_length`` slots (compute dtype
        unless ``dtype`` is given), stacked or per layer (see KVCache)."""
        return KVCache.create(self.config, batch_size, max_length, dtype, per_layer=per_layer)

    def output_embedding(self) -> jax.Array:
        """[D, V] matrix W with logits = hidden @ W (the embedding transposed when tied);
        logical axes ("embed", "vocab") either way."""
        if self.config.tie_word_embeddings:
            return self.embed[...].T
        return self.lm_head[...]

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array | None = None,
        attention_mask: jax.Array | None = None,
        cache: KVCache | None = None,
        routing: jax.Array | None = None,
        return_logits: bool = True,
        segment_ids: jax.Array | None = None,
    ) -> ModelOutput:
        """Forward pass.

        Args:
          tokens: int32 [B, T]. Ids outside [0, V) are clamped into it: such ids are
            meant for padding (attention_mask 0), which they must not poison (a NaN
            embedding, as an out-of-range lookup gives, reaches every real token of
            its row through attention: probability 0 times NaN is NaN).
          positions: int32 [B, T] RoPE positions; default 0..T-1, or cache.index + 0..T-1
            with a cache. Right-padded rows need explicit ones (prompt_length + step).
          attention_mask: [B, T], 1 = real token; keys with 0 are never attended. Default ones.
          cache: KVCache to read and extend at slots [index, index+T), or None.
          routing: int32 [L_moe, B, T, k] experts to replay in every MoE layer, or None.
          return_logits: False skips the vocabulary projection (logits=None).
          segment_ids: int32 [B, T] or None: packed rows, several sequences per row; a
            token attends only to earlier tokens of its own segment, and tokens of
            segment 0 are padding (as with attention_mask 0). Positions stay the
            caller's (per segment: 0.. at each segment's start). Not with a cache.
        Returns:
          ModelOutput.
        """
        cfg = self.config
        b, t = tokens.shape
        if positions is None:
            start = 0 if cache is None else cache.index
            positions = jnp.broadcast_to(start + jnp.arange(t, dtype=jnp.int32), (b, t))
        if attention_mask is None:
            token_mask = jnp.ones((b, t), bool)
        else:
            token_mask = attention_mask.astype(bool)
        if segment_ids is not None:
            if cache is not None:
                raise ValueError("segment_ids (packed rows) cannot be used with a KV cache")
            if tuple(segment_ids.shape) != (b, t):
                raise ValueError(
                    f"segment_ids must have the tokens' shape [B, T] = {(b, t)}, "
                    f"got {tuple(segment_ids.shape)}"
                )
            segment_ids = segment_ids.astype(jnp.int32)
            token_mask = token_mask & (segment_ids != 0)
        if routing is not None:
            expected = (cfg.num_moe_layers, b, t, cfg.num_experts_per_tok)
            if not cfg.is_moe:
                raise ValueError("routing was passed to a dense model (num_experts == 0)")
            if tuple(routing.shape) != expected:
                raise ValueError(
                    f"routing must have shape [L_moe, B, T, k] = {expected}, "
                    f"got {tuple(routing.shape)}"
                )

        # The table is gathered whole along `embed` first (as FSDP gathers every weight at
        # use): a lookup into a table sharded along `embed` yields rows sharded along it,
        # which XLA can only reshard to batch rows by replicating them in full
        # ("involuntary full rematerialization" on a data x fsdp x tensor mesh). On an
        # fsdp mesh the gather is explicit, in a shard_map (fsdp_call), so that the
        # table's gradient is reduce-scattered onto its shards.
        def lookup(tokens, weights):
            table = constrain(weights[0], ("vocab", None))
            return jnp.take(table, tokens, axis=0, mode="clip").astype(cfg.compute_dtype)

        x = fsdp_call(lookup, tokens, (self.embed[...],), (_EMBED_AXES,))
        x = constrain(x, ("batch", "length", "embed"))
        cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta)
        policy = _remat_policy(cfg.remat)
        routings, auxes = [], []
        if cfg.scan_layers:
            # The scan carries the stacked cache: each layer writes its slots in place and
            # reads its keys and values at a traced layer index.
            per_layer_cache = cache is not None and cache.per_layer
            if per_layer_cache:
                cache = cache.stack()
            for (start, stop), block in zip(cfg.layer_runs, self.layers):
                run_routing = None
                if block.is_moe and routing is not None:
                    moe_start = sum(r.shape[0] for r in routings)
                    run_routing = routing[moe_start : moe_start + stop - start]
                x, cache, run_routing, aux = _scan_blocks(
                    block,
                    start,
                    stop,
                    policy,
                    x,
                    cos,
                    sin,
                    token_mask,
                    segment_ids,
                    cache,
                    run_routing,
                )
                if block.is_moe:
                    routings.append(run_routing)
                    auxes.append(aux)
            if per_layer_cache:
                cache = cache.unstack()
        else:
            for block in self.layers:
                layer_routing = None
                if block.is_moe and routing is not None:
                    layer_routing = routing[len(routings)]
                x, cache, layer_routing, aux = _apply_block(
                    block, policy, x, cos, sin, token_mask, segment_ids, cache, layer_routing
                )
                if block.is_moe:
                    routings.append(layer_routing[None])
                    auxes.append(jax.tree.map(lambda a: a[None], aux))
        hidden = self.final_norm(x)
        logits = None
        if return_logits:

            def project(hidden, weights):
                return jnp.einsum(
                    "btd,dv->btv",
                    hidden,
                    weights[0].astype(hidden.dtype),
                    preferred_element_type=jnp.float32,
                )

            logits = fsdp_call(project, hidden, (self.output_embedding(),), (_HEAD_AXES,))
        if cache is not None:
            cache = cache.replace(index=cache.index + t)
        out_routing, out_aux = None, {}
        if routings:
            # Per-layer outputs, [L_moe, ...] once the runs are joined.
            out_routing = jnp.concatenate(routings)
            stacked = {name: jnp.concatenate([a[name] for a in auxes]) for name in auxes[0]}
            out_aux = {
                "load_balancing_loss": jnp.mean(stacked["load_balancing_loss"]),
                "router_z_loss": jnp.mean(stacked["router_z_loss"]),
                "dropped_tokens": jnp.sum(stacked["dropped_tokens"]),
                "tokens_per_expert": stacked["tokens_per_expert"],
                "router_prob_sum": stacked["router_prob_sum"],
            }
        return ModelOutput(
            logits=logits, hidden=hidden, cache=cache, routing=out_routing, aux=out_aux
        )


def add_adapters(model: "Transformer", config: lora.LoRAConfig, key) -> None:
    """Attaches LoRA adapters (``policyopt.models.lora``) to ``model``'s blocks, in place,
    and records ``config`` in ``model.config.lora``. A of layer l and target t depends on
    (key, l, t) only (``lora.build_adapters``), B is zero: the model's outputs are
    unchanged. Per-layer and stacked (``scan_layers``) blocks alike.

    Raises:
      ValueError: a target the model lacks, or a rank above a target's smaller dimension.
    """
    model_config = model.config.replace(lora=config)  # checks the targets and ranks
    targets = config.check(model_config)
    if model_config.scan_layers:
        runs = [tuple(range(start, stop)) for start, stop in model_config.layer_runs]
    else:
        runs = [(i,) for i in range(model_config.num_layers)]
    for block, layers in zip(model.layers, runs, strict=True):
        block.add_adapters(config, targets, key, layers)
    model.config = model_config


# --------------------------------------------------------------------------- layers


def _remat_policy(remat: str):
    """``ModelConfig.remat`` -> (whether to checkpoint, the ``jax.checkpoint`` policy).

    "save_dots" keeps ``dots_with_no_batch_dims_saveable`` rather than ``checkpoint_dots``:
    the latter also saves the attention einsums, whose rows and heads are batch dimensions,
    i.e. the [B, H, T, T] scores that rematerialisation exists to drop.
    """
    if remat == "none":
        return False, None
    if remat == "full":
        return True, None
    return True, jax.checkpoint_policies.dots_with_no_batch_dims_saveable


def _apply_block(block: Block, policy, x, cos, sin, token_mask, segment_ids, cache, routing):
    """One per-layer block, under ``jax.checkpoint`` when ``policy`` asks for it."""
    remat, save = policy
    if not remat:
        return block(x, cos, sin, token_mask, cache, routing, segment_ids)
    graphdef, params = nnx.split(block)

    def run(params, x, cache, routing):
        return nnx.merge(graphdef, params)(x, cos, sin, token_mask, cache, routing, segment_ids)

    return jax.checkpoint(run, policy=save)(params, x, cache, routing)


def _scan_blocks(
    block: Block,
    start: int,
    stop: int,
    policy,
    x,
    cos,
    sin,
    token_mask,
    segment_ids,
    cache,
    routing,
):
    """Layers [start, stop) of one run, ``block`` holding their stacked parameters, as a
    ``jax.lax.scan`` whose body is one block (under ``jax.checkpoint`` per the policy).

    Carry: the residual stream x [B, T, D] and the stacked KVCache (written at the
    layer's index). Scanned inputs: the layer's parameters, its index, its replayed
    routing [B, T, k] (MoE runs). Outputs per layer: routing [B, T, k] and aux (MoE).

    Returns:
      (x, cache, routing [n, B, T, k] or None, aux dict of [n, ...] arrays or None).
    """
    remat, save = policy
    graphdef, params = nnx.split(block)

    def body(carry, inputs):
        x, cache = carry
        layer_params, layer, layer_routing = inputs
        layer_block = nnx.merge(graphdef, layer_params)
        x, cache, layer_routing, aux = layer_block(
            x, cos, sin, token_mask, cache, layer_routing, segment_ids, layer=layer
        )
        return (x, cache), (layer_routing, aux)

    if remat:
        # prevent_cse guards against XLA merging the recomputation with the forward;
        # inside a scan that cannot happen, and it would block optimisations.
        body = jax.checkpoint(body, policy=save, prevent_cse=False)
    layers = jnp.arange(start, stop, dtype=jnp.int32)
    (x, cache), (routing, aux) = jax.lax.scan(body, (x, cache), (params, layers, routing))
    return x, cache, routing, aux


def _stack_values(values, logical_axes):
    """Per-layer arrays -> one [n, ...] array with logical axes ("layers", *axes).

    Traced values (a build under jit or ``nnx.eval_shape``) are stacked in the trace;
    concrete ones on the host and placed as ``policyopt.models.layers.param`` places a
    parameter (sharded by its logical axes on the current mesh), so that building a
    model compiles nothing.
    """
    if any(isinstance(v, jax.core.Tracer) for v in values):
        return jnp.stack(values)
    host = np.stack(sharding.to_host(list(values)))
    return sharding.place_host_array(host, logical_axes)


def _stack_variables(variables):
    """Per-layer ``nnx.Variable`` s of one parameter -> the stacked Variable."""
    axes = variables[0].get_metadata().get("logical_axes")
    stacked_axes = None if axes is None else ("layers",) + tuple(axes)
    value = _stack_values([v.get_value() for v in variables], stacked_axes or ())
    if axes is None:
        return variables[0].replace(value)
    return variables[0].replace(value, logical_axes=stacked_axes)


def _unstack_variable(variable, count: int):
    """A stacked ``nnx.Variable`` -> ``count`` per-layer Variables (leading axis dropped)."""
    axes = variable.get_metadata().get("logical_axes")
    value = variable.get_value()
    if isinstance(value, jax.core.Tracer):
        values = [value[j] for j in range(count)]
    else:
        host = sharding.to_host(value)
        values = [sharding.place_host_array(host[j], tuple(axes or ())[1:]) for j in range(count)]
    if axes is None:
        return [variable.replace(v) for v in values]
    return [variable.replace(v, logical_axes=tuple(axes)[1:]) for v in values]


def _stack_blocks(blocks: list[Block]) -> Block:
    """Blocks of identical structure -> one Block whose variables are stacked (layer 0 of
    the stack is ``blocks[0]``); its ``layer`` attribute is that of the first."""
    graphdef, _ = nnx.split(blocks[0])
    states = [nnx.state(b) for b in blocks]
    stacked = jax.tree.map(
        lambda *vs: _stack_variables(vs), *states, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
    return nnx.merge(graphdef, stacked)


def stack_layers(state: nnx.State, config: ModelConfig) -> nnx.State:
    """A Transformer's state in the per-layer layout -> the scan_layers layout.

    Paths ("layers", i, ...) become ("layers", r, ...) with layer i at index i - start of
    run r = ``config.layer_runs`` entry holding i. Any part of the state (all variables,
    or ``nnx.state(model, nnx.Param)``, or an optimiser's moments shaped like it) converts;
    merge it with the graphdef of a model built with ``scan_layers=True``.

    Args:
      state: ``nnx.State`` of a model with per-layer blocks (``config.num_layers``).
      config: the model's config (either scan_layers value: only its layer runs are read).
    Returns:
      The stacked ``nnx.State``.
    """
    groups: dict[tuple, list] = {}
    flat = []
    for path, variable in nnx.to_flat_state(state):
        if path[0] != "layers":
            flat.append((path, variable))
            continue
        run, offset = config.layer_run(int(path[1]))
        size = config.layer_runs[run][1] - config.layer_runs[run][0]
        groups.setdefault(("layers", run) + tuple(path[2:]), [None] * size)[offset] = variable
    for path, variables in groups.items():
        missing = [j for j, v in enumerate(variables) if v is None]
        if missing:
            raise ValueError(
                f"stack_layers: {'.'.join(map(str, path[2:]))} is missing for layers "
                f"{[config.layer_runs[path[1]][0] + j for j in missing]}"
            )
        flat.append((path, _stack_variables(variables)))
    return nnx.from_flat_state(flat)


def unstack_layers(state: nnx.State, config: ModelConfig) -> nnx.State:
    """The inverse of ``stack_layers``: a scan_layers state -> the per-layer layout."""
    flat = []
    for path, variable in nnx.to_flat_state(state):
        if path[0] != "layers":
            flat.append((path, variable))
            continue
        start, stop = config.layer_runs[int(path[1])]
        for j, layer_variable in enumerate(_unstack_variable(variable, stop - start)):
            flat.append((("layers", start + j) + tuple(path[2:]), layer_variable))
    return nnx.from_flat_state(flat)
