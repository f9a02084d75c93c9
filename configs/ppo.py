"""PPO for LLMs (Schulman et al. 2017; GAE 1506.02438): a critic (the policy's backbone
with a value head), per-token GAE advantages, token clip 0.2, clipped value loss.

    --config configs/ppo.py                        # tiny MoE on the CPU
    --config configs/ppo.py:model=tiny_dense,critic.pretrain_iterations=5
    --config configs/ppo.py:scale=paper            # a real-size model, lr 1e-6
"""

from configs import base


def get_config(arg=None):
    c = base.base_config()
    c.algo.method = "ppo"
    # Clipped surrogate, eps = 0.2 on both sides (1707.06347 §6.1).
    c.algo.clip_low = 0.2
    c.algo.clip_high = 0.2
    # Per-token loss averaged over the minibatch's tokens (verl / OpenRLHF PPO default;
    # this project's choice: the PPO papers for LLMs name no aggregation).
    c.algo.aggregation = "token_mean"
    # GAE with one lambda for advantages and value targets: gamma 1.0, lambda 0.95
    # (classic PPO for LLMs, as VC-PPO's baseline, 2503.01491); gae_lambda_critic stays None, i.e.
    # follows gae_lambda. The outcome reward sits on the last response token.
    c.algo.advantage = "gae"
    c.algo.gae_gamma = 1.0
    c.algo.gae_lambda = 0.95
    # Advantages whitened over the batch's tokens (verl, OpenRLHF; not a paper value).
    c.algo.adv_whiten = True
    # No KL term and no dynamic sampling: the advantage needs no groups (any group_size
    # works; the default 8 samples per prompt only fills the CPU batch).
    c.algo.kl_beta = 0.0
    c.dynamic_sampling.enabled = False
    # Rule-based reward +1 correct / -1 incorrect: VC-PPO's (2503.01491), whose PPO
    # baseline this recipe is (classic PPO fixes no reward). With a critic whose values
    # start at 0 and an absolute value clip, 0 is then the midpoint of the two outcomes.
    c.reward.incorrect_value = -1.0
    # Value clip 0.2 (OpenAI baselines' cliprange, OpenRLHF's value_clip; verl's default
    # cliprange_value is 0.5; the papers give none); no value pretraining.
    c.critic.value_clip = 0.2
    c.critic.pretrain_iterations = 0
    # The tiny CPU models need larger learning rates than 1e-6 (this project's choice);
    # the critic gets twice the actor's, the ratio VAPO uses (2504.05118).
    c.optim.lr = 1e-4
    c.critic.lr = 2e-4
    paper = {
        "model.preset": "qwen3_30b_a3b",  # this project's target
        "optim.lr": 1e-6,  # the actor lr of the critic-based papers (VAPO: 1e-6)
        "critic.lr": 2e-6,  # VAPO's critic lr; classic PPO papers do not fix one for LLMs
    }
    return base.finalize(c, arg, paper)
