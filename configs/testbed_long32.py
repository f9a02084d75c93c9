"""`configs/testbed_long.py` with twice the chain: remainders by 1 to 32 repeated
subtractions, so that correct responses range from ~11 to ~403 tokens (the testbed_long
task stops at ~195). It is the "several hundred tokens" setting of claim 3 (VC-PPO's
collapse of PPO on long responses, VAPO's length-adaptive lambda):

    python -m experiments.reproduce --claim vc_ppo --setting testbed_long32 --seeds 0

Its SFT start continues testbed_long's (``SFT_PARENT``: `experiments/reproduce.py`
trains that one first, or reuses its cache) for 300 updates on the longer task, to 1300
in all on a cosine over 1300, with testbed_long's half of solutions that stop one
subtraction early. Before that wrong procedure (benchmarks/HISTORY.md "2026-12-03: claim 3
on responses"): greedy pass@1 0.62 on the 32-step task, mean length 172, and no arm of
claim 3 improved on it; the start with it is not measured yet. Training it from a random
initialisation instead costs ~4.4 s per update on 2 cores, ~73 minutes for 1000; the
continuation 21 minutes (1231 s). An RL iteration costs about twice testbed_long's
(~20 s): claim 3's 4 arms took 646-707 s each at one seed (``--variant
train.num_iterations=20``, with the critic's 10 reward-model iterations and 5 of value
pretraining), 45 minutes in all, ~2.3 hours at 3 seeds: a probe, not a sweep.
"""

from configs import base, testbed_long

#: The setting whose cached SFT start this one's continues (`experiments/reproduce.py`
#: `ensure_sft`).
SFT_PARENT = "testbed_long"


def get_config(arg=None):
    c = testbed_long.get_config()
    c.unlock()
    c.task.max_steps = 32
    # Responses: 32 steps of `1682-99=1583,` are <= 403 tokens with EOS.
    c.sampling.max_new_tokens = 416
    c.batch.response_buckets = (128, 256, 416)
    # The parent's 1000 updates, then 300 more on this task; the cosine is redrawn over
    # 1300, so the continuation starts at ~2.2e-3 and ends at the parent's 1e-3.
    c.sft.steps = 1300
    return base.finalize(c, arg)
