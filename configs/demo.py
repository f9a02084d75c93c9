"""The main job's recipe (`make demo`): SFT cold start of the tiny MoE on synthetic
addition where 60% of the worked solutions forget to carry, then SAPO.

The SFT policy learns both procedures; its greedy answer follows the majority (wrong)
one, while correct answers stay within what it samples, so only a verifiable reward can
fix it: RL lifts greedy pass@1 while the same budget of further SFT does not.

    python -m experiments.sft   --config configs/demo.py --workdir runs/demo/sft
    python -m experiments.train --config configs/demo.py \
        --config.init_checkpoint=runs/demo/sft/checkpoints --workdir runs/demo/rl
"""

from configs import base


def get_config(arg=None):
    c = base.base_config()
    c.model.preset = "tiny_moe"
    # Addition of two 3-digit numbers; 60% of SFT solutions add without carrying.
    c.task.wrong_procedure_fraction = 0.6
    c.task.num_train = 20_000
    c.task.num_test = 512
    # SFT cold start.
    # 800 steps at lr 1e-2 give greedy pass@1 ~0.49 (first run: 0.49 -> 0.81 after 40 SAPO
    # iterations; lr 3e-3 for 600 steps left the policy at 0.10, too weak to sample from).
    c.sft.steps = 800
    c.sft.batch_size = 64
    c.sft.lr = 1e-2
    c.sft.warmup_steps = 20
    # SAPO (2511.20347): soft gate, tau_pos 1.0 / tau_neg 1.05, sequence-mean token-mean.
    c.algo.method = "sapo"
    c.algo.tau_pos = 1.0
    c.algo.tau_neg = 1.05
    c.algo.aggregation = "seq_mean_token_mean"
    # Rollouts: responses are at most 17 tokens (trace, answer, EOS).
    c.sampling.max_new_tokens = 20
    c.batch.response_buckets = (20,)
    c.batch.prompt_buckets = (16,)
    c.batch.n_prompts = 16
    c.batch.group_size = 8
    # One update per batch (base n_minibatches = 1): the ratio is 1 at every update, so
    # SAPO's gate is 1 and the update is the group-baseline policy gradient; the gate and
    # its temperatures act from the second update on a batch (configs/ablations.py).
    c.optim.lr = 1e-3
    c.optim.weight_decay = 0.0
    c.train.num_iterations = 40
    c.train.eval_every = 0
    c.train.checkpoint_every = 1000
    c.train.routing_metrics = False
    c.train.loggers = "jsonl,tensorboard"  # run directories hold TensorBoard events (docs/runs.md)
    c.eval.num_prompts = 512
    c.eval.batch_size = 512
    return base.finalize(c, arg)
