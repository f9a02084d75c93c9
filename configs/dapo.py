"""DAPO (arXiv 2503.14476): clip-higher, token-level loss, dynamic sampling, overlong
reward shaping, no KL.

    --config configs/dapo.py[:model=tiny_dense|scale=paper|...]
"""

from configs import base


def get_config(arg=None):
    c = base.base_config()
    c.algo.method = "ppo"
    # Clip-higher: eps_low = 0.2, eps_high = 0.28 (PAPERS.md, DAPO).
    c.algo.clip_low = 0.2
    c.algo.clip_high = 0.28
    # Token-level policy-gradient loss: sum over all tokens / number of tokens. The
    # library divides by the tokens of the minibatch (PAPERS.md "Aggregation").
    c.algo.aggregation = "token_mean"
    c.algo.adv_center = "group"
    c.algo.adv_scale = "group"
    # No KL term (DAPO removes it).
    c.algo.kl_beta = 0.0
    # Dynamic sampling: drop groups with accuracy 0 or 1, sample more until full.
    c.dynamic_sampling.enabled = True
    c.dynamic_sampling.max_rounds = 4
    c.dynamic_sampling.criterion = "accuracy"  # eq. 11: 0 < |{o_i correct}| < G
    # Overlong reward shaping with L_max = max_new_tokens and L_cache a quarter of it on
    # the CPU (paper: 20480 / 4096).
    c.reward.overlong = "dapo"
    # Rule-based reward: +1 correct, -1 incorrect; truncated samples masked out.
    c.reward.incorrect_value = -1.0
    c.reward.overlong_filter = True
    # The paper uses lr 1e-6 with 20 warm-up steps; the tiny CPU model needs more.
    c.optim.lr = 1e-4
    c.optim.warmup_steps = 2
    c.optim.weight_decay = 0.1
    paper = {
        "model.preset": "qwen3_30b_a3b",
        "optim.lr": 1e-6,                 # DAPO §4.1: lr 1e-6, linear warm-up over 20
        "optim.warmup_steps": 320,        # rollout steps = 20 x 16 optimiser updates
        "batch.n_prompts": 512,           # prompt batch 512
        "batch.group_size": 16,           # 16 responses per prompt
        "batch.n_minibatches": 16,        # mini-batch 512: 16 updates per rollout step
        "sampling.max_new_tokens": 20480, # 16384 expected + 4096 soft punish cache
        "reward.max_len": 20480,
        "reward.cache_len": 4096,
    }
    return base.finalize(c, arg, paper)
