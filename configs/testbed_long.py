"""The length-variety task of `experiments/reproduce.py` (claim 3: VC-PPO's value
pretraining and decoupled lambda, VAPO's length-adaptive lambda), on the testbed's MoE
(`configs/testbed.py`): sums and differences of 2 to 24 operands of 1-2 digits, worked
left to right one binary step at a time (`12+7=19,19-40=-21,...`), so that correct
responses range from ~20 to ~300 tokens. VAPO's lambda_policy = 1 - 1 / (alpha |y|)
(alpha 0.05) then spans 0 (under 20 tokens) to ~0.93, and a critic's bias has long
responses to act on.

    python -m experiments.reproduce --claim vc_ppo --seeds 0,1,2

trains (once, cached under runs/testbed_long/sft) the SFT start of the
`testbed_long` setting (`configs/ablations.py`).
"""

from configs import base, testbed


def get_config(arg=None):
    c = testbed.get_config()
    c.unlock()
    c.task.operators = "+-"
    c.task.num_operands = 2
    c.task.max_operands = 24
    c.task.min_digits = 1
    c.task.max_digits = 2
    # "+-" has no precedence to forget: the wrong procedure would be the right one.
    c.task.wrong_procedure_fraction = 0.0
    # Prompts: BOS + up to 24 operands of 2 digits, 23 operators and "=" (<= 72 tokens).
    c.batch.prompt_buckets = (32, 80)
    # Responses: the longest worked solution (24 operands) is <= ~300 tokens with EOS.
    c.sampling.max_new_tokens = 320
    c.batch.response_buckets = (64, 160, 320)
    return base.finalize(c, arg)
