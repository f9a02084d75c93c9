"""SAPO (arXiv 2511.20347): a soft, temperature-controlled gate sigmoid(tau (r - 1)) * 4 / tau
instead of a clip, with tau_neg > tau_pos.

    --config configs/sapo.py[:model=tiny_dense|scale=paper|...]
    --config.algo.tau_neg=1.1
"""

from configs import base


def get_config(arg=None):
    c = base.base_config()
    c.algo.method = "sapo"
    # tau_pos = 1.0, tau_neg = 1.05 (PAPERS.md, SAPO: from public implementations).
    c.algo.tau_pos = 1.0
    c.algo.tau_neg = 1.05
    c.algo.aggregation = "seq_mean_token_mean"
    c.algo.adv_center = "group"
    c.algo.adv_scale = "group"
    c.algo.kl_beta = 0.0
    c.optim.lr = 1e-4  # CPU
    paper = {"model.preset": "qwen3_30b_a3b", "optim.lr": 1e-6}
    return base.finalize(c, arg, paper)
