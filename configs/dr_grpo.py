"""Dr. GRPO (arXiv 2503.20783): advantages without the std, per-sequence token *sum*
divided by a constant (the maximum generation length), no KL.

    --config configs/dr_grpo.py[:model=tiny_dense|scale=paper|...]
"""

from configs import base


def get_config(arg=None):
    c = base.base_config()
    c.algo.method = "ppo"
    c.algo.clip_low = 0.2
    c.algo.clip_high = 0.2
    # A_i = R_i - mean(R_group): no division by the std (PAPERS.md, Dr. GRPO).
    c.algo.adv_center = "group"
    c.algo.adv_scale = "none"
    # Token sum per sequence / constant (max generation length), mean over sequences.
    c.algo.aggregation = "seq_mean_token_sum_norm"
    c.algo.max_len = None  # None: sampling.max_new_tokens
    c.algo.kl_beta = 0.0
    c.optim.lr = 1e-4  # CPU; the paper uses 1e-6
    paper = {
        "model.preset": "qwen3_30b_a3b",
        "optim.lr": 1e-6,
        "sampling.max_new_tokens": 3000,
        "batch.n_prompts": 128,
        "batch.group_size": 8,
    }
    return base.finalize(c, arg, paper)
