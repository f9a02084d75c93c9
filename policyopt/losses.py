"""Policy objectives, aggregation, KL, value and NLL losses as pure functions of arrays.

Every policy objective of the library is written in the unified form of the SAPO paper
(2511.20347):

    J = E[ agg_{i,t}( f_{i,t}(r_{i,t}) * A_{i,t} ) ],      loss = -J,

with one *gate* per method (the function ``f`` and its gradient weight) and one
*aggregation* step ``agg`` that turns per-token terms into a scalar. Its gradient is

    grad J = E[ agg_{i,t}( w_{i,t} * r_{i,t} * A_{i,t} * grad log pi(y_{i,t}) ) ],

where ``w = f'(r)`` is the gate's gradient weight: 1 inside the PPO trust region and 0
outside it, the sequence-level 0/1 for GSPO, and the smooth ``sech^2`` for SAPO.

Methods (``policy_loss(method=...)``; a new method is one gate registered with
``register_objective``, with the record of its own settings, whose fields become
``algo.<setting>`` config fields):

- ``"ppo"``: token ratio, asymmetric clip ``min(r A, clip(r, 1-eps_low, 1+eps_high) A)``
  (PPO, 1707.06347; GRPO, 2402.03300 eq. 3; DAPO clip-higher, 2503.14476; Magistral,
  VAPO), with an optional dual clip (Ye et al., 1912.09729) bounding the loss for A < 0.
- ``"gspo"``: sequence ratio ``s_i = exp(mean_t log r_{i,t})`` and a sequence-level clip
  (GSPO, 2507.18071).
- ``"gspo_token"``: ``s_{i,t} = sg[s_i] * pi / sg[pi]`` with token advantages (GSPO-token).
- ``"sapo"``: soft gate ``f(r) = sigmoid(tau (r - 1)) * 4 / tau`` with ``tau = tau_pos`` if
  A > 0 else ``tau_neg``, no clip (SAPO, 2511.20347).

Rollout correction, between the sampler's (behaviour, mu) and the trainer's (pi_old)
log-probs of the sampled tokens: ``truncated_importance_weights`` (token or sequence
level, into ``policy_loss(importance_weights=...)``), ``rejection_mask`` (token, sequence
or geometric level, and a veto; multiply it into the policy loss's mask) and the
diagnostics ``offpolicy_metrics``.

All arrays are ``[B, T]`` (B sequences, T response positions) with ``mask`` 1 on valid
response tokens; values at positions where ``mask`` is 0 never influence any output.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from policyopt.checks import check_choice
from policyopt.registry import Registry, caller
from policyopt.schema import Check, number, setting

Array = jax.Array

AGGREGATIONS = (
    "token_mean",
    "group_token_mean",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_sum_norm",
)
KL_ESTIMATORS = ("k1", "k2", "k3")
# verl's k3 clamp (``kl_penalty(..., clamp=True)``): the log-ratio to +-20, then k3 to <= 10.
KL_LOG_RATIO_CLAMP = 20.0
K3_MAX = 10.0
# Rollout correction (sampler vs trainer): importance-weight and rejection levels.
IS_LEVELS = ("token", "sequence")
RS_LEVELS = ("token", "sequence", "geometric")
METRICS = ("all", "none")


# ----------------------------------------------------------------------------------------
# Masked reductions and aggregation.
# ----------------------------------------------------------------------------------------


def _as_mask(mask: Array, dtype=jnp.float32) -> Array:
    """A 0/1 float mask from a bool, int or float mask (anything > 0 is valid)."""
    return (jnp.asarray(mask) > 0).astype(dtype)


def _safe_div(numerator: Array, denominator: Array) -> Array:
    """numerator / denominator, and 0 where the denominator is 0 (empty sets)."""
    nonzero = denominator > 0
    return jnp.where(nonzero, numerator / jnp.where(nonzero, denominator, 1), 0)


def aggregate(
    per_token: Array,
    mask: Array,
    aggregation: str = "token_mean",
    *,
    group_size: int | None = None,
    max_len: int | float | None = None,
) -> Array:
    """Reduces per-token terms ``[B, T]`` to one scalar (the aggregation rule).

    With ``m`` the mask and ``|y_i| = sum_t m_{i,t}``, and ``I`` the set of sequences with
    at least one valid token (fully masked sequences count in no mean):

    - ``"token_mean"``: ``sum_{i,t} m x / sum_{i,t} m``, the denominator being all valid
      tokens of the *minibatch passed in* (verl's, TRL's and OpenRLHF's token-level loss;
      not the papers' form, see ``"group_token_mean"``).
    - ``"group_token_mean"``: the token-level loss as DAPO (2503.14476 eq. 12), Magistral
      (2506.10910) and VAPO (2504.05118) write it: token mean within each group of
      ``group_size`` consecutive sequences (one prompt), then mean over groups that have at
      least one valid token: ``mean_g sum_{i in g,t} m x / sum_{i in g,t} m``.
    - ``"seq_mean_token_mean"``: ``mean_{i in I} (1/|y_i|) sum_t m x`` (GRPO 2402.03300 eq. 3,
      GSPO, SAPO as published).
    - ``"seq_mean_token_sum"``: ``mean_{i in I} sum_t m x``.
    - ``"seq_mean_token_sum_norm"``: ``mean_{i in I} sum_t m x / max_len`` with a constant
      ``max_len`` (Dr. GRPO 2503.20783: the generation budget), default ``T``.

    Args:
      per_token: ``[B, T]`` per-token terms, or ``[B, 1]``: one term per sequence that
        stands on each of its valid tokens (summed as ``x_i |y_i|`` without a ``[B, T]`` pass).
      mask: ``[B, T]`` 1 on valid tokens.
      aggregation: one of ``AGGREGATIONS``.
      group_size: sequences per group, used by ``"group_token_mean"`` only (must divide B).
      max_len: the constant of ``"seq_mean_token_sum_norm"``; default ``T``.

    Returns:
      A scalar; 0 when no token is valid.
    """
    mask = _as_mask(mask, per_token.dtype)
    lengths = jnp.sum(mask, axis=-1)
    seq_sums = _row_sums(per_token, mask, lengths)
    if aggregation == "token_mean":
        return _safe_div(jnp.sum(seq_sums), jnp.sum(lengths))
    if aggregation == "group_token_mean":
        _check_group_size(per_token.shape[0], group_size)
        group_sums = jnp.sum(seq_sums.reshape(-1, group_size), axis=1)
        group_tokens = jnp.sum(lengths.reshape(-1, group_size), axis=1)
        return _safe_div(jnp.sum(_safe_div(group_sums, group_tokens)), jnp.sum(group_tokens > 0))
    num_nonempty = jnp.sum(lengths > 0)
    if aggregation == "seq_mean_token_mean":
        per_seq = _safe_div(seq_sums, lengths)
    elif aggregation == "seq_mean_token_sum":
        per_seq = seq_sums
    elif aggregation == "seq_mean_token_sum_norm":
        norm = mask.shape[-1] if max_len is None else max_len
        if not norm or norm <= 0:
            raise ValueError(f"max_len must be a positive constant, got {max_len!r}")
        per_seq = seq_sums / norm
    else:
        raise ValueError(f"aggregation={aggregation!r} is not one of {AGGREGATIONS}")
    return _safe_div(jnp.sum(per_seq), num_nonempty)


def _row_sums(per_token: Array, mask: Array, lengths: Array) -> Array:
    """``sum_t m x`` per row ``[B]``, for token terms ``[B, T]`` or sequence terms ``[B, 1]``.

    A ``[B, 1]`` term is one value per sequence standing on each of its valid tokens (GSPO's
    sequence objective), so its row sum is ``x_i |y_i|``: no ``[B, T]`` pass at all.
    """
    if per_token.shape[-1] == 1 and mask.shape[-1] != 1:
        return jnp.where(lengths > 0, per_token[:, 0] * lengths, 0)
    return jnp.sum(jnp.where(mask > 0, per_token, 0), axis=-1)


def _check_group_size(num_seqs: int, group_size: int | None) -> None:
    if group_size is None or group_size < 1 or num_seqs % group_size:
        raise ValueError(
            f"aggregation='group_token_mean' needs group_size dividing the batch "
            f"({num_seqs} sequences), got group_size={group_size!r}"
        )


def aggregation_weights(
    mask: Array,
    aggregation: str = "token_mean",
    *,
    group_size: int | None = None,
    max_len: int | float | None = None,
) -> Array:
    """The weight of each row in an aggregation: ``aggregate(x) = sum_i w_i sum_t m_{i,t} x_{i,t}``.

    Every aggregation rule is linear in the per-token terms with coefficients that depend
    on the mask only, and the same for all tokens of a row. With ``|y_i| = sum_t m_{i,t}``,
    ``n`` the number of rows with ``|y_i| > 0`` and ``w_i = 0`` where ``|y_i| = 0``:

    - ``"token_mean"``: ``w_i = 1 / sum_j |y_j|``;
    - ``"group_token_mean"``: ``w_i = 1 / (T_g n_g)``, ``T_g`` the valid tokens of row i's
      group and ``n_g`` the number of groups with ``T_g > 0``;
    - ``"seq_mean_token_mean"``: ``w_i = 1 / (|y_i| n)``;
    - ``"seq_mean_token_sum"``: ``w_i = 1 / n``;
    - ``"seq_mean_token_sum_norm"``: ``w_i = 1 / (max_len n)``.

    Computed once over a whole minibatch, these weights make the loss of any subset of its
    rows (a micro-batch, ``weighted_row_sum``) that subset's share of the minibatch's
    loss: the shares sum to ``aggregate`` over the minibatch, with its denominators.

    Args:
      mask: ``[B, T]`` 1 on valid tokens.
      aggregation, group_size, max_len: as in ``aggregate``.

    Returns:
      float ``[B]`` row weights, stop-gradient.
    """
    mask = _as_mask(mask)
    lengths = jnp.sum(mask, axis=-1)
    nonempty = lengths > 0
    one = jnp.ones_like(lengths)
    if aggregation == "token_mean":
        weights = one * _safe_div(1.0, jnp.sum(lengths))
    elif aggregation == "group_token_mean":
        _check_group_size(mask.shape[0], group_size)
        group_tokens = jnp.sum(lengths.reshape(-1, group_size), axis=1)
        num_groups = jnp.sum(group_tokens > 0)
        per_group = _safe_div(1.0, group_tokens * num_groups)
        weights = jnp.repeat(per_group, group_size)
    else:
        num_nonempty = jnp.sum(nonempty)
        if aggregation == "seq_mean_token_mean":
            weights = _safe_div(1.0, lengths * num_nonempty)
        elif aggregation == "seq_mean_token_sum":
            weights = one * _safe_div(1.0, num_nonempty)
        elif aggregation == "seq_mean_token_sum_norm":
            norm = mask.shape[-1] if max_len is None else max_len
            if not norm or norm <= 0:
                raise ValueError(f"max_len must be a positive constant, got {max_len!r}")
            weights = one * _safe_div(1.0, norm * num_nonempty)
        else:
            raise ValueError(f"aggregation={aggregation!r} is not one of {AGGREGATIONS}")
    return jax.lax.stop_gradient(jnp.where(nonempty, weights, 0.0))


def weighted_row_sum(per_token: Array, mask: Array, row_weights: Array) -> Array:
    """``sum_i w_i sum_t m_{i,t} x_{i,t}``: an aggregation with row weights given
    (``aggregation_weights``, computed over the minibatch these rows belong to).

    Args:
      per_token: ``[B, T]`` terms, or ``[B, 1]`` sequence terms (as in ``aggregate``).
      mask: ``[B, T]``.
      row_weights: ``[B]``.

    Returns:
      A scalar.
    """
    mask = _as_mask(mask, per_token.dtype)
    seq_sums = _row_sums(per_token, mask, jnp.sum(mask, axis=-1))
    return jnp.sum(jnp.asarray(row_weights, per_token.dtype) * seq_sums)


def masked_mean(x: Array, mask: Array, axis=None) -> Array:
    """Mean of ``x`` over positions where ``mask`` is 1; 0 where there are none."""
    mask = _as_mask(mask, x.dtype)
    return _safe_div(jnp.sum(jnp.where(mask > 0, x, 0), axis=axis), jnp.sum(mask, axis=axis))


# ----------------------------------------------------------------------------------------
# The gates: one function per method, registered by name.
# ----------------------------------------------------------------------------------------


class GateInputs(NamedTuple):
    """What a method's gate sees (its settings come beside: ``register_objective``). Padding
    positions hold 0 in every ``[B, T]`` array.

    log_ratio: ``[B, T]`` ``log pi_theta - log pi_old`` (differentiable w.r.t. log_probs).
    advantages: ``[B, T]`` per-token advantages ``A_{i,t}``.
    mask: ``[B, T]`` float 0/1.
    seq_log_ratio: ``[B]`` ``(1/|y_i|) sum_t log r_{i,t}`` (0 for empty sequences).
    seq_advantages: ``[B]`` mean advantage over each sequence's valid tokens.
    """

    log_ratio: Array
    advantages: Array
    mask: Array
    seq_log_ratio: Array
    seq_advantages: Array


class Surrogate(NamedTuple):
    """A method's per-token output.

    objective: ``[B, T]`` ``f_{i,t} * A_{i,t}``, the term to maximise before aggregation.
    gate: ``[B, T]`` gradient weight ``w`` (1/0 for clipped methods, ``sech^2`` for SAPO).
    clipped_low / clipped_high: ``[B, T]`` bool, tokens whose gradient the clip removed on
      the low side (A < 0, ratio < 1 - clip_low) / high side (A > 0, ratio > 1 + clip_high);
      None for a method without a clip.
    dual_clipped: ``[B, T]`` bool, tokens bounded by the dual clip (A < 0, ratio > c), or None.

    A sequence-level method (GSPO) may return every field as ``[B, 1]``: one value per
    sequence, standing on each of its valid tokens. Aggregation and metrics then work on
    ``[B]`` values and token counts instead of ``[B, T]`` arrays.
    """

    objective: Array
    gate: Array
    clipped_low: Array
    clipped_high: Array
    dual_clipped: Array


# gate(inputs, settings) -> Surrogate; gate(inputs) for an objective without settings.
ObjectiveFn = Callable[..., Surrogate]


@dataclasses.dataclass(frozen=True)
class Objective:
    """A registered policy objective: its gate, the type of its settings record (or None)
    and where it was registered (``file:line``)."""

    name: str
    gate: ObjectiveFn
    settings: type | None
    where: str

    def __call__(self, inputs: GateInputs, settings=None) -> Surrogate:
        return self.gate(inputs) if self.settings is None else self.gate(inputs, settings)

    def defaults(self):
        """The settings record at its defaults, or None."""
        return None if self.settings is None else self.settings()


OBJECTIVES: Registry = Registry("objective")
# The types a setting's default may have: what a ConfigDict field and the command line hold.
_SETTING_TYPES = (bool, int, float, str, tuple, type(None))


def register_objective(name: str, gate: ObjectiveFn | None = None, *, settings: type | None = None):
    """Registers ``gate`` as ``policy_loss(method=name)`` and ``algo.method=name``.

    ``gate(inputs: GateInputs, settings) -> Surrogate``, where ``settings`` is an instance of
    the objective's own ``settings`` record: a frozen dataclass whose fields, each with a
    default (``policyopt.schema.setting`` adds its doc, paper and check), become the config
    fields ``algo.<field>`` (a field two objectives share, like ``clip_low``, is one config
    field: their defaults must agree). Without ``settings``, ``gate(inputs)``. Also a
    decorator: ``@register_objective(name, settings=...)``.

    Raises:
      ValueError: the name is taken (naming both registrations); the settings record is not
        a frozen dataclass, or a field has no default, or shares a name with another
        objective's setting of another default or type.
    """
    where = caller()
    if gate is None:
        return lambda fn: _register(name, fn, settings, where)
    return _register(name, gate, settings, where)


def _register(name, gate, settings, where):
    if isinstance(gate, Objective):  # an alias of a registered objective, its settings too
        settings, gate = settings or gate.settings, gate.gate
    if not callable(gate):
        raise ValueError(f"objective {name!r}: the gate must be callable, got {gate!r}")
    _check_settings_type(name, settings, where)
    OBJECTIVES.add(name, Objective(name, gate, settings, where))
    return gate


def _check_settings_type(name: str, settings, where: str) -> None:
    if settings is None:
        return
    label = f"objective {name!r} ({where})"
    params = getattr(settings, "__dataclass_params__", None)
    if not (isinstance(settings, type) and params is not None and params.frozen):
        raise ValueError(
            f"{label}: settings must be a frozen dataclass type (its fields become "
            f"algo.<field> config fields), got {settings!r}"
        )
    for field in dataclasses.fields(settings):
        if field.default is dataclasses.MISSING:
            raise ValueError(
                f"{label}: setting {settings.__name__}.{field.name} has no default; every "
                f"setting needs one (the value of algo.{field.name} when a recipe does not "
                "set it)"
            )
        if not isinstance(field.default, _SETTING_TYPES):
            raise ValueError(
                f"{label}: setting {settings.__name__}.{field.name} has a default of type "
                f"{type(field.default).__name__}; a config field holds a bool, int, float, "
                "str, tuple or None"
            )
        for other, record in objective_settings_fields().items():
            if other == field.name and (
                record.default != field.default or type(record.default) is not type(field.default)
            ):
                owner = next(o for o in OBJECTIVES.values() if field.name in _field_names(o))
                raise ValueError(
                    f"{label}: setting {field.name!r} (default {field.default!r}) is also a "
                    f"setting of objective {owner.name!r} ({owner.where}) with default "
                    f"{record.default!r}: one algo.{field.name} serves both, so the defaults "
                    "must agree (or name it differently)"
                )


def _field_names(objective: Objective) -> tuple[str, ...]:
    if objective.settings is None:
        return ()
    return tuple(f.name for f in dataclasses.fields(objective.settings))


def objective_settings_fields() -> dict[str, dataclasses.Field]:
    """Every registered objective's settings fields by name (the ``algo.<setting>`` config
    fields), in registration order."""
    out = {}
    for objective in OBJECTIVES.values():
        if objective.settings is not None:
            for field in dataclasses.fields(objective.settings):
                out.setdefault(field.name, field)
    return out


def setting_owners(name: str) -> tuple[str, ...]:
    """The registered objectives whose settings hold field ``name``."""
    return tuple(o.name for o in OBJECTIVES.values() if name in _field_names(o))


def objective_settings(method: str, settings=None, values: dict | None = None, label=None):
    """The settings record of objective ``method``: ``settings`` itself, or one built from
    ``values`` (its fields; defaults for the rest). A value of another objective's setting is
    accepted and unused, except one that is off by default (None) and is set: that would
    silently do nothing, an error naming the objectives that read it. The record's checks
    run on Python numbers (not on traced arrays), each error naming ``label(field)``
    (default: the field's name). None for an objective without settings.
    """
    label, values = label or (lambda field: field), values or {}
    check_choice(label("method"), method, OBJECTIVES)
    objective = OBJECTIVES[method]
    own = set(_field_names(objective))
    known = objective_settings_fields()
    for key, value in values.items():
        if key not in known:
            raise TypeError(
                f"unexpected setting {key}={value!r} for method={method!r} (settings of the "
                f"registered objectives: {', '.join(known) or 'none'})"
            )
        if key not in own and known[key].default is None and value is not None:
            owners = setting_owners(key)
            wanted = repr(owners[0]) if len(owners) == 1 else f"one of {owners}"
            raise ValueError(
                f"{label(key)}={value!r} needs {label('method')}={wanted}, got {method!r}"
            )
    if objective.settings is None:
        return None
    if settings is None:
        settings = objective.settings(**{k: v for k, v in values.items() if k in own})
    elif not isinstance(settings, objective.settings):
        raise TypeError(
            f"settings of method={method!r} must be a {objective.settings.__name__}, got "
            f"{type(settings).__name__}"
        )
    check_settings(settings, label)
    return settings


def check_settings(settings, label=None) -> None:
    """Runs the checks of a settings record's fields (``policyopt.schema.setting``) on
    the values that are Python numbers, strings or None (a traced array is left alone)."""
    label = label or (lambda field: field)
    for field in dataclasses.fields(settings):
        check = field.metadata.get("check")
        value = getattr(settings, field.name)
        if check is not None and (value is None or isinstance(value, (bool, int, float, str))):
            check(label(field.name), value)


def _clipped_surrogate(
    ratio: Array, log_ratio: Array, advantages: Array, clip_low: float, clip_high: float
) -> Surrogate:
    """``min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)`` with an explicit gate.

    The min picks the clipped (constant) term exactly when the ratio has left the trust
    region on the side that matters: A > 0 and r > 1 + clip_high, or A < 0 and
    r < 1 - clip_low. There the gradient is 0; elsewhere it is ``r A grad log pi``. Writing
    the gate explicitly gives the same values as the min and a well-defined gradient at the
    boundary (inside: gradient 1). The trust-region tests compare ``log_ratio`` with
    ``log(1 + clip_high)`` and ``log(1 - clip_low)`` (the same test, as exp is monotonic),
    so that no consumer of the flags has to recompute ``exp``.
    """
    clipped_high = (advantages > 0) & (log_ratio > math.log1p(clip_high))
    clipped_low = (advantages < 0) & (log_ratio < math.log1p(-clip_low))
    clipped = clipped_high | clipped_low
    bound = jax.lax.stop_gradient(jnp.clip(ratio, 1 - clip_low, 1 + clip_high))
    objective = jnp.where(clipped, bound, ratio) * advantages
    gate = jnp.where(clipped, 0.0, 1.0).astype(ratio.dtype)
    return Surrogate(objective, gate, clipped_low, clipped_high, None)


def _dual_clip() -> Check:
    def fn(label, value):
        if value is None:
            return
        number_ = not isinstance(value, bool) and isinstance(value, (int, float))
        if not (number_ and math.isfinite(value) and value > 1):
            raise ValueError(f"{label} must be > 1 (or None: off), got {value!r}")

    return Check(fn, "number > 1, or None")


@dataclasses.dataclass(frozen=True)
class ClipSettings:
    """The trust region of the clipped objectives (``"gspo"``, ``"gspo_token"``; ``"ppo"``'s
    with its dual clip)."""

    clip_low: float = setting(
        0.2,
        "Clip range of the clipped objectives: the ratio is clipped to [1 - clip_low, "
        "1 + clip_high].",
        paper="PPO 1707.06347 §6.1: 0.2; GSPO 2507.18071: 3e-4",
        check=number(0.0, 1.0),
    )
    clip_high: float = setting(
        0.2,
        "Upper clip range (1 + clip_high).",
        paper="DAPO 2503.14476 clip-higher: 0.28; GSPO 2507.18071: 4e-4",
        check=number(0.0),
    )


@dataclasses.dataclass(frozen=True)
class PPOSettings(ClipSettings):
    """``"ppo"``: the token clip, and the dual clip for A < 0."""

    dual_clip: float | None = setting(
        None,
        'Dual clip ratio c > 1 bounding the loss of A < 0 tokens ("ppo"); None = off.',
        paper="Ye et al. 1912.09729; 3.0 in common use",
        check=_dual_clip(),
    )


@dataclasses.dataclass(frozen=True)
class SAPOSettings:
    """``"sapo"``: the soft gate's temperatures."""

    tau_pos: float = setting(
        1.0,
        "SAPO temperature of the soft gate for A > 0.",
        paper="SAPO 2511.20347: 1.0",
        check=number(0.0, low_inclusive=False),
    )
    tau_neg: float = setting(
        1.05,
        "SAPO temperature of the soft gate for A <= 0.",
        paper="SAPO 2511.20347: 1.05",
        check=number(0.0, low_inclusive=False),
    )


def ppo_objective(inputs: GateInputs, settings: PPOSettings) -> Surrogate:
    """Token-level clipped surrogate (PPO; GRPO eq. 3; DAPO with clip-higher).

    ``f(r) A = min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)``, ``r = exp(log_ratio)``.
    Dual clip (Ye et al., 1912.09729), when ``dual_clip = c > 1``: for A < 0 the objective is
    ``max(f(r) A, c A)``, i.e. constant (zero gradient) once ``r > c``.
    """
    ratio = jnp.exp(inputs.log_ratio)
    out = _clipped_surrogate(
        ratio, inputs.log_ratio, inputs.advantages, settings.clip_low, settings.clip_high
    )
    if settings.dual_clip is None:
        return out
    dual = (inputs.advantages < 0) & (inputs.log_ratio > math.log(settings.dual_clip))
    objective = jnp.where(dual, settings.dual_clip * inputs.advantages, out.objective)
    gate = jnp.where(dual, 0.0, out.gate).astype(ratio.dtype)
    return out._replace(objective=objective, gate=gate, dual_clipped=dual)


def gspo_objective(inputs: GateInputs, settings: ClipSettings) -> Surrogate:
    """Sequence-level clipped surrogate of GSPO (2507.18071).

    ``s_i = exp((1/|y_i|) sum_t log r_{i,t})`` over valid tokens, objective per sequence
    ``min(s_i A_i, clip(s_i, 1 - clip_low, 1 + clip_high) A_i)`` with ``A_i`` the mean of the
    sequence's token advantages (the outcome advantage when they are constant). The
    sequence term stands on each of its valid tokens (``[B, 1]`` fields), so ``seq_mean_token_mean``
    aggregation gives the paper's ``(1/G) sum_i`` exactly, and its gradient is
    ``s_i A_i (1/|y_i|) sum_t grad log pi(y_{i,t})``. Paper clip: 3e-4 / 4e-4.
    """
    seq_ratio = jnp.exp(inputs.seq_log_ratio)
    out = _clipped_surrogate(
        seq_ratio,
        inputs.seq_log_ratio,
        inputs.seq_advantages,
        settings.clip_low,
        settings.clip_high,
    )
    # One value per sequence ([B, 1]), standing on each of its valid tokens.
    return Surrogate(*(None if x is None else x[:, None] for x in out))


def gspo_token_objective(inputs: GateInputs, settings: ClipSettings) -> Surrogate:
    """GSPO-token (2507.18071): ``s_{i,t} = sg[s_i] * pi(y_{i,t}) / sg[pi(y_{i,t})]``.

    Its value is ``s_i`` on every token and its gradient ``s_i A_{i,t} grad log pi(y_{i,t})``;
    clipped per token like PPO. With ``A_{i,t} = A_i`` it equals ``"gspo"`` in value and
    gradient.
    """
    log_ratio = inputs.log_ratio
    seq_ratio = jnp.exp(jax.lax.stop_gradient(inputs.seq_log_ratio))[:, None]
    # sg[s_i] * pi / sg[pi] = sg[s_i] * exp(log r - sg[log r]), written without a per-token
    # exp: s_i + s_i (log r - sg[log r]) has the value s_i exactly (x - x = 0 for finite x)
    # and the same gradient s_i d log r.
    ratio = seq_ratio + seq_ratio * (log_ratio - jax.lax.stop_gradient(log_ratio))
    # The value of the ratio is s_i: the clip tests use the (constant) sequence log-ratio.
    value_log_ratio = jnp.broadcast_to(
        jax.lax.stop_gradient(inputs.seq_log_ratio)[:, None], ratio.shape
    )
    return _clipped_surrogate(
        ratio, value_log_ratio, inputs.advantages, settings.clip_low, settings.clip_high
    )


def sapo_objective(inputs: GateInputs, settings: SAPOSettings) -> Surrogate:
    """Soft adaptive policy optimisation (SAPO, 2511.20347): a smooth gate, no clip.

    ``f(r) = sigmoid(tau (r - 1)) * 4 / tau`` with ``tau = tau_pos`` if A > 0 else
    ``tau_neg``. Gradient weight ``w = f'(r) = 4 p (1 - p) = sech^2(tau (r - 1) / 2)``,
    ``p = sigmoid(tau (r - 1))``: 1 at r = 1, in (0, 1], so ``d loss / d log pi = -w r A``
    before aggregation. Note ``f(1) = 2 / tau``: loss values depend on tau even at r = 1.
    """
    ratio = jnp.exp(inputs.log_ratio)
    tau = jnp.where(inputs.advantages > 0, settings.tau_pos, settings.tau_neg).astype(ratio.dtype)
    prob = jax.nn.sigmoid(tau * (ratio - 1))
    objective = prob * (4.0 / tau) * inputs.advantages
    gate = jax.lax.stop_gradient(4.0 * prob * (1.0 - prob))
    return Surrogate(objective, gate, None, None, None)


register_objective("ppo", ppo_objective, settings=PPOSettings)
register_objective("gspo", gspo_objective, settings=ClipSettings)
register_objective("gspo_token", gspo_token_objective, settings=ClipSettings)
register_objective("sapo", sapo_objective, settings=SAPOSettings)


# ----------------------------------------------------------------------------------------
# The policy loss.
# ----------------------------------------------------------------------------------------


def kl_penalty(
    log_probs: Array,
    ref_log_probs: Array,
    mask: Array,
    *,
    estimator: str = "k3",
    clamp: bool = False,
) -> Array:
    """Per-token KL(pi_theta || pi_ref) estimate from samples of pi_theta, 0 on padding.

    With ``delta = log pi_ref - log pi_theta`` (Schulman, "Approximating KL divergence"):
    ``k1 = -delta``; ``k2 = delta^2 / 2``; ``k3 = exp(delta) - delta - 1 >= 0`` (the
    unbiased, low-variance estimator of GRPO eq. 4, used with beta = 0.04).

    ``clamp=True`` (k3 only) is verl's ``low_var_kl``:
    ``min(exp(d) - d - 1, 10)`` with ``d = clip(delta, -20, 20)``. Its value differs from
    the paper's k3 only where k3 > 10 (``delta`` above ~2.6 or below -11: pi_theta ~14x
    below pi_ref on the token, or ~6e4x above it), and there its gradient is 0; the clip of
    ``delta`` keeps ``exp`` finite, so that no inf or NaN reaches the gradient. Off, the
    paper's formula (see docs/algorithms.md, "KL to the reference policy").

    Args:
      log_probs, ref_log_probs, mask: ``[B, T]``.
      estimator: ``"k1"``, ``"k2"`` or ``"k3"``.
      clamp: verl's clamp of k3 (``KL_LOG_RATIO_CLAMP``, ``K3_MAX``); k1 and k2 have none.

    Returns:
      ``[B, T]`` per-token penalty (aggregate it like the policy terms).
    """
    if clamp and estimator != "k3":
        raise ValueError(
            f"the KL clamp (kl_clamp=True) is defined for estimator 'k3' only (verl's "
            f"low_var_kl), got estimator={estimator!r}"
        )
    valid = _as_mask(mask, log_probs.dtype) > 0
    delta = jnp.where(valid, ref_log_probs - log_probs, 0)
    if estimator == "k1":
        per_token = -delta
    elif estimator == "k2":
        per_token = 0.5 * jnp.square(delta)
    elif estimator == "k3":
        if clamp:
            delta = jnp.clip(delta, -KL_LOG_RATIO_CLAMP, KL_LOG_RATIO_CLAMP)
        per_token = jnp.expm1(delta) - delta
        if clamp:
            per_token = jnp.minimum(per_token, K3_MAX)
    else:
        raise ValueError(f"estimator={estimator!r} is not one of {KL_ESTIMATORS}")
    return jnp.where(valid, per_token, 0)


def _rollout_log_ratio(old_log_probs: Array, behaviour_log_probs: Array, mask: Array):
    """``(valid, log rho)``: the valid tokens and ``log rho_t = old - behaviour`` (0 on padding)."""
    valid = _as_mask(mask, old_log_probs.dtype) > 0
    return valid, jnp.where(valid, old_log_probs - behaviour_log_probs, 0)


def _sequence_log_ratio(log_rho: Array, valid: Array, level: str) -> Array:
    """Per sequence ``[B, 1]``: ``sum_t log rho_t`` ("sequence": the log of the product of
    the token ratios) or its mean over the valid tokens ("geometric"; 0 for an empty
    sequence)."""
    total = jnp.sum(log_rho, axis=-1, keepdims=True)
    if level == "sequence":
        return total
    return _safe_div(total, jnp.sum(valid, axis=-1, keepdims=True).astype(log_rho.dtype))


def truncated_importance_weights(
    old_log_probs: Array,
    behaviour_log_probs: Array,
    mask: Array,
    cap: float = 2.0,
    *,
    level: str = "token",
) -> Array:
    """Truncated importance weights between the sampler (behaviour) and the trainer, stop-gradient.

    Corrects the mismatch between the sampler's (behaviour, mu) and the trainer's (old)
    log-probs of the same tokens, ``rho_t = exp(old - behaviour)``:

    - ``level="token"`` (TIS): ``w_t = min(rho_t, cap)``; ``cap = 2.0`` is the common default;
    - ``level="sequence"``: ``w_i = min(prod_t rho_{i,t}, cap)`` over the valid tokens of
      sequence i, the same weight on each of its tokens (unbiased up to the cap, higher
      variance: verl's "sequence" rollout IS, after Liu, Li et al. 2025, "When Speed Kills
      Stability"; caps of 2-10 are usual).

    0 on padding.

    Returns:
      ``[B, T]`` weights to pass as ``policy_loss(importance_weights=...)``.
    """
    if level not in IS_LEVELS:
        raise ValueError(f"level={level!r} is not one of {IS_LEVELS}")
    if not cap > 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    valid, log_weight = _rollout_log_ratio(old_log_probs, behaviour_log_probs, mask)
    if level == "sequence":
        log_weight = jnp.broadcast_to(
            _sequence_log_ratio(log_weight, valid, level), log_weight.shape
        )
    weights = jnp.minimum(jnp.exp(log_weight), cap)
    return jax.lax.stop_gradient(jnp.where(valid, weights, 0))


def rejection_mask(
    old_log_probs: Array,
    behaviour_log_probs: Array,
    mask: Array,
    *,
    level: str | None = None,
    upper: float | None = None,
    lower: float | None = None,
    veto: float | None = None,
) -> Array:
    """Rollout rejection sampling: which tokens the policy loss keeps, stop-gradient.

    With ``rho_t = exp(old - behaviour)`` (trainer over sampler), a token or a whole
    sequence is rejected, rather than reweighted, when its ratio lies outside
    ``[lower, upper]`` (``lower`` defaults to ``1 / upper``):

    - ``level="token"``: token t when ``rho_t`` is outside;
    - ``level="sequence"``: sequence i when ``prod_t rho_{i,t}`` is outside;
    - ``level="geometric"``: sequence i when the geometric mean ``exp(mean_t log rho_{i,t})``
      is outside (it does not grow with length, so the bounds are tight: 1.001 - 1.01);
    - ``veto``: besides, sequence i when any of its tokens has ``rho_t < veto`` (a token the
      trainer finds far less likely than the sampler did; 1e-4 is usual).

    ``level=None`` applies the veto alone. (verl's rollout rejection sampling and veto,
    after Liu, Li et al. 2025, "When Speed Kills Stability".) Rejected tokens leave the
    loss and its denominators: pass ``mask * rejection_mask(...)`` as the policy loss's
    mask. Bounds are compared in log space, so products over long sequences never
    overflow.

    Returns:
      ``[B, T]`` float 0/1, 1 on the valid tokens kept, 0 on rejected tokens and padding.
    """
    if level is not None and level not in RS_LEVELS:
        raise ValueError(f"level={level!r} is not one of {RS_LEVELS} or None")
    if level is not None and (upper is None or not upper > 0):
        raise ValueError(f"rejection at level={level!r} needs upper > 0, got {upper}")
    lower = (1.0 / upper if level is not None else None) if lower is None else lower
    if level is not None and not 0 < lower <= upper:
        raise ValueError(
            f"the rejection bounds need 0 < lower <= upper, got lower={lower}, upper={upper}"
        )
    if veto is not None and not veto > 0:
        raise ValueError(f"veto must be > 0, got {veto}")
    valid, log_rho = _rollout_log_ratio(old_log_probs, behaviour_log_probs, mask)
    keep = valid
    if level is not None:
        x = log_rho if level == "token" else _sequence_log_ratio(log_rho, valid, level)
        keep = keep & (x >= math.log(lower)) & (x <= math.log(upper))
    if veto is not None:
        keep = keep & ~jnp.any(valid & (log_rho < math.log(veto)), axis=-1, keepdims=True)
    return jax.lax.stop_gradient(keep.astype(old_log_probs.dtype))


# Log-ratios (per token, per-sequence sums and means) are clamped to +-20 inside the
# metrics, as verl clamps them, so that a far-off token gives a large finite value, not inf.
_OFFPOLICY_LOG_CLAMP = 20.0


def offpolicy_metrics(
    old_log_probs: Array, behaviour_log_probs: Array, mask: Array
) -> dict[str, Array]:
    """How far the trainer's log-probs (pi_old) are from the sampler's (mu) on the sampled
    tokens, with ``rho_t = pi_old / mu``, over valid tokens only:

    - ``kl_k1``: token mean of ``log mu - log pi_old``, an estimate of KL(mu || pi_old);
    - ``kl_k3``: token mean of ``rho - 1 - log rho`` (the same KL, k3 estimator, >= 0);
    - ``ppl_ratio``: mean over non-empty sequences of ``PPL_old / PPL_mu =
      exp(-mean_t log rho_t)``;
    - ``chi2_token``: token mean of ``rho^2 - 1``; ``chi2_seq``: mean over non-empty
      sequences of ``(prod_t rho_t)^2 - 1``;
    - ``log_ratio_abs_max``: the largest ``|log rho_t|``.

    ``log rho_t`` (in ``kl_k3`` and ``chi2_token``), the per-sequence mean (``ppl_ratio``)
    and sum (``chi2_seq``) are clamped to +-20 first, as verl does, so that one far-off
    token gives a large finite value rather than inf; ``kl_k1`` and ``log_ratio_abs_max``
    are not clamped.

    All are 0 when the two agree; they are the diagnostics of verl's rollout correction.
    """
    valid, log_rho = _rollout_log_ratio(old_log_probs, behaviour_log_probs, mask)
    clamp = lambda x: jnp.clip(x, -_OFFPOLICY_LOG_CLAMP, _OFFPOLICY_LOG_CLAMP)
    clamped = clamp(log_rho)
    rho = jnp.where(valid, jnp.exp(clamped), 1)
    valid_f = valid.astype(log_rho.dtype)
    n = jnp.sum(valid_f)
    non_empty = jnp.any(valid, axis=-1)
    n_seq = jnp.sum(non_empty.astype(log_rho.dtype))
    seq_mean = lambda x: _safe_div(jnp.sum(jnp.where(non_empty, x, 0)), n_seq)
    geometric = clamp(_sequence_log_ratio(log_rho, valid, "geometric")[:, 0])
    seq_log = clamp(jnp.sum(log_rho, axis=-1))
    out = {
        "kl_k1": _safe_div(jnp.sum(-log_rho), n),
        "kl_k3": _safe_div(jnp.sum(jnp.where(valid, rho - 1 - clamped, 0)), n),
        "ppl_ratio": seq_mean(jnp.exp(-geometric)),
        "chi2_token": _safe_div(jnp.sum(jnp.where(valid, jnp.square(rho) - 1, 0)), n),
        "chi2_seq": seq_mean(jnp.expm1(2 * seq_log)),
        "log_ratio_abs_max": jnp.max(jnp.abs(log_rho)),
    }
    return jax.tree.map(jax.lax.stop_gradient, out)


def check_policy_options(
    *, aggregation: str, kl_estimator: str, kl_clamp: bool, label=None
) -> None:
    """Raises a one-line ValueError for an option of ``policy_loss`` outside its objective's
    settings that it cannot take: ``aggregation`` not one of ``AGGREGATIONS``, an unknown KL
    estimator, or the KL clamp with an estimator other than k3 (``objective_settings``
    checks the method and its settings). ``label(arg)`` names an argument in the errors."""
    label = label or (lambda arg: arg)
    check_choice(label("aggregation"), aggregation, AGGREGATIONS)
    check_choice(label("kl_estimator"), kl_estimator, KL_ESTIMATORS)
    if kl_clamp and kl_estimator != "k3":
        raise ValueError(
            f"{label('kl_clamp')}=True is defined for {label('kl_estimator')}='k3' "
            f"only (verl's low_var_kl), got {kl_estimator!r}"
        )


def policy_loss(
    log_probs: Array,
    old_log_probs: Array,
    advantages: Array,
    mask: Array,
    *,
    method: str = "ppo",
    settings: Any = None,
    aggregation: str = "token_mean",
    group_size: int | None = None,
    max_len: int | float | None = None,
    importance_weights: Array | None = None,
    ref_log_probs: Array | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    kl_clamp: bool = False,
    metrics: str = "all",
    row_weights: Array | None = None,
    **setting_values,
) -> tuple[Array, dict[str, Array]]:
    """The policy loss ``-J`` of the unified objective, and its metrics.

    Per token: ``term = sg[iw] * f_{i,t}(r) * A_{i,t} - kl_coef * KL_{i,t}``, where ``f A``
    comes from the method's gate (see the module docstring), ``iw`` the optional importance
    weights (1 if None) and ``KL`` the ``kl_estimator`` penalty to ``ref_log_probs`` (only if
    given; GRPO eq. 3, beta = 0.04). Then ``loss = -aggregate(term, mask, aggregation)``.

    Args:
      log_probs: ``[B, T]`` log pi_theta of the sampled tokens (differentiate through this).
      old_log_probs: ``[B, T]`` log pi_old of the same tokens (treated as a constant).
      advantages: ``[B, T]`` per-token advantages (GAE), or ``[B]``: one per sequence
        (outcome advantages), broadcast over its tokens.
      mask: ``[B, T]`` 1 on valid response tokens; padding values never matter.
      method: a key of ``OBJECTIVES``: ``"ppo"``, ``"gspo"``, ``"gspo_token"``, ``"sapo"``,
        or one registered with ``register_objective``.
      settings: the method's settings record (``PPOSettings``, ``ClipSettings``,
        ``SAPOSettings``, or a registered objective's), or None: built from
        ``setting_values``.
      aggregation: see ``aggregate``.
      group_size: for ``aggregation="group_token_mean"``; ignored otherwise.
      max_len: the constant of ``"seq_mean_token_sum_norm"`` (default T).
      importance_weights: optional ``[B, T]`` per-token weights, stop-gradient (see
        ``truncated_importance_weights``).
      ref_log_probs: optional ``[B, T]`` reference log-probs for a KL penalty in the loss.
      kl_coef: coefficient ``beta`` of that penalty.
      kl_estimator: ``"k1"``, ``"k2"`` or ``"k3"``.
      kl_clamp: verl's clamp of k3 (see ``kl_penalty``); False: the paper's k3.
      metrics: ``"all"`` (default) computes every metric below; ``"none"`` returns only
        ``loss`` (for steps that do not log: on XLA:CPU each metric is one more pass over
        ``[B, T]`` arrays, see ``benchmarks/bench_core.py``). Loss and gradient are the same.
      row_weights: optional ``[B]`` weights of the rows in place of the aggregation rule,
        ``aggregation_weights`` of the whole minibatch these rows are part of (a
        micro-batch): the loss is then ``-sum_i w_i sum_t m term``, these rows' share of
        the minibatch's loss (``aggregation``, ``group_size`` and ``max_len`` unused).
      **setting_values: the method's settings by name, the rest at their defaults:
        ``clip_low``, ``clip_high`` (trust region ``[1 - clip_low, 1 + clip_high]``; DAPO:
        0.2 / 0.28, GSPO: 3e-4 / 4e-4) and ``dual_clip`` (``c > 1`` bounding the loss of
        A < 0 tokens) for ``"ppo"``; ``clip_low``, ``clip_high`` for ``"gspo"`` /
        ``"gspo_token"``; ``tau_pos``, ``tau_neg`` (1.0 / 1.05) for ``"sapo"``. Another
        objective's setting is accepted and unused, except one that is off by default and
        set (``dual_clip`` with ``"sapo"``): an error.

    Returns:
      ``(loss, metrics)``: a scalar to minimise, and a flat dict of scalars computed over
      valid tokens only: ``loss``; ``clip_frac_low`` / ``clip_frac_high`` / ``clip_frac``
      (fraction of tokens whose gradient the clip removed, low side A < 0, high side A > 0,
      total) and ``dual_clip_frac``; ``ratio_mean`` / ``ratio_min`` / ``ratio_max`` of the
      token ratio ``r`` and ``seq_ratio_mean`` of ``s_i`` (the same for every method);
      ``approx_kl``, the k3 estimate of KL(pi_old || pi_theta), token mean of
      ``r - 1 - log r``; ``gate_mean``, mean gradient weight ``w`` (SAPO's mean gate; for
      PPO ``1 - clip_frac - dual_clip_frac``: the gate is 1 on every token that neither
      clip removed); ``log_ratio_seq_var``, variance (ddof 0) of ``log r`` within each
      sequence, mean over non-empty sequences (SAPO reports < 0.02); ``zero_grad_frac``,
      fraction of tokens with no gradient (gate 0, advantage 0 or importance weight 0);
      ``num_tokens``; and ``kl_ref`` / ``importance_weight_mean`` when those are used.
      Under ``jit`` the metrics cost nothing when they are discarded (dead code); on
      XLA:CPU computing all of them costs several times the loss itself (see
      ``benchmarks/bench_core.py``). The policy ratio's log is not clamped (verl clamps it at
      +-20); the KL's is with ``kl_clamp``.
    """
    settings = objective_settings(method, settings, setting_values)
    check_policy_options(aggregation=aggregation, kl_estimator=kl_estimator, kl_clamp=kl_clamp)
    if metrics not in METRICS:
        raise ValueError(f"metrics={metrics!r} is not one of {METRICS}")
    if aggregation == "group_token_mean" and row_weights is None:
        _check_group_size(jnp.shape(log_probs)[0], group_size)
    advantages = _token_advantages(log_probs, old_log_probs, advantages, mask)
    dtype = jnp.result_type(log_probs, jnp.float32)

    def compute(
        log_probs, old_log_probs, advantages, mask, importance_weights, ref_log_probs, row_weights
    ):
        mask_f = _as_mask(mask, dtype)
        valid = mask_f > 0
        log_probs = jnp.asarray(log_probs, dtype)
        old_log_probs = jax.lax.stop_gradient(jnp.asarray(old_log_probs, dtype))
        advantages = jax.lax.stop_gradient(jnp.where(valid, jnp.asarray(advantages, dtype), 0))
        log_ratio = jnp.where(valid, log_probs - old_log_probs, 0)
        lengths = jnp.sum(mask_f, axis=-1)
        seq_log_ratio = _safe_div(jnp.sum(log_ratio, axis=-1), lengths)
        seq_advantages = _safe_div(jnp.sum(advantages, axis=-1), lengths)

        inputs = GateInputs(log_ratio, advantages, mask_f, seq_log_ratio, seq_advantages)
        surrogate = OBJECTIVES[method](inputs, settings)
        per_token, weights, diagnostics = _weighted_terms(
            surrogate.objective,
            log_probs,
            mask_f,
            importance_weights,
            ref_log_probs,
            kl_coef=kl_coef,
            kl_estimator=kl_estimator,
            kl_clamp=kl_clamp,
        )
        if row_weights is None:
            loss = -aggregate(
                per_token, mask_f, aggregation, group_size=group_size, max_len=max_len
            )
        else:
            loss = -weighted_row_sum(per_token, mask_f, jax.lax.stop_gradient(row_weights))

        if metrics == "none":
            return loss, {"loss": jax.lax.stop_gradient(loss)}
        diagnostics.update(
            _policy_metrics(
                jax.lax.stop_gradient(log_ratio),
                seq_log_ratio,
                advantages,
                mask_f,
                lengths,
                surrogate,
                weights,
            )
        )
        diagnostics["loss"] = jax.lax.stop_gradient(loss)
        return loss, diagnostics

    # Rematerialise the [B, T] intermediates in the backward pass instead of storing them:
    # only reduction outputs ([B] or scalars) are saved. The backward pass then recomputes
    # the few elementwise terms it needs inside its single gradient pass, which on
    # XLA:CPU costs less than writing and re-reading stored [B, T] residuals
    # (benchmarks/bench_core.py); loss, gradient and metrics are unchanged.
    return jax.checkpoint(compute, policy=_save_only_reductions)(
        log_probs, old_log_probs, advantages, mask, importance_weights, ref_log_probs, row_weights
    )


def _token_advantages(log_probs, old_log_probs, advantages, mask) -> Array:
    """``advantages`` as ``[B, T]`` (one per sequence broadcast over its tokens), after
    checking the shapes of ``policy_loss``'s inputs against ``log_probs``'s."""
    shape = jnp.shape(log_probs)
    if len(shape) == 2 and jnp.shape(advantages) == shape[:1]:  # one per sequence
        advantages = jnp.broadcast_to(jnp.asarray(advantages)[:, None], shape)
    elif jnp.shape(advantages) != shape:
        raise ValueError(
            f"advantages has shape {jnp.shape(advantages)}, expected [B, T] = {shape} like "
            f"log_probs, or [B] = {shape[:1]} (one per sequence)"
        )
    for name, array in (("old_log_probs", old_log_probs), ("mask", mask)):
        if jnp.shape(array) != shape:
            raise ValueError(
                f"{name} has shape {jnp.shape(array)}, expected {shape} like log_probs"
            )
    return advantages


def _weighted_terms(
    per_token: Array,
    log_probs: Array,
    mask_f: Array,
    importance_weights: Array | None,
    ref_log_probs: Array | None,
    *,
    kl_coef: float,
    kl_estimator: str,
    kl_clamp: bool,
) -> tuple[Array, Array | None, dict[str, Array]]:
    """``policy_loss``'s per-token terms ``sg[iw] * f A - kl_coef * KL`` from the gate's
    ``f A`` (``per_token``): ``(terms, the importance weights or None, their metrics)``."""
    valid = mask_f > 0
    diagnostics = {}
    weights = None
    if importance_weights is not None:
        weights = jax.lax.stop_gradient(
            jnp.where(valid, jnp.asarray(importance_weights, mask_f.dtype), 0)
        )
        per_token = per_token * weights
        diagnostics["importance_weight_mean"] = masked_mean(weights, mask_f)
    if ref_log_probs is not None:
        kl = kl_penalty(
            log_probs,
            jax.lax.stop_gradient(ref_log_probs),
            mask_f,
            estimator=kl_estimator,
            clamp=kl_clamp,
        )
        per_token = per_token - kl_coef * kl
        diagnostics["kl_ref"] = masked_mean(kl, mask_f)
    return per_token, weights, diagnostics


_REDUCTIONS = (jax.lax.reduce_sum_p, jax.lax.reduce_max_p, jax.lax.reduce_min_p)


def _save_only_reductions(primitive, *_, **__) -> bool:
    """``jax.checkpoint`` policy: keep outputs of reductions, recompute everything else."""
    return primitive in _REDUCTIONS


def _policy_metrics(log_ratio, seq_log_ratio, advantages, mask_f, lengths, surrogate, weights):
    """Diagnostics of ``policy_loss``, all over valid tokens (see its docstring).

    Every token reduction is a row sum first (``[B, T] -> [B]``), which XLA:CPU runs
    faster than a full reduction; absent flags (e.g. no dual clip) cost nothing.
    """
    valid = mask_f > 0
    num_tokens = jnp.sum(lengths)
    nonempty = lengths > 0
    num_seqs = jnp.sum(nonempty.astype(mask_f.dtype))
    has_tokens = num_tokens > 0
    zero = jnp.zeros((), mask_f.dtype)

    def token_sum(x):
        return jnp.sum(_row_sums(x, mask_f, lengths))

    def token_frac(flags):
        if flags is None:
            return zero
        return _safe_div(token_sum(jnp.where(flags, 1.0, 0.0).astype(mask_f.dtype)), num_tokens)

    gate = jax.lax.stop_gradient(surrogate.gate)
    no_grad = (gate == 0) | (advantages == 0)
    if weights is not None:
        no_grad = no_grad | (weights == 0)
    clip_low = token_frac(surrogate.clipped_low)
    clip_high = token_frac(surrogate.clipped_high)
    # One array serves min, max and the intra-sequence variance: padding holds the row's
    # mean log-ratio (the global mean for empty rows), which lies between the row's min
    # and max and adds 0 to its centred squares.
    global_mean = _safe_div(jnp.sum(seq_log_ratio * lengths), num_tokens)
    fill = jnp.where(nonempty, seq_log_ratio, global_mean)[:, None]
    filled = jnp.where(valid, log_ratio, fill)
    min_log_ratio = jnp.min(jnp.min(filled, axis=-1))
    max_log_ratio = jnp.max(jnp.max(filled, axis=-1))
    # Intra-sequence variance of the token log-ratio (ddof 0), then mean over sequences.
    seq_var = _safe_div(jnp.sum(jnp.square(filled - fill), axis=-1), lengths)
    return {
        "clip_frac_low": clip_low,
        "clip_frac_high": clip_high,
        "clip_frac": clip_low + clip_high,
        "dual_clip_frac": token_frac(surrogate.dual_clipped),
        "ratio_mean": _safe_div(token_sum(jnp.exp(log_ratio)), num_tokens),
        "ratio_min": jnp.exp(jnp.where(has_tokens, min_log_ratio, 0.0)),
        "ratio_max": jnp.exp(jnp.where(has_tokens, max_log_ratio, 0.0)),
        "seq_ratio_mean": _safe_div(
            jnp.sum(jnp.where(nonempty, jnp.exp(seq_log_ratio), 0)), num_seqs
        ),
        "approx_kl": _safe_div(token_sum(jnp.expm1(log_ratio) - log_ratio), num_tokens),
        "gate_mean": _safe_div(token_sum(gate), num_tokens),
        "log_ratio_seq_var": _safe_div(jnp.sum(seq_var), num_seqs),
        "zero_grad_frac": token_frac(no_grad),
        "num_tokens": num_tokens,
    }


# ----------------------------------------------------------------------------------------
# Entropy, value and NLL losses.
# ----------------------------------------------------------------------------------------


def entropy_from_logits(logits: Array) -> Array:
    """Entropy ``-sum_v p_v log p_v`` of ``softmax(logits)`` over the last axis, in float32.

    Computed as ``logsumexp(l) - sum_v p_v l_v`` (stable for any logits, -inf included). For
    large vocabularies prefer the chunked
    ``policyopt.logprobs.token_log_probs(..., return_entropy=True)``.

    Args:
      logits: ``[..., V]``.

    Returns:
      ``[...]`` entropies in nats.
    """
    logits = jnp.asarray(logits, jnp.float32)
    log_norm = jax.nn.logsumexp(logits, axis=-1)
    probs = jax.nn.softmax(logits, axis=-1)
    # Entries at -inf (masked vocabulary) have p = 0 and contribute 0, not 0 * inf.
    return log_norm - jnp.sum(jnp.where(probs > 0, probs * logits, 0), axis=-1)


def value_loss(
    values: Array,
    old_values: Array,
    returns: Array,
    mask: Array,
    *,
    clip: float | None = 0.2,
    aggregation: str = "token_mean",
    row_weights: Array | None = None,
) -> tuple[Array, dict[str, Array]]:
    """PPO's clipped value loss (Schulman et al. 2017; as in OpenAI baselines / verl).

    ``0.5 * max((V - R)^2, (clip(V, V_old - clip, V_old + clip) - R)^2)`` per token,
    aggregated with ``aggregation`` (token mean by default). ``clip=None`` gives the
    plain ``0.5 (V - R)^2``.

    Args:
      values: ``[B, T]`` current critic values (differentiate through this).
      old_values: ``[B, T]`` values when the rollout was scored.
      returns: ``[B, T]`` value targets (e.g. from ``advantages.gae``).
      mask: ``[B, T]``.
      clip: value clip range, or None.
      aggregation: see ``aggregate``.
      row_weights: optional ``[B]``: ``aggregation_weights`` of the whole minibatch these
        rows are part of, in place of ``aggregation`` (``policy_loss``): the loss is then
        these rows' share of the minibatch's loss.

    Returns:
      ``(loss, metrics)`` with ``value_loss``, ``value_clip_frac`` (tokens where the clipped
      term is the larger) and ``explained_variance`` ``1 - Var[R - V] / Var[R]`` (with
      constant returns: 1 if the values equal them, else 0).
    """
    mask_f = _as_mask(mask)
    valid = mask_f > 0
    values = jnp.where(valid, values, 0)
    old_values = jax.lax.stop_gradient(jnp.where(valid, old_values, 0))
    returns = jax.lax.stop_gradient(jnp.where(valid, returns, 0))
    unclipped = jnp.square(values - returns)
    if clip is None:
        per_token = 0.5 * unclipped
        clip_frac = jnp.zeros((), mask_f.dtype)
    else:
        clipped_values = old_values + jnp.clip(values - old_values, -clip, clip)
        clipped = jnp.square(clipped_values - returns)
        per_token = 0.5 * jnp.maximum(unclipped, clipped)
        clip_frac = masked_mean((clipped > unclipped).astype(mask_f.dtype), mask_f)
    if row_weights is None:
        loss = aggregate(per_token, mask_f, aggregation)
    else:
        loss = weighted_row_sum(per_token, mask_f, jax.lax.stop_gradient(row_weights))
    metrics = {
        "value_loss": jax.lax.stop_gradient(loss),
        "value_clip_frac": clip_frac,
        "explained_variance": jax.lax.stop_gradient(explained_variance(returns, values, mask_f)),
    }
    return loss, metrics


# Variances below this fraction of the mean square count as 0: float32 rounding of a
# constant (e.g. returns computed as (R - V) + V) leaves a variance of order (1e-7 R)^2.
_CONSTANT_REL_VAR = 1e-12


def explained_variance(returns: Array, values: Array, mask: Array) -> Array:
    """``1 - Var[R - V] / Var[R]`` over valid positions; with constant returns it is 1 if the
    values match them and 0 otherwise (never NaN, never a spurious 1).

    Returns whose variance is below ``1e-12 E[R^2]`` count as constant, and values within
    that of them as matching: float32 rounding makes GAE returns ``(R - V) + V`` of a batch
    with one reward "vary" by ~1e-14, which would otherwise give explained variances of -1e13.
    """
    mask_f = _as_mask(mask, jnp.result_type(returns, jnp.float32))
    residual_var = masked_var(returns - values, mask_f)
    returns_var = masked_var(returns, mask_f)
    floor = _CONSTANT_REL_VAR * masked_mean(jnp.square(returns), mask_f)
    exact = jnp.where(residual_var > floor, 0.0, 1.0).astype(returns_var.dtype)
    return jnp.where(returns_var > floor, 1.0 - _safe_div(residual_var, returns_var), exact)


def masked_var(x: Array, mask: Array, axis=None) -> Array:
    """Population variance (ddof 0) of ``x`` over valid positions; 0 where there are none."""
    mean = masked_mean(x, mask, axis=axis)
    if axis is not None:
        mean = jnp.expand_dims(mean, axis)
    return masked_mean(jnp.square(x - mean), mask, axis=axis)


def nll_loss(
    log_probs: Array, mask: Array, seq_weights: Array, *, denominator: Array | None = None
) -> Array:
    """Negative log-likelihood over a chosen subset of sequences (VAPO's positive samples).

    ``L_NLL = -(1 / sum_{i in S} |y_i|) sum_{i in S} sum_t log pi(y_{i,t})`` with ``S`` the
    sequences whose ``seq_weights`` is non-zero (VAPO 2504.05118, the correct
    samples; added to the loss with mu = 0.1). Non-binary weights weight each sequence's
    tokens: ``-sum w_i m log pi / sum w_i m``. 0 when no token is selected.

    Args:
      log_probs: ``[B, T]``.
      mask: ``[B, T]``.
      seq_weights: ``[B]`` bool or float, e.g. ``correct``.
      denominator: ``sum w_i m`` of the whole minibatch these rows are part of (a
        micro-batch), in place of these rows' own: the result is then their share of the
        minibatch's loss. None: these rows' own.

    Returns:
      A scalar.
    """
    mask_f = _as_mask(mask, jnp.result_type(log_probs, jnp.float32))
    weights = mask_f * jnp.asarray(seq_weights, mask_f.dtype)[:, None]
    selected = jnp.where(weights != 0, log_probs, 0) * weights
    total = jnp.sum(weights) if denominator is None else jax.lax.stop_gradient(denominator)
    return -_safe_div(jnp.sum(selected), total)
