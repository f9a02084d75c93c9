"""SAPO (arXiv 2511.20347): a soft, temperature-controlled gate sigmoid(tau (r - 1)) * 4 / tau
instead of a clip, with tau_neg > tau_pos.

    --config configs/sapo.py[:model=tiny_dense|scale=paper|...]
    --config.algo.tau_neg=1.1        # acts: 4 updates per batch (batch.n_minibatches)
"""

from configs import base


def get_config(arg=None):
    c = base.base_config()
    c.algo.method = "sapo"
    # tau_pos = 1.0, tau_neg = 1.05: from public implementations (verl's actor defaults),
    # not confirmed from the paper's text (2511.20347); tau_neg > tau_pos as it advises.
    c.algo.tau_pos = 1.0
    c.algo.tau_neg = 1.05
    # The paper's unified form: (1/G) sum_i (1/|y_i|) sum_t, GRPO's group advantages.
    c.algo.aggregation = "seq_mean_token_mean"
    c.algo.adv_center = "group"
    c.algo.adv_scale = "group"
    c.algo.kl_beta = 0.0  # no KL term (this project's choice, as GSPO)
    # Several updates per batch: SAPO's gate (and tau_pos / tau_neg) acts only where the
    # ratio has left 1, i.e. on the off-policy updates after a batch's first (SAPO, arXiv
    # 2511.20347, gates the updates of a batch split into minibatches). With one update
    # the ratio is 1 at every token and `--config.algo.tau_neg=1.1` would change nothing.
    # 4 is this CPU recipe's choice (8 prompts: 2 groups per update), not the paper's count.
    c.batch.n_minibatches = 4
    c.optim.lr = 1e-4  # CPU (this project's choice)
    # Qwen3-30B-A3B and lr 1e-6: this project's choice (as GSPO's recipe); max_new_tokens
    # must be named (base.py).
    paper = {"model.preset": "qwen3_30b_a3b", "optim.lr": 1e-6}
    return base.finalize(c, arg, paper)
