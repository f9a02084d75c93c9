"""GRPO (DeepSeekMath, arXiv 2402.03300): group-normalised advantages, PPO token clip,
k3 KL to the reference policy in the loss.

    --config configs/grpo.py                      # tiny MoE on the CPU
    --config configs/grpo.py:model=tiny_dense,algo.routing_replay=R2
    --config configs/grpo.py:scale=paper          # the paper's geometry, a real-size model
"""

from configs import base


def get_config(arg=None):
    c = base.base_config()
    c.algo.method = "ppo"  # GRPO's objective (2402.03300 eq. 3): PPO's token clip
    # Clip epsilon 0.2 on both sides: DeepSeekMath states no epsilon; 0.2 is PPO's
    # (1707.06347 §6.1) and verl's default (this project's choice).
    c.algo.clip_low = 0.2
    c.algo.clip_high = 0.2
    # Loss: mean over each response's tokens, then over responses (GRPO eq. 3).
    c.algo.aggregation = "seq_mean_token_mean"
    # A_i = (R_i - mean(R_group)) / std(R_group) (2402.03300 §4.1.2, outcome supervision);
    # the unbiased std plus adv_eps 1e-6, as verl (the paper states no convention).
    c.algo.adv_center = "group"
    c.algo.adv_scale = "group"
    # KL in the loss, beta = 0.04 (2402.03300 §4.2), k3 estimator (eq. 4), unclamped
    # (algo.kl_clamp=True: verl's clamp).
    c.algo.kl_beta = 0.04
    c.algo.kl_estimator = "k3"
    # On MoE, GRPO needed Routing Replay to converge (GSPO paper, 2507.18071); off here
    # (this project's choice) so that the ablation is one override away:
    # algo.routing_replay=R2.
    c.algo.routing_replay = "none"
    # DeepSeekMath uses lr 1e-6 (scale=paper); the tiny CPU model needs a larger one
    # (this project's choice, like every CPU-sized value).
    c.optim.lr = 1e-4
    paper = {
        "model.preset": "qwen3_30b_a3b",  # this project's target (the paper's: 7B dense)
        "optim.lr": 1e-6,  # DeepSeekMath §4.2: lr 1e-6
        "batch.group_size": 64,  # 64 samples per question
        "batch.n_prompts": 16,  # batch of 1024 samples
        "batch.n_minibatches": 1,  # one update per exploration stage
        "sampling.max_new_tokens": 1024,  # max length 1024
        "task.num_test": 512,  # this project's choice
    }
    return base.finalize(c, arg, paper)
