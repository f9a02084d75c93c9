"""HuggingFace import / export against transformers itself (tiny random Qwen3 and
Qwen3-MoE models built in code, torch on the CPU, no downloads)."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from policyopt.models import from_pretrained, save_pretrained
from policyopt.models.hf import config_from_hf

# Imported when a test of the file first runs, not at collection: every test process collects
# every file, and torch with transformers is ~4 CPU seconds of import.
torch = transformers = None


def import_torch():
    """torch and transformers, imported into this module (a skip where either is missing)."""
    global torch, transformers
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    return torch, transformers


@pytest.fixture(scope="module", autouse=True)
def _torch_and_transformers():
    import_torch()


COMMON = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=40,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
    initializer_range=0.2,
)


def _hf_model(kind: str, **overrides):
    torch.manual_seed(0)
    if kind == "dense":
        config = transformers.Qwen3Config(**{**COMMON, "tie_word_embeddings": True, **overrides})
        model = transformers.Qwen3ForCausalLM(config)
    else:
        fields = dict(
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        )
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


@pytest.mark.parametrize("scan_layers", [False, True], ids=["loop", "scan"])
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_import_matches_transformers(kind, scan_layers, tmp_path):
    hf_model = _hf_model(kind)
    hf_model.save_pretrained(tmp_path)
    model = from_pretrained(str(tmp_path), scan_layers=scan_layers)
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


@pytest.mark.parametrize("scan_layers", [False, True], ids=["loop", "scan"])
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_export_round_trip_and_transformers_reload(kind, scan_layers, tmp_path):
    hf_model = _hf_model(kind, norm_topk_prob=False) if kind == "moe" else _hf_model(kind)
    hf_model.save_pretrained(tmp_path / "hf")
    model = from_pretrained(str(tmp_path / "hf"), scan_layers=scan_layers)
    save_pretrained(model, str(tmp_path / "export"))
    again = from_pretrained(str(tmp_path / "export"), scan_layers=scan_layers)
    for a, b in zip(
        jax.tree.leaves(nnx.state(model, nnx.Param)), jax.tree.leaves(nnx.state(again, nnx.Param))
    ):
        np.testing.assert_array_equal(a, b)
    reloaded = type(hf_model).from_pretrained(tmp_path / "export").eval()
    tokens = _tokens()
    np.testing.assert_array_equal(
        _hf_forward(reloaded, tokens)[0], _hf_forward(hf_model, tokens)[0]
    )
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
    np.testing.assert_array_equal(
        from_pretrained(str(tmp_path / "out"))(jnp.asarray(tokens)).logits,
        model(jnp.asarray(tokens)).logits,
    )
    # Config overrides at load time: bfloat16 storage, another dispatch.
    low = from_pretrained(str(tmp_path / "out"), param_dtype="bfloat16", moe_dispatch="blocked")
    assert low.layers[0].mlp.gate_proj[...].dtype == jnp.bfloat16
    assert low.config.moe_dispatch == "blocked"


def _base_config(**fields):
    base = {
        "model_type": "qwen3",
        "vocab_size": 8,
        "hidden_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "intermediate_size": 8,
    }
    return {**base, **fields}


def test_config_field_mapping_old_and_new_names():
    old = config_from_hf(_base_config(rope_theta=1e6, rope_scaling=None))
    new = config_from_hf(_base_config(rope_parameters={"rope_type": "default", "rope_theta": 1e6}))
    assert old == new and old.rope_theta == 1e6 and old.num_kv_heads == 2
    # No head_dim in config.json: transformers' Qwen3Config default (128) for dense Qwen3,
    # hidden_size / heads for Qwen3-MoE.
    assert old.head_dim == 128 and config_from_hf(_base_config(head_dim=4)).head_dim == 4
    moe = config_from_hf(
        _base_config(
            model_type="qwen3_moe",
            num_hidden_layers=4,
            num_local_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=4,
            decoder_sparse_step=2,
        )
    )
    assert moe.num_experts == 8 and moe.moe_layer_indices == (1, 3) and not moe.norm_topk_prob
    assert moe.head_dim == 4


@pytest.mark.parametrize(
    "fields,match",
    [
        (dict(model_type="llama"), "model_type"),
        (dict(architectures=["Qwen3ForSequenceClassification"]), "Qwen3ForSequenceClassification"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(attention_bias=True), "attention_bias"),
        (dict(use_sliding_window=True), "use_sliding_window"),
        (
            dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}),
            "rope_type",
        ),
        (dict(rope_scaling={"type": "linear", "factor": 2.0}), "rope_type"),
    ],
)
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
    from policyopt.rl.loop import build
    from tests.rl.test_trainer import tiny

    hf_model = _hf_model("moe")
    hf_model.save_pretrained(tmp_path)
    extra = (
        f"model.pretrained={tmp_path},model.moe_dispatch=blocked,model.moe_block_size=8,"
        "model.moe_decode_dispatch=ragged,model.moe_weight_gather=onehot,"
        "model.moe_chunk_rows=64"
    )
    config = tiny("grpo", "tiny_moe", extra=extra)
    with pytest.raises(ValueError, match="num_layers"):  # tiny() shrinks num_layers
        build.make_model(config, vocab_size=0)
    config.unlock()
    config.model.num_layers = None
    cfg = build.make_model(config, vocab_size=0).config
    assert (
        cfg.moe_dispatch,
        cfg.moe_block_size,
        cfg.moe_decode_dispatch,
        cfg.moe_weight_gather,
        cfg.moe_chunk_rows,
    ) == ("blocked", 8, "ragged", "onehot", 64)
    assert cfg.num_experts == hf_model.config.num_experts


def test_wrong_tensor_shape_names_both_shapes(tmp_path):
    """The checkpoint's own shape, what it maps to, and what the parameter needs."""
    from safetensors.numpy import load_file, save_file

    hf_model = _hf_model("dense")
    hf_model.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    good = dict(tensors)
    tensors["model.layers.0.mlp.gate_proj.weight"] = tensors["model.layers.0.mlp.gate_proj.weight"][
        :39
    ]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(
        ValueError,
        match=r"'model\.layers\.0\.mlp\.gate_proj\.weight' has shape "
        r"\(39, 32\), which maps to \(32, 39\) instead of "
        r"\(32, 40\) for layers\.0\.mlp\.gate_proj",
    ):
        from_pretrained(str(tmp_path))
    # A shape that the head split cannot even reshape: 60 rows for 4 heads of 16.
    good["model.layers.1.self_attn.q_proj.weight"] = good["model.layers.1.self_attn.q_proj.weight"][
        :60
    ]
    save_file(good, tmp_path / "model.safetensors")
    with pytest.raises(
        ValueError,
        match=r"'model\.layers\.1\.self_attn\.q_proj\.weight' has shape "
        r"\(60, 32\), which does not map to \(32, 4, 16\)",
    ):
        from_pretrained(str(tmp_path))


def _numpy_balance_statistics(layer_logits, mask, k):
    """Per layer: f_le = c_le / (N k) and P_le = mean_n softmax(z_n)_e over valid tokens."""
    fractions, mean_probs = [], []
    valid = mask.reshape(-1).astype(bool)
    for logits in layer_logits:
        logits = np.asarray(logits, np.float64)[valid]
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        chosen = np.argsort(-probs, axis=-1)[:, :k]
        counts = np.bincount(chosen.ravel(), minlength=logits.shape[-1])
        fractions.append(counts / (len(logits) * k))
        mean_probs.append(probs.mean(0))
    return np.array(fractions), np.array(mean_probs)


@pytest.mark.parametrize("num_layers", [1, 3])
def test_load_balancing_loss_against_transformers(num_layers):
    """LB = E sum_e f_e P_e per layer (1 at balance), mean over layers here; transformers'
    load_balancing_loss_func = k E sum_e (mean_l f_le)(mean_l P_le) (k at balance): for
    one layer exactly k * LB (policyopt.models.router.router_aux)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from policyopt.models.router import route, router_aux

    num_experts, k, batch, length = 8, 3, 2, 40
    rng = np.random.default_rng(num_layers)
    layer_logits = rng.normal(size=(num_layers, batch * length, num_experts)).astype(np.float32)
    mask = np.ones((batch, length), np.int64)
    mask[1, 25:] = 0
    ours = []
    for logits in layer_logits:
        ids, _, probs = route(jnp.asarray(logits), k, True)
        ours.append(
            float(
                router_aux(
                    jnp.asarray(logits), probs, ids, jnp.asarray(mask.reshape(-1) > 0), num_experts
                )["load_balancing_loss"]
            )
        )
    hf = float(
        load_balancing_loss_func(
            tuple(torch.tensor(l) for l in layer_logits),
            num_experts,
            k,
            attention_mask=torch.tensor(mask),
        )
    )
    fractions, mean_probs = _numpy_balance_statistics(layer_logits, mask, k)
    np.testing.assert_allclose(ours, num_experts * np.sum(fractions * mean_probs, -1), rtol=1e-5)
    np.testing.assert_allclose(
        hf, k * num_experts * np.sum(fractions.mean(0) * mean_probs.mean(0)), rtol=1e-5
    )
    if num_layers == 1:
        np.testing.assert_allclose(hf, k * ours[0], rtol=1e-5)
    else:  # pooling before the product: not k times the mean of the layers' losses
        assert abs(hf - k * np.mean(ours)) > 1e-3 * hf


def test_model_load_balancing_loss_is_1_over_k_of_transformers_aux_loss(tmp_path):
    """A checkpoint with one MoE layer, right-padded rows: Qwen3MoeForCausalLM's aux_loss
    (output_router_logits=True) is exactly k times ModelOutput.aux["load_balancing_loss"]."""
    hf_model = _hf_model("moe", mlp_only_layers=[0, 2])
    hf_model.save_pretrained(tmp_path)
    model = from_pretrained(str(tmp_path))
    assert model.config.moe_layer_indices == (1,)
    tokens = _tokens(batch=3, length=9)
    mask = np.ones(tokens.shape, np.int64)
    mask[1, 6:] = 0
    mask[2, 3:] = 0
    with torch.no_grad():
        hf = hf_model(
            torch.tensor(tokens, dtype=torch.long),
            attention_mask=torch.tensor(mask),
            output_router_logits=True,
        )
    # Jitted: this shape occurs nowhere else (eagerly, every op would compile on its own).
    graphdef, state = nnx.split(model)
    ours = jax.jit(
        lambda state, tokens, mask: nnx.merge(graphdef, state)(tokens, attention_mask=mask).aux[
            "load_balancing_loss"
        ]
    )(state, jnp.asarray(tokens), jnp.asarray(mask))
    k = hf_model.config.num_experts_per_tok
    np.testing.assert_allclose(float(hf.aux_loss), k * float(ours), rtol=1e-5)
