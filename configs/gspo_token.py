"""GSPO-token (arXiv 2507.18071 §4.3): s_{i,t} = sg[s_i] * pi(y_t) / sg[pi(y_t)], equal to
GSPO in value and gradient when advantages are constant within a sequence; allows
token-level advantages.

    --config configs/gspo_token.py[:...]
"""

from configs import base, gspo


def get_config(arg=None):
    c = gspo.get_config()
    c.unlock()
    c.algo.method = "gspo_token"  # every other field: GSPO's, cited there
    return base.finalize(c, arg, {"model.preset": "qwen3_30b_a3b", "optim.lr": 1e-6})
