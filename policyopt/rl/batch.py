"""RL batches in the training layout, shape buckets, dynamic sampling and minibatches.

**Layout.** Every sequence of a batch is one row of ``[R, P + N]`` int32 tokens: the
prompt *left*-padded to ``P`` (right-aligned), then the response right-padded to ``N``,
the layout of ``policyopt.sampling.Rollout.sequences()`` and of ``Rollout.routing``.
Response token ``n`` of every row is predicted by the hidden state at index ``P - 1 + n``.
RoPE positions are ``0 .. len - 1`` on the prompt and ``len + n`` on the response, so a
row computes exactly what the KV-cache sampler computed (padding keys are masked out).

**Buckets.** ``P`` and ``N`` are rounded up to the next size of a short list
(``config.batch.prompt_buckets`` / ``response_buckets``), so a jitted step sees at most
``len(prompt_buckets) * len(response_buckets)`` shapes in a run. ``N`` is the bucket of
the longest valid response of the batch: the sampler's ``max_new_tokens`` columns are
trimmed when every response ended early.

**Dynamic sampling** (DAPO, 2503.14476 §3.2; Magistral's filter): groups whose rewards
are all equal have zero advantage and carry no gradient; they are dropped and further
prompts are sampled, round after round, until the batch holds ``n_prompts`` groups or a
cap on rounds is reached (the remaining slots then keep zero-variance groups, counted).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from policyopt.sharding import shard_rows, to_host


class Batch(NamedTuple):
    """One RL batch (or minibatch) in the training layout. R rows, S = P + N columns.

    Optional fields are None when unused (a None leaf is part of the jit cache key, so a
    run with a fixed config compiles once per shape bucket).
    """

    tokens: jax.Array  # int32 [R, S]: left-padded prompt, then response
    positions: jax.Array  # int32 [R, S]: RoPE positions (0 on padding)
    attention_mask: jax.Array  # int32 [R, S]: 1 on real prompt and valid response tokens
    mask: jax.Array  # float32 [R, N]: 1 on valid response tokens (up to and incl. EOS)
    advantages: jax.Array  # float32 [R]: one per sequence, or [R, N]: per token (GAE)
    old_log_probs: jax.Array  # float32 [R, N]: log pi_old of the response tokens
    importance_weights: jax.Array | None = None  # float32 [R, N]: truncated IS weights
    ref_log_probs: jax.Array | None = None  # float32 [R, N]: reference policy (KL)
    routing: jax.Array | None = None  # int32 [L_moe, R, S, k]: routing to replay
    old_values: jax.Array | None = None  # float32 [R, N]: critic values of the rollout
    returns: jax.Array | None = None  # float32 [R, N]: value targets (critic methods)
    nll_weights: jax.Array | None = None  # float32 [R]: weight of each row in the NLL term
    # float32 [R, N]: the policy terms' mask when rollout rejection sampling drops tokens
    # (``losses.rejection_mask``; 0 on padding); None: ``mask``. The critic uses ``mask``.
    loss_mask: jax.Array | None = None
    # ``policyopt.rl.update.packing.PackedLayout`` of these rows (``config.batch.pack``): the
    # forwards run on packed rows, every loss on the fields above; None: padded rows.
    packing: Any = None

    @property
    def num_response(self) -> int:
        return self.mask.shape[1]

    @property
    def num_prompt(self) -> int:
        return self.tokens.shape[1] - self.mask.shape[1]


def bucket(length: int, buckets: Sequence[int], *, name: str = "length") -> int:
    """The smallest bucket >= ``length``.

    Raises:
      ValueError: naming ``name`` when no bucket is large enough.
    """
    for size in sorted(buckets):
        if size >= length:
            return int(size)
    raise ValueError(
        f"{name} {length} exceeds the largest bucket {max(buckets)} (extend config.batch.*_buckets)"
    )


def truncated_rows(
    tokens: np.ndarray, lengths: np.ndarray, max_new_tokens: int, end_ids: Sequence[int]
) -> np.ndarray:
    """bool ``[B]``: responses that reached ``max_new_tokens`` without ending on an end
    token (a response whose end token is its last allowed one is complete)."""
    tokens, lengths = np.asarray(tokens), np.asarray(lengths)
    ended = np.isin(tokens[:, max_new_tokens - 1], np.asarray(end_ids, tokens.dtype))
    return (lengths >= max_new_tokens) & ~ended


def encode_prompts(
    prompts: Sequence[str], tokenizer, buckets: Sequence[int]
) -> tuple[np.ndarray, np.ndarray]:
    """Tokenises prompts (``tokenizer.encode_prompt``) and right-pads them to a bucket.

    Returns:
      ``(tokens int32 [B, P], lengths int32 [B])``, the sampler's input format.
    """
    encoded = [tokenizer.encode_prompt(p) for p in prompts]
    lengths = np.array([len(e) for e in encoded], np.int32)
    width = bucket(int(lengths.max()), buckets, name="prompt length")
    tokens = np.full((len(encoded), width), tokenizer.pad_id, np.int32)
    for i, e in enumerate(encoded):
        tokens[i, : len(e)] = e
    return tokens, lengths


def layout(
    prompt_ids: Sequence[Sequence[int]],
    response_ids: Sequence[Sequence[int]],
    pad_id: int,
    prompt_width: int,
    response_width: int,
) -> dict[str, np.ndarray]:
    """Builds the training layout from token lists (SFT batches, tests).

    Returns:
      dict of numpy arrays ``tokens``, ``positions``, ``attention_mask`` ``[R, P + N]`` and
      ``mask`` ``[R, N]`` (see the module docstring).
    """
    rows = len(prompt_ids)
    width = prompt_width + response_width
    tokens = np.full((rows, width), pad_id, np.int32)
    positions = np.zeros((rows, width), np.int32)
    attention_mask = np.zeros((rows, width), np.int32)
    mask = np.zeros((rows, response_width), np.float32)
    for r, (prompt, response) in enumerate(zip(prompt_ids, response_ids)):
        p, n = len(prompt), len(response)
        if p > prompt_width or n > response_width or p == 0:
            raise ValueError(
                f"row {r}: prompt length {p} / response length {n} do not fit "
                f"[{prompt_width}, {response_width}] (prompts need >= 1 token)"
            )
        tokens[r, prompt_width - p : prompt_width] = prompt
        tokens[r, prompt_width : prompt_width + n] = response
        positions[r, prompt_width - p : prompt_width] = np.arange(p)
        positions[r, prompt_width:] = p + np.arange(response_width)
        attention_mask[r, prompt_width - p : prompt_width + n] = 1
        mask[r, :n] = 1
    return dict(tokens=tokens, positions=positions, attention_mask=attention_mask, mask=mask)


def pad_prompt_axis(
    array: np.ndarray, new_prompt_width: int, prompt_width: int, axis: int, value
) -> np.ndarray:
    """Left-pads the prompt part of a ``[..., P + N, ...]`` array to ``new_prompt_width``."""
    extra = new_prompt_width - prompt_width
    if extra == 0:
        return array
    pad = [(0, 0)] * array.ndim
    pad[axis] = (extra, 0)
    return np.pad(array, pad, constant_values=value)


class Round(NamedTuple):
    """One sampling round on the host (numpy): G rows per prompt, groups contiguous."""

    tokens: np.ndarray  # int32 [R, P + N]
    positions: np.ndarray  # int32 [R, P + N]
    attention_mask: np.ndarray  # int32 [R, P + N]
    mask: np.ndarray  # float32 [R, N]
    behaviour_log_probs: np.ndarray  # float32 [R, N] sampler's log-probs (raw, untruncated)
    routing: np.ndarray | None  # int32 [L, R, P + N, k] sampler routing
    rewards: np.ndarray  # float32 [R]
    correct: np.ndarray  # bool [R]
    prompt_width: int  # P
    # bool [R]: the reward is a verdict (False: a stand-in, the sample missed the scoring
    # deadline; it counts in no group statistic). None: every sample was scored.
    scored: np.ndarray | None = None

    def scored_rows(self) -> np.ndarray:
        """``scored``, all True when None."""
        return (
            np.ones(len(self.rewards), bool)
            if self.scored is None
            else np.asarray(self.scored, bool)
        )

    @property
    def num_groups(self) -> int:
        return self.tokens.shape[0]  # divided by G by the caller


def round_from_rollout(rollout, rewards, correct, response_width: int, scored=None) -> Round:
    """Moves a ``Rollout`` to the host in the training layout, trimmed to ``response_width``
    (``scored``: see ``Round``; None: every sample was scored)."""
    (tokens, positions, attention_mask), mask, behaviour, routing = to_host(
        (rollout.sequences(), rollout.mask, rollout.raw_log_probs, rollout.routing)
    )
    prompt_width = rollout.prompt_tokens.shape[1]
    width = prompt_width + response_width
    return Round(
        tokens=tokens[:, :width],
        positions=positions[:, :width],
        attention_mask=attention_mask[:, :width],
        mask=mask[:, :response_width],
        behaviour_log_probs=behaviour[:, :response_width],
        routing=None if routing is None else routing[:, :, :width],
        rewards=np.asarray(rewards, np.float32),
        correct=np.asarray(correct, bool),
        prompt_width=prompt_width,
        scored=None if scored is None else np.asarray(scored, bool),
    )


def trim_prompt(r: Round, prompt_width: int) -> Round:
    """``r`` with its prompt part cut to the last ``prompt_width`` columns (prompts are
    left-padded, so only padding goes: checked)."""
    cut = r.prompt_width - prompt_width
    if cut == 0:
        return r
    if cut < 0 or np.any(r.attention_mask[:, :cut]):
        raise ValueError(
            f"cannot trim prompts of width {r.prompt_width} to {prompt_width}: "
            "real prompt tokens would be cut"
        )
    return r._replace(
        tokens=r.tokens[:, cut:],
        positions=r.positions[:, cut:],
        attention_mask=r.attention_mask[:, cut:],
        routing=None if r.routing is None else r.routing[:, :, cut:],
        prompt_width=prompt_width,
    )


def merge_rounds(
    selected: Sequence[tuple[Round, np.ndarray]], group_size: int, pad_id: int
) -> Round:
    """Concatenates chosen groups of several rounds into one ``Round``.

    Args:
      selected: ``(round, group_indices)`` pairs; groups are taken in this order.
      group_size: G.
      pad_id: token used for the extra left padding when prompt widths differ.

    Returns:
      One Round whose prompt width is the largest of the rounds and whose response width
      is the largest response width (rounds are right-padded with masked slots).
    """
    prompt_width = max(r.prompt_width for r, _ in selected)
    response_width = max(r.mask.shape[1] for r, _ in selected)
    parts = []
    for r, groups in selected:
        rows = (np.asarray(groups)[:, None] * group_size + np.arange(group_size)[None]).reshape(-1)
        extra_n = response_width - r.mask.shape[1]

        def seq(a, value, axis=1):
            a = pad_prompt_axis(a, prompt_width, r.prompt_width, axis, value)
            pad = [(0, 0)] * a.ndim
            pad[axis] = (0, extra_n)
            return np.pad(a, pad, constant_values=value)

        routing = None
        if r.routing is not None:
            routing = r.routing[:, rows]
            k = routing.shape[-1]
            # Padding slots get k distinct experts (never attended, kept valid for replay).
            filler = np.broadcast_to(np.arange(k, dtype=np.int32), routing.shape[:2] + (1, k))
            left = np.repeat(filler, prompt_width - r.prompt_width, axis=2)
            right = np.repeat(filler, extra_n, axis=2)
            routing = np.concatenate([left, routing, right], axis=2)
        parts.append(
            Round(
                tokens=seq(r.tokens[rows], pad_id),
                positions=seq(r.positions[rows], 0),
                attention_mask=seq(r.attention_mask[rows], 0),
                mask=np.pad(r.mask[rows], ((0, 0), (0, extra_n))),
                behaviour_log_probs=np.pad(r.behaviour_log_probs[rows], ((0, 0), (0, extra_n))),
                routing=routing,
                rewards=r.rewards[rows],
                correct=r.correct[rows],
                prompt_width=prompt_width,
                scored=r.scored_rows()[rows],
            )
        )
    cat = lambda name, axis=0: np.concatenate([getattr(p, name) for p in parts], axis=axis)
    return Round(
        tokens=cat("tokens"),
        positions=cat("positions"),
        attention_mask=cat("attention_mask"),
        mask=cat("mask"),
        behaviour_log_probs=cat("behaviour_log_probs"),
        routing=None if parts[0].routing is None else cat("routing", axis=1),
        rewards=cat("rewards"),
        correct=cat("correct"),
        prompt_width=prompt_width,
        scored=cat("scored"),
    )


DYNAMIC_SAMPLING_CRITERIA = ("reward", "accuracy")


def uninformative_groups(
    rewards: np.ndarray,
    correct: np.ndarray,
    group_size: int,
    criterion: str = "reward",
    scored: np.ndarray | None = None,
) -> np.ndarray:
    """bool ``[N / G]``: the groups dynamic sampling drops.

    ``"reward"``: all G rewards are equal (zero advantage under any group baseline;
    Magistral drops these). ``"accuracy"``: all G samples are correct or all are wrong
    (DAPO eq. 11, ``0 < |{o_i correct}| < G`` keeps a group); with overlong shaping in the
    reward, an all-correct group of different lengths has unequal rewards but still goes.
    ``scored`` (bool ``[N]``, None: all): only scored samples are compared (a missed
    sample's stand-in reward says nothing); a group with fewer than two is uninformative.
    """
    scored = np.ones(np.shape(rewards), bool) if scored is None else np.asarray(scored, bool)
    scored = scored.reshape(-1, group_size)
    few = scored.sum(axis=1) < 2
    if criterion == "reward":
        grouped = np.asarray(rewards, np.float64).reshape(-1, group_size)
        high = np.where(scored, grouped, -np.inf).max(axis=1)
        low = np.where(scored, grouped, np.inf).min(axis=1)
        return few | (high <= low)
    if criterion == "accuracy":
        grouped = np.asarray(correct, bool).reshape(-1, group_size)
        return few | ~(grouped & scored).any(axis=1) | ~(~grouped & scored).any(axis=1)
    raise ValueError(
        f"dynamic sampling criterion {criterion!r} is not one of {DYNAMIC_SAMPLING_CRITERIA}"
    )


class DynamicSampler:
    """Accumulates groups over sampling rounds until a batch of ``n_prompts`` is full.

    DAPO's dynamic sampling: an uninformative group (``uninformative_groups``: all rewards
    equal, or with ``criterion="accuracy"`` accuracy 0 or 1) is dropped; rounds continue
    until ``n_prompts`` groups are kept or ``max_rounds`` rounds were drawn. A batch that
    is still short is completed with dropped groups whose loss mask is 0 (they keep the
    batch shape fixed and count in no loss, mean or statistic) and the shortfall is
    reported. With ``enabled=False`` one round is taken as it is.
    """

    def __init__(
        self,
        n_prompts: int,
        group_size: int,
        *,
        enabled: bool,
        max_rounds: int,
        criterion: str = "reward",
    ):
        if criterion not in DYNAMIC_SAMPLING_CRITERIA:
            raise ValueError(f"criterion={criterion!r} is not one of {DYNAMIC_SAMPLING_CRITERIA}")
        self.n_prompts, self.group_size = n_prompts, group_size
        self.enabled, self.max_rounds, self.criterion = enabled, max_rounds, criterion
        self.reset()

    @classmethod
    def from_config(cls, config) -> "DynamicSampler":
        """The sampler of a run: ``config.batch.n_prompts`` groups of ``group_size``,
        ``config.dynamic_sampling`` (disabled: one round, taken as it is)."""
        ds = config.dynamic_sampling
        return cls(
            config.batch.n_prompts,
            config.batch.group_size,
            enabled=ds.enabled,
            max_rounds=ds.max_rounds if ds.enabled else 1,
            criterion=ds.criterion,
        )

    def reset(self) -> None:
        self.kept: list[tuple[Round, np.ndarray]] = []
        self.dropped: list[tuple[Round, np.ndarray]] = []
        self.num_kept = 0
        self.num_informative = 0  # drawn, including those beyond a full batch
        self.rounds = 0

    def add(self, r: Round) -> bool:
        """Adds one round; returns True when the batch is complete (full or cap reached)."""
        self.rounds += 1
        if self.enabled:
            drop_mask = uninformative_groups(
                r.rewards, r.correct, self.group_size, self.criterion, scored=r.scored
            )
        else:
            drop_mask = np.zeros((len(r.rewards) // self.group_size,), bool)
        informative = np.flatnonzero(~drop_mask)
        self.num_informative += informative.size
        keep = informative[: self.n_prompts - self.num_kept]
        if keep.size:
            self.kept.append((r, keep))
            self.num_kept += keep.size
        drop = np.flatnonzero(drop_mask)
        if drop.size:
            self.dropped.append((r, drop))
        return self.num_kept >= self.n_prompts or self.rounds >= self.max_rounds

    def batch(self, pad_id: int) -> tuple[Round, dict[str, float]]:
        """The assembled batch (kept groups first, then any fillers, masked out) and its
        dynamic-sampling metrics; then resets."""
        selected = list(self.kept)
        shortfall = self.n_prompts - self.num_kept
        need = shortfall
        for r, groups in reversed(self.dropped):
            if need <= 0:
                break
            take = groups[:need]
            selected.append((r, take))
            need -= take.size
        if need > 0:
            raise RuntimeError(f"dynamic sampling could not fill the batch ({need} groups missing)")
        total_groups = self.rounds * self.n_prompts
        metrics = {
            "dynamic_sampling/rounds": float(self.rounds),
            "dynamic_sampling/prompts_drawn": float(total_groups),
            "dynamic_sampling/kept_fraction": self.num_informative / total_groups,
            "dynamic_sampling/shortfall": float(shortfall),
        }
        merged = mask_fillers(
            merge_rounds(selected, self.group_size, pad_id), shortfall, self.group_size
        )
        self.reset()
        return merged, metrics


def mask_fillers(r: Round, num_fillers: int, group_size: int) -> Round:
    """``r`` with the loss mask of its last ``num_fillers`` groups set to 0 and their rows
    marked unscored: the groups that complete a short dynamic-sampling batch keep its shape
    and count in no loss, mean or statistic (under token-mean they would otherwise sit in
    the denominator; with the "accuracy" criterion a filler's rewards can differ, e.g. by
    their length penalties, and would enter batch or minibatch advantage statistics)."""
    if num_fillers <= 0:
        return r
    mask = np.array(r.mask, copy=True)
    mask[-num_fillers * group_size :] = 0
    scored = r.scored_rows().copy()
    scored[-num_fillers * group_size :] = False
    return r._replace(mask=mask, scored=scored)


def minibatch_indices(
    num_groups: int, group_size: int, n_minibatches: int, rng: jax.Array | None
) -> list[np.ndarray]:
    """Row indices of each minibatch: whole groups, shuffled by ``rng`` (None: in order)."""
    order = (
        np.arange(num_groups)
        if rng is None
        else np.asarray(jax.random.permutation(rng, num_groups))
    )
    per = num_groups // n_minibatches
    chunks = [order[i * per : (i + 1) * per] for i in range(n_minibatches)]
    return [
        (np.sort(c)[:, None] * group_size + np.arange(group_size)[None]).reshape(-1) for c in chunks
    ]


def take_rows(batch: Batch, rows: np.ndarray) -> Batch:
    """Selects rows of every field (routing along its row axis 1); a packing of the whole
    batch does not carry over (the minibatch is packed on its own: ``packing=None``)."""
    rows = jnp.asarray(rows)
    pick = lambda a: None if a is None else jnp.take(a, rows, axis=0)
    return Batch(
        tokens=pick(batch.tokens),
        positions=pick(batch.positions),
        attention_mask=pick(batch.attention_mask),
        mask=pick(batch.mask),
        advantages=pick(batch.advantages),
        old_log_probs=pick(batch.old_log_probs),
        importance_weights=pick(batch.importance_weights),
        ref_log_probs=pick(batch.ref_log_probs),
        routing=None if batch.routing is None else jnp.take(batch.routing, rows, axis=1),
        old_values=pick(batch.old_values),
        returns=pick(batch.returns),
        nll_weights=pick(batch.nll_weights),
        loss_mask=pick(batch.loss_mask),
    )


def shard_batch(batch: Batch) -> Batch:
    """``batch`` with every field's rows split over the ``data`` and ``fsdp`` axes of the
    mesh set by ``jax.set_mesh`` (routing along its row axis 1), replicated when the row
    count does not divide (``policyopt.sharding.shard_rows``); without a mesh, as device
    arrays placed by default."""

    def place(name, value):
        if name == "packing":  # packed rows and padded rows, each split as a batch's rows
            return None if value is None else type(value)(*(shard_rows(x) for x in value))
        return shard_rows(value, axis=1 if name == "routing" else 0)

    return Batch(*(place(name, value) for name, value in zip(Batch._fields, batch)))
