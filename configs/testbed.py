"""The volatile-routing testbed (`experiments/reproduce.py`): the demo's task and recipe
(`configs/demo.py`: three-digit addition with 60% carry-less SFT solutions, SAPO, 16
prompts x 8 samples, responses <= 20 tokens) on the `moe_volatile` preset, an MoE of 4
layers with 32 small experts top-4 per layer, whose routing changes by >= 5% of the
(token, layer) expert choices after one update, the regime of the GSPO paper's
Qwen3-30B-A3B (~10%; 2507.18071 §5.3). The demo's 2-layer, 4-expert top-2 model moves
~0.8% (benchmarks/HISTORY.md "2026-11-30: the papers' ablations"). Measured with

    python -m experiments.reproduce --claim routing_volatility --seeds 0

which trains (once, cached under runs/testbed/sft) the SFT start the `testbed` setting of
the ablations starts from (`configs/ablations.py`), then makes one RL update and prints
the fraction of expert choices that changed.
"""

from configs import base, demo


def get_config(arg=None):
    c = demo.get_config()
    c.unlock()
    c.model.preset = "moe_volatile"
    # SFT: the demo's recipe (800 steps at lr 1e-2) on the deeper model.
    # RL step size: routing volatility after the first update from the SFT start grows about
    # linearly with the learning rate (seed 0: 0.016 at 1e-3, the demo's; 0.044 at 3e-3;
    # 0.124 at 1e-2; the demo's model moves 0.008 at 1e-3), and with depth (layer 0 0.013
    # to layer 3 0.022 at 1e-3). 5e-3 puts it in the GSPO paper's regime (>= 5%,
    # benchmarks/HISTORY.md "2026-12-02: a volatile-routing testbed").
    c.optim.lr = 5e-3
    # Held-out evaluation on 256 prompts (the demo's 512 double the evaluation time).
    c.eval.num_prompts = 256
    c.eval.batch_size = 256
    return base.finalize(c, arg)
