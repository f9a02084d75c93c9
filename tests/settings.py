"""The library's settings dataclasses at this project's defaults (`configs/base.py`, the one
place of them: the dataclasses have none), with the fields a test names changed."""

import dataclasses

from configs import base
from policyopt.rl.critic import CriticConfig, GAEConfig
from policyopt.rl.learner import LossConfig, OptimConfig


def loss_settings(**fields) -> LossConfig:
    return dataclasses.replace(LossConfig.from_config(base.base_config()), **fields)


def optim_settings(**fields) -> OptimConfig:
    return dataclasses.replace(OptimConfig.from_config(base.base_config().optim), **fields)


def critic_settings(**fields) -> CriticConfig:
    return dataclasses.replace(CriticConfig.from_config(base.base_config()), **fields)


def gae_settings(**fields) -> GAEConfig:
    return dataclasses.replace(GAEConfig.from_config(base.base_config().algo), **fields)
