"""Shared defaults of every RL recipe (big_vision style: `get_config(arg)` -> ConfigDict).

A recipe (`configs/grpo.py`, `configs/sapo.py`, ...) starts from `base_config()`, sets
the fields its paper fixes (each value cited: paper and section, or marked as this
project's choice; docs/algorithms.md has them all), and calls `finalize(config,
arg)`, which applies the variant string and locks the config, so that a mistyped field,
from a recipe, a variant or the command line, is an error naming it.

Variant strings are comma-separated `key=value` pairs after the file name:

    --config configs/sapo.py:model=tiny_dense,algo.routing_replay=R2

`model=NAME` picks a model preset (`policyopt.models.presets`); `scale=paper` switches to
a real-size model and the settings the paper fixes (learning rate, batch geometry and
generation budget, as the paper states them; for accelerators); where the paper records
no generation budget (GSPO, SAPO, PPO, VC-PPO) the variant must name
`sampling.max_new_tokens`, and fields the paper leaves open keep the CPU defaults (check
`batch.*`); any other key is a
dotted field path, its value a Python literal (tuples in brackets:
`batch.response_buckets=(16,32)`). The command line then overrides single fields:
`--config.algo.tau_neg=1.1`.

Defaults are sized for the CPU: a tiny MoE, the synthetic addition task, 8 prompts x 8
samples, responses of at most 24 tokens.

This file is the one place of a run's defaults. The settings dataclasses the library builds
from a config (`rl.learner.LossConfig`, `OptimConfig`, `rl.critic.GAEConfig`,
`CriticConfig`, `rl.methods.CorrectionConfig`, `rl.async_rl.AsyncConfig`) have no defaults
of their own; the first four check their fields when they are built (`check` builds them),
`check` checks the sections of the others. Keyword defaults of library functions
(`losses.policy_loss`, `advantages.gae`, ...) and of the classes a run fills field by field
from the config (`sampling.SamplingConfig`, `engine.EngineConfig`, `rewards.RewardSpec`)
serve direct calls and are never read by a run for a field this file holds. The choices of
`algo.method` (any objective registered with `policyopt.losses.register_objective`),
`algo.aggregation` and the advantage estimators come from the library's modules.
"""

from __future__ import annotations

import ast
import json

import ml_collections
from ml_collections import config_dict

placeholder = config_dict.placeholder


def base_config() -> ml_collections.ConfigDict:
    """The shared defaults, every field commented. Recipes override what their paper fixes.

    A default that its comment does not attribute to a paper is this project's choice
    (sized for the CPU, or verl's default where the comment says so)."""
    c = ml_collections.ConfigDict()
    # Seed of parameter initialisation (when not starting from a checkpoint), of the
    # sampler's rng stream and of minibatch shuffling.
    c.seed = 0

    # ---- Policy model ----------------------------------------------------------------
    c.model = ml_collections.ConfigDict()
    # Preset name of `policyopt.models.presets.preset`: "tiny_moe", "tiny_dense" (CPU),
    # "moe_7m", "moe_0p5b", "qwen3_30b_a3b" (accelerators).
    c.model.preset = "tiny_moe"
    # Folder of a HuggingFace Qwen3 / Qwen3-MoE checkpoint to start from instead of a
    # preset (then the tokenizer is read from the same folder). None: preset.
    c.model.pretrained = placeholder(str)
    # Tokenizer of a preset: a tokenizer.json (`python -m experiments.tokenizer` trains one
    # on the task's files) or a folder holding one; the preset's vocabulary becomes the
    # tokenizer's size. None: the character tokenizer of the synthetic task.
    c.model.tokenizer = placeholder(str)
    # Overrides of single preset fields; None keeps the preset's value.
    c.model.num_layers = placeholder(int)
    c.model.hidden_size = placeholder(int)
    c.model.num_experts = placeholder(int)
    c.model.num_experts_per_tok = placeholder(int)
    # Computation dtype ("float32", "bfloat16"); parameters stay in param_dtype.
    c.model.dtype = placeholder(str)
    c.model.param_dtype = placeholder(str)
    # MoE dispatch: "ragged", "blocked", "dense" or "gathered" (dropless; dense: every
    # token through every expert, gathered: each expert's own tokens in a small buffer,
    # both for decoding small models), or "capacity" (drops tokens by batch
    # position; SFT and benchmarks only: the RL trainer refuses it).
    c.model.moe_dispatch = placeholder(str)
    # Dispatch of the sampler's decode steps (one token per row); None: the preset's
    # (tiny_moe: "dense", moe_7m: "gathered"; otherwise moe_dispatch). On a GPU:
    # moe_dispatch="blocked", moe_block_size=512, moe_decode_dispatch="ragged".
    c.model.moe_decode_dispatch = placeholder(str)
    # Rows per block of the "blocked" dispatch (CPU 16-64, GPU 256-512).
    c.model.moe_block_size = placeholder(int)
    # "auto", "take" or "onehot": how "blocked" hands the blocks their expert's weights.
    c.model.moe_weight_gather = placeholder(str)
    # Attention of the training and scoring forwards: "auto" (default: cuDNN flash
    # attention on GPUs, splash on TPUs, on CPUs the einsum below 1,024 tokens and
    # "blockwise" from there), "xla" (einsum: [B, H, T, T] float32 scores), "blockwise"
    # (online softmax over key blocks, memory linear in T, every backend), "cudnn"
    # (GPU, bf16/fp16) or "splash" (TPU). An implementation the backend lacks is an
    # error before anything compiles. None: "auto".
    c.model.attention = placeholder(str)
    # Query and key rows per block of "blockwise" (None: 512).
    c.model.attention_block_size = placeholder(int)
    # Stack each run of identical decoder layers and run it with a scan (True): compile
    # time stops growing with depth, and remat frees memory on XLA:CPU only this way.
    # For deep models and long sequences (qwen3_30b_a3b: True); the CPU presets keep
    # False (faster decoding). Changes the checkpoint layout: fixed for a run.
    c.model.scan_layers = placeholder(bool)
    # Rematerialisation of each decoder block: "none", "full" (keep each block's input
    # only) or "save_dots" (keep the projections' outputs, recompute attention). Turn it
    # on, with scan_layers, when activations do not fit (long sequences).
    c.model.remat = placeholder(str)

    # Expert parallelism (a mesh with expert > 1): "auto", "ragged_all_to_all" or
    # "all_to_all" (how tokens travel to their experts' devices), and the receive buffer
    # in units of the mean load (a larger load takes more passes; no drops).
    c.model.moe_ep_transport = placeholder(str)
    c.model.moe_ep_buffer_factor = placeholder(float)

    # Orbax checkpoint directory of the base policy (e.g. the SFT run's `checkpoints/`);
    # None: random initialisation from `seed`.
    c.init_checkpoint = placeholder(str)

    # ---- Task -----------------------------------------------------------------------
    c.task = ml_collections.ConfigDict()
    # "arithmetic" (the synthetic task of `policyopt.data.synthetic`), "math_jsonl"
    # (local GSM8K / MATH style JSONL files, `policyopt.data.jsonl`) or "code_jsonl"
    # (local code problems with tests, MBPP / HumanEval / APPS style, scored by running
    # the response's first Python block against them in the sandbox of
    # `policyopt.rewards.code`; the format gate then asks for a fenced block) or
    # "mixed_jsonl" (both in the same files, Magistral's mixture: a row with one of
    # `tests_fields` is code, any other math; each sample is checked by its own task's
    # verifier). The file tasks need a tokenizer for their text: `model.tokenizer` (one
    # trained on the files, docs/quickstart.md) or a pretrained model's, `model.pretrained`.
    c.task.name = "arithmetic"
    # Difficulty knobs of `ArithmeticConfig` (task "arithmetic").
    c.task.num_operands = 2
    # None, or the most operands: each problem draws its number in [num_operands,
    # max_operands] (responses of varied length; configs/testbed_long.py).
    c.task.max_operands = placeholder(int)
    c.task.min_digits = 3
    c.task.max_digits = 3
    # A subset of "+-*", or "mod": remainders by repeated subtraction (`152mod9=`, one
    # step per subtraction), whose quotient is uniform in [min_steps, max_steps].
    c.task.operators = "+"
    c.task.min_steps = 1
    c.task.max_steps = 16
    # Share of SFT solutions that follow the wrong procedure (forgotten carry); the RL
    # prompts and the held-out split only use the prompt and the reference answer.
    c.task.wrong_procedure_fraction = 0.0
    # Number of training prompts generated (the RL loop cycles through them, reshuffled
    # each epoch) and of held-out prompts used for evaluation.
    c.task.num_train = 20_000
    c.task.num_test = 512
    # Seed of the task generator (independent of `seed`).
    c.task.seed = 0
    # Task "math_jsonl": one file per split, every row used (`JsonlConfig`).
    # - The problem is the first of `question_fields` present; a list of chat messages
    #   gives its last user message. Dotted names reach into nested objects
    #   ("reward_model.ground_truth"), in every field list.
    # - The reference is extracted from the first of `answer_fields` present, per
    #   `extract`: "auto" (last \boxed{}, else the text after `answer_marker`, else the
    #   whole field), "boxed", "marker" or "none".
    # - The SFT target is `solution_field` (None: "solution", else "answer").
    # - The prompt is `prompt_template` with `{question}` (a Python format string: write
    #   literal braces twice, `\\boxed{{}}`); the tokenizer's chat template goes on top.
    # - Malformed rows raise with file:line unless `skip_malformed`.
    c.task.train_file = placeholder(str)
    c.task.test_file = placeholder(str)
    c.task.question_fields = "question,problem,prompt"
    c.task.answer_fields = "answer,solution"
    c.task.solution_field = placeholder(str)
    c.task.extract = "auto"
    c.task.answer_marker = "####"
    c.task.prompt_template = "{question}"
    c.task.skip_malformed = False
    # Task "code_jsonl": the same fields, except that the tests come from the first of
    # `tests_fields` present, in any encoding `policyopt.rewards.parse_tests` reads
    # (asserts, MBPP's list of asserts, HumanEval's check() with the row's `entry_point`,
    # stdin / stdout cases, APPS / CodeContests parallel lists, or JSON text of these; an
    # empty field gives way to the next). Call-based tests (APPS's fn_name) make a row
    # malformed (see `skip_malformed`). The SFT target is `solution_field` (None:
    # "solution", else "code"), put in a ```python fence when it has none.
    c.task.tests_fields = "tests,test_list,test,input_output,public_tests"
    # Task "mixed_jsonl": a field naming each row's task, for files whose math answers and
    # code tests share a field (verl-style rows: "ability", with "math" / "coding"
    # values); None: a row is code when one of `tests_fields` holds something.
    c.task.task_field = placeholder(str)
    # The prompt of code rows ("code_jsonl", the code rows of "mixed_jsonl", which then
    # need not share the math rows' template); None: `prompt_template`.
    c.task.code_prompt_template = placeholder(str)
    # Prompts longer than the largest `batch.prompt_buckets` (chat template included;
    # every prompt is tokenised once when the run is built): "error" (raise, naming the
    # record), "drop", "truncate_left" or "truncate_right" (keep the text's end / start).
    # Held-out prompts over the limit raise with "error", else are left out of the
    # evaluation (a truncated problem is not the problem).
    c.task.overlong_prompt = "error"
    # A directory to write either task to as tfds array_record files
    # (`policyopt.data.tfds_builders`, prepared once, named by content) and read it back
    # by random access instead of holding it in memory; None: in memory.
    c.task.tfds_dir = placeholder(str)

    # ---- Batch geometry ---------------------------------------------------------------
    c.batch = ml_collections.ConfigDict()
    # Prompts per RL batch (after dynamic sampling, if on).
    c.batch.n_prompts = 8
    # G: samples per prompt (a group).
    c.batch.group_size = 8
    # Minibatches per batch: n_prompts * group_size / n_minibatches sequences per
    # update (Magistral's n_batch / n_minibatch). Groups are never split.
    c.batch.n_minibatches = 1
    # Passes over the batch (PPO epochs).
    c.batch.epochs = 1
    # Prompt lengths are padded up to the smallest bucket that holds them, response
    # lengths (longest valid response of the batch) likewise, so each jitted step compiles
    # at most len(prompt_buckets) * len(response_buckets) times. The largest response
    # bucket must be >= sampling.max_new_tokens.
    c.batch.prompt_buckets = (16, 32, 64, 128, 256, 512, 1024, 2048)
    c.batch.response_buckets = (
        8,
        16,
        24,
        32,
        64,
        128,
        256,
        512,
        1024,
        2048,
        4096,
        8192,
        16384,
        20480,
    )
    # Sequence packing of the training forwards (old / reference log-probs, critic values,
    # updates): the real tokens of each minibatch's rows (prompt + response) placed one
    # after another in rows of `pack_tokens` slots, first-fit decreasing, attention within
    # each sequence only (policyopt.rl.packing). The losses are unchanged: the per-token
    # results return to the padded rows before them. Logged: batch/padding_fraction
    # (padded layout) and batch/packed_padding_fraction.
    c.batch.pack = False
    # Slots per packed row, >= the longest row's real tokens; None: the batch's padded
    # width (prompt bucket + response bucket), so packing never adds rows.
    c.batch.pack_tokens = None
    # Gradient accumulation: each minibatch's update runs as micro-batches of at most this
    # many tokens (rows x padded row length, over the whole mesh), their gradients summed
    # in float32 inside the jitted step, then one optimiser step. The result is the
    # minibatch's (its denominators; `policyopt.rl.micro_batches`), the memory one
    # micro-batch's. At least the longest row, max(prompt_buckets) + max_new_tokens.
    # With algo.load_balancing_coef > 0 and no routing replay, one more forward pass per
    # update counts the minibatch's expert loads first. None or 0: one pass.
    c.batch.micro_batch_tokens = placeholder(int)

    # ---- Sampling -----------------------------------------------------------------------
    c.sampling = ml_collections.ConfigDict()
    # N: most tokens generated per response.
    c.sampling.max_new_tokens = 24
    # Rollout temperature (DAPO, GSPO, Magistral use 1.0). The trainer's log-probs use the
    # same temperature so that ratios compare like with like.
    c.sampling.temperature = 1.0
    # Truncation (0 / 1.0 = off). With truncation, old log-probs come from the trainer's
    # untruncated forward and the ratio is biased (see `policyopt.sampling`).
    c.sampling.top_k = 0
    c.sampling.top_p = 1.0
    # Decode loops over growing KV caches (`SamplingConfig.decode_segments`): loop k of K
    # attends over P + (k+1) N/K slots instead of P + N. The same tokens up to float
    # rounding; each loop is one more compiled body. CPU, a 7M dense model, 16 prompts of
    # 32 + 512 tokens: K = 4 -17%, K = 8 -22% per call (benchmarks/HISTORY.md, 2026-11-30); 1 for
    # short responses like the demo's. Synchronous generation only (the async generator keeps
    # its own windowed cache).
    c.sampling.decode_segments = 1
    # Continuous batching (`policyopt.engine`) on a paged KV cache instead of one
    # `generate_fn` call over all B x G rows: the pool's KV token slots (the memory budget,
    # shared by all rows; 0 = off), the rows decoded together (a multiple of
    # batch.group_size; 0 = all B x G), and the token slots per page. Greedy tokens are
    # generate's; sampled ones follow per-row keys (another draw of the same distribution).
    # Both trainers (the async generator's rows are async_mode.num_slots, engine_rows
    # unused; its pool must hold one group of P + N tokens alone); on a mesh one engine
    # shard per device along the row axes (the budget and rows are per shard); records the
    # routing for R3. The budget must admit one group of the longest prompt (its pages, a
    # copy of its partly filled last page per other row, a page per row) and take one row
    # to max_new_tokens: checked here, the error names the smallest budget that works.
    c.sampling.engine_kv_tokens = 0
    c.sampling.engine_rows = 0
    c.sampling.engine_page_size = 16

    # ---- Algorithm ------------------------------------------------------------------------
    c.algo = ml_collections.ConfigDict()
    # Policy objective of `policyopt.losses.policy_loss`: "ppo", "gspo", "gspo_token", "sapo".
    c.algo.method = "ppo"
    # Clip range of "ppo" / "gspo": ratio clipped to [1 - clip_low, 1 + clip_high].
    c.algo.clip_low = 0.2
    c.algo.clip_high = 0.2
    # Dual clip ratio c for A < 0 (None = off; 3.0 in common use).
    c.algo.dual_clip = placeholder(float)
    # SAPO temperatures of the soft gate for A > 0 and A <= 0.
    c.algo.tau_pos = 1.0
    c.algo.tau_neg = 1.05
    # Aggregation: "token_mean" (over the minibatch's tokens: verl's token-mean),
    # "group_token_mean" (per group, then mean over groups: the form of the DAPO, Magistral
    # and VAPO papers), "seq_mean_token_mean",
    # "seq_mean_token_sum", "seq_mean_token_sum_norm" (see policyopt.losses.aggregate).
    c.algo.aggregation = "seq_mean_token_mean"
    # Constant divisor of "seq_mean_token_sum_norm" (Dr. GRPO); None = max_new_tokens.
    c.algo.max_len = placeholder(int)
    # Advantage estimator: "outcome" (critic-free: one advantage per sequence from the
    # rewards of its group, adv_center / adv_scale below) or "gae" (PPO, VC-PPO, VAPO: a
    # critic, `config.critic`, and per-token GAE advantages, the gae_* fields below).
    c.algo.advantage = "outcome"
    # Advantage centring: "group" (subtract the group mean) or "none".
    c.algo.adv_center = "group"
    # Advantage scaling: "group" (GRPO: group std), "batch" (std over the batch),
    # "minibatch" (Magistral: (A - mean_mb) / std_mb over each minibatch), "none" (Dr. GRPO).
    c.algo.adv_scale = "group"
    # Epsilon added to the std (verl's 1e-6; the papers state none).
    c.algo.adv_eps = 1e-6
    # GAE (algo.advantage = "gae"; docs/algorithms.md "GAE"). The outcome reward sits on
    # the last valid response token, 0 elsewhere. Discount gamma (1.0 for LLMs).
    c.algo.gae_gamma = 1.0
    # lambda of the policy advantages (classic PPO 0.95; VC-PPO lambda_actor 0.95).
    c.algo.gae_lambda = 0.95
    # lambda of the value targets A^lambda + V. None: gae_lambda (classic PPO, one lambda
    # for both, so overriding gae_lambda moves both); VC-PPO and VAPO: 1.0, Monte-Carlo
    # returns.
    c.algo.gae_lambda_critic = placeholder(float)
    # VAPO's length-adaptive policy lambda 1 - 1/(gae_alpha * |y|) per sequence instead of
    # gae_lambda (clamped at 0 when gae_alpha * |y| <= 1: `advantages.length_adaptive_lambda`).
    c.algo.gae_length_adaptive = False
    c.algo.gae_alpha = 0.05
    # Whiten the GAE advantages over the valid tokens of the batch ((A - mean) / std), as
    # verl and OpenRLHF do for PPO (the papers do not say). Outcome advantages: unused.
    c.algo.adv_whiten = True
    # VAPO's NLL on correct samples: loss += nll_coef * L_NLL over the tokens of the
    # minibatch's correct responses (mu = 0.1; 0 = off). Any advantage estimator.
    c.algo.nll_coef = 0.0
    # KL to the frozen initial policy, in the loss (GRPO: beta = 0.04, k3). 0 = off, and
    # then no reference forward pass is run.
    c.algo.kl_beta = 0.0
    c.algo.kl_estimator = "k3"
    # verl's clamp of k3 (log-ratio to +-20, k3 to <= 10: `losses.kl_penalty`); off: the
    # paper's k3 (GRPO eq. 4). This project's choice: off, as the clamp zeroes the KL's
    # gradient on exactly the tokens furthest from the reference (k3 > 10), and a
    # non-finite loss already skips the update (`learner.guarded_update`).
    c.algo.kl_clamp = False
    # Routing replay for MoE policies: "none", "R2" (replay the old-log-prob forward's
    # routing in every update forward), "R3" (replay the sampler's routing in the
    # old-log-prob forward and in every update forward).
    c.algo.routing_replay = "none"
    # Truncated importance sampling cap C: per-token weight min(exp(old - behaviour), C)
    # between trainer and sampler log-probs (None = off; 2.0 is a common choice; needs
    # old_log_probs = "trainer", with "sampler" the weight would always be 1).
    c.algo.tis_cap = placeholder(float)
    # Its level: "token" (min(rho_t, C)) or "sequence" (min(prod_t rho_t, C), one weight
    # per sequence: unbiased up to the cap, more variance; caps of 2-10 are usual).
    c.algo.tis_level = "token"
    # Rollout rejection sampling between sampler and trainer (Liu, Li et al. 2025, "When
    # Speed Kills Stability"; verl's rollout_rs): tokens or sequences whose ratio
    # rho = pi_old / mu lies outside [rs_lower, rs_upper] leave the policy loss (and its
    # denominators; the critic still trains on them). Level None (off), "token" (rho_t),
    # "sequence" (prod_t rho_t) or "geometric" (exp(mean_t log rho_t): tight bounds,
    # e.g. rs_upper = 1.001). rs_lower None: 1 / rs_upper. Needs old_log_probs = "trainer".
    c.algo.rs_level = placeholder(str)
    c.algo.rs_upper = placeholder(float)
    c.algo.rs_lower = placeholder(float)
    # Veto: also reject every sequence holding a token with rho_t < rs_veto (1e-4 is
    # usual; None = off), with or without rs_level.
    c.algo.rs_veto = placeholder(float)
    # Where pi_old comes from: "trainer" (a forward pass of the policy before the updates,
    # as verl and OpenRLHF do) or "sampler" (the rollout's untruncated log-probs; saves a
    # forward pass, valid when sampler and trainer agree numerically).
    c.algo.old_log_probs = "trainer"
    # Coefficient of the MoE load-balancing auxiliary loss in the update (0 = off); the
    # critic's update (algo.advantage = "gae", MoE backbone) adds its own with the same one.
    # The loss is E * sum_e f_e P_e with f_e the fraction of the k * N routing slots that go
    # to expert e, per layer, averaged over layers: 1 at perfect balance. HuggingFace's
    # Qwen3-MoE counts f_e over the N tokens (k at balance) and averages f and P over
    # layers first: its router_aux_loss_coef c (0.001 in the released configs) is about
    # load_balancing_coef = c * k here.
    c.algo.load_balancing_coef = 0.0
    # Coefficient of the router z-loss (ST-MoE, 2202.08906: mean squared logsumexp of the
    # router logits; reported as moe/router_z_loss) in the policy update (0 = off).
    c.algo.router_z_coef = 0.0
    # Entropy bonus coefficient (0 = off; none of the recipes use one).
    c.algo.entropy_coef = 0.0

    # ---- Critic (algo.advantage = "gae") ---------------------------------------------------
    c.critic = ml_collections.ConfigDict()
    # The value model is the policy's backbone with a scalar head (zero-initialised),
    # started from the policy's initial parameters (`policyopt.rl.critic`). Its AdamW
    # uses these, with betas, eps and gradient clipping shared with `optim`.
    c.critic.lr = 1e-5
    c.critic.warmup_steps = 0
    c.critic.weight_decay = 0.0
    # PPO value clip: 0.5 max((V - R)^2, (clip(V, V_old +- value_clip) - R)^2); None = off.
    c.critic.value_clip = 0.2
    # Value pretraining / warm-up: the first N iterations update only the critic, on
    # Monte-Carlo returns (lambda_critic = 1 whatever algo.gae_lambda_critic) (the policy is
    # frozen and samples as the initial policy; VC-PPO value pretraining, VAPO: 50 steps).
    # 0 = off. They count in `train.num_iterations` (VAPO's `scale=paper`, 100 iterations
    # with 50 of warm-up, makes 50 policy iterations); `experiments/ablate.py` adds them
    # on top, so that its arms with and without pretraining make as many policy updates.
    c.critic.pretrain_iterations = 0
    # A critic initialised from an outcome reward model (the RLHF practice VC-PPO and VAPO
    # name as the source of the value initialisation bias): the first N iterations, before
    # any value pretraining, train the critic on the SFT policy's rollouts as a reward
    # model: its value at the last response token only, fitted to the outcome reward
    # (`policyopt.rl.critic`, "Reward-model initialisation"). 0 = off: the critic starts
    # from the policy's parameters with a zero value head. They count in
    # `train.num_iterations` and `experiments/ablate.py` adds them on top, as above.
    c.critic.reward_model_iterations = 0

    # ---- Dynamic sampling (DAPO) ---------------------------------------------------------
    c.dynamic_sampling = ml_collections.ConfigDict()
    # Drop groups whose rewards all agree and sample more prompts until the batch is full.
    c.dynamic_sampling.enabled = False
    # Most sampling rounds (of n_prompts prompts each) per batch; if the batch is still
    # not full, the remaining slots keep zero-variance groups (zero advantage) and the
    # shortfall is reported in the metrics.
    c.dynamic_sampling.max_rounds = 4
    # Which groups are dropped: "reward" (all G rewards equal: zero advantage; Magistral)
    # or "accuracy" (all correct or all wrong: DAPO eq. 11, whose reward also carries the
    # overlong penalty).
    c.dynamic_sampling.criterion = "reward"

    # ---- Reward (`policyopt.rewards.RewardSpec`) ------------------------------------------
    c.reward = ml_collections.ConfigDict()
    # Magistral's format reward: format failure 0, format ok `format_value`, correct +
    # `correct_value`. Off: 1.0 for a correct answer, else 0.
    c.reward.format = False
    c.reward.format_value = 0.1
    c.reward.correct_value = 0.9
    # Without the format gate: reward of an incorrect response (correct is 1). 0: this
    # project's choice; DAPO (2503.14476 §2.4), VC-PPO and VAPO use -1.
    c.reward.incorrect_value = 0.0
    # Length shaping: "none", "dapo" (overlong penalty), "magistral" (-0.1 scale).
    c.reward.overlong = "none"
    # L_max and L_cache of the length shaping (None: max_new_tokens and a quarter of it;
    # the quarter is this project's choice: DAPO's 4096 of 20480 is a fifth; this project
    # records no Magistral value).
    c.reward.max_len = placeholder(int)
    c.reward.cache_len = placeholder(int)
    # DAPO's overlong filtering: responses cut at max_new_tokens are masked out of the loss.
    c.reward.overlong_filter = False
    # Added to the reward of a graded response whose problem, reasoning and answer languages
    # agree: 0 (off); Magistral (2506.10910 §2.2) adds 0.1.
    c.reward.language_bonus = 0.0
    # Worker processes for scoring (0 = in-process; the synthetic task is fast).
    c.reward.num_workers = 0
    # Your own correctness function in place of the math verifier, for rewards and for
    # the evaluation's pass@1: "package.module:function", called as
    # function(completion, reference) -> c in [0, 1] (`RewardSpec.verifier`); None: the
    # task's (math, or code for "code_jsonl" and the code rows of "mixed_jsonl", whose
    # reference is then the tests as JSON text, read by `policyopt.rewards.parse_tests`).
    c.reward.verifier = placeholder(str)
    # Its per-sample time limit, in seconds.
    c.reward.verifier_timeout_s = 5.0
    # Code problems ("code_jsonl", code rows of "mixed_jsonl"): per-test limits of the
    # sandbox (Magistral: 4 s, 300 MB) and partial credit (the pass rate; Magistral found
    # all-or-nothing better).
    c.reward.code_timeout_s = 4.0
    c.reward.code_memory_mb = 300
    # Size (MB) of each test process's working directory, /tmp and /dev/shm: tmpfs where
    # the sandbox has a root of its own (memory, on top of code_memory_mb), else the
    # working directory on disk, watched and killed past it (docs/rewards.md, "The sandbox").
    c.reward.code_disk_mb = 64
    c.reward.code_partial = False
    # Run only a problem's first N tests in the training reward (Magistral: 20; stdin /
    # stdout cases or top-level asserts); None: all of them. The evaluation runs all.
    c.reward.code_max_tests = placeholder(int)
    # Where assert tests run: "process", in a process of their own that sees only plain
    # values from the program's (an object equal to everything, a redefined built-in or
    # a program that finds the harness's marker cannot pass them), or "none", after the
    # program in its process (one interpreter per test instead of two). The module
    # docstring of policyopt/rewards/isolation.py lists what "process" changes.
    c.reward.code_isolation = "process"
    # Where the math answer is: "boxed" (the last \boxed{}), "answer_line" (the last
    # "Answer: ..." line, as DAPO-Math-17k's prompts ask) or "gsm8k" (the text after the
    # last "####", the form of GSM8K's solutions, so that SFT on them and the RL reward
    # agree); for the verifier, the format gate and the evaluation (with `verifier` set,
    # for the format gate only).
    c.reward.answer_format = "boxed"
    # Wall-clock budget (s) for scoring one round of samples (synchronous) or one group
    # (async); None: none. Samples not scored by then are left out of the loss and of
    # their group's statistics (mean, std, dynamic sampling's test; advantage 0), and are
    # counted in `reward/deadline_missed` (`score_batch`'s deadline_s).
    c.reward.deadline_s = placeholder(float)

    # ---- Optimiser (optax AdamW, warm-up then constant, global-norm clipping) --------------
    c.optim = ml_collections.ConfigDict()
    c.optim.lr = 1e-6
    # Linear warm-up from 0 over this many updates, then constant.
    c.optim.warmup_steps = 0
    c.optim.b1 = 0.9
    c.optim.b2 = 0.999
    c.optim.eps = 1e-8
    c.optim.weight_decay = 0.01  # verl's default
    # Global gradient-norm clipping threshold (verl's default 1.0).
    c.optim.max_grad_norm = 1.0
    # The MoE routers' learning rate as a multiple of optim.lr (1.0: the same). A lever on
    # routing volatility: the routers move faster than the rest of the policy, so that
    # routing causes more of the ratio's noise (docs/claims.md, "routing_share"). The
    # policy's optimiser only; SFT and the critic keep 1.0.
    c.optim.router_lr_scale = 1.0

    # ---- Loop -------------------------------------------------------------------------------
    c.train = ml_collections.ConfigDict()
    # RL iterations (batches).
    c.train.num_iterations = 100
    # Evaluate every K iterations (0 = only at the start and the end).
    c.train.eval_every = 25
    # Save a checkpoint every K iterations (and at the end).
    c.train.checkpoint_every = 25
    # Checkpoints kept.
    c.train.keep_checkpoints = 2
    # Console progress line every K iterations.
    c.train.log_every = 1
    # Where the metrics, the config, the sampled completions and the evaluations go,
    # comma-separated: "jsonl" (metrics.jsonl, always written), "tensorboard" (event files
    # in the run directory), "wandb" (Weights & Biases; WANDB_MODE=offline writes it to
    # the run directory) and "mlflow" (MLflow; a file store in the run directory unless
    # MLFLOW_TRACKING_URI); docs/runs.md. The last two are extras: pip install
    # 'policyopt[wandb]' / 'policyopt[mlflow]'.
    c.train.loggers = "jsonl,tensorboard"
    # Measure routing volatility (an extra router-only forward pass per iteration).
    c.train.routing_metrics = True
    # Resume from the workdir's checkpoint even if the config differs from the one it was
    # saved under (the changed fields are logged). By default a change other than the
    # loop's cadence, the evaluation and the mesh (`build.RESUME_FREE_FIELDS`) is refused.
    c.train.allow_config_change = False
    # Stop the run (with a one-line message) once this many policy or critic updates in a
    # row were skipped by the non-finite guard (loss, gradient, new parameters or optimiser
    # state not finite): such a run learns nothing more.
    c.train.max_skipped_updates = 10
    # At iteration 1 and every K iterations (K, 2K, ...; 0 = never), the completions of the
    # batch's first `sample_prompts` prompts (with rewards and verdicts) go to
    # samples.jsonl and TensorBoard text.
    c.train.sample_every = 10
    c.train.sample_prompts = 2
    # Warn after this many iterations in a row with no informative group (every group's
    # rewards equal: zero advantage, nothing to learn); 0 = never.
    c.train.zero_variance_patience = 5

    # ---- Asynchronous generation (`policyopt.rl.async_rl`; docs/algorithms.md) -------------
    # Magistral's mode, for any recipe: generators never wait for the trainer, finished
    # groups are scored at once, new weights reach the generators mid-generation.
    c.async_mode = ml_collections.ConfigDict()
    # Run `run_async_rl` instead of the synchronous `run_rl` (experiments/train.py).
    c.async_mode.enabled = False
    # n_async: most completions started and not yet taken by the trainer (in generation
    # or waiting); it bounds staleness. A multiple of batch.group_size.
    # None: 2 * n_batch, n_batch = n_prompts * group_size (Magistral: best with
    # n_async / n_batch <= 2, and n_batch = n_minibatch, i.e. one update per batch).
    c.async_mode.n_async = placeholder(int)
    # Generation rows (slots; the KV cache is [rows, P + N + segment_steps]); None: n_async.
    # A multiple of batch.group_size; set it below n_async when memory is short.
    c.async_mode.num_slots = placeholder(int)
    # Decode steps between two pick-ups of new weights by the generator (the push
    # granularity; a completion is decoded under at most
    # ceil(max_new_tokens / segment_steps) versions).
    c.async_mode.segment_steps = 8
    # Prompt width of the generator's slots; None: the prompt bucket of the longest
    # training prompt (every prompt fits). A longer prompt is an error naming this field.
    c.async_mode.prompt_width = placeholder(int)
    # Seconds to wait for the scoring thread to stop at the end or on an error (with
    # reward.num_workers > 0 its worker pool is killed at once; in-process scoring finishes
    # the group it is on, and after this long is left to finish in the background).
    c.async_mode.join_timeout_s = 60.0

    # ---- Device mesh (`policyopt.sharding`) -----------------------------------------------
    # One mesh over every device of every host, one field per axis of
    # `policyopt.sharding.MESH_AXES`: the sizes multiply to the device count, and at most
    # one of them is -1 (the devices the others leave). The default puts every device on
    # `data`, which on one CPU is a single device. Parameters and optimiser states are
    # sharded by their logical axes, batch rows split over data x fsdp (replicated when
    # the row count does not divide).
    c.mesh = ml_collections.ConfigDict()
    # Data parallelism: batch rows split, parameters replicated.
    c.mesh.data = -1
    # FSDP (ZeRO-3 style): batch rows split and parameters sharded along `embed`.
    c.mesh.fsdp = 1
    # Tensor parallelism: attention heads, MLP hidden units and the vocabulary split.
    c.mesh.tensor = 1
    # Expert parallelism: the MoE experts split.
    c.mesh.expert = 1

    # ---- Evaluation on the held-out split --------------------------------------------------
    c.eval = ml_collections.ConfigDict()
    # Held-out prompts evaluated (at most task.num_test).
    c.eval.num_prompts = 512
    # Prompts per sampler call.
    c.eval.batch_size = 256
    # mean@k: k samples per prompt at `temperature` (0 = skip, only greedy pass@1).
    c.eval.k = 0
    c.eval.temperature = 1.0

    # ---- SFT cold start (experiments/sft.py) -------------------------------------------------
    c.sft = ml_collections.ConfigDict()
    # Updates of next-token training on worked solutions.
    c.sft.steps = 300
    # Sequences per update.
    c.sft.batch_size = 64
    # Its AdamW (Adam's betas and eps shared with `optim`).
    c.sft.lr = 3e-3
    c.sft.warmup_steps = 20
    # After the warm-up: "constant", or "cosine" to lr * min_lr_ratio at update sft.steps
    # (a run extended past sft.steps, `experiments/sft.py --steps`, continues at that rate).
    c.sft.lr_decay = "constant"
    c.sft.min_lr_ratio = 0.0
    c.sft.weight_decay = 0.0
    c.sft.max_grad_norm = 1.0
    # Save a checkpoint every K updates (and at the end); 0: only at the end.
    c.sft.checkpoint_every = 500
    # Worked solutions longer than the largest of batch.prompt_buckets and
    # batch.response_buckets (the SFT batch's length buckets; EOS included):
    # "error" (raised when the data is built, naming the record), "drop", or "truncate"
    # (the first tokens are kept, EOS lost: the model learns not to stop).
    c.sft.overlong_response = "error"
    return c


def _parse_value(text: str):
    """`"3"` -> 3, `"1e-3"` -> 0.001, `"True"` -> True, anything else stays a string."""
    if text in ("true", "false"):
        text = text.capitalize()
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def unknown_field(config: ml_collections.ConfigDict, path: str) -> str | None:
    """The one-line error for a dotted field that ``config`` does not have, with the
    closest name (``unknown config field 'optimizer.lr': no section 'optimizer' (did you
    mean 'optim'?)``), or None when the field exists."""
    import difflib

    parts, node = path.split("."), config
    for i, part in enumerate(parts):
        is_section = i < len(parts) - 1
        if not isinstance(node, ml_collections.ConfigDict):
            return f"unknown config field {path!r}: {'.'.join(parts[:i])} is a field, not a section"
        if part in node and (not is_section or isinstance(node[part], ml_collections.ConfigDict)):
            node = node[part]
            continue
        names = [
            key
            for key in node.keys()
            if not is_section or isinstance(node[key], ml_collections.ConfigDict)
        ]
        close = difflib.get_close_matches(part, names, n=1)
        prefix = ".".join(parts[:i] + [""])
        if not is_section:
            hint = f" (did you mean {prefix + close[0]!r}?)" if close else ""
            return f"unknown config field {path!r}{hint}"
        hint = f"did you mean {prefix + close[0]!r}?" if close else "sections: " + ", ".join(names)
        return f"unknown config field {path!r}: no section {prefix + part!r} ({hint})"
    return None


def set_field(config: ml_collections.ConfigDict, path: str, value) -> None:
    """Sets a dotted field, raising a KeyError that names it (``unknown_field``) when it
    does not exist."""
    message = unknown_field(config, path)
    if message is not None:
        raise KeyError(message)
    *parents, name = path.split(".")
    node = config
    for part in parents:
        node = node[part]
    node[name] = value


def split_variant(arg: str) -> list[str]:
    """Splits a variant string at the commas outside brackets and quotes, so that a tuple,
    list or quoted value stays whole: `"a=1,b=(16, 32),c='x,y'"` -> `["a=1", "b=(16, 32)",
    "c='x,y'"]`. Unbalanced brackets or quotes are an error naming the string."""
    items, stack, quote, start = [], [], None, 0
    pairs = {")": "(", "]": "[", "}": "{"}
    for i, char in enumerate(arg):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "([{":
            stack.append(char)
        elif char in pairs:
            if not stack or stack.pop() != pairs[char]:
                raise ValueError(f"config variant {arg!r}: unbalanced {char!r} at position {i}")
        elif char == "," and not stack:
            items.append(arg[start:i])
            start = i + 1
    if stack or quote:
        raise ValueError(f"config variant {arg!r}: unclosed {(quote or stack[-1])!r}")
    items.append(arg[start:])
    return [item for item in items if item.strip()]


# Fields that `scale=paper` must set, from the recipe's paper or from the variant: the
# CPU default (24 tokens) silently changes the methods at scale (VAPO's length-adaptive
# lambda, Dr. GRPO's constant, overlong shaping).
PAPER_SCALE_REQUIRED = ("sampling.max_new_tokens",)

# What every recipe's `scale=paper` sets before its own paper values (this project's
# choices for 16k-40k-token responses on accelerators; the recipe or the variant may
# override them): bf16 matmuls, the decoder layers stacked and scanned with full
# rematerialisation (each layer keeps only its input for the backward: "save_dots" would
# keep every projection's output, ~2.5 GB per layer of Qwen3-8B at 32k tokens), and
# `model.attention="auto"`, which is cuDNN's flash attention on GPUs and splash on TPUs
# (blockwise on CPUs past 1,024 tokens). MoE presets train with the "blocked" dispatch in
# blocks of 4,096 token copies: XLA:GPU (and XLA:CPU) run "ragged" as a product over every
# expert (qwen3_30b_a3b's GSPO update at 32k tokens on 64 devices: 326 GiB per device),
# and small blocks multiply the per-block copies of the expert weights (blocks of 64:
# 248 GiB, 1,024: 71, 4,096: 67 at the time); decode steps, a few tokens per expert,
# keep "ragged" (blocks of 4,096 would pad each expert's tokens to a block). TPUs: set
# `model.moe_dispatch=megablox`. `benchmarks/scale_sim.py` measures the result.
PAPER_SCALE_MODEL = {
    "model.dtype": "bfloat16",
    "model.scan_layers": True,
    "model.remat": "full",
    "model.attention": "auto",
    "model.moe_dispatch": "blocked",
    "model.moe_block_size": 4096,
    "model.moe_decode_dispatch": "ragged",
}


def check_variant_fields(arg: str | None) -> None:
    """Raises a ValueError naming a field that the variant string `arg` sets twice
    (`model=NAME` sets `model.preset`): in a string a user types, the later value would
    silently win. `apply_variant` itself lets a later item override an earlier one, as
    composed variants need (`experiments/ablate.py`: an arm's, then the command line's)."""
    named = set()
    for item in split_variant(arg or ""):
        key = item.split("=", 1)[0].strip()
        field = "model.preset" if key == "model" else key
        if field in named:
            raise ValueError(
                f"config variant {arg!r}: {field} is given twice (name each field once)"
            )
        named.add(field)


def apply_variant(
    config: ml_collections.ConfigDict, arg: str | None, paper: dict | None = None
) -> ml_collections.ConfigDict:
    """Applies a variant string `key=value,key=value` (see the module docstring); a later
    item overrides an earlier one (`check_variant_fields` refuses that in a user's string).

    Args:
      config: the config to change in place.
      arg: the variant string.
      paper: dotted-field -> value overrides that `scale=paper` applies.
    """
    if not arg:
        return config
    named, paper_scale = set(), False
    for item in split_variant(arg):  # no empty items
        if "=" not in item:
            raise ValueError(f"config variant {item!r} is not key=value (in {arg!r})")
        key, text = (s.strip() for s in item.split("=", 1))
        named.add(key)
        if key == "model":
            config.model.preset = text
        elif key == "scale":
            if text != "paper":
                raise ValueError(f"scale={text!r}: only scale=paper is defined")
            if not paper:
                raise ValueError("this recipe defines no paper-scale variant")
            for path, value in {**PAPER_SCALE_MODEL, **paper}.items():
                set_field(config, path, value)
            paper_scale = True
        else:
            set_field(config, key, _parse_value(text))
    missing = [key for key in PAPER_SCALE_REQUIRED if key not in (paper or {}) and key not in named]
    if paper_scale and missing:
        raise ValueError(
            f"scale=paper: this recipe's paper records no value for {', '.join(missing)} "
            f"(docs/algorithms.md); keeping the CPU default would be wrong at scale, so name "
            f"it in the variant, e.g. scale=paper,{missing[0]}=16384"
        )
    return config


def finalize(
    config: ml_collections.ConfigDict, arg: str | None, paper: dict | None = None
) -> ml_collections.ConfigDict:
    """Applies the variant string, checks the config and locks it.

    Args:
      config: the recipe's config.
      arg: the variant string after `:` in `--config`.
      paper: dotted-field -> value overrides of the `scale=paper` variant.
    """
    config = apply_variant(config, arg, paper)
    check(config)
    config.lock()
    return config


# Fields with a fixed set of values that no library module owns. The library's own choices
# (the advantage estimators and rollout-correction levels) come from its modules
# (`_library_choices`), and the policy loss's (`algo.method`, the objectives registered
# with `policyopt.losses.register_objective`; `algo.aggregation`; `algo.kl_estimator`) are
# checked by `LossConfig` when `check` builds it, so a newly registered objective is
# accepted without editing this file.
_CHOICES = {
    "algo.routing_replay": ("none", "R2", "R3"),
    "algo.old_log_probs": ("trainer", "sampler"),
    "reward.overlong": ("none", "dapo", "magistral"),
    "reward.answer_format": ("boxed", "answer_line", "gsm8k"),
    "dynamic_sampling.criterion": ("reward", "accuracy"),
    "task.name": ("arithmetic", "math_jsonl", "code_jsonl", "mixed_jsonl"),
    "task.extract": ("auto", "boxed", "marker", "none"),
    "task.overlong_prompt": ("error", "drop", "truncate_left", "truncate_right"),
    "sft.overlong_response": ("error", "drop", "truncate"),
    "sft.lr_decay": ("constant", "cosine"),
    "reward.code_isolation": ("process", "none"),
}

# Integer fields and their least value (None: the field may also be None).
_MINIMUMS = {
    "train.num_iterations": 1,
    "train.eval_every": 0,
    "train.checkpoint_every": 1,
    "train.log_every": 1,
    "eval.num_prompts": 0,
    "eval.batch_size": 1,
    "eval.k": 0,
    "train.max_skipped_updates": 1,
    "sft.steps": 0,
    "sft.batch_size": 1,
    "sft.checkpoint_every": 0,
}


def check(config: ml_collections.ConfigDict) -> None:
    """Raises a ValueError naming the first field with an impossible value.

    The sections that the library holds in a settings dataclass are checked by building
    it, where its checks live (`LossConfig`: `algo`'s objective, aggregation, clip, KL and
    coefficients; `GAEConfig`: `algo.gae_*`; `CriticConfig`: `critic.value_clip`); the rest
    here. Imports the library (JAX) on first use: the configs themselves do not."""
    from policyopt import checks

    for path, choices in (_library_choices() | _CHOICES).items():
        checks.check_choice(f"config.{path}", _field(config, path), choices)
    for path, least in _MINIMUMS.items():
        section, name = path.split(".")
        value = config[section][name]
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"config.{path} must be an int >= {least}, got {value!r}")
    keep = config.train.keep_checkpoints
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(
            f"config.train.keep_checkpoints must be an int >= 1 (or None: keep "
            f"every checkpoint), got {keep!r}"
        )
    t = config.task
    if t.name in ("math_jsonl", "code_jsonl", "mixed_jsonl"):
        missing = [f"task.{split}_file" for split in ("train", "test") if not t[f"{split}_file"]]
        if missing:
            raise ValueError(f"config.{missing[0]} is required with task.name={t.name!r}")
        for name in ("prompt_template", "code_prompt_template"):
            template = t[name]
            if template is None:
                continue
            try:
                probe = template.format(question="\0")
            except (IndexError, KeyError, ValueError) as error:
                raise ValueError(
                    f"config.task.{name}={template!r} is not a format "
                    f"string with only {{question}} ({error!r}); write literal braces "
                    "twice, e.g. \\boxed{{}}"
                ) from None
            if "\0" not in probe:
                raise ValueError(
                    f"config.task.{name} must contain '{{question}}', got {template!r}"
                )
    _check_tokenizer_and_loggers(config)
    b = config.batch
    for name in ("prompt_buckets", "response_buckets"):
        buckets = b[name]
        if (
            not isinstance(buckets, (tuple, list))
            or not buckets
            or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in buckets)
        ):
            raise ValueError(
                f"config.batch.{name} must be a non-empty tuple of ints >= 1, got {buckets!r}"
            )
    if b.n_prompts < 1 or b.group_size < 1 or b.epochs < 1 or b.n_minibatches < 1:
        raise ValueError(
            "config.batch.n_prompts, group_size, epochs and n_minibatches must be >= 1"
        )
    if b.n_prompts % b.n_minibatches:
        raise ValueError(
            f"config.batch.n_minibatches ({b.n_minibatches}) must divide "
            f"n_prompts ({b.n_prompts}): minibatches hold whole groups"
        )
    if not isinstance(b.pack, bool):
        raise ValueError(f"config.batch.pack must be True or False, got {b.pack!r}")
    if b.pack_tokens is not None and (
        isinstance(b.pack_tokens, bool) or not isinstance(b.pack_tokens, int) or b.pack_tokens < 1
    ):
        raise ValueError(
            f"config.batch.pack_tokens must be an int >= 1 (or None: the padded "
            f"width), got {b.pack_tokens!r}"
        )
    if max(b.response_buckets) < config.sampling.max_new_tokens:
        raise ValueError(
            f"config.batch.response_buckets (max {max(b.response_buckets)}) must hold "
            f"sampling.max_new_tokens ({config.sampling.max_new_tokens})"
        )
    max_new = config.sampling.max_new_tokens
    micro = b.micro_batch_tokens
    if micro is not None and (isinstance(micro, bool) or not isinstance(micro, int) or micro < 0):
        raise ValueError(
            f"config.batch.micro_batch_tokens must be an int >= 0 (None or 0: off), got {micro!r}"
        )
    if micro and micro < max(b.prompt_buckets) + max_new:
        raise ValueError(
            f"config.batch.micro_batch_tokens ({micro}) is below the longest row, "
            f"{max(b.prompt_buckets) + max_new} tokens (the largest of "
            f"batch.prompt_buckets, {max(b.prompt_buckets)}, + "
            f"sampling.max_new_tokens, {max_new}): a micro-batch holds whole rows"
        )
    if micro and b.pack:
        raise ValueError(
            "config.batch.micro_batch_tokens and config.batch.pack cannot be used "
            "together yet: a packed minibatch is not split into micro-batches "
            "(turn one of them off)"
        )
    if not config.sampling.temperature > 0:
        raise ValueError(
            f"config.sampling.temperature must be > 0, got {config.sampling.temperature}: "
            "the trainer's log-probs are taken at the rollout temperature (greedy "
            "pass@1 is what the evaluation reports)"
        )
    if not 1 <= config.sampling.decode_segments <= max_new:
        raise ValueError(
            f"config.sampling.decode_segments must be in [1, max_new_tokens={max_new}], "
            f"got {config.sampling.decode_segments}"
        )
    s = config.sampling
    if s.engine_kv_tokens < 0 or s.engine_rows < 0 or s.engine_page_size < 1:
        raise ValueError(
            f"config.sampling.engine_kv_tokens ({s.engine_kv_tokens}) and "
            f"engine_rows ({s.engine_rows}) must be >= 0, engine_page_size "
            f"({s.engine_page_size}) >= 1"
        )
    if s.engine_kv_tokens > 0:
        if s.engine_rows % b.group_size:
            raise ValueError(
                f"config.sampling.engine_rows ({s.engine_rows}) must be a multiple "
                f"of batch.group_size ({b.group_size}): rows are refilled by group"
            )
        _check_engine_budget(config)
    r = config.reward
    module, colon, function = (r.verifier or "").partition(":")
    if r.verifier and not (module.strip() and colon and function.strip()):
        raise ValueError(
            f"config.reward.verifier must be 'package.module:function', got {r.verifier!r}"
        )
    for name in (
        "verifier_timeout_s",
        "deadline_s",
        "code_timeout_s",
        "code_memory_mb",
        "code_disk_mb",
        "code_max_tests",
    ):
        if r[name] is not None and r[name] <= 0:
            raise ValueError(f"config.reward.{name} must be > 0, got {r[name]}")
    if r.overlong != "none" and r.max_len is not None and r.max_len > max_new:
        raise ValueError(
            f"config.reward.max_len ({r.max_len}) must be <= sampling.max_new_tokens "
            f"({max_new}) with reward.overlong={r.overlong!r}: responses stop at "
            "max_new_tokens, so none would get the full overlong penalty"
        )
    _check_settings(config)
    algo = config.algo
    for name in ("pretrain_iterations", "reward_model_iterations"):
        if config.critic[name] < 0:
            raise ValueError(f"config.critic.{name} must be >= 0, got {config.critic[name]}")
        if algo.advantage == "outcome" and config.critic[name] > 0:
            raise ValueError(f"config.critic.{name} > 0 needs a critic: set algo.advantage='gae'")
    if algo.advantage == "gae" and algo.adv_scale == "minibatch":
        raise ValueError(
            "config.algo.adv_scale='minibatch' (Magistral) is an outcome-advantage "
            "option; with algo.advantage='gae' use algo.adv_whiten"
        )
    a, group = config.async_mode, b.group_size
    if a.n_async is not None and (a.n_async < group or a.n_async % group):
        raise ValueError(
            f"config.async_mode.n_async ({a.n_async}) must be a positive multiple of "
            f"batch.group_size ({group})"
        )
    if a.num_slots is not None and (a.num_slots < group or a.num_slots % group):
        raise ValueError(
            f"config.async_mode.num_slots ({a.num_slots}) must be a positive multiple "
            f"of batch.group_size ({group})"
        )
    if a.segment_steps < 1:
        raise ValueError(f"config.async_mode.segment_steps must be >= 1, got {a.segment_steps}")
    if a.prompt_width is not None and a.prompt_width < 1:
        raise ValueError(f"config.async_mode.prompt_width must be >= 1, got {a.prompt_width}")
    sizes = dict(config.mesh.items())
    for name, size in sizes.items():
        if isinstance(size, bool) or not isinstance(size, int) or (size < 1 and size != -1):
            raise ValueError(
                f"config.mesh.{name} must be a positive int, or -1 for the devices the "
                f"other axes leave, got {size!r}"
            )
    if list(sizes.values()).count(-1) > 1:
        axes = [name for name, size in sizes.items() if size == -1]
        raise ValueError(f"config.mesh: at most one axis may be -1, got -1 for {axes}")
    if config.algo.routing_replay in ("R2", "R3") and config.algo.old_log_probs == "sampler":
        raise ValueError(
            f"config.algo.routing_replay={config.algo.routing_replay!r} needs the "
            "trainer's old-log-prob forward (R2 records its routing, R3 replays the "
            "sampler's routing in it); set algo.old_log_probs='trainer'"
        )
    if config.algo.tis_cap is not None and config.algo.old_log_probs == "sampler":
        raise ValueError(
            "config.algo.tis_cap weighs tokens by min(exp(old - behaviour), C), which "
            "is 1 when pi_old is the sampler's log-probs (algo.old_log_probs="
            "'sampler'); use one correction: tis_cap with old_log_probs='trainer', "
            "or old_log_probs='sampler' alone"
        )
    if algo.tis_cap is not None and not algo.tis_cap > 0:
        raise ValueError(f"config.algo.tis_cap must be > 0, got {algo.tis_cap}")
    if algo.rs_level is not None or algo.rs_veto is not None:
        if algo.old_log_probs == "sampler":
            raise ValueError(
                "config.algo.rs_level / rs_veto reject tokens by rho = exp(old - "
                "behaviour), which is 1 when pi_old is the sampler's log-probs "
                "(algo.old_log_probs='sampler'); set algo.old_log_probs='trainer'"
            )
        if algo.rs_level is not None and (algo.rs_upper is None or not algo.rs_upper > 0):
            raise ValueError(
                f"config.algo.rs_level={algo.rs_level!r} needs algo.rs_upper > 0, "
                f"got {algo.rs_upper}"
            )
        lower = (
            algo.rs_lower
            if algo.rs_lower is not None
            else (1.0 / algo.rs_upper if algo.rs_level is not None else None)
        )
        if algo.rs_level is not None and not 0 < lower <= algo.rs_upper:
            raise ValueError(
                f"config.algo.rs_lower ({lower}) must be in (0, rs_upper={algo.rs_upper}]"
            )
        if algo.rs_veto is not None and not algo.rs_veto > 0:
            raise ValueError(f"config.algo.rs_veto must be > 0, got {algo.rs_veto}")
    if algo.rs_level is None and (algo.rs_upper is not None or algo.rs_lower is not None):
        raise ValueError(
            "config.algo.rs_upper / rs_lower are set but algo.rs_level is None: "
            "choose the level they apply at ('token', 'sequence' or 'geometric')"
        )
    _check_ranges(config)


def _check_tokenizer_and_loggers(config) -> None:
    """`model.tokenizer` parses (and is not given beside `model.pretrained`, which brings its
    own); every logger of `train.loggers` is known and its package installed."""
    from policyopt.data.tokenizer import load_tokenizer
    from policyopt.loggers import check_loggers

    path = config.model.tokenizer
    if path:
        if config.model.pretrained:
            raise ValueError(
                "config.model.tokenizer and config.model.pretrained are both set: a pretrained "
                "checkpoint's embeddings index its own tokenizer (in its folder)"
            )
        try:
            load_tokenizer(path)
        except (ValueError, OSError) as error:
            raise ValueError(f"config.model.tokenizer: {error}") from None
    check_loggers(config.train.loggers)


def _library_choices() -> dict[str, tuple]:
    """The values of the fields whose choices the library's modules define: the model
    preset (`policyopt.models.presets`), the advantage estimator, its centring and scaling
    (`policyopt.advantages`; "minibatch" is Magistral's scaling, applied per minibatch by
    the trainer) and the rollout correction's levels (`policyopt.losses`). Imported here:
    the configs stay importable without JAX."""
    from policyopt import advantages, losses
    from policyopt.models.presets import PRESETS

    return {
        "model.preset": tuple(sorted(PRESETS)),
        "algo.advantage": advantages.ESTIMATORS,
        "algo.adv_center": advantages.CENTERS,
        "algo.adv_scale": advantages.SCALES + ("minibatch",),
        "algo.tis_level": losses.IS_LEVELS,
        "algo.rs_level": (None,) + losses.RS_LEVELS,
    }


def _engine_pages(prompt_width: int, max_new: int, group: int, page_size: int, rows_to_end: int):
    """Pages one engine shard needs for any prompt of 1..P tokens: to admit its group of G
    rows, ceil(L / ps) + (G - 1) [L % ps > 0] + G (`policyopt.engine.group_pages`), and to
    take `rows_to_end` of its rows to their ends alone, floor(L / ps) + rows_to_end
    (ceil((L + N) / ps) - floor(L / ps)) (the full prompt pages are shared)."""
    need = 0
    for length in range(1, prompt_width + 1):
        pages, shared = -(-length // page_size), length // page_size
        admit = pages + (group - 1) * int(length % page_size > 0) + group
        end = shared + rows_to_end * (-(-(length + max_new) // page_size) - shared)
        need = max(need, admit, end)
    return need


def _check_engine_budget(config) -> None:
    """`sampling.engine_kv_tokens` against the engine's need (`_engine_pages`) for the
    longest prompt (the largest of `batch.prompt_buckets`, or `async_mode.prompt_width`):
    a budget that cannot admit a group leaves the engine waiting for pages for ever. The
    synchronous engine preempts rows down to one, which must reach its end; the
    asynchronous one needs the whole group to reach its end alone."""
    s, group, asynchronous = config.sampling, config.batch.group_size, config.async_mode.enabled
    width = max(config.batch.prompt_buckets, default=1)  # empty: refused elsewhere
    if asynchronous and config.async_mode.prompt_width:
        width = max(1, config.async_mode.prompt_width)
    rows_to_end = group if asynchronous else 1
    need = _engine_pages(width, s.max_new_tokens, group, s.engine_page_size, rows_to_end)
    if s.engine_kv_tokens // s.engine_page_size < need:
        where = (
            f"async_mode.prompt_width={width}"
            if asynchronous and config.async_mode.prompt_width
            else f"the largest of batch.prompt_buckets, {width}"
        )
        to_end = f"all {group} rows" if asynchronous else "one row"
        raise ValueError(
            f"config.sampling.engine_kv_tokens ({s.engine_kv_tokens}) is too small for "
            f"batch.group_size={group}: admitting the group of a prompt of up to {width} "
            f"tokens ({where}) and taking {to_end} to sampling.max_new_tokens="
            f"{s.max_new_tokens} takes {need} pages of engine_page_size={s.engine_page_size}; "
            f"the smallest budget that works is engine_kv_tokens={need * s.engine_page_size}"
        )


def _check_settings(config) -> None:
    """Builds the library's settings dataclasses of `config`, which check their fields
    (each error naming the config field): the policy loss, GAE and the value loss."""
    from policyopt.rl.critic import CriticConfig, GAEConfig
    from policyopt.rl.learner import LossConfig

    LossConfig.from_config(config)
    GAEConfig.from_config(config.algo)
    CriticConfig.from_config(config)


# float32's smallest normal number (numpy.finfo(numpy.float32).tiny): an Adam eps below it
# is 0 on the device (subnormals flush to zero), which divides 0 by 0 on weights without
# gradient, so every update would be skipped by the non-finite guard.
FLOAT32_TINY = 1.1754943508222875e-38

# Numeric fields and their allowed range: (field, low, high, low_inclusive, allow None).
# Every value must be a finite number; learning rates must be > 0 (0 trains nothing, a
# negative one ascends the loss) and Adam's eps >= FLOAT32_TINY (above). The policy loss's
# and GAE's ranges are checked by their dataclasses (`_check_settings`).
_RANGES = (
    ("optim.lr", 0.0, None, False, False),
    ("optim.eps", FLOAT32_TINY, None, True, False),
    ("optim.b1", 0.0, 1.0, True, False),
    ("optim.b2", 0.0, 1.0, True, False),
    ("optim.weight_decay", 0.0, None, True, False),
    ("optim.max_grad_norm", 0.0, None, False, True),
    ("optim.router_lr_scale", 0.0, None, False, False),
    ("critic.lr", 0.0, None, False, False),
    ("critic.weight_decay", 0.0, None, True, False),
    ("sft.lr", 0.0, None, False, False),
    ("sft.min_lr_ratio", 0.0, 1.0, True, False),
    ("sft.weight_decay", 0.0, None, True, False),
    ("sft.max_grad_norm", 0.0, None, False, True),
    ("algo.adv_eps", 0.0, None, True, False),
    ("sampling.top_p", 0.0, 1.0, False, False),
    ("eval.temperature", 0.0, None, False, False),
    ("reward.format_value", None, None, True, False),
    ("reward.correct_value", None, None, True, False),
    ("reward.incorrect_value", None, None, True, False),
    ("reward.language_bonus", 0.0, None, True, False),
    ("async_mode.join_timeout_s", 0.0, None, False, False),
)
# Integer fields and their least value, beside `_MINIMUMS` (these are read by the
# optimiser, the sampler and dynamic sampling rather than by the loop).
_INT_MINIMUMS = (
    ("optim.warmup_steps", 0),
    ("critic.warmup_steps", 0),
    ("sft.warmup_steps", 0),
    ("sampling.max_new_tokens", 1),
    ("sampling.top_k", 0),
    ("dynamic_sampling.max_rounds", 1),
    ("train.sample_every", 0),
    ("train.sample_prompts", 1),
    ("train.zero_variance_patience", 0),
    ("task.num_train", 1),
    ("task.num_test", 0),
    ("reward.num_workers", 0),
)


def _field(config, path: str):
    node = config
    for part in path.split("."):
        node = node[part]
    return node


def _check_ranges(config) -> None:
    """The numeric ranges of `_RANGES` and `_INT_MINIMUMS`, and the rule that group-relative
    advantages need G >= 2."""
    from policyopt.checks import check_number

    for path, low, high, low_inclusive, optional in _RANGES:
        check_number(
            f"config.{path}",
            _field(config, path),
            low=low,
            high=high,
            low_inclusive=low_inclusive,
            optional=optional,
        )
    for path, least in _INT_MINIMUMS:
        value = _field(config, path)
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"config.{path} must be an int >= {least}, got {value!r}")
    algo, group = config.algo, config.batch.group_size
    if algo.advantage == "outcome" and group < 2 and "group" in (algo.adv_center, algo.adv_scale):
        raise ValueError(
            f"config.batch.group_size must be >= 2 with group-relative advantages "
            f"(algo.adv_center={algo.adv_center!r}, adv_scale={algo.adv_scale!r}), "
            f"got {group}: a group of one has advantage 0 and trains nothing"
        )


def field_comments() -> dict[str, str]:
    """``{"algo.tau_neg": "SAPO temperatures of ..."}``: the comment above each field of
    `base_config()` (read from this file), for `--print_config`."""
    import re

    comments, pending = {}, []
    with open(__file__, encoding="utf-8") as f:
        for line in f:
            text = line.strip()
            if text.startswith("# ----"):
                pending = []
            elif text.startswith("#"):
                pending.append(text.lstrip("#").strip())
            elif match := re.match(r"c\.([\w.]+)\s*=", text):
                if pending:
                    comments[match.group(1)] = " ".join(pending)
                elif match.group(1) not in comments and comments.get("_last"):
                    # a field that shares the comment above the previous one
                    comments[match.group(1)] = comments["_last"]
                comments["_last"] = comments.get(match.group(1), "")
                pending = []
            elif not text.startswith(("c.", ")")) and text:
                pending = [] if not text.endswith((",", "(")) else pending
    comments.pop("_last", None)
    return comments


def describe(config: ml_collections.ConfigDict, width: int = 100) -> str:
    """The resolved config as `section.field = value` lines, each under its comment
    (`--print_config`)."""
    import textwrap

    comments, lines = field_comments(), []

    def visit(node, prefix):
        for key in node.keys():
            value, name = node[key], prefix + key
            if isinstance(value, ml_collections.ConfigDict):
                lines.append(f"\n# ---- {name} " + "-" * max(4, 40 - len(name)))
                visit(value, name + ".")
                continue
            comment = comments.get(name)
            if comment:
                lines.extend(
                    textwrap.wrap(comment, width, initial_indent="# ", subsequent_indent="# ")
                )
            lines.append(f"{name} = {value!r}")

    visit(config, "")
    return "\n".join(lines).lstrip("\n")


def load_run_config(path: str) -> ml_collections.ConfigDict:
    """The config a run wrote (`workdir/config.json`), rebuilt on `base_config()` so that
    every field keeps its type (tuples stay tuples); checked and locked. A field that
    `base_config()` does not have is an error naming it."""
    with open(path) as f:
        values = json.load(f)
    config = base_config()

    def assign(node, tree, prefix):
        for key, value in tree.items():
            name = prefix + key
            if key not in node:
                raise KeyError(f"{path}: {name!r} is not a config field")
            if isinstance(value, dict):
                assign(node[key], value, name + ".")
            else:
                node[key] = tuple(value) if isinstance(value, list) else value

    assign(config, values, "")
    check(config)
    config.lock()
    return config


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    """The base defaults alone (PPO-clip with GRPO advantages, no KL)."""
    return finalize(base_config(), arg)
