"""The routing claim's dense control (`configs/claims.py` "routing_dense_control"): the
testbed (`configs/testbed.py`) with a dense policy of the same depth and width (4 layers,
D = 64, one SwiGLU MLP of 128 per layer where the MoE has 32 experts of 16, top-4), so
that nothing routes. Its SFT start is trained as the testbed's (`experiments/reproduce.py`
caches it under runs/testbed_dense/sft)."""

from configs import base, testbed


def get_config(arg=None):
    c = testbed.get_config()
    c.unlock()
    c.model.preset = "tiny_dense"
    c.model.num_layers = 4
    return base.finalize(c, arg)
