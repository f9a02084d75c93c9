"""What the sampler, the engine and the learner need of a policy model and of its KV cache,
written as ``typing.Protocol``s. ``Transformer`` with ``KVCache`` or ``PagedKVCache`` is the
implementation; another model that offers these runs with the same sampler, engine and
learner (``isinstance`` checks the names, the annotations say the rest)."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Protocol, runtime_checkable

import jax

if TYPE_CHECKING:
    from policyopt.models.config import ModelConfig
    from policyopt.models.transformer import ModelOutput


@runtime_checkable
class Cache(Protocol):
    """A key / value cache that a forward call reads and extends at slots
    ``[index, index + T)``: dense slots per row (``KVCache``) or pages of a shared pool
    (``PagedKVCache``), each stacked over the layers or one array per layer."""

    # True: each layer's attention goes through the cache's own
    # ``attend(layer, q, k, v, token_mask) -> (out, cache)`` (pages); False: the dense path.
    paged: ClassVar[bool]
    index: jax.Array  # int32 []: the next slot; a call's default positions start there

    @property
    def per_layer(self) -> bool:
        """One array per layer (the decode loop's form) rather than stacked ones."""
        ...

    def stack(self) -> Cache:
        """The stacked form (what a scan over the layers carries)."""
        ...

    def unstack(self) -> Cache:
        """The per-layer form."""
        ...

    def replace(self, **changes) -> Cache: ...


@runtime_checkable
class PolicyModel(Protocol):
    """A causal language model as the sampler (``policyopt.sampling``), the engine
    (``policyopt.engine``) and the learner (``policyopt.rl.update.learner``) call it."""

    config: ModelConfig  # the architecture (routing shapes: L_moe, k) and the kernels

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array | None = None,
        attention_mask: jax.Array | None = None,
        cache: Cache | None = None,
        routing: jax.Array | None = None,
        return_logits: bool = True,
        segment_ids: jax.Array | None = None,
    ) -> ModelOutput:
        """One forward pass: ``ModelOutput`` (logits or None, final hidden states, the
        extended cache, routing ``[L_moe, B, T, k]`` or None, auxiliary losses)."""
        ...

    def init_cache(
        self, batch_size: int, max_length: int, dtype=None, *, per_layer: bool = False
    ) -> Cache:
        """An empty dense cache of ``batch_size`` rows and ``max_length`` slots."""
        ...

    def output_embedding(self) -> jax.Array:
        """The ``[D, V]`` matrix ``W`` with ``logits = hidden @ W``."""
        ...
