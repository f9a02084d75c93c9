"""Named model sizes. ``preset(name, vocab_size=None, **overrides) -> ModelConfig``.

  tiny_dense, tiny_moe  trains on a laptop CPU in minutes (tests, smoke runs)
  moe_7m                4 layers, D=256, 8 experts top-2, V=512 (sampler benchmark)
  moe_volatile          4 layers, D=64, 32 small experts top-4, V=512: the volatile-routing
                        testbed of experiments/reproduce.py (configs/testbed.py), whose
                        routing changes by >= 5% per update like the GSPO paper's
                        Qwen3-30B-A3B (benchmarks/HISTORY.md, "2026-12-02: a
                        volatile-routing testbed")

The CPU presets (tiny_moe, moe_7m) train and prefill with the "blocked" dropless
dispatch: XLA:CPU lowers ``jax.lax.ragged_dot`` to one dense matmul per expert, 3-10x
slower there (benchmarks/RESULTS.md "MoE layer"). So does XLA:GPU (a dense product over
all experts): on an H200, moe_0p5b's training step ran 3.75x faster with "blocked" (block
512, one-hot weight gather) than with "ragged", while decoding (a few tokens per expert)
was faster with "ragged" (RESULTS.md "Accelerator"). moe_0p5b therefore trains and
prefills with "blocked" and decodes with "ragged" (``moe_decode_dispatch``). tiny_moe
decodes with "dense" (every token through every expert: E / k times the FLOPs, but no
sort, gather or scatter; moe_7m's whole sampler call at batch 64, 128 new tokens, ran
~1.6x faster than with "blocked" decoding, HISTORY.md "2026-11-30: the CPU sampler");
moe_7m with "gathered" (the same batched matmuls on each expert's own tokens only: its sampler call
took 27% less CPU time than with "dense", HISTORY.md "2026-12-02: the CPU decode step").
moe_7m's blocks hold 128 rows: each block gathers its expert's weights, and at D = F = 256
(bench_moe, 2048 tokens) blocks of 128 ran the layer 2x faster than blocks of 16 (its
sampler call 8-11% faster). qwen3_30b_a3b keeps "ragged", the choice on TPUs
(grouped-matmul kernels); ``scale=paper`` trains it with "blocked" in blocks of 4,096 and
decodes with "ragged" (``configs/base.py``, ``PAPER_SCALE_MODEL``).
  moe_0p5b              ~0.5B total parameters, 32 experts top-4 (accelerator benchmark)
  qwen3_8b              the shape of Qwen3-8B (dense, 36 layers, D=4096, ~8.2B parameters)
  qwen3_30b_a3b         the shape of Qwen3-30B-A3B (48 layers, 128 experts top-8)

Only qwen3_30b_a3b scans its layers (``scan_layers``: one stacked block, compiled once
rather than 48 times); every preset keeps ``remat="none"``, which a run at long sequence
lengths overrides (``model.remat``; with the scan, since XLA:CPU frees rematerialised
memory only there). The small presets stay unrolled: their decode steps are faster
without the per-layer loop and cache-slice copy of a scan, and they compile in seconds.
"""

from __future__ import annotations

from policyopt.models.config import ModelConfig

PRESETS: dict[str, dict] = {
    "tiny_dense": dict(
        vocab_size=512,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=128,
        rope_theta=1e4,
    ),
    "tiny_moe": dict(
        vocab_size=512,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=128,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        rope_theta=1e4,
        moe_dispatch="blocked",
        moe_block_size=16,
        moe_decode_dispatch="dense",
    ),
    "moe_7m": dict(
        vocab_size=512,
        hidden_size=256,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        intermediate_size=512,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=256,
        rope_theta=1e4,
        moe_dispatch="blocked",
        moe_block_size=128,
        moe_decode_dispatch="gathered",
    ),
    # Many small experts (F_e = 16) behind a 32-way router: the gaps between the k-th and
    # the (k+1)-th router logit are small, so one update moves many tokens' expert sets.
    "moe_volatile": dict(
        vocab_size=512,
        hidden_size=64,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=128,
        num_experts=32,
        num_experts_per_tok=4,
        moe_intermediate_size=16,
        rope_theta=1e4,
        moe_dispatch="blocked",
        moe_block_size=16,
        moe_decode_dispatch="dense",
    ),
    "moe_0p5b": dict(
        vocab_size=32768,
        hidden_size=1024,
        num_layers=12,
        num_heads=16,
        num_kv_heads=4,
        head_dim=64,
        intermediate_size=2816,
        num_experts=32,
        num_experts_per_tok=4,
        moe_intermediate_size=352,
        moe_dispatch="blocked",
        moe_block_size=512,
        moe_decode_dispatch="ragged",
    ),
    # Qwen3-8B config.json (Qwen team, 2025): untied input and output embeddings.
    "qwen3_8b": dict(
        vocab_size=151936,
        hidden_size=4096,
        num_layers=36,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=12288,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        max_position_embeddings=40960,
    ),
    # Qwen3-30B-A3B config.json (Qwen team, 2025).
    "qwen3_30b_a3b": dict(
        vocab_size=151936,
        hidden_size=2048,
        num_layers=48,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        intermediate_size=6144,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        norm_topk_prob=True,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        max_position_embeddings=40960,
        scan_layers=True,
    ),
}


def preset(name: str, vocab_size: int | None = None, **overrides) -> ModelConfig:
    """The ModelConfig of preset ``name``, with ``vocab_size`` and any field overridden."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; expected one of {sorted(PRESETS)}")
    fields = dict(PRESETS[name])
    if vocab_size is not None:
        fields["vocab_size"] = vocab_size
    fields.update(overrides)
    return ModelConfig(**fields)
