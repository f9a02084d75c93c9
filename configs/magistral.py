"""Magistral (arXiv 2506.10910): PPO clip-higher, no KL, group-centred advantages
normalised per minibatch, zero-variance groups dropped, format / length / language reward.

    --config configs/magistral.py[:model=tiny_dense|scale=paper|...]
"""

from configs import base


def get_config(arg=None):
    c = base.base_config()
    c.algo.method = "ppo"
    # eps_high in [0.26, 0.28] (0.3 for the small model); eps_low not stated, 0.2 usual.
    c.algo.clip_low = 0.2
    c.algo.clip_high = 0.28
    c.algo.aggregation = "token_mean"
    # A_i = R_i - mean(R_group), then (A - mean_mb) / std_mb over each minibatch.
    c.algo.adv_center = "group"
    c.algo.adv_scale = "minibatch"
    c.algo.kl_beta = 0.0
    # Groups with all-equal rewards are dropped before the batch is formed.
    c.dynamic_sampling.enabled = True
    # Format first (0 on failure, 0.1 if ok), +0.9 when correct; length penalty.
    c.reward.format = True
    c.reward.format_value = 0.1
    c.reward.correct_value = 0.9
    c.reward.overlong = "magistral"
    # Code problems (task.name code_jsonl / mixed_jsonl): the training reward runs 20
    # tests, 4 s and 300 MB each (the evaluation runs every test).
    c.reward.code_max_tests = 20
    # One update per batch (n_batch = n_minibatch works best).
    c.batch.n_minibatches = 1
    c.optim.lr = 1e-4  # CPU
    paper = {
        "model.preset": "qwen3_30b_a3b",
        "optim.lr": 1e-6,
        "reward.language_bonus": True,  # +0.1 when languages agree
        "sampling.max_new_tokens": 32768,
        "batch.response_buckets": c.batch.response_buckets + (32768,),  # base's stop at 20480
    }
    return base.finalize(c, arg, paper)
