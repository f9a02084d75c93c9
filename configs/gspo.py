"""GSPO (arXiv 2507.18071): sequence-level importance ratio (geometric mean of the token
ratios) with a sequence-level clip, no KL; no routing replay needed on MoE.

    --config configs/gspo.py[:model=tiny_dense|scale=paper|...]
"""

from configs import base


def get_config(arg=None):
    c = base.base_config()
    c.algo.method = "gspo"  # 2507.18071 §4.1: sequence ratio s_i, sequence clip
    # Paper clip range: eps_l = 3e-4, eps_r = 4e-4 (2507.18071 §5.1).
    c.algo.clip_low = 3e-4
    c.algo.clip_high = 4e-4
    # (1/G) sum_i over sequences of the sequence term (the GSPO objective).
    c.algo.aggregation = "seq_mean_token_mean"
    # GRPO's group-normalised advantage (the paper's A_i).
    c.algo.adv_center = "group"
    c.algo.adv_scale = "group"
    c.algo.kl_beta = 0.0  # no KL term in the GSPO objective
    # GSPO converges on MoE without Routing Replay (2507.18071).
    c.algo.routing_replay = "none"
    # Each batch of rollouts is split into four minibatches (GSPO §5.1).
    c.batch.n_minibatches = 4
    c.optim.lr = 1e-4  # CPU (this project's choice)
    # The paper's model is Qwen3-30B-A3B; lr 1e-6 is this project's choice (the paper's
    # learning rate is not recorded here); max_new_tokens must be named (base.py).
    paper = {"model.preset": "qwen3_30b_a3b", "optim.lr": 1e-6}
    return base.finalize(c, arg, paper)
