"""KV-cache sampling: one prefill pass, then a jitted ``lax.while_loop`` decode.

``generate`` turns right-padded prompts into a ``Rollout``: the sampled tokens, their mask,
the behaviour log-probs (of the distribution sampled from, and of the untruncated
temperature-scaled one) and, for MoE models, the experts of every prompt and generated
token (R3, arXiv 2510.11370). ``decode_step`` is the one decode step of every sampler: this
one, ``policyopt.engine`` and ``policyopt.rl.rollouts.async_generation`` (docs/scale.md,
"Generation engine").
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

if TYPE_CHECKING:  # the model package stays out of the sampler's imports
    from policyopt.models.interface import PolicyModel

__all__ = [
    "Greedy",
    "Temperature",
    "TopK",
    "TopP",
    "SamplingMethod",
    "SamplingConfig",
    "Rollout",
    "sampling_method",
    "generate",
    "generate_fn",
    "decode_step",
    "DecodeStep",
    "next_logits",
]


# --------------------------------------------------------------------------------------
# Sampling methods: small frozen (hashable) dataclasses with one `sample` method.
# --------------------------------------------------------------------------------------


class SamplingMethod(Protocol):
    """Draws one token per row from next-token logits.

    `sample(logits [B, V] float32, rng) -> (tokens int32 [B], log_probs float32 [B])`:
    `log_probs` are those of the distribution actually sampled from.
    `scale(logits) -> logits`: the temperature-scaled logits whose untruncated
    log-softmax gives `Rollout.raw_log_probs`.
    """

    def sample(self, logits: jax.Array, rng: jax.Array) -> tuple[jax.Array, jax.Array]: ...

    def scale(self, logits: jax.Array) -> jax.Array: ...


def _take(values: jax.Array, index: jax.Array) -> jax.Array:
    """values[b, index[b]] for values [B, V], index [B]."""
    return jnp.take_along_axis(values, index[:, None], axis=-1)[:, 0]


@dataclasses.dataclass(frozen=True)
class Greedy:
    """argmax of the logits. The sampling distribution is a point mass: log_probs = 0.

    Raw log-probs are the model's own (temperature 1) log-softmax at the argmax.
    """

    def sample(self, logits, rng):
        del rng
        tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return tokens, jnp.zeros(logits.shape[:1], jnp.float32)

    def scale(self, logits):
        return logits


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 (use Greedy for 0), got {temperature}")


@dataclasses.dataclass(frozen=True)
class Temperature:
    """Sample from softmax(logits / temperature)."""

    temperature: float = 1.0

    def __post_init__(self):
        _check_temperature(self.temperature)

    def scale(self, logits):
        return logits / self.temperature

    def sample(self, logits, rng):
        scaled = self.scale(logits)
        tokens = jax.random.categorical(rng, scaled, axis=-1).astype(jnp.int32)
        return tokens, _take(jax.nn.log_softmax(scaled, axis=-1), tokens)


@dataclasses.dataclass(frozen=True)
class TopK:
    """Sample among the k largest logits, renormalised: softmax over top_k(logits) / T.

    Exactly k candidates (`lax.top_k`), so ties at the k-th value are broken by index.
    """

    k: int
    temperature: float = 1.0

    def __post_init__(self):
        if self.k < 1:
            raise ValueError(f"TopK.k must be >= 1, got {self.k}")
        _check_temperature(self.temperature)

    def scale(self, logits):
        return logits / self.temperature

    def sample(self, logits, rng):
        # k larger than the vocabulary keeps every token (as TopP clamps its own).
        values, indices = jax.lax.top_k(logits, min(self.k, logits.shape[-1]))  # [B, k], descending
        values = self.scale(values)
        choice = jax.random.categorical(rng, values, axis=-1)
        tokens = _take(indices, choice).astype(jnp.int32)
        return tokens, _take(jax.nn.log_softmax(values, axis=-1), choice)


@dataclasses.dataclass(frozen=True)
class TopP:
    """Nucleus sampling (Holtzman et al. 2020, arXiv 1904.09751).

    With candidates sorted by probability p_(1) >= p_(2) >= ... (of softmax(logits / T),
    restricted first to the `top_k` largest when top_k > 0), keep the smallest prefix
    whose mass reaches `p`: candidate i is kept iff sum_{j<i} p_(j) < p (so the most
    likely token always is), then sample from the kept set renormalised. Tokens of equal
    probability at the cut are ordered by index (``lax.top_k``), so the lower indices are
    kept. Build it through `sampling_method`, which uses no nucleus for p = 1 (a float32
    cumulative sum can drop a tail of ~1e-7 of the mass over a large vocabulary).
    """

    p: float
    temperature: float = 1.0
    top_k: int = 0

    def __post_init__(self):
        if not 0.0 < self.p <= 1.0:
            raise ValueError(f"TopP.p must be in (0, 1], got {self.p}")
        if self.top_k < 0:
            raise ValueError(f"TopP.top_k must be >= 0, got {self.top_k}")
        _check_temperature(self.temperature)

    def scale(self, logits):
        return logits / self.temperature

    def sample(self, logits, rng):
        k = self.top_k if 0 < self.top_k < logits.shape[-1] else logits.shape[-1]
        values, indices = jax.lax.top_k(logits, k)  # sorted, descending
        values = self.scale(values)
        probs = jax.nn.softmax(values, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        values = jnp.where(mass_before < self.p, values, -jnp.inf)
        choice = jax.random.categorical(rng, values, axis=-1)
        tokens = _take(indices, choice).astype(jnp.int32)
        return tokens, _take(jax.nn.log_softmax(values, axis=-1), choice)


def sampling_method(temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> SamplingMethod:
    """The simplest method for these settings; temperature=0 means greedy.

    Order as in common practice (HF, vLLM): temperature, then top-k, then top-p.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if temperature == 0:
        return Greedy()
    if top_p < 1.0:
        return TopP(p=top_p, temperature=temperature, top_k=top_k)
    if top_k > 0:
        return TopK(k=top_k, temperature=temperature)
    return Temperature(temperature)


# --------------------------------------------------------------------------------------
# Configuration and outputs.
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """Everything static about a `generate_fn` call (hashable: a jit cache key)."""

    # Number of decode steps N; the cache holds P + N slots (at the last segment).
    max_new_tokens: int
    # How tokens are drawn from the logits (Greedy, Temperature, TopK, TopP).
    method: SamplingMethod = Temperature(1.0)
    # Token that ends a sequence (kept, with mask 1). None: sequences end only at N.
    eos_id: int | None = None
    # Further single tokens that end a sequence, like eos_id.
    stop_ids: tuple[int, ...] = ()
    # Token sequences that end a sequence once generated (all their tokens get mask 1).
    stop_sequences: tuple[tuple[int, ...], ...] = ()
    # No end token (eos_id / stop_ids) may be drawn before this many tokens.
    min_new_tokens: int = 0
    # G samples per prompt sharing one prefill; rows b*G .. b*G+G-1 belong to prompt b.
    num_samples: int = 1
    # Token written after a sequence has ended, and in prompt padding. None: eos_id or 0.
    pad_id: int | None = None
    # dtype of the KV cache; None: the model's default.
    cache_dtype: str | None = None
    # Decode in K loops of N/K steps (rounded down at each end); loop k attends over a cache
    # of P + (k+1) N/K slots instead of P + N (fewer bytes read per step for long
    # generations), at the cost of one more compiled loop body per loop. The same tokens
    # up to float rounding (the softmax sums over fewer empty slots).
    decode_segments: int = 1

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {self.num_samples}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], "
                f"got {self.min_new_tokens}"
            )
        if not 1 <= self.decode_segments <= self.max_new_tokens:
            raise ValueError(
                f"decode_segments must be in [1, max_new_tokens={self.max_new_tokens}], "
                f"got {self.decode_segments}"
            )
        if any(len(s) == 0 for s in self.stop_sequences):
            raise ValueError("stop_sequences must not contain an empty sequence")
        object.__setattr__(self, "stop_ids", tuple(int(t) for t in self.stop_ids))
        object.__setattr__(
            self, "stop_sequences", tuple(tuple(int(t) for t in s) for s in self.stop_sequences)
        )
        # Negative ids would wrap in the min_new_tokens ban (logits[:, -1] is token V - 1)
        # and match the -1 that fills the stop-sequence window before any token is drawn.
        for name, token in self._special_ids():
            if token < 0:
                raise ValueError(f"SamplingConfig.{name} = {token} is a negative token id")

    def _special_ids(self) -> tuple[tuple[str, int], ...]:
        """(field, id) of every token id the config names."""
        ids = [("eos_id", self.eos_id), ("pad_id", self.pad_id)]
        ids += [(f"stop_ids[{i}]", t) for i, t in enumerate(self.stop_ids)]
        ids += [
            (f"stop_sequences[{i}][{j}]", t)
            for i, seq in enumerate(self.stop_sequences)
            for j, t in enumerate(seq)
        ]
        return tuple((name, int(t)) for name, t in ids if t is not None)

    def check_vocab(self, vocab_size: int) -> None:
        """Raises ValueError naming any token id of this config outside [0, vocab_size).

        Called by `generate_fn` (at trace time) with the model's vocabulary: inside the
        jitted loop an out-of-range id raises nothing. A pad_id >= V would be written into
        the rollout and fed back at padding positions; an eos_id or stop id >= V can
        never be drawn, so its rows would never end.
        """
        for name, token in self._special_ids():
            if not 0 <= token < vocab_size:
                raise ValueError(
                    f"SamplingConfig.{name} = {token} is outside the model's vocabulary "
                    f"[0, {vocab_size})"
                )

    @property
    def end_ids(self) -> tuple[int, ...]:
        return ((self.eos_id,) if self.eos_id is not None else ()) + self.stop_ids

    @property
    def stop_window(self) -> int:
        """M, the longest stop sequence (0: none): the last tokens each row keeps to match
        them (``decode_step``'s ``recent``)."""
        return max((len(stop) for stop in self.stop_sequences), default=0)

    @property
    def segment_ends(self) -> tuple[int, ...]:
        """Decode step at which each of the K loops ends: ``(k + 1) N // K``, strictly
        increasing for K <= N, the last ``N``."""
        n, k = self.max_new_tokens, self.decode_segments
        return tuple((i + 1) * n // k for i in range(k))

    @property
    def fill_id(self) -> int:
        if self.pad_id is not None:
            return self.pad_id
        return self.eos_id if self.eos_id is not None else 0


@struct.dataclass
class Rollout:
    """What `generate` returns. Rows of one prompt are contiguous (b*G .. b*G+G-1).

    Shapes: R = B * G rows, P prompt length (padded), N = max_new_tokens,
    L_moe MoE layers, k experts per token.
    """

    tokens: jax.Array  # int32 [R, N]; pad_id after the end of each sequence
    mask: jax.Array  # float32 [R, N]; 1 up to and including the end token
    log_probs: jax.Array  # float32 [R, N]; behaviour log-probs (distribution sampled from)
    raw_log_probs: jax.Array  # float32 [R, N]; temperature-scaled, untruncated
    lengths: jax.Array  # int32 [R]; number of valid generated tokens (= mask.sum(-1))
    prompt_tokens: jax.Array  # int32 [R, P]; prompts right-aligned (left-padded with pad_id)
    prompt_lengths: jax.Array  # int32 [R]
    routing: jax.Array | None  # int32 [L_moe, R, P + N, k] in the `sequences()` layout
    num_steps: jax.Array  # int32 []; decode steps run (< N when every row ended early)

    def sequences(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Prompt + response as one batch for a training forward pass.

        Returns:
          tokens: int32 [R, P + N]; index P - prompt_lengths[r] + j holds prompt token j,
            index P + n holds response token n.
          positions: int32 [R, P + N]; RoPE positions (0 .. len-1 for the prompt, then
            len + n for response token n; padding gets 0).
          attention_mask: int32 [R, P + N]; 1 on real prompt tokens and valid response
            tokens. Response token n is predicted by the hidden state at index P - 1 + n.

        NumPy in, NumPy out (computed on the host, no device round trip); JAX arrays
        otherwise.
        """
        arrays = (self.prompt_tokens, self.prompt_lengths, self.tokens, self.mask)
        xp = np if all(isinstance(a, np.ndarray) for a in arrays) else jnp
        prompt_len = self.prompt_tokens.shape[1]
        index = xp.arange(prompt_len)[None, :]
        start = prompt_len - self.prompt_lengths[:, None]
        prompt_real = index >= start
        prompt_positions = xp.where(prompt_real, index - start, 0)
        response_positions = self.prompt_lengths[:, None] + xp.arange(self.tokens.shape[1])[None]
        tokens = xp.concatenate([self.prompt_tokens, self.tokens], axis=1)
        positions = xp.concatenate([prompt_positions, response_positions], axis=1)
        attention_mask = xp.concatenate([prompt_real, self.mask > 0], axis=1)
        return (
            tokens.astype(xp.int32),
            positions.astype(xp.int32),
            attention_mask.astype(xp.int32),
        )


# --------------------------------------------------------------------------------------
# The jitted generation function.
# --------------------------------------------------------------------------------------


@struct.dataclass
class _DecodeState:
    """Carry of the decode `while_loop`."""

    step: jax.Array  # int32 []; index of the token sampled next
    done: jax.Array  # bool [R]; the row has ended
    logits: jax.Array  # float32 [R, V]; next-token logits
    cache: object  # KVCache
    tokens: jax.Array  # int32 [R, N]
    mask: jax.Array  # float32 [R, N]
    log_probs: jax.Array  # float32 [R, N]
    raw_log_probs: jax.Array  # float32 [R, N]
    routing: jax.Array | None  # int32 [L_moe, R, N, k]
    recent: jax.Array | None  # int32 [R, M]; last M tokens, for stop sequences


def _repeat_rows(x: jax.Array, times: int, axis: int) -> jax.Array:
    return x if times == 1 else jnp.repeat(x, times, axis=axis)


def _repeat_cache(cache, times: int):
    """Repeats every row of a KVCache (axis 0 of each layer's keys and values, and of
    `key_mask [B, S]`)."""
    if times == 1:
        return cache
    cache = cache.map_layers(lambda x: _repeat_rows(x, times, 0))
    return cache.replace(key_mask=_repeat_rows(cache.key_mask, times, 0))


def next_logits(model: PolicyModel, hidden: jax.Array) -> jax.Array:
    """float32 [R, V] logits from final hidden states [R, D], computed as the model's own
    projection and `policyopt.logprobs.token_log_probs` do (weights in the hidden dtype,
    float32 accumulation), so behaviour and training log-probs agree."""
    embedding = model.output_embedding().astype(hidden.dtype)
    return jnp.einsum("rd,dv->rv", hidden, embedding, preferred_element_type=jnp.float32).astype(
        jnp.float32
    )


@struct.dataclass
class DecodeStep:
    """What `decode_step` returns for R rows (non-live rows: fill token, zero log-probs,
    their logits unchanged)."""

    tokens: jax.Array  # int32 [R]; the token drawn (fill_id where not live)
    log_probs: jax.Array  # float32 [R]; log q(token), q the distribution sampled from
    raw_log_probs: jax.Array  # float32 [R]; log softmax(scale(logits))[token], untruncated
    ended: jax.Array  # bool [R]; live and the token ends the row (end id, stop sequence)
    recent: jax.Array | None  # int32 [R, M]; last M tokens (live rows shifted)
    logits: jax.Array  # float32 [R, V]; next-token logits after feeding the token
    cache: object  # the cache with the token's keys / values written
    routing: jax.Array | None  # int32 [L_moe, R, k]; experts that routed the fed token


def decode_step(
    model,
    config: SamplingConfig,
    logits: jax.Array,
    cache,
    *,
    count: jax.Array,
    live: jax.Array,
    positions: jax.Array,
    rng: jax.Array | None = None,
    row_rngs: jax.Array | None = None,
    recent: jax.Array | None = None,
) -> DecodeStep:
    """One decode step of R rows: draw a token from each live row's logits, then feed it.

    The step every sampler shares (`generate`, `policyopt.engine`, the asynchronous
    `SlotGenerator`); they differ only in their bookkeeping (a step for all rows or one per
    row, dense or paged cache, one key per step or per row). For live row r:

      sample_logits = logits with the end ids at -inf while count[r] < min_new_tokens
      token, log q = config.method.sample(sample_logits)
      raw = log softmax(config.method.scale(logits))[token]        (untruncated, no ban)
      ended = token in end_ids, or the last M tokens equal a stop sequence

    then the token goes through ``model`` at ``positions[r]`` (live rows only: the
    attention mask), writing its keys / values to ``cache``, and the next-token logits
    are read from its final hidden state (`next_logits`).

    Args:
      model: a `policyopt.models.PolicyModel` (`policyopt.models.Transformer`).
      config: the sampling settings (method, end ids, stop sequences, min_new_tokens, fill).
      logits: float32 [R, V], each row's next-token logits.
      cache: a KVCache or PagedKVCache (pages for the token reserved by the caller).
      count: int32 [R], tokens each row has generated (for min_new_tokens).
      live: bool [R], rows that draw and feed a token this step.
      positions: int32 [R], RoPE position of the token drawn.
      rng: one key for the whole step (rows draw from it together), or
      row_rngs: keys [R], one per row (each row drawn alone). Exactly one of the two.
      recent: int32 [R, M], the last M tokens, when config has stop sequences.
    Returns:
      A `DecodeStep`.
    """
    if (rng is None) == (row_rngs is None):
        raise ValueError("decode_step takes exactly one of rng and row_rngs")
    fill = config.fill_id
    end_ids = jnp.asarray(config.end_ids, jnp.int32) if config.end_ids else None
    sample_logits = logits
    if config.min_new_tokens > 0 and end_ids is not None:
        banned = logits.at[:, end_ids].set(-jnp.inf)
        sample_logits = jnp.where((count < config.min_new_tokens)[:, None], banned, logits)
    if rng is not None:
        tokens, log_probs = config.method.sample(sample_logits, rng)
    else:
        tokens, log_probs = jax.vmap(lambda row, key: config.method.sample(row[None], key))(
            sample_logits, row_rngs
        )
        tokens, log_probs = tokens[:, 0], log_probs[:, 0]
    raw_log_probs = _take(jax.nn.log_softmax(config.method.scale(logits), axis=-1), tokens)
    tokens = jnp.where(live, tokens, fill)
    log_probs = jnp.where(live, log_probs, 0.0)
    raw_log_probs = jnp.where(live, raw_log_probs, 0.0)
    ended = jnp.zeros_like(live)
    if end_ids is not None:
        ended = jnp.any(tokens[:, None] == end_ids[None, :], axis=-1)
    if recent is not None:
        window = recent.shape[1]
        shifted = jnp.concatenate([recent[:, 1:], tokens[:, None]], axis=1)
        recent = jnp.where(live[:, None], shifted, recent)
        for stop in config.stop_sequences:
            stop_arr = jnp.asarray(stop, jnp.int32)
            ended |= jnp.all(recent[:, window - len(stop) :] == stop_arr, axis=-1)
    out = model(
        tokens[:, None],
        positions=positions[:, None],
        attention_mask=live[:, None],
        cache=cache,
        return_logits=False,
    )
    routing = None if out.routing is None else out.routing[:, :, 0].astype(jnp.int32)
    logits = jnp.where(live[:, None], next_logits(model, out.hidden[:, 0]), logits)
    return DecodeStep(
        tokens=tokens,
        log_probs=log_probs,
        raw_log_probs=raw_log_probs,
        ended=live & ended,
        recent=recent,
        logits=logits,
        cache=out.cache,
        routing=routing,
    )


def _right_align(x: jax.Array, lengths: jax.Array, axis: int) -> jax.Array:
    """Moves the first lengths[r] entries of each row to the end (a per-row roll).

    `x` has rows on `axis - 1` and the length-P sequence on `axis`.
    """
    size = x.shape[axis]
    shift = size - lengths  # [R]
    source = (jnp.arange(size)[None, :] - shift[:, None]) % size  # [R, P]
    source = source.reshape(source.shape + (1,) * (x.ndim - axis - 1))
    source = source.reshape((1,) * (axis - 1) + source.shape)
    return jnp.take_along_axis(x, source, axis=axis)


def _generate(graphdef, state, prompts, prompt_lengths, rng, *, config: SamplingConfig) -> Rollout:
    model: PolicyModel = nnx.merge(graphdef, state)
    config.check_vocab(model.config.vocab_size)
    batch, prompt_len = prompts.shape
    num_new, group = config.max_new_tokens, config.num_samples
    rows = batch * group
    prompts = prompts.astype(jnp.int32)
    prompt_lengths = prompt_lengths.astype(jnp.int32)

    # 1. Prefill B prompts into slots [0, P).
    index = jnp.arange(prompt_len, dtype=jnp.int32)[None, :]
    prompt_mask = index < prompt_lengths[:, None]
    # Per-layer cache buffers: each layer's attention reads its own (see KVCache); a
    # scanned model (scan_layers) carries the stacked cache through its layer scan. The
    # cache grows segment by segment (config.decode_segments): slots [0, P + end of the
    # segment), so each step's attention reads only slots that can hold keys by then.
    segment_ends = config.segment_ends
    cache = model.init_cache(
        batch,
        prompt_len + segment_ends[0],
        dtype=config.cache_dtype,
        per_layer=not model.config.scan_layers,
    )
    out = model(
        prompts,
        positions=jnp.broadcast_to(index, prompts.shape),
        attention_mask=prompt_mask,
        cache=cache,
        return_logits=False,
    )
    last_hidden = jnp.take_along_axis(out.hidden, (prompt_lengths - 1)[:, None, None], axis=1)[:, 0]
    logits = next_logits(model, last_hidden)

    # 2. G samples per prompt share this prefill.
    cache = _repeat_cache(out.cache, group)
    logits = _repeat_rows(logits, group, 0)
    lengths_rep = _repeat_rows(prompt_lengths, group, 0)
    prompt_routing = None if out.routing is None else _repeat_rows(out.routing, group, 1)

    # 3. Decode.
    fill = config.fill_id
    stop_window = config.stop_window
    routing = None
    if prompt_routing is not None:
        num_moe, _, _, top_k = prompt_routing.shape
        # Steps never run (early stop) keep k distinct experts, so replay stays valid.
        routing = jnp.broadcast_to(
            jnp.arange(top_k, dtype=jnp.int32), (num_moe, rows, num_new, top_k)
        )
    init = _DecodeState(
        step=jnp.zeros((), jnp.int32),
        done=jnp.zeros((rows,), bool),
        logits=logits,
        cache=cache,
        tokens=jnp.full((rows, num_new), fill, jnp.int32),
        mask=jnp.zeros((rows, num_new), jnp.float32),
        log_probs=jnp.zeros((rows, num_new), jnp.float32),
        raw_log_probs=jnp.zeros((rows, num_new), jnp.float32),
        routing=routing,
        recent=jnp.full((rows, stop_window), -1, jnp.int32) if stop_window else None,
    )

    def body(s: _DecodeState) -> _DecodeState:
        live = ~s.done
        step = decode_step(
            model,
            config,
            s.logits,
            s.cache,
            count=jnp.full((rows,), s.step),
            live=live,
            positions=lengths_rep + s.step,
            rng=jax.random.fold_in(rng, s.step),
            recent=s.recent,
        )
        write = lambda buf, col: jax.lax.dynamic_update_index_in_dim(buf, col, s.step, axis=1)
        routing = s.routing
        if routing is not None:  # [L, R, N, k] <- [L, R, k] at column step
            routing = jax.lax.dynamic_update_index_in_dim(routing, step.routing, s.step, axis=2)
        return _DecodeState(
            step=s.step + 1,
            done=s.done | step.ended,
            logits=step.logits,
            cache=step.cache,
            tokens=write(s.tokens, step.tokens),
            mask=write(s.mask, live.astype(jnp.float32)),
            log_probs=write(s.log_probs, step.log_probs),
            raw_log_probs=write(s.raw_log_probs, step.raw_log_probs),
            routing=routing,
            recent=step.recent,
        )

    final = init
    for end in segment_ends:
        # Steps [previous end, end): no row writes past slot P + end - 1 in this segment.
        final = final.replace(cache=final.cache.resize(prompt_len + end))
        final = jax.lax.while_loop(
            lambda s, end=end: (s.step < end) & ~jnp.all(s.done), body, final
        )

    prompt_tokens = _right_align(jnp.where(prompt_mask, prompts, fill), prompt_lengths, axis=1)
    routing = None
    if prompt_routing is not None:
        prompt_routing = _right_align(prompt_routing.astype(jnp.int32), lengths_rep, axis=2)
        routing = jnp.concatenate([prompt_routing, final.routing], axis=2)
    return Rollout(
        tokens=final.tokens,
        mask=final.mask,
        log_probs=final.log_probs,
        raw_log_probs=final.raw_log_probs,
        lengths=final.mask.sum(axis=-1).astype(jnp.int32),
        prompt_tokens=_repeat_rows(prompt_tokens, group, 0),
        prompt_lengths=lengths_rep,
        routing=routing,
        num_steps=final.step,
    )


generate_fn = jax.jit(_generate, static_argnums=(0,), static_argnames=("config",))
generate_fn.__doc__ = """Pure functional sampler:
`generate_fn(graphdef, state, prompts, prompt_lengths, rng, *, config) -> Rollout`, jitted
(graphdef and config static).

For callers that hold their own parameters (e.g. a trainer): `graphdef, state =
nnx.split(model)` once, then pass any `state` with the same structure (new params).
Can also be called inside another jit. See `generate` for the arguments.
"""


def generate(
    model: PolicyModel,
    prompts,
    prompt_lengths,
    *,
    max_new_tokens: int,
    rng: jax.Array,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_id: int | None = None,
    num_samples: int = 1,
    min_new_tokens: int = 0,
    stop_ids: tuple[int, ...] = (),
    stop_sequences: tuple[tuple[int, ...], ...] = (),
    pad_id: int | None = None,
    method: SamplingMethod | None = None,
    cache_dtype: str | None = None,
    decode_segments: int = 1,
) -> Rollout:
    """Samples `num_samples` continuations of each right-padded prompt.

    Args:
      model: a `policyopt.models.Transformer` (dense or MoE).
      prompts: int [B, P], right-padded.
      prompt_lengths: int [B], true lengths, 1 <= prompt_lengths <= P.
      max_new_tokens: N, number of decode steps at most.
      rng: a JAX PRNG key; the same key gives the same samples.
      temperature, top_k, top_p: the sampling distribution (see `sampling_method`);
        temperature=0 is greedy. Ignored when `method` is given.
      eos_id: end-of-sequence token (mask 1 on it, pad after it); None: no EOS.
      num_samples: G samples per prompt sharing one prefill.
      min_new_tokens: end tokens are banned for the first min_new_tokens steps (stop
        sequences are not: one completed earlier still ends the row).
      stop_ids, stop_sequences: further tokens / token sequences that end a sequence.
      pad_id: token written after the end; default eos_id, or 0 without EOS.
        Every token id (eos_id, stop_ids, stop_sequences, pad_id, and the prompts'
        real tokens) must be in [0, V): ValueError otherwise.
      method: an explicit `SamplingMethod`, overriding temperature/top_k/top_p.
      cache_dtype: KV-cache dtype (default: the model's).
      decode_segments: decode loops whose caches grow with the step (see `SamplingConfig`).

    Returns:
      A `Rollout` with B * G rows (prompt b -> rows b*G .. b*G+G-1).
    """
    # Checked on the host copies (the inputs are usually host arrays), then sent once.
    prompts_np = np.asarray(prompts).astype(np.int32, copy=False)
    lengths_np = np.asarray(prompt_lengths).astype(np.int32, copy=False)
    prompts, prompt_lengths = prompts_np, lengths_np
    if prompts.ndim != 2:
        raise ValueError(f"prompts must be [B, P], got shape {prompts.shape}")
    if prompt_lengths.shape != prompts.shape[:1]:
        raise ValueError(
            f"prompt_lengths must be [B={prompts.shape[0]}], got shape {prompt_lengths.shape}"
        )
    if lengths_np.size and (lengths_np.min() < 1 or lengths_np.max() > prompts.shape[1]):
        raise ValueError(
            f"prompt_lengths must be in [1, P={prompts.shape[1]}], got "
            f"min {lengths_np.min()} max {lengths_np.max()}"
        )
    # Real prompt tokens only: padding is masked out, and any id there is clamped into
    # the vocabulary by the embedding lookup (Transformer.__call__).
    real = np.arange(prompts.shape[1])[None, :] < lengths_np[:, None]
    bad = np.argwhere(real & ((prompts_np < 0) | (prompts_np >= model.config.vocab_size)))
    if bad.size:
        row, col = bad[0]
        raise ValueError(
            f"prompts[{row}, {col}] = {prompts_np[row, col]} is outside the model's vocabulary "
            f"[0, {model.config.vocab_size}) ({len(bad)} such tokens)"
        )
    config = SamplingConfig(
        max_new_tokens=max_new_tokens,
        method=method if method is not None else sampling_method(temperature, top_k, top_p),
        eos_id=eos_id,
        stop_ids=tuple(stop_ids),
        stop_sequences=tuple(tuple(s) for s in stop_sequences),
        min_new_tokens=min_new_tokens,
        num_samples=num_samples,
        pad_id=pad_id,
        cache_dtype=cache_dtype,
        decode_segments=decode_segments,
    )
    graphdef, state = nnx.split(model)
    return generate_fn(
        graphdef, state, jnp.asarray(prompts), jnp.asarray(prompt_lengths), rng, config=config
    )
