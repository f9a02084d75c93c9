"""Model presets: the real models' shapes, and their parameter counts by hand."""

import jax
import numpy as np
from flax import nnx

from policyopt.models import Transformer, preset


def _num_params(config) -> int:
    """Parameters of the model built from ``config``, from abstract shapes (nothing allocated)."""
    model = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def test_qwen3_8b_matches_its_config_json():
    # Qwen3-8B's config.json (Qwen team, 2025).
    config = preset("qwen3_8b")
    assert (
        config.num_layers,
        config.hidden_size,
        config.num_heads,
        config.num_kv_heads,
        config.head_dim,
        config.intermediate_size,
        config.vocab_size,
    ) == (36, 4096, 32, 8, 128, 12288, 151936)
    assert config.rope_theta == 1e6 and config.rms_norm_eps == 1e-6
    assert not config.tie_word_embeddings and not config.is_moe


def test_qwen3_8b_parameter_count():
    # By hand: input and output embeddings V x D each (untied); per layer q and o
    # D x 32*128, k and v D x 8*128, SwiGLU 3 x D x 12288, two RMSNorms of D, q/k norms of
    # 128; the final RMSNorm. 8,190,735,360 in all (Qwen3-8B: "8.2B").
    V, D, L, F, Dh = 151936, 4096, 36, 12288, 128
    attention = 2 * D * 32 * Dh + 2 * D * 8 * Dh + 2 * Dh
    per_layer = attention + 3 * D * F + 2 * D
    expected = 2 * V * D + L * per_layer + D
    assert expected == 8_190_735_360
    assert _num_params(preset("qwen3_8b")) == expected


def test_qwen3_30b_a3b_parameter_count():
    # Per layer: attention (D = 2048, 32 query and 4 kv heads of 128), router E x D, 128
    # experts of 3 x D x 768, two RMSNorms; untied embeddings. 30,532,122,624 ("30.5B").
    V, D, L, E, F, Dh = 151936, 2048, 48, 128, 768, 128
    attention = 2 * D * 32 * Dh + 2 * D * 4 * Dh + 2 * Dh
    per_layer = attention + E * D + E * 3 * D * F + 2 * D
    expected = 2 * V * D + L * per_layer + D
    assert expected == 30_532_122_624
    assert _num_params(preset("qwen3_30b_a3b")) == expected
