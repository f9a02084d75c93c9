"""The RL trainer: batch layout and dynamic sampling (`batch`), the jitted update and
forward steps (`learner`), the value model and GAE targets of PPO / VC-PPO / VAPO
(`critic`), routing metrics (`routing`), held-out evaluation (`evaluate`), SFT (`sft`)
and the loop (`trainer`).

    from policyopt.rl.trainer import run_rl
    from policyopt.rl.sft import run_sft
    from policyopt.rl.evaluate import evaluate
"""
