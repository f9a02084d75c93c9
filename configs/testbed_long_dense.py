"""The long task's dense control (`configs/claims.py` "routing_dense_control"): the long
task (`configs/testbed_long.py`) on a dense policy of the testbed MoE's depth and width
(4 layers, D = 64, one SwiGLU MLP of 128 per layer where the MoE has 32 experts of 16,
top-4), so that nothing routes. Its SFT starts are trained as the long task's
(`experiments/reproduce.py` caches them under runs/testbed_long_dense/sft_start<K>)."""

from configs import base, testbed_long


def get_config(arg=None):
    c = testbed_long.get_config()
    c.unlock()
    c.model.preset = "tiny_dense"
    c.model.num_layers = 4
    return base.finalize(c, arg)
