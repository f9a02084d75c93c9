"""The ``algo`` and ``critic`` sections: the method's objective, advantages, KL, rollout
correction and auxiliary losses, and the value model of the critic methods."""

from __future__ import annotations

import dataclasses

from policyopt import schema
from policyopt.schema import Check, choice, integer, number, pairs, positive, setting


def _objectives():
    from policyopt import losses

    return losses.OBJECTIVES


def objective_fields() -> dict[str, schema.Field]:
    """The ``algo.<setting>`` fields that the registered objectives' settings records bring
    (``policyopt.losses.register_objective``), by name; a field two objectives share is one.
    A setting named like one of the section's own fields is an error naming its objective."""
    own = {f.name for f in dataclasses.fields(Algo)}
    out = {}
    for objective in _objectives().values():
        if objective.settings is None:
            continue
        for field in schema.fields(objective.settings):
            if field.path in own:
                raise ValueError(
                    f"objective {objective.name!r} ({objective.where}): its setting "
                    f"{field.path!r} is a field of the algo section; name it differently"
                )
            out.setdefault(field.path, field)
    return out


def _default_settings() -> tuple:
    return tuple((name, field.default) for name, field in objective_fields().items())


def _library(module: str, name: str, extra: tuple = ()):
    """The choices a library module defines, read when checked."""

    def source():
        import importlib

        return tuple(getattr(importlib.import_module(module), name)) + extra

    return source


def _iterations() -> Check:
    def fn(label, value):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{label} must be >= 0, got {value}")

    return Check(fn, "int >= 0")


@dataclasses.dataclass(frozen=True)
class Algo:
    """The method: policy objective and aggregation, advantage estimator, KL term, routing
    replay, rollout correction and auxiliary losses (docs/algorithms.md)."""

    method: str = setting(
        "ppo",
        "Policy objective of `policyopt.losses.policy_loss`: a registered objective.",
        note='"ppo" (token clip: GRPO, DAPO, Magistral, VAPO), "gspo", "gspo_token", "sapo", '
        "or one registered with `policyopt.losses.register_objective`.",
        check=choice(
            source=_objectives, rule="a registered objective (policyopt.losses.OBJECTIVES)"
        ),
    )
    aggregation: str = setting(
        "seq_mean_token_mean",
        "How per-token terms become the loss (see policyopt.losses.aggregate).",
        paper="GRPO 2402.03300 eq. 3: seq_mean_token_mean; DAPO 2503.14476 eq. 12: "
        "group_token_mean",
        note="\"token_mean\" (over the minibatch's tokens: verl's token-mean), "
        '"group_token_mean" (per group, then mean over groups: the form of the DAPO, '
        'Magistral and VAPO papers), "seq_mean_token_mean", "seq_mean_token_sum", '
        '"seq_mean_token_sum_norm".',
        check=choice(
            source=_library("policyopt.losses", "AGGREGATIONS"),
            rule="one of policyopt.losses.AGGREGATIONS",
        ),
    )
    max_len: int | None = setting(
        None,
        'Constant divisor of "seq_mean_token_sum_norm"; None = sampling.max_new_tokens.',
        paper="Dr. GRPO 2503.20783",
        check=integer(1, none="sampling.max_new_tokens"),
    )
    advantage: str = setting(
        "outcome",
        'Advantage estimator: "outcome" (critic-free, from the group\'s rewards) or "gae" '
        "(a critic and per-token GAE).",
        note='"outcome": one advantage per sequence from the rewards of its group, adv_center '
        '/ adv_scale below. "gae" (PPO, VC-PPO, VAPO): a critic, `config.critic`, and '
        "per-token GAE advantages, the gae_* fields below.",
        check=choice(
            source=_library("policyopt.advantages", "ESTIMATORS"),
            rule="a registered estimator (policyopt.advantages.ESTIMATORS)",
        ),
    )
    adv_center: str = setting(
        "group",
        'Advantage centring: "group" (subtract the group mean) or "none".',
        check=choice(
            source=_library("policyopt.advantages", "CENTERS"), rule="one of 'group', 'none'"
        ),
    )
    adv_scale: str = setting(
        "group",
        'Advantage scaling: "group", "batch", "minibatch" or "none".',
        paper="GRPO 2402.03300 §4.1.2: group std; Magistral 2506.10910 §2.1: minibatch; "
        "Dr. GRPO 2503.20783: none",
        note='"group" (GRPO: group std), "batch" (std over the batch), "minibatch" '
        '(Magistral: (A - mean_mb) / std_mb over each minibatch), "none" (Dr. GRPO).',
        check=choice(
            source=_library("policyopt.advantages", "SCALES", ("minibatch",)),
            rule="one of 'group', 'batch', 'none', 'minibatch'",
        ),
    )
    adv_eps: float = setting(
        1e-6,
        "Epsilon added to the std (verl's 1e-6; the papers state none).",
        check=number(0.0),
    )
    gae_gamma: float = setting(
        1.0,
        "GAE discount gamma (1.0 for LLMs).",
        paper="GAE 1506.02438",
        note='algo.advantage = "gae"; docs/algorithms.md "GAE". The outcome reward sits on '
        "the last valid response token, 0 elsewhere.",
        check=number(0.0, 1.0),
    )
    gae_lambda: float = setting(
        0.95,
        "lambda of the policy advantages.",
        paper="classic PPO 0.95; VC-PPO 2503.01491 lambda_actor 0.95",
        check=number(0.0, 1.0),
    )
    gae_lambda_critic: float | None = setting(
        None,
        "lambda of the value targets A^lambda + V; None: gae_lambda.",
        paper="VC-PPO 2503.01491 and VAPO 2504.05118: 1.0, Monte-Carlo returns",
        note="None is classic PPO, one lambda for both, so overriding gae_lambda moves both.",
        check=number(0.0, 1.0, optional=True),
    )
    gae_length_adaptive: bool = setting(
        False,
        "VAPO's length-adaptive policy lambda 1 - 1/(gae_alpha * |y|) per sequence instead of "
        "gae_lambda.",
        paper="VAPO 2504.05118",
        note="Clamped at 0 when gae_alpha * |y| <= 1: `advantages.length_adaptive_lambda`.",
    )
    gae_alpha: float = setting(
        0.05,
        "alpha of the length-adaptive lambda.",
        paper="VAPO 2504.05118: 0.05",
        check=number(0.0, low_inclusive=False),
    )
    adv_whiten: bool = setting(
        True,
        "Whiten the GAE advantages over the valid tokens of the batch ((A - mean) / std).",
        note="As verl and OpenRLHF do for PPO (the papers do not say). Outcome advantages: unused.",
    )
    nll_coef: float = setting(
        0.0,
        "VAPO's NLL on correct samples: loss += nll_coef * L_NLL (0 = off).",
        paper="VAPO 2504.05118: mu = 0.1",
        note="Over the tokens of the minibatch's correct responses. Any advantage estimator.",
        check=number(0.0),
    )
    kl_beta: float = setting(
        0.0,
        "Coefficient of the KL to the frozen initial policy, in the loss (0 = off).",
        paper="GRPO 2402.03300 §4.2: beta = 0.04, k3",
        note="0 runs no reference forward pass.",
        check=number(0.0),
    )
    kl_estimator: str = setting(
        "k3",
        'KL estimator: "k1", "k2" or "k3".',
        paper="GRPO 2402.03300 eq. 4: k3",
        check=choice(
            source=_library("policyopt.losses", "KL_ESTIMATORS"), rule="one of 'k1', 'k2', 'k3'"
        ),
    )
    kl_clamp: bool = setting(
        False,
        "verl's clamp of k3 (log-ratio to +-20, k3 to <= 10: `losses.kl_penalty`); off: the "
        "paper's k3.",
        paper="GRPO 2402.03300 eq. 4 (off)",
        note="This project's choice: off, as the clamp zeroes the KL's gradient on exactly the "
        "tokens furthest from the reference (k3 > 10), and a non-finite loss already skips "
        "the update (`learner.guarded_update`).",
    )
    routing_replay: str = setting(
        "none",
        'Routing replay for MoE policies: "none", "R2" or "R3".',
        paper="GSPO 2507.18071 (Routing Replay)",
        note='"R2" replays the old-log-prob forward\'s routing in every update forward; "R3" '
        "replays the sampler's routing in the old-log-prob forward and in every update "
        "forward.",
        check=choice("none", "R2", "R3"),
    )
    tis_cap: float | None = setting(
        None,
        "Truncated importance sampling cap C: per-token weight min(exp(old - behaviour), C) "
        "(None = off).",
        note="Between trainer and sampler log-probs; 2.0 is a common choice; needs "
        'old_log_probs = "trainer", with "sampler" the weight would always be 1.',
        check=positive(optional=True),
    )
    tis_level: str = setting(
        "token",
        'Its level: "token" (min(rho_t, C)) or "sequence" (min(prod_t rho_t, C)).',
        note="Sequence: one weight per sequence, unbiased up to the cap, more variance; caps "
        "of 2-10 are usual.",
        check=choice(
            source=_library("policyopt.losses", "IS_LEVELS"), rule="one of 'token', 'sequence'"
        ),
    )
    rs_level: str | None = setting(
        None,
        'Rollout rejection sampling level: None (off), "token", "sequence" or "geometric".',
        paper='Liu, Li et al. 2025, "When Speed Kills Stability"; verl\'s rollout_rs',
        note="Tokens or sequences whose ratio rho = pi_old / mu lies outside [rs_lower, "
        "rs_upper] leave the policy loss (and its denominators; the critic still trains on "
        'them). "token": rho_t, "sequence": prod_t rho_t, "geometric": exp(mean_t log rho_t) '
        '(tight bounds, e.g. rs_upper = 1.001). Needs old_log_probs = "trainer".',
        check=choice(
            source=_library("policyopt.losses", "RS_LEVELS", (None,)),
            rule="one of None, 'token', 'sequence', 'geometric'",
        ),
    )
    rs_upper: float | None = setting(None, "Upper bound of rho for rejection sampling.")
    rs_lower: float | None = setting(None, "Lower bound of rho; None: 1 / rs_upper.")
    rs_veto: float | None = setting(
        None,
        "Veto: also reject every sequence holding a token with rho_t < rs_veto (None = off).",
        note="1e-4 is usual; with or without rs_level.",
        check=positive(optional=True),
    )
    old_log_probs: str = setting(
        "trainer",
        'Where pi_old comes from: "trainer" (a forward pass before the updates) or "sampler" '
        "(the rollout's log-probs).",
        note='"trainer" as verl and OpenRLHF do; "sampler" saves a forward pass, valid when '
        "sampler and trainer agree numerically.",
        check=choice("trainer", "sampler"),
    )
    load_balancing_coef: float = setting(
        0.0,
        "Coefficient of the MoE load-balancing auxiliary loss in the update (0 = off).",
        note='The critic\'s update (algo.advantage = "gae", MoE backbone) adds its own with '
        "the same one. The loss is E * sum_e f_e P_e with f_e the fraction of the k * N "
        "routing slots that go to expert e, per layer, averaged over layers: 1 at perfect "
        "balance. HuggingFace's Qwen3-MoE counts f_e over the N tokens (k at balance) and "
        "averages f and P over layers first: its router_aux_loss_coef c (0.001 in the "
        "released configs) is about load_balancing_coef = c * k here.",
        check=number(0.0),
    )
    router_z_coef: float = setting(
        0.0,
        "Coefficient of the router z-loss in the policy update (0 = off).",
        paper="ST-MoE 2202.08906",
        note="Mean squared logsumexp of the router logits; reported as moe/router_z_loss.",
        check=number(0.0),
    )
    entropy_coef: float = setting(
        0.0, "Entropy bonus coefficient (0 = off; none of the recipes use one).", check=number(0.0)
    )
    # The registered objectives' settings (clip_low, tau_neg, ...): each an algo.<setting>
    # config field, read as an attribute (algo.tau_neg) and as the chosen objective's record
    # (algo.objective).
    settings: tuple = pairs(_default_settings, "the registered objectives' settings")

    @classmethod
    def from_config_node(cls, node) -> "Algo":
        """The section of a ConfigDict node: its own fields and every registered objective's
        settings (a setting the node lacks, registered after it was made, at its default)."""
        algo = schema.from_node(cls, node)
        values = tuple(
            (name, node[name] if name in node else field.default)
            for name, field in objective_fields().items()
        )
        return dataclasses.replace(algo, settings=values)

    def __getattr__(self, name: str):
        if name.startswith("__") or name == "settings":
            raise AttributeError(name)
        for key, value in self.settings:
            if key == name:
                return value
        raise AttributeError(f"the algo section has no field or objective setting {name!r}")

    def replace(self, **fields) -> "Algo":
        """A copy with ``fields`` changed: the section's own and the objectives' settings."""
        names = {name for name, _ in self.settings}
        unknown = set(fields) - names - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise TypeError(f"the algo section has no field or objective setting {sorted(unknown)}")
        settings = tuple((name, fields.get(name, value)) for name, value in self.settings)
        own = {k: v for k, v in fields.items() if k not in names}
        return dataclasses.replace(self, **own, settings=settings)

    @property
    def uses_critic(self) -> bool:
        """Whether ``advantage`` is an estimator of a critic's values (kind ``"gae"``): the
        run then trains a critic (``config.critic``)."""
        from policyopt.advantages import uses_critic

        return uses_critic(self.advantage)

    @property
    def objective(self):
        """The settings record of ``method`` (its registered type, filled from this section),
        or None for an objective without settings."""
        objective = _objectives()[self.method]
        if objective.settings is None:
            return None
        values = dict(self.settings)
        return objective.settings(
            **{
                f.name: values[f.name]
                for f in dataclasses.fields(objective.settings)
                if f.name in values
            }
        )

    @property
    def critic_lambda(self) -> float:
        """lambda of the value targets: ``gae_lambda_critic``, or ``gae_lambda`` when None."""
        return self.gae_lambda if self.gae_lambda_critic is None else self.gae_lambda_critic

    def validate(self, label: str) -> None:
        from policyopt import losses

        name = lambda field: f"{label}.{field}"  # noqa: E731
        values = dict(self.settings)
        for objective in _objectives().values():  # every setting checked, as every field is
            if objective.settings is not None:
                losses.check_settings(
                    objective.settings(
                        **{
                            f.name: values[f.name]
                            for f in dataclasses.fields(objective.settings)
                            if f.name in values
                        }
                    ),
                    name,
                )
        losses.objective_settings(self.method, None, values, name)
        if self.kl_clamp and self.kl_estimator != "k3":
            raise ValueError(
                f"{label}.kl_clamp=True is defined for {label}.kl_estimator='k3' only (verl's "
                f"low_var_kl), got {self.kl_estimator!r}"
            )
        if self.adv_scale == "minibatch" and self.advantage != "outcome":
            if self.uses_critic:
                raise ValueError(
                    f"{label}.adv_scale='minibatch' (Magistral) is an outcome-advantage "
                    f"option; with algo.advantage={self.advantage!r} use algo.adv_whiten"
                )
            raise ValueError(
                f"{label}.adv_scale='minibatch' (Magistral) rescales the built-in 'outcome' "
                f"estimator's advantages per minibatch; algo.advantage={self.advantage!r} "
                "computes its own"
            )
        self._validate_correction(label)

    def _validate_correction(self, label: str) -> None:
        """Routing replay and the rollout correction against where pi_old comes from."""
        if self.routing_replay in ("R2", "R3") and self.old_log_probs == "sampler":
            raise ValueError(
                f"{label}.routing_replay={self.routing_replay!r} needs the trainer's "
                "old-log-prob forward (R2 records its routing, R3 replays the sampler's "
                "routing in it); set algo.old_log_probs='trainer'"
            )
        if self.tis_cap is not None and self.old_log_probs == "sampler":
            raise ValueError(
                f"{label}.tis_cap weighs tokens by min(exp(old - behaviour), C), which is 1 "
                "when pi_old is the sampler's log-probs (algo.old_log_probs='sampler'); use "
                "one correction: tis_cap with old_log_probs='trainer', or "
                "old_log_probs='sampler' alone"
            )
        if self.rs_level is not None or self.rs_veto is not None:
            if self.old_log_probs == "sampler":
                raise ValueError(
                    f"{label}.rs_level / rs_veto reject tokens by rho = exp(old - behaviour), "
                    "which is 1 when pi_old is the sampler's log-probs "
                    "(algo.old_log_probs='sampler'); set algo.old_log_probs='trainer'"
                )
            if self.rs_level is not None and (self.rs_upper is None or not self.rs_upper > 0):
                raise ValueError(
                    f"{label}.rs_level={self.rs_level!r} needs algo.rs_upper > 0, "
                    f"got {self.rs_upper}"
                )
            if self.rs_level is not None:
                lower = 1.0 / self.rs_upper if self.rs_lower is None else self.rs_lower
                if not 0 < lower <= self.rs_upper:
                    raise ValueError(
                        f"{label}.rs_lower ({lower}) must be in (0, rs_upper={self.rs_upper}]"
                    )
        if self.rs_level is None and (self.rs_upper is not None or self.rs_lower is not None):
            raise ValueError(
                f"{label}.rs_upper / rs_lower are set but algo.rs_level is None: choose the "
                "level they apply at ('token', 'sequence' or 'geometric')"
            )


@dataclasses.dataclass(frozen=True)
class Critic:
    """The value model of PPO, VC-PPO and VAPO (algo.advantage = "gae"): a backbone with a
    scalar head (zero-initialised), started from the policy's initial parameters or from a
    model of its own (``init_checkpoint``; `policyopt.rl.update.critic`)."""

    init_checkpoint: str | None = setting(
        None,
        "A value model of its own: a full-weight checkpoint directory whose recorded model "
        "is the critic's backbone. None: a copy of the policy.",
        note="E.g. an SFT run's `checkpoints/` of a larger model on the same task and "
        "tokenizer. The model (preset or HuggingFace folder, and its shape overrides) is read from "
        "the checkpoint's config record; the run's runtime fields (dtypes, dispatch, "
        "attention) apply. Full weights only: with LoRA it needs "
        '`model.lora.critic = "full"`.',
    )

    lr: float = setting(
        1e-5,
        "The critic's AdamW learning rate.",
        note="Betas, eps and gradient clipping are shared with `optim`.",
        check=number(0.0, low_inclusive=False),
    )
    warmup_steps: int = setting(
        0, "Linear warm-up of the critic's learning rate, in updates.", check=integer(0)
    )
    weight_decay: float = setting(0.0, "The critic's AdamW weight decay.", check=number(0.0))
    value_clip: float | None = setting(
        0.2,
        "PPO value clip: 0.5 max((V - R)^2, (clip(V, V_old +- value_clip) - R)^2); None = off.",
        paper="PPO 1707.06347",
        check=number(0.0, optional=True),
    )
    pretrain_iterations: int = setting(
        0,
        "Value pretraining: the first N iterations update only the critic, on Monte-Carlo "
        "returns (0 = off).",
        paper="VC-PPO 2503.01491 value pretraining; VAPO 2504.05118: 50 steps",
        note="lambda_critic = 1 whatever algo.gae_lambda_critic; the policy is frozen and "
        "samples as the initial policy. They count in `train.num_iterations` (VAPO's "
        "`scale=paper`, 100 iterations with 50 of warm-up, makes 50 policy iterations); "
        "`experiments/ablate.py` adds them on top, so that its arms with and without "
        "pretraining make as many policy updates.",
        check=_iterations(),
    )
    reward_model_iterations: int = setting(
        0,
        "The first N iterations, before any value pretraining, train the critic as an outcome "
        "reward model (0 = off).",
        paper="VC-PPO 2503.01491 and VAPO 2504.05118 name it the source of the value "
        "initialisation bias",
        note="On the SFT policy's rollouts: its value at the last response token only, fitted "
        'to the outcome reward (`policyopt.rl.update.critic`, "Reward-model initialisation"). 0: '
        "the critic starts from the policy's parameters with a zero value head. They count in "
        "`train.num_iterations` and `experiments/ablate.py` adds them on top, as above.",
        check=_iterations(),
    )
