"""The sections the library's steps take, at this project's defaults (the schema,
`policyopt.config`, is the one place of them), with the fields a test names changed and the
sections checked as a config's are. The names of the loss and GAE settings map to their
config fields (`lam_actor` is `algo.gae_lambda`, `temperature` is `sampling.temperature`)."""

import dataclasses

from policyopt import schema
from policyopt.config import Algo, Optim, RunConfig
from policyopt.rl.update.critic import CriticSettings
from policyopt.rl.update.learner import LossSettings

# The tiny transformer of the model, sampler and engine tests (two layers, grouped-query
# attention); with ``TINY_MOE`` its MoE blocks (4 experts, top 2).
TINY_MODEL = dict(
    vocab_size=40,
    hidden_size=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    intermediate_size=48,
    rope_theta=1e4,
)
TINY_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)

# The recipe files of the RL methods, each a paper's settings (`configs/<name>.py`).
RL_RECIPES = (
    "grpo",
    "dapo",
    "dr_grpo",
    "gspo",
    "gspo_token",
    "sapo",
    "magistral",
    "ppo",
    "vc_ppo",
    "vapo",
)

# Loss settings outside `algo`, by section.
_LOSS_SECTIONS = {"group_size": "batch", "micro_batch_tokens": "batch", "temperature": "sampling"}
# Critic settings outside `critic`, by section.
_CRITIC_SECTIONS = {"micro_batch_tokens": "batch", "load_balancing_coef": "algo"}
# GAE settings: their `algo` fields.
_GAE_FIELDS = {
    "gamma": "gae_gamma",
    "lam_actor": "gae_lambda",
    "lam_critic": "gae_lambda_critic",
    "length_adaptive": "gae_length_adaptive",
    "alpha": "gae_alpha",
    "whiten": "adv_whiten",
}


def _replace(section, **fields):
    """``section`` with ``fields`` changed (the algo section's objective settings too)."""
    if isinstance(section, Algo):
        return section.replace(**fields)
    return dataclasses.replace(section, **fields)


def _replace_in_sections(settings, fields, sections: dict, default: str):
    """``settings`` (a tuple of named sections) with each of ``fields`` changed in its
    section: ``sections[name]``, else ``default``."""
    for name, value in fields.items():
        section = sections.get(name, default)
        changed = _replace(getattr(settings, section), **{name: value})
        settings = settings._replace(**{section: changed})
    return settings


def _replace_loss(settings: LossSettings, fields) -> LossSettings:
    """``settings`` with ``fields`` changed, each in its section (``_LOSS_SECTIONS``)."""
    return _replace_in_sections(settings, fields, _LOSS_SECTIONS, "algo")


def _replace_critic(settings: CriticSettings, fields) -> CriticSettings:
    """``settings`` with ``fields`` changed, each in its section (``_CRITIC_SECTIONS``)."""
    return _replace_in_sections(settings, fields, _CRITIC_SECTIONS, "critic")


def loss_settings(**fields) -> LossSettings:
    """``LossSettings`` of the default config with ``fields`` changed, ``algo`` checked."""
    settings = _replace_loss(LossSettings.of(RunConfig()), fields)
    schema.check(settings.algo, "config.algo")
    return settings


def optim_settings(**fields) -> Optim:
    """The policy's ``Optim`` section with ``fields`` changed (not checked: tests of the
    non-finite guard give it an infinite learning rate)."""
    return _replace(RunConfig().optim, **fields)


def critic_settings(**fields) -> CriticSettings:
    """``CriticSettings`` of the default config: ``value_clip`` in ``critic``,
    ``load_balancing_coef`` in ``algo``, ``micro_batch_tokens`` in ``batch``; checked."""
    settings = _replace_critic(CriticSettings.of(RunConfig()), fields)
    schema.check(settings.critic, "config.critic")
    schema.check(settings.algo, "config.algo")
    return settings


def gae_settings(**fields) -> Algo:
    """The default ``algo`` section with GAE ``fields`` changed (``lam_actor``, ...), checked."""
    algo = _replace(RunConfig().algo, **{_GAE_FIELDS.get(k, k): v for k, v in fields.items()})
    schema.check(algo, "config.algo")
    return algo


def replace(settings, **fields):
    """``settings`` (``LossSettings``, ``CriticSettings``, or a section) with ``fields``
    changed, each in the section that holds it (as ``loss_settings`` and ``critic_settings``
    name them); not checked again."""
    if isinstance(settings, LossSettings):
        return _replace_loss(settings, fields)
    if isinstance(settings, CriticSettings):
        return _replace_critic(settings, fields)
    if isinstance(settings, Algo):
        return _replace(settings, **{_GAE_FIELDS.get(k, k): v for k, v in fields.items()})
    return _replace(settings, **fields)
