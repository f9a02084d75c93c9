"""Reinforcement learning (and SFT) by role: the batch records (`batch`), the run and its
loop (`loop`), generation and scoring bookkeeping (`rollouts`), the jitted training steps
and the methods (`update`), what a run reports (`reporting`), SFT (`sft`); the map is in
docs/design.md, "Module map".

    from policyopt.rl.loop.trainer import run_rl
    from policyopt.rl.sft import run_sft
    from policyopt.rl.reporting.evaluate import evaluate
"""
