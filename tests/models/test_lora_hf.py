"""LoRA export (``policyopt.models.hf``): a merged export loaded back (by policyopt and by
transformers) gives the adapted model's logits; a PEFT folder's tensors, applied to the
base checkpoint as PEFT applies them (W + (alpha / r) B A per module), give them too;
adapters added on import start as the base."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from policyopt.models import from_pretrained, save_adapters, save_pretrained
from policyopt.models.lora import LoRAConfig
from tests.models import test_hf
from tests.models.test_hf import _hf_forward, _hf_model, _tokens
from tests.models.test_lora import _randomise_b

torch = transformers = None  # test_hf.import_torch, when the file's first test runs


@pytest.fixture(scope="module", autouse=True)
def _torch_and_transformers():
    global torch, transformers
    torch, transformers = test_hf.import_torch()


RANK, ALPHA = 2, 5.0


def _adapted(kind, scan_layers, tmp_path):
    """A transformers model saved to ``tmp_path/hf`` and imported with adapters on every
    target (B random)."""
    hf_model = _hf_model(kind)
    hf_model.save_pretrained(tmp_path / "hf")
    adapters = LoRAConfig(rank=RANK, alpha=ALPHA, targets=("all",))
    model = from_pretrained(str(tmp_path / "hf"), scan_layers=scan_layers, lora=adapters, seed=3)
    return hf_model, model


@pytest.mark.parametrize("scan_layers", [False, True], ids=["loop", "scan"])
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_merged_export_reloads_to_the_adapted_logits(kind, scan_layers, tmp_path):
    hf_model, model = _adapted(kind, scan_layers, tmp_path)
    tokens = _tokens()
    # Zero B: the import with adapters is the base model.
    np.testing.assert_array_equal(
        model(jnp.asarray(tokens)).logits,
        from_pretrained(str(tmp_path / "hf"), scan_layers=scan_layers)(jnp.asarray(tokens)).logits,
    )
    _randomise_b(model, std=0.2)
    want = np.asarray(model(jnp.asarray(tokens)).logits)
    save_pretrained(model, str(tmp_path / "merged"), merge_lora=True)
    again = from_pretrained(str(tmp_path / "merged"), scan_layers=scan_layers)
    assert not any("lora" in str(p) for p, _ in nnx.to_flat_state(nnx.state(again)))
    np.testing.assert_allclose(again(jnp.asarray(tokens)).logits, want, rtol=1e-5, atol=1e-5)
    reloaded = type(hf_model).from_pretrained(tmp_path / "merged").eval()
    got = _hf_forward(reloaded, tokens)[0]
    assert np.max(np.abs(got - want)) / np.max(np.abs(want)) < 1e-4
    base = _hf_forward(hf_model, tokens)[0]
    assert np.max(np.abs(base - want)) > 1e-3  # the adapters changed the model


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_peft_folder_applied_to_the_base_gives_the_adapted_logits(kind, tmp_path):
    from safetensors.numpy import load_file, save_file

    hf_model, model = _adapted(kind, False, tmp_path)
    _randomise_b(model, std=0.2)
    save_adapters(model, str(tmp_path / "peft"), base_model_name_or_path="tiny")
    with open(tmp_path / "peft" / "adapter_config.json") as f:
        adapter_config = json.load(f)
    assert adapter_config["peft_type"] == "LORA"
    assert (adapter_config["r"], adapter_config["lora_alpha"]) == (RANK, ALPHA)
    lora_tensors = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    assert all(k.startswith("base_model.model.model.layers.") for k in lora_tensors)
    if kind == "moe":
        assert "base_model.model.model.layers.0.mlp.gate.lora_A.weight" in lora_tensors
        assert (
            "base_model.model.model.layers.0.mlp.experts.5.down_proj.lora_B.weight" in lora_tensors
        )
    # PEFT's LoRA on the base checkpoint's own tensors: W [out, in] + (alpha / r) B A.
    base = load_file(str(tmp_path / "hf" / "model.safetensors"))
    pattern = adapter_config["target_modules"]
    scale = adapter_config["lora_alpha"] / adapter_config["r"]
    for key in [k for k in lora_tensors if k.endswith("lora_A.weight")]:
        module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
        assert __import__("re").fullmatch(pattern, module), module
        a, b = lora_tensors[key], lora_tensors[key.replace("lora_A", "lora_B")]
        weight = module + ".weight"
        assert weight in base, weight
        base[weight] = (base[weight] + scale * b @ a).astype(base[weight].dtype)
    os.makedirs(tmp_path / "applied")
    save_file(base, str(tmp_path / "applied" / "model.safetensors"), metadata={"format": "pt"})
    hf_model.config.save_pretrained(tmp_path / "applied")
    applied = type(hf_model).from_pretrained(tmp_path / "applied").eval()
    tokens = _tokens()
    got = _hf_forward(applied, tokens)[0]
    want = np.asarray(model(jnp.asarray(tokens)).logits)
    assert np.max(np.abs(got - want)) / np.max(np.abs(want)) < 1e-4


def test_save_adapters_needs_adapters(tmp_path):
    _hf_model("dense").save_pretrained(tmp_path / "hf")
    with pytest.raises(ValueError, match="has no LoRA adapters"):
        save_adapters(from_pretrained(str(tmp_path / "hf")), str(tmp_path / "peft"))
