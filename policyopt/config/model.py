"""The ``model`` section: the policy's preset or checkpoint, and how a run computes it."""

from __future__ import annotations

import dataclasses

from policyopt.schema import choice, integer, positive, section, setting


def _presets():
    from policyopt.models.presets import PRESETS

    return sorted(PRESETS)


@dataclasses.dataclass(frozen=True)
class Lora:
    """LoRA adapters (docs/lora.md): only the adapters train (and are in the optimiser state
    and the checkpoints); the base is frozen, held once, and is the KL reference policy. RL
    only: SFT (experiments/sft.py) trains full weights."""

    rank: int = setting(
        0,
        "Rank r of every adapter; 0: full weights.",
        paper="LoRA 2106.09685 §4.1",
        check=integer(0),
    )
    alpha: float = setting(
        32.0,
        "Adapters add (alpha / r) x A B.",
        paper="LoRA 2106.09685 §4.1; 32: LoRA Without Regret (Schulman et al., Thinking "
        "Machines 2025)",
        note="With the 1/r scaling the best learning rate is nearly independent of the rank.",
        check=positive(),
    )
    targets: str = setting(
        "all",
        "Comma-separated adapter targets or groups.",
        note='"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj" '
        '(dense MLP), "experts.gate_proj", "experts.up_proj", "experts.down_proj" (one '
        'adapter per expert), "router"; groups "attention", "mlp" (every layer\'s '
        'feed-forward: dense MLP and experts), "experts", "all" (every target, the router '
        "included). A name the model lacks is an error listing its targets.",
    )
    base_dtype: str | None = setting(
        None,
        "Storage dtype of the frozen base; None: model.param_dtype.",
        note='"bfloat16" halves the base\'s memory; the adapters keep model.param_dtype.',
        check=choice(None, "float32", "bfloat16", "float16"),
    )
    sampler: str = setting(
        "merged",
        'What the sampler and the evaluation decode: "merged" or "unmerged".',
        note='"merged": the base with W + (alpha/r) A B folded in once per weight version, '
        'then the plain model; "unmerged": A and B applied at every decode step. Merged was '
        "the faster on the CPU (docs/lora.md).",
        check=choice("merged", "unmerged"),
    )
    critic: str = setting(
        "adapters",
        'The critic of PPO-family methods: "adapters" or "full".',
        note='"adapters": its own adapters, a copy of the policy\'s initial ones, and its '
        'value head on the policy\'s frozen base, shared; "full": full weights, a copy of '
        "the base.",
        check=choice("adapters", "full"),
    )
    init_checkpoint: str = setting(
        "match",
        'How `init_checkpoint` is read: "match", "base" or "merged".',
        note="\"match\" (of the run's kind: a LoRA checkpoint's adapters continue on the base "
        'it records, a full-weight one into a full-weight run), "base" (a full-weight '
        'checkpoint, e.g. the SFT start, is the frozen base of new adapters) or "merged" '
        "(a LoRA checkpoint, merged into its base, starts a full-weight run). Any other "
        "pairing is an error.",
        check=choice("match", "base", "merged"),
    )

    def validate(self, label: str) -> None:
        """The adapters' fields together (``policyopt.models.lora.LoRAConfig``: a target
        list that names something); targets and ranks are checked against the model when
        it is built."""
        if self.rank and not [t for t in self.targets.split(",") if t.strip()]:
            raise ValueError(f"{label}.targets is empty: name at least one target or group")


@dataclasses.dataclass(frozen=True)
class Model:
    """The policy model: a preset or a HuggingFace folder, single-field overrides, and the
    kernels and runtime a run chooses (docs/scale.md)."""

    preset: str = setting(
        "tiny_moe",
        "Model preset (`policyopt.models.presets`).",
        note='"tiny_moe", "tiny_dense" (CPU), "moe_7m", "moe_0p5b", "qwen3_30b_a3b" '
        "(accelerators).",
        check=choice(source=_presets, rule="a preset of policyopt.models.presets"),
    )
    pretrained: str | None = setting(
        None,
        "Folder of a HuggingFace Qwen3 / Qwen3-MoE checkpoint to start from instead of a "
        "preset; None: the preset.",
        note="The tokenizer is then read from the same folder.",
    )
    tokenizer: str | None = setting(
        None,
        "Tokenizer of a preset: a tokenizer.json or a folder holding one; None: the character "
        "tokenizer of the synthetic task.",
        note="`python -m experiments.tokenizer` trains one on the task's files "
        "(docs/quickstart.md); the preset's vocabulary becomes the tokenizer's size. Not "
        "beside `pretrained`, which brings its own.",
    )
    num_layers: int | None = setting(
        None, "Override of the preset's layer count; None: the preset's."
    )
    hidden_size: int | None = setting(None, "Override of the preset's width; None: the preset's.")
    num_experts: int | None = setting(
        None, "Override of the preset's number of experts; None: the preset's."
    )
    num_experts_per_tok: int | None = setting(
        None, "Override of the preset's experts per token (k); None: the preset's."
    )
    dtype: str | None = setting(
        None,
        'Computation dtype ("float32", "bfloat16"); None: the preset\'s.',
        note="Parameters stay in param_dtype.",
    )
    param_dtype: str | None = setting(None, "Parameter dtype; None: the preset's.")
    moe_dispatch: str | None = setting(
        None,
        "MoE dispatch of the training and scoring forwards; None: the preset's.",
        note='"ragged", "blocked", "dense" or "gathered" (dropless; dense: every token '
        "through every expert, gathered: each expert's own tokens in a small buffer, both "
        'for decoding small models), or "capacity" (drops tokens by batch position; SFT '
        "and benchmarks only: the RL trainer refuses it).",
    )
    moe_decode_dispatch: str | None = setting(
        None,
        "Dispatch of the sampler's decode steps (one token per row); None: the preset's.",
        note='tiny_moe: "dense", moe_7m: "gathered"; otherwise moe_dispatch. On a GPU: '
        'moe_dispatch="blocked", moe_block_size=512, moe_decode_dispatch="ragged".',
    )
    moe_block_size: int | None = setting(
        None, 'Rows per block of the "blocked" dispatch (CPU 16-64, GPU 256-512).'
    )
    moe_chunk_rows: int | None = setting(
        None,
        'Padded rows of the "blocked" dispatch through the expert matmuls at a time; None: all.',
        note="A scan over chunks of blocks, each recomputed in the backward: the MoE block's "
        "memory is one chunk's (docs/scale.md). scale=paper: 65,536.",
    )
    moe_weight_gather: str | None = setting(
        None, '"auto", "take" or "onehot": how "blocked" hands the blocks their expert\'s weights.'
    )
    attention: str | None = setting(
        None,
        'Attention of the training and scoring forwards; None: "auto".',
        note='"auto" (cuDNN flash attention on GPUs, splash on TPUs, on CPUs the einsum below '
        '1,024 tokens and "blockwise" from there), "xla" (einsum: [B, H, T, T] float32 '
        'scores), "blockwise" (online softmax over key blocks, memory linear in T, every '
        'backend), "cudnn" (GPU, bf16/fp16) or "splash" (TPU). An implementation the backend '
        "lacks is an error before anything compiles.",
    )
    attention_block_size: int | None = setting(
        None, 'Query and key rows per block of "blockwise"; None: 512.'
    )
    scan_layers: bool | None = setting(
        None,
        "Stack each run of identical decoder layers and run it with a scan; None: the preset's.",
        note="Compile time stops growing with depth, and remat frees memory on XLA:CPU only "
        "this way. For deep models and long sequences (qwen3_30b_a3b: True); the CPU presets "
        "keep False (faster decoding). Changes the checkpoint layout: fixed for a run.",
    )
    remat: str | None = setting(
        None,
        'Rematerialisation of each decoder block: "none", "full" or "save_dots".',
        note='"full" keeps each block\'s input only, "save_dots" the projections\' outputs '
        "(attention recomputed). Turn it on, with scan_layers, when activations do not fit "
        "(long sequences).",
    )
    moe_ep_transport: str | None = setting(
        None,
        'Expert parallelism (mesh.expert > 1): "auto", "ragged_all_to_all" or "all_to_all", '
        "how tokens travel to their experts' devices.",
    )
    moe_ep_buffer_factor: float | None = setting(
        None,
        "Expert parallelism: the receive buffer in units of the mean load.",
        note="A larger load takes more passes; no drops.",
    )
    lora: Lora = section(Lora, "LoRA adapters (docs/lora.md).")

    def validate(self, label: str) -> None:
        if self.tokenizer:
            if self.pretrained:
                raise ValueError(
                    f"{label}.tokenizer and {label}.pretrained are both set: a pretrained "
                    "checkpoint's embeddings index its own tokenizer (in its folder)"
                )
            from policyopt.data.tokenizer import load_tokenizer

            try:
                load_tokenizer(self.tokenizer)
            except (ValueError, OSError) as error:
                raise ValueError(f"{label}.tokenizer: {error}") from None
