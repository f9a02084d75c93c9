"""HuggingFace import / export against transformers itself (tiny random Qwen3 and
Qwen3-MoE models built in code, torch on the CPU, no downloads)."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from policyopt.models import from_pretrained, save_pretrained  # noqa: E402
from policyopt.models.hf import config_from_hf  # noqa: E402

COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=40, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
              rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
              initializer_range=0.2)


def _hf_model(kind: str, **overrides):
    torch.manual_seed(0)
    if kind == "dense":
        config = transformers.Qwen3Config(**{**COMMON, "tie_word_embeddings": True, **overrides})
        model = transformers.Qwen3ForCausalLM(config)
    else:
        fields = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24,
                      norm_topk_prob=True, mlp_only_layers=[1])
        config = transformers.Qwen3MoeConfig(**{**COMMON, **fields, **overrides})
        model = transformers.Qwen3MoeForCausalLM(config)
    # Random norms too, so a swapped or untransposed norm weight cannot go unnoticed.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    return model.eval()


def _tokens(batch=2, length=7, vocab=64):
    return np.random.default_rng(0).integers(0, vocab, size=(batch, length)).astype(np.int32)


def _hf_forward(model, tokens):
    captured = []
    hooks = []
    for layer in model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None:
            hooks.append(gate.register_forward_hook(lambda m, i, o: captured.append(o[2])))
    with torch.no_grad():
        logits = model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    for hook in hooks:
        hook.remove()
    routing = None
    if captured:
        routing = np.stack([c.numpy().reshape(*tokens.shape, -1) for c in captured])
    return logits, routing


def _assert_close(got, want):
    rel = np.max(np.abs(np.asarray(got) - want)) / np.max(np.abs(want))
    assert rel < 1e-4, rel


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_import_matches_transformers(kind, tmp_path):
    hf_model = _hf_model(kind)
    hf_model.save_pretrained(tmp_path)
    model = from_pretrained(str(tmp_path))
    tokens = _tokens()
    hf_logits, hf_routing = _hf_forward(hf_model, tokens)
    out = model(jnp.asarray(tokens))
    _assert_close(out.logits, hf_logits)
    if kind == "dense":
        assert out.routing is None and model.config.tie_word_embeddings
        return
    assert model.config.moe_layer_indices == (0, 2)
    assert model.config.rope_theta == 5000.0
    # Same experts, in the same best-first order, on every token of every MoE layer.
    np.testing.assert_array_equal(np.asarray(out.routing), hf_routing)
    replayed = model(jnp.asarray(tokens), routing=out.routing)
    np.testing.assert_array_equal(replayed.logits, out.logits)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_export_round_trip_and_transformers_reload(kind, tmp_path):
    hf_model = _hf_model(kind, norm_topk_prob=False) if kind == "moe" else _hf_model(kind)
    hf_model.save_pretrained(tmp_path / "hf")
    model = from_pretrained(str(tmp_path / "hf"))
    save_pretrained(model, str(tmp_path / "export"))
    again = from_pretrained(str(tmp_path / "export"))
    from flax import nnx
    import jax
    for a, b in zip(jax.tree.leaves(nnx.state(model, nnx.Param)),
                    jax.tree.leaves(nnx.state(again, nnx.Param))):
        np.testing.assert_array_equal(a, b)
    reloaded = type(hf_model).from_pretrained(tmp_path / "export").eval()
    tokens = _tokens()
    np.testing.assert_array_equal(_hf_forward(reloaded, tokens)[0], _hf_forward(hf_model, tokens)[0])
    _assert_close(model(jnp.asarray(tokens)).logits, _hf_forward(reloaded, tokens)[0])


def test_sharded_checkpoint_with_index(tmp_path):
    hf_model = _hf_model("moe")
    hf_model.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    model = from_pretrained(str(tmp_path / "hf"))
    tokens = _tokens()
    _assert_close(model(jnp.asarray(tokens)).logits, _hf_forward(hf_model, tokens)[0])
    save_pretrained(model, str(tmp_path / "out"), max_shard_size=20_000)
    with open(tmp_path / "out" / "model.safetensors.index.json") as f:
        index = json.load(f)
    files = set(index["weight_map"].values())
    assert len(files) > 2 and all((tmp_path / "out" / name).exists() for name in files)
    np.testing.assert_array_equal(from_pretrained(str(tmp_path / "out"))(jnp.asarray(tokens)).logits,
                                  model(jnp.asarray(tokens)).logits)
    # Config overrides at load time: bfloat16 storage, another dispatch.
    low = from_pretrained(str(tmp_path / "out"), param_dtype="bfloat16", moe_dispatch="blocked")
    assert low.layers[0].mlp.gate_proj[...].dtype == jnp.bfloat16
    assert low.config.moe_dispatch == "blocked"


def _base_config(**fields):
    base = {"model_type": "qwen3", "vocab_size": 8, "hidden_size": 8, "num_hidden_layers": 1,
            "num_attention_heads": 2, "intermediate_size": 8}
    return {**base, **fields}


def test_config_field_mapping_old_and_new_names():
    old = config_from_hf(_base_config(rope_theta=1e6, rope_scaling=None))
    new = config_from_hf(_base_config(rope_parameters={"rope_type": "default", "rope_theta": 1e6}))
    assert old == new and old.rope_theta == 1e6 and old.num_kv_heads == 2
    # No head_dim in config.json: transformers' Qwen3Config default (128) for dense Qwen3,
    # hidden_size / heads for Qwen3-MoE.
    assert old.head_dim == 128 and config_from_hf(_base_config(head_dim=4)).head_dim == 4
    moe = config_from_hf(_base_config(model_type="qwen3_moe", num_hidden_layers=4, num_local_experts=8,
                                      num_experts_per_tok=2, moe_intermediate_size=4,
                                      decoder_sparse_step=2))
    assert moe.num_experts == 8 and moe.moe_layer_indices == (1, 3) and not moe.norm_topk_prob
    assert moe.head_dim == 4


@pytest.mark.parametrize("fields,match", [
    (dict(model_type="llama"), "model_type"),
    (dict(architectures=["Qwen3ForSequenceClassification"]), "Qwen3ForSequenceClassification"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(use_sliding_window=True), "use_sliding_window"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}), "rope_type"),
    (dict(rope_scaling={"type": "linear", "factor": 2.0}), "rope_type"),
])
def test_unsupported_config_raises_naming_the_field(fields, match):
    with pytest.raises(ValueError, match=match):
        config_from_hf(_base_config(**fields))


def test_missing_tensor_names_it(tmp_path):
    from safetensors.numpy import load_file, save_file
    hf_model = _hf_model("dense")
    hf_model.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(KeyError, match="model.layers.1.self_attn.k_norm.weight"):
        from_pretrained(str(tmp_path))
    assert os.path.exists(tmp_path / "config.json")


def test_rl_build_applies_runtime_overrides_to_a_pretrained_model(tmp_path):
    """config.model's dtype / MoE-dispatch fields reach a pretrained checkpoint; a field
    that would change its shapes is refused instead of being ignored."""
    from policyopt.rl import build
    from tests.test_rl_trainer import tiny
    hf_model = _hf_model("moe")
    hf_model.save_pretrained(tmp_path)
    extra = (f"model.pretrained={tmp_path},model.moe_dispatch=blocked,model.moe_block_size=8,"
             "model.moe_decode_dispatch=ragged,model.moe_weight_gather=onehot")
    config = tiny("grpo", "tiny_moe", extra=extra)
    with pytest.raises(ValueError, match="num_layers"):      # tiny() shrinks num_layers
        build.make_model(config, vocab_size=0)
    config.unlock()
    config.model.num_layers = None
    cfg = build.make_model(config, vocab_size=0).config
    assert (cfg.moe_dispatch, cfg.moe_block_size, cfg.moe_decode_dispatch, cfg.moe_weight_gather) == (
        "blocked", 8, "ragged", "onehot")
    assert cfg.num_experts == hf_model.config.num_experts
