"""The papers' ablations as sweeps: each is a list of arms (label, recipe, variant) that
`experiments/ablate.py` trains side by side over seeds, then tabulates and plots.

    make demo    # once: writes the SFT checkpoint runs/demo/sft/checkpoints
    python -m experiments.ablate --ablation sapo_tau --setting demo --seeds 0,1,2 \
        --workdir runs/ablate/sapo_tau

An arm's config is `configs/<recipe>.py` with (later winning) `scale=paper` if the common
`--variant` asks for it, the ablation's shared variant, the arm's variant, the rest of the
common `--variant`, and `seed=N` (`experiments/ablate.arm_config`). Every arm then takes
the `SHARED_SECTIONS` (model, task, sampling, batch geometry and generation budget, loop,
evaluation) of the ablation's *reference* recipe at the same scale (`Ablation.reference`:
at `scale=paper`, that paper's geometry for every arm, not each arm's own paper's), a named
`--setting` (`SETTINGS`: "demo", the demo's model, task, batch geometry and SFT start)
replaces its sections, and the variants are applied again, so they win. So arms differ
only in the method: arms of one recipe exactly in the fields their variants name, arms of
different recipes also in the fields `Ablation.compares` declares
(`tests/experiments/test_ablate.py` checks both for every ablation, at the CPU defaults, in
the demo setting and at paper scale), and every arm gets `train.num_iterations` policy
iterations (value pretraining comes on top). The recipes' defaults are sized for the CPU;
on the CPU task start from an SFT checkpoint (`--setting demo`, or `init_checkpoint`): a
random policy never earns a reward.

Each ablation names the claim it tests, from its paper (docs/algorithms.md).
"""

from __future__ import annotations

import dataclasses
import importlib


@dataclasses.dataclass(frozen=True)
class Arm:
    """One configuration of an ablation: ``configs/<recipe>.py`` with ``variant``."""

    label: str  # also the arm's directory name: letters, digits, '_' and '-'
    recipe: str
    variant: str = ""


#: Config sections that are budget, not method: every arm of an ablation takes them from
#: its reference recipe (`share_sections`), so that no arm samples more prompts, more
#: responses per prompt or longer ones, or makes more updates per batch, than another.
SHARED_SECTIONS = ("model", "task", "sampling", "batch", "train", "eval")
#: Subsections of SHARED_SECTIONS that are a method, not budget: how the model trains
#: (LoRA adapters or full weights). Each arm keeps its own.
METHOD_FIELDS = ("model.lora",)
#: An ablation's runs save a checkpoint at least this often (``demo_setting``).
SWEEP_CHECKPOINT_EVERY = 10


def shared_field(path: str) -> bool:
    """Whether the dotted config field ``path`` is budget every arm shares
    (``SHARED_SECTIONS`` but ``METHOD_FIELDS``)."""
    method = any(path == m or path.startswith(m + ".") for m in METHOD_FIELDS)
    return path.split(".", 1)[0] in SHARED_SECTIONS and not method


@dataclasses.dataclass(frozen=True)
class Ablation:
    name: str
    claim: str  # what the paper reports (docs/algorithms.md)
    arms: tuple[Arm, ...]
    # Shared by every arm, before the arm's own variant: the conditions under which the
    # compared mechanism acts at all.
    variant: str = ""
    # The recipe whose SHARED_SECTIONS every arm takes, at the scale asked for (its CPU
    # defaults, or its `scale=paper` geometry and generation budget): the paper whose
    # claim the ablation tests where there is one. None: the first arm's recipe.
    reference: str | None = None
    # The fields in which arms of different recipes differ besides those their variants
    # name: the methods compared (dotted paths; one ending in "." is a whole section).
    # Never a field of SHARED_SECTIONS.
    compares: tuple[str, ...] = ()

    def __post_init__(self):
        shared = [f for f in self.compares if shared_field(f.rstrip("."))]
        if shared:
            raise ValueError(
                f"ablation {self.name!r}: compares names {shared}, fields of the "
                f"sections every arm shares ({', '.join(SHARED_SECTIONS)})"
            )

    @property
    def reference_recipe(self) -> str:
        return self.reference or self.arms[0].recipe


# Clips, soft gates and routing replay act only where the ratio pi / pi_old is not 1,
# i.e. from the second update on the same batch: with one update per batch, the trainer's
# old log-probs equal the policy's at that update, r = 1 on every token, and every clip
# range and SAPO temperature gives the same gradient (measured with the demo setting:
# identical runs for tau_neg = 1.05 and 1.0). These ablations use 4 minibatches per batch.
OFF_POLICY = "batch.n_minibatches=4"

# The GSPO paper's GRPO baseline (2507.18071; docs/algorithms.md "GSPO"): clip 0.2 / 0.27, no KL
# (GRPO's own recipe has beta 0.04 and a symmetric 0.2 clip).
GSPO_GRPO_BASELINE = "algo.clip_high=0.27,algo.kl_beta=0.0"
# What GRPO and GSPO(-token) differ in: the objective and its clip range.
GSPO_VS_GRPO = ("algo.method", "algo.clip_low", "algo.clip_high")

# LoRA on every layer's attention and MLP / experts (the router left out: tiny_moe's has 4
# outputs), the full-weight start (the setting's SFT checkpoint) as the frozen base.
LORA_ALL = "model.lora.targets='attention,mlp',model.lora.init_checkpoint=base"
LORA_ATTENTION = "model.lora.targets=attention,model.lora.init_checkpoint=base"


#: The routing claim's dose-response: routing-volatility levels set by the routers'
#: learning rate as a multiple of the policy's (``optim.router_lr_scale``; each level's
#: routing share, ``routing/ratio_share``, is measured in its runs), on the long task at
#: the routing claims' lr 3e-5. Measured there (GSPO, 100 iterations, SFT start 2): volatility
#: per batch 0.001 / 0.004 / 0.011 at 1x / 30x / 100x, routing share pooled over the run
#: 0.377 / 0.394 / 0.543 (start 1 at 100x: 0.262), GSPO +0.215 / +0.215 / +0.023
#: (benchmarks/RESULTS.md "The routing share"); the testbed's, at lr 3e-5 with the routers at
#: 1x / 100x / 300x over 150 iterations, 0.047 / 0.051 / 0.076.
ROUTING_LEVELS = {"low": 1.0, "mid": 30.0, "high": 100.0}
_LEVELS_TEXT = ", ".join(f"{scale:g}x" for scale in ROUTING_LEVELS.values())
# The asynchronous loop of Magistral's recipe: its sampler is stale, so its routing differs
# from pi_old's own and R3 (which replays the sampler's) differs from R2.
ASYNC = "async_mode.enabled=True"


def routing_dose_arms() -> tuple[Arm, ...]:
    """Per level: GRPO (the GSPO paper's baseline) without replay and with R2; without
    replay, with R2 and with R3 in the asynchronous loop (whose sampler routes differently:
    there R3 replays the sampler's routing, R2 pi_old's); GSPO."""
    arms = []
    for level, scale in ROUTING_LEVELS.items():
        lr = f"optim.router_lr_scale={scale:g}"
        grpo = f"{GSPO_GRPO_BASELINE},{lr}"
        arms += [
            Arm(f"grpo_{level}", "grpo", f"algo.routing_replay=none,{grpo}"),
            Arm(f"grpo_R2_{level}", "grpo", f"algo.routing_replay=R2,{grpo}"),
            Arm(f"grpo_async_{level}", "grpo", f"algo.routing_replay=none,{grpo},{ASYNC}"),
            Arm(f"grpo_R2_async_{level}", "grpo", f"algo.routing_replay=R2,{grpo},{ASYNC}"),
            Arm(f"grpo_R3_async_{level}", "grpo", f"algo.routing_replay=R3,{grpo},{ASYNC}"),
            Arm(f"gspo_{level}", "gspo", f"algo.routing_replay=none,{lr}"),
        ]
    return tuple(arms)


#: SAPO's temperature grid (2511.20347; the issue of its regime: docs/claims.md "sapo"):
#: tau_neg over the grid at tau_pos 1.0, and tau_pos over it at tau_neg 1.0.
SAPO_TAUS = (0.8, 1.0, 1.05, 1.25, 2.0)
# Enough updates per batch that SAPO's gate acts (its weight departs from 1).
SAPO_UPDATES = "batch.n_minibatches=8,batch.epochs=2"


def _tau_label(value: float) -> str:
    return f"{value:g}".replace(".", "p")


def sapo_grid_arms() -> tuple[Arm, ...]:
    """SAPO at each (tau_pos, tau_neg) of the grid (``neg<tau>`` at tau_pos 1.0, ``pos<tau>``
    at tau_neg 1.0; the recipe's 1.0 / 1.05 is ``neg1p05``), and GRPO without KL (the SAPO
    paper's baseline)."""
    arms = [
        Arm(f"neg{_tau_label(t)}", "sapo", f"algo.tau_pos=1.0,algo.tau_neg={t}") for t in SAPO_TAUS
    ]
    arms += [
        Arm(f"pos{_tau_label(t)}", "sapo", f"algo.tau_pos={t},algo.tau_neg=1.0")
        for t in SAPO_TAUS
        if t != 1.0
    ]
    return (*arms, Arm("grpo", "grpo", "algo.kl_beta=0.0"))


#: The critic's value pretraining in the VC-PPO and VAPO ablations (the papers pretrain
#: "until value loss and explained variance converge"), fixed from the held-out explained
#: variance over 40 pretraining iterations on the long task (SFT start 1, critic lr 2e-4 /
#: 1e-3 / 3e-3, 2026-12-06): means over blocks of 5 iterations rise to ~0 by the second
#: block at 1e-3 and 3e-3 (-0.022 -> +0.002, -0.042 -> +0.005) and stay within 0.00-0.03
#: after it, far below the 0.336 a perfect critic reaches (benchmarks/RESULTS.md
#: "The critic's regime"). So 10, at the long task's critic lr 3e-3 (``LONG_TASK_CRITIC``).
CRITIC_PRETRAIN_ITERATIONS = 10
#: VAPO's length-adaptive lambda against fixed lambdas of the same mean over the tokens,
#: measured on the long task's worked solutions (20000 training records, 6-194 tokens with
#: EOS, median 91; `python -m experiments.vapo_lambda --setting testbed_long`,
#: benchmarks/RESULTS.md "The critic's regime", 2026-12-06): at the paper's alpha 0.05 the
#: token mean is 0.789 (1.3% of the tokens at 0); alpha 0.275 = 0.05 x 500 / 91 gives the
#: median the paper's lambda at 500 tokens (0.96), token mean 0.960. The adaptive arms log
#: theirs (advantages/lambda_policy_token_mean) beside the controls (docs/claims.md
#: "vapo_length_adaptive").
VAPO_MATCHED_LAMBDA = 0.79
VAPO_RESCALED_ALPHA = 0.275
VAPO_RESCALED_MATCHED_LAMBDA = 0.96


ABLATIONS: dict[str, Ablation] = {
    a.name: a
    for a in (
        Ablation(
            "sapo_tau",
            "SAPO (2511.20347): tau_neg > tau_pos is the most stable, equal temperatures are in "
            "between, tau_neg < tau_pos is unstable.",
            (
                Arm("neg_gt_pos", "sapo", "algo.tau_pos=1.0,algo.tau_neg=1.05"),
                Arm("equal", "sapo", "algo.tau_pos=1.0,algo.tau_neg=1.0"),
                Arm("neg_lt_pos", "sapo", "algo.tau_pos=1.05,algo.tau_neg=1.0"),
            ),
            OFF_POLICY,
        ),
        Ablation(
            "routing_replay",
            "GSPO (2507.18071): on an MoE policy GRPO needs routing replay to converge, GSPO does "
            "not; R2 replays the old policy's routing, R3 (2510.11370) the sampler's. (GRPO as "
            "the paper's baseline: clip 0.2 / 0.27, no KL; every arm in GSPO's geometry. With 4 "
            "minibatches, routing/volatility is measured after a batch's 4 updates, not the "
            "one update of the paper's ~10%.)",
            (
                Arm("grpo", "grpo", f"algo.routing_replay=none,{GSPO_GRPO_BASELINE}"),
                Arm("grpo_R2", "grpo", f"algo.routing_replay=R2,{GSPO_GRPO_BASELINE}"),
                Arm("grpo_R3", "grpo", f"algo.routing_replay=R3,{GSPO_GRPO_BASELINE}"),
                Arm("gspo", "gspo", "algo.routing_replay=none"),
            ),
            OFF_POLICY + ",train.routing_metrics=True",
            reference="gspo",
            compares=GSPO_VS_GRPO,
        ),
        Ablation(
            "routing_dose",
            "GSPO (2507.18071): GRPO needs routing replay on an MoE policy, GSPO does not, and "
            "the more routing moves the ratio, the more replay matters. Three routing-volatility "
            f"levels (the routers' learning rate {_LEVELS_TEXT} the policy's); at each, GRPO "
            "without replay and with R2, GRPO without replay, with R2 and with R3 (2510.11370) "
            "in the asynchronous loop, GSPO without replay. (GRPO as the paper's baseline: clip "
            "0.2 / 0.27, no KL; every arm in GSPO's geometry.)",
            routing_dose_arms(),
            OFF_POLICY + ",train.routing_metrics=True",
            reference="gspo",
            compares=GSPO_VS_GRPO,
        ),
        Ablation(
            "sapo_grid",
            "SAPO (2511.20347): tau_neg > tau_pos is the most stable, equal temperatures in "
            "between, tau_neg < tau_pos unstable; SAPO is more stable than GRPO. The grid "
            "{0.8, 1.0, 1.05, 1.25, 2.0} for tau_neg (tau_pos 1.0) and for tau_pos (tau_neg "
            "1.0), and GRPO without KL, with 8 minibatches x 2 epochs per batch so that the "
            "gate acts.",
            sapo_grid_arms(),
            SAPO_UPDATES,
            reference="sapo",
            compares=("algo.",),
        ),
        Ablation(
            "dapo",
            "DAPO (2503.14476): each technique (clip-higher, token-level loss, dynamic sampling, "
            "overlong shaping and filtering) removed in turn from the full recipe.",
            (
                Arm("dapo", "dapo"),
                Arm("no_clip_higher", "dapo", "algo.clip_high=0.2"),
                Arm("no_token_loss", "dapo", "algo.aggregation=seq_mean_token_mean"),
                Arm("no_dynamic_sampling", "dapo", "dynamic_sampling.enabled=False"),
                Arm("no_overlong", "dapo", "reward.overlong=none,reward.overlong_filter=False"),
                Arm("no_overlong_shaping", "dapo", "reward.overlong=none"),
                Arm("no_overlong_filter", "dapo", "reward.overlong_filter=False"),
            ),
            OFF_POLICY,
        ),
        Ablation(
            "dr_grpo",
            "Dr. GRPO (2503.20783): no std scaling and a constant normaliser remove GRPO's "
            "difficulty and length biases; GRPO's responses grow longer when wrong. (GRPO without "
            "its KL term, as Dr. GRPO has none: the arms differ in the std and the normaliser; "
            "every arm in Dr. GRPO's geometry, its constant the shared generation budget.)",
            (
                Arm("grpo", "grpo", "algo.kl_beta=0.0"),
                Arm("grpo_no_std", "grpo", "algo.kl_beta=0.0,algo.adv_scale=none"),
                Arm("dr_grpo", "dr_grpo"),
            ),
            reference="dr_grpo",
            compares=("algo.adv_scale", "algo.aggregation", "algo.max_len"),
        ),
        Ablation(
            "gspo",
            "GSPO (2507.18071): the sequence-level ratio and clip against GRPO's token level; "
            "GSPO-token equals GSPO when advantages are per sequence. (GRPO as the paper's "
            "baseline: clip 0.2 / 0.27, no KL; every arm in GSPO's geometry.)",
            (
                Arm("grpo", "grpo", GSPO_GRPO_BASELINE),
                Arm("gspo", "gspo"),
                Arm("gspo_token", "gspo_token"),
            ),
            OFF_POLICY,
            reference="gspo",
            compares=GSPO_VS_GRPO,
        ),
        Ablation(
            "vc_ppo",
            "VC-PPO (2503.01491): value pretraining and decoupled GAE (lambda_critic 1.0, "
            "lambda_actor in [0.95, 1)) against plain PPO, whose value bias hurts long "
            "responses; the lambda_actor grid {0.9, 0.95, 0.99, 1.0} after value pretraining. "
            f"(Every pretrained arm's critic pretrains for {CRITIC_PRETRAIN_ITERATIONS} "
            "iterations; the critic_warmup claim checks its held-out fit: docs/claims.md "
            '"vc_ppo".)',
            (
                Arm("ppo", "ppo", "critic.pretrain_iterations=0"),
                Arm("ppo_pretrained", "ppo"),
                Arm("vc_ppo_lambda_090", "vc_ppo", "algo.gae_lambda=0.9"),
                Arm("vc_ppo", "vc_ppo"),
                Arm("vc_ppo_lambda_099", "vc_ppo", "algo.gae_lambda=0.99"),
                Arm("vc_ppo_lambda_1", "vc_ppo", "algo.gae_lambda=1.0"),
            ),
            f"{OFF_POLICY},critic.pretrain_iterations={CRITIC_PRETRAIN_ITERATIONS}",
            reference="vc_ppo",
            compares=("algo.gae_lambda_critic", "critic.pretrain_iterations"),
        ),
        Ablation(
            "vapo",
            "VAPO (2504.05118): length-adaptive GAE, the NLL term on correct samples and the "
            "value warm-up, each removed in turn; the length-adaptive lambda against fixed "
            "lambdas matched to its token mean, at the paper's alpha 0.05 and at an alpha "
            'rescaled to the task\'s lengths (docs/claims.md "vapo_length_adaptive").',
            (
                Arm("vapo", "vapo"),
                Arm(
                    "no_length_adaptive",
                    "vapo",
                    "algo.gae_length_adaptive=False,algo.gae_lambda=0.95",
                ),
                Arm(
                    "fixed_matched",
                    "vapo",
                    f"algo.gae_length_adaptive=False,algo.gae_lambda={VAPO_MATCHED_LAMBDA:g}",
                ),
                Arm("vapo_rescaled", "vapo", f"algo.gae_alpha={VAPO_RESCALED_ALPHA:g}"),
                Arm(
                    "fixed_matched_rescaled",
                    "vapo",
                    "algo.gae_length_adaptive=False,"
                    f"algo.gae_lambda={VAPO_RESCALED_MATCHED_LAMBDA:g}",
                ),
                Arm("no_nll", "vapo", "algo.nll_coef=0.0"),
                Arm("no_warmup", "vapo", "critic.pretrain_iterations=0"),
            ),
            f"{OFF_POLICY},critic.pretrain_iterations={CRITIC_PRETRAIN_ITERATIONS}",
        ),
        Ablation(
            "magistral_async",
            "Magistral (2506.10910): asynchronous generation (n_async = 2 n_batch, the default) "
            "against the synchronous loop, same recipe; and two off-policy corrections the paper "
            "does not use: truncated importance weights between the sampler's and the trainer's "
            "log-probs (C = 2; per token, or per sequence), the PPO ratio taken against the "
            "sampler's log-probs, or geometric rejection sampling (bound 1.01) alone.",
            (
                Arm("sync", "magistral"),
                Arm("async", "magistral", "async_mode.enabled=True"),
                Arm("async_tis", "magistral", "async_mode.enabled=True,algo.tis_cap=2.0"),
                Arm(
                    "async_seq_tis",
                    "magistral",
                    "async_mode.enabled=True,algo.tis_cap=2.0,algo.tis_level=sequence",
                ),
                Arm(
                    "async_sampler_old",
                    "magistral",
                    "async_mode.enabled=True,algo.old_log_probs=sampler",
                ),
                Arm(
                    "async_geo_rs",
                    "magistral",
                    "async_mode.enabled=True,algo.rs_level=geometric,algo.rs_upper=1.01",
                ),
            ),
        ),
        Ablation(
            "lora_rl",
            "LoRA Without Regret (Schulman et al., Thinking Machines 2025): for RL with "
            "verifiable rewards, LoRA matches full fine-tuning even at rank 1 when it is on "
            "every layer (MLP and MoE included), at a learning rate ~10x full fine-tuning's; "
            "LoRA on attention only falls behind. (SAPO, one update per batch in the demo "
            "setting; each arm at its best step size of a one-seed sweep over 1e-4 to 3e-3, "
            "docs/lora.md.)",
            (
                Arm("full", "sapo", "optim.lr=1e-3"),
                Arm("r1_all", "sapo", f"model.lora.rank=1,{LORA_ALL},optim.lr=1e-3"),
                Arm("r8_all", "sapo", f"model.lora.rank=8,{LORA_ALL},optim.lr=3e-4"),
                Arm("r32_all", "sapo", f"model.lora.rank=32,{LORA_ALL},optim.lr=1e-3"),
                Arm("r8_attention", "sapo", f"model.lora.rank=8,{LORA_ATTENTION},optim.lr=3e-3"),
            ),
        ),
        Ablation(
            "objectives",
            "The critic-free objectives side by side on one task, in the SAPO paper's unified "
            "form: each recipe with its paper's method settings (objective, advantages, KL, "
            "reward shaping, dynamic sampling, optimiser schedule) on one geometry, with 4 "
            "minibatches per batch for all of them, so that the clips act (Magistral's paper "
            "prefers one update per batch). At scale=paper every arm takes DAPO's geometry: "
            "512 prompts x 16, 20480 tokens (Magistral's 32768 is cut to it).",
            tuple(
                Arm(name, name)
                for name in ("grpo", "dapo", "dr_grpo", "gspo", "gspo_token", "sapo", "magistral")
            ),
            OFF_POLICY,
            reference="dapo",
            # DAPO's recipe also sets the optimiser's weight decay and warm-up (paper: 20
            # rollout steps); the reward and sampling filters are methods here.
            compares=(
                "algo.",
                "reward.",
                "dynamic_sampling.",
                "optim.weight_decay",
                "optim.warmup_steps",
            ),
        ),
    )
}


def demo_setting(
    config,
    sft_checkpoint: str = "runs/demo/sft/checkpoints",
    *,
    recipe: str = "demo",
    cache_len: int | None = 3,
    critic: dict | None = None,
):
    """An arm's recipe in the demo's setting (`configs/demo.py`, `make demo`; or in that of
    ``recipe``, another such recipe: `configs/testbed.py`, `configs/testbed_long.py`, with
    ``cache_len`` the overlong ramp's length, None: the recipe's): its model,
    task, sampling, batch geometry, optimiser, loop (with routing metrics) and evaluation,
    started from the demo's SFT checkpoint; algorithm, reward (but for the overlong ramp's
    length, below), critic, dynamic sampling and asynchronous mode stay the recipe's, and
    the critic's learning rate keeps the recipe's ratio to the actor's; ``critic``
    (``{field: value}`` of the critic section) then overrides it for the critic's
    arms. Returns a new, locked config."""
    setting = importlib.import_module(f"configs.{recipe}")  # only needed here

    # The critic keeps the recipe's critic / actor learning-rate ratio (VAPO 2:1).
    critic_ratio = config.critic.lr / config.optim.lr
    config = share_sections(config, setting.get_config(), SHARED_SECTIONS + ("optim",))
    config.unlock()
    config.init_checkpoint = sft_checkpoint
    if config.algo.advantage == "gae":
        config.critic.lr = critic_ratio * config.optim.lr
        for key, value in (critic or {}).items():
            config.critic[key] = value
    # Overlong shaping (DAPO, Magistral) ramps over the last L_cache tokens of L_max =
    # max_new_tokens = 20; the default L_cache (a quarter) would start it at 15 tokens and
    # penalise the task's correct answers (up to 17 tokens; measured: DAPO 0.585 with the
    # shaping vs 0.721 without). L_cache = 3 starts it past them, as DAPO's 4096 of 20480
    # starts past its expected 16384 (L_cache / L_max 15% here, 20% there).
    if config.reward.cache_len is None:
        config.reward.cache_len = cache_len
    # The demo turns them off for speed; the ablation summary reports routing volatility.
    config.train.routing_metrics = True
    # Sweeps run for hours in the background: a run killed outright (SIGKILL; SIGTERM
    # saves anyway) resumes from its last few iterations, not its start. Resume-free.
    config.train.checkpoint_every = min(config.train.checkpoint_every, SWEEP_CHECKPOINT_EVERY)
    config.lock()
    return config


def share_sections(config, reference, sections=SHARED_SECTIONS):
    """``config`` with the ``sections`` of ``reference`` (default ``SHARED_SECTIONS``, of
    an ablation's reference recipe at the same scale: model, task, sampling (the
    generation budget), batch geometry, loop and evaluation). Fields derived from the
    budget follow it where the recipe leaves them to it (Dr. GRPO's constant
    ``algo.max_len`` and the overlong shaping's ``reward.max_len`` are None:
    ``sampling.max_new_tokens``). Returns a new, locked config."""
    config = config.copy_and_resolve_references()
    config.unlock()
    for section in sections:
        for key, value in reference[section].items():
            if f"{section}.{key}" not in METHOD_FIELDS:
                config[section][key] = value
    config.lock()
    return config


def testbed_setting(config, sft_checkpoint: str = "runs/testbed/sft/checkpoints"):
    """``demo_setting`` with the volatile-routing testbed (`configs/testbed.py`: the demo's
    task and geometry on a 4-layer MoE of 32 experts top-4) and its SFT start
    (`python -m experiments.reproduce` trains it). Returns a new, locked config."""
    return demo_setting(config, sft_checkpoint, recipe="testbed")


#: The critic of the long settings' PPO-family arms (claim 3). VC-PPO's collapse comes from
#: a value model initialised from the reward model, so the critic first trains as an
#: outcome reward model (``critic.reward_model_iterations``, the policy frozen), which
#: gives it that bias (explained variance -0.82 at PPO's first rollout), before value
#: pretraining and PPO. Its learning rate is 3e-3, not 2x the actor's 1e-4: at 2e-4 the
#: freshly initialised value head fits nothing in 12 iterations of value pretraining
#: (held-out explained variance ~0), at 3e-3 it reaches 0.19-0.28 (benchmarks/HISTORY.md,
#: 2026-12-03).
LONG_TASK_CRITIC = {"lr": 3e-3, "reward_model_iterations": 10}


def testbed_long_setting(config, sft_checkpoint: str = "runs/testbed_long/sft/checkpoints"):
    """``demo_setting`` with the length-variety task (`configs/testbed_long.py`: remainders
    by repeated subtraction, responses of ~11 to ~195 tokens) on the testbed's MoE, and its SFT
    start; the overlong ramp keeps the recipe's length (a quarter of the budget); a
    critic starts as a reward model and learns at 3e-3 (``LONG_TASK_CRITIC``).
    Returns a new, locked config."""
    return demo_setting(
        config, sft_checkpoint, recipe="testbed_long", cache_len=None, critic=LONG_TASK_CRITIC
    )


def testbed_long32_setting(config, sft_checkpoint: str = "runs/testbed_long32/sft/checkpoints"):
    """``testbed_long_setting`` with twice the chain (`configs/testbed_long32.py`: 1 to 32
    subtractions, responses of ~11 to ~403 tokens) and its SFT start, which continues
    testbed_long's. Returns a new, locked config."""
    return demo_setting(
        config, sft_checkpoint, recipe="testbed_long32", cache_len=None, critic=LONG_TASK_CRITIC
    )


def testbed_dense_setting(config, sft_checkpoint: str = "runs/testbed_dense/sft/checkpoints"):
    """``demo_setting`` with the testbed's dense control (`configs/testbed_dense.py`) and
    its SFT start. Returns a new, locked config."""
    return demo_setting(config, sft_checkpoint, recipe="testbed_dense")


def testbed_long_dense_setting(
    config, sft_checkpoint: str = "runs/testbed_long_dense/sft/checkpoints"
):
    """``testbed_long_setting`` with the long task's dense control
    (`configs/testbed_long_dense.py`) and its SFT start. Returns a new, locked config."""
    return demo_setting(
        config, sft_checkpoint, recipe="testbed_long_dense", cache_len=None, critic=LONG_TASK_CRITIC
    )


#: Named settings for ``experiments/ablate.py --setting``: ``config -> config``.
#: "testbed", "testbed_long" and "testbed_long32" are those of ``experiments/reproduce.py``.
SETTINGS = {
    "demo": demo_setting,
    "testbed": testbed_setting,
    "testbed_dense": testbed_dense_setting,
    "testbed_long": testbed_long_setting,
    "testbed_long32": testbed_long32_setting,
    "testbed_long_dense": testbed_long_dense_setting,
}


def get_ablation(name: str) -> Ablation:
    if name not in ABLATIONS:
        raise ValueError(f"unknown ablation {name!r}; known: {', '.join(sorted(ABLATIONS))}")
    return ABLATIONS[name]
