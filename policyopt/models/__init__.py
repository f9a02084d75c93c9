"""Dense and Mixture-of-Experts transformers (Qwen3 / Qwen3-MoE architecture) with
routing capture and replay, a KV cache, and HuggingFace checkpoint import / export.

    from policyopt.models import ModelConfig, Transformer, from_pretrained, save_pretrained
    model = Transformer(ModelConfig(...), rngs=nnx.Rngs(0))
    out = model(tokens)                        # out.logits, out.hidden, out.routing, out.aux
    model(tokens, routing=out.routing)         # routing replay (R2 / R3)
"""

from policyopt.models.attention import KVCache
from policyopt.models.config import Architecture, Kernels, ModelConfig
from policyopt.models.hf import (
    config_from_hf,
    config_to_hf,
    from_pretrained,
    save_adapters,
    save_pretrained,
)
from policyopt.models.interface import Cache, PolicyModel
from policyopt.models.presets import PRESETS, preset
from policyopt.models.transformer import ModelOutput, Transformer
from policyopt.sharding import LOGICAL_AXIS_RULES, logical_to_mesh_axes, param_partition_specs

__all__ = [
    "KVCache",
    "Architecture",
    "Kernels",
    "ModelConfig",
    "PolicyModel",
    "Cache",
    "ModelOutput",
    "Transformer",
    "preset",
    "PRESETS",
    "from_pretrained",
    "save_pretrained",
    "save_adapters",
    "LOGICAL_AXIS_RULES",
    "logical_to_mesh_axes",
    "param_partition_specs",
    "config_from_hf",
    "config_to_hf",
]
