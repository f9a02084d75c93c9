"""HuggingFace checkpoints: read and write ``Qwen3ForCausalLM`` and
``Qwen3MoeForCausalLM`` folders (config.json + safetensors, single file or sharded with
``model.safetensors.index.json``).

    model = from_pretrained("path/to/Qwen3-30B-A3B")        # -> Transformer
    save_pretrained(model, "path/to/export")                 # transformers loads it back

Weight layout: HuggingFace stores ``nn.Linear`` weights as [out, in]; policyopt keeps
[in, out] with heads split out, so every matrix is transposed on the way in and out.
Experts are read either per expert (``mlp.experts.{e}.gate_proj.weight``: the Qwen
release format, also what transformers 5 writes) or fused (``mlp.experts.gate_up_proj``
[E, 2F, D], ``mlp.experts.down_proj`` [E, D, F]: transformers 5's in-memory layout), and
written per expert.

A model with ``scan_layers`` holds each run of identical layers as one stacked array per
parameter (``policyopt.models.transformer``); HF's per-layer tensors are read into and
written out of its slices, one stacked parameter at a time.

A model with LoRA adapters (``policyopt.models.lora``) exports merged (``save_pretrained``,
W + (alpha / r) A B: a plain folder) or as a PEFT adapter folder (``save_adapters``:
adapter_config.json + adapter_model.safetensors, PEFT's key names); ``from_pretrained``
adds fresh adapters with ``lora=LoRAConfig(...)``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from policyopt import sharding
from policyopt.models import lora
from policyopt.models.config import ModelConfig
from policyopt.models.transformer import Transformer, add_adapters

_ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
_INDEX_FILE = "model.safetensors.index.json"
_SINGLE_FILE = "model.safetensors"


# --------------------------------------------------------------------------- config


def config_from_hf(hf: dict, **overrides) -> ModelConfig:
    """ModelConfig from a transformers config.json dict (Qwen3 or Qwen3-MoE).

    Reads both the current field names (``rope_parameters`` nested dict,
    ``num_local_experts``) and the older ones (top-level ``rope_theta`` / ``rope_scaling``,
    ``num_experts``). Raises ValueError naming any field or architecture whose meaning
    this model does not implement.
    """
    model_type = hf.get("model_type")
    if model_type not in _ARCHITECTURES:
        raise ValueError(
            f"config.json model_type {model_type!r} is not supported; expected one of "
            f"{sorted(_ARCHITECTURES)}"
        )
    for arch in hf.get("architectures") or []:
        if arch not in _ARCHITECTURES.values():
            raise ValueError(
                f"config.json architectures: {arch!r} is not supported; expected "
                f"{sorted(_ARCHITECTURES.values())}"
            )

    def require(field, ok, expected):
        if field in hf and hf[field] is not None and not ok(hf[field]):
            raise ValueError(
                f"config.json field {field!r} = {hf[field]!r} is not supported; expected {expected}"
            )

    require("hidden_act", lambda v: v == "silu", "'silu'")
    require("attention_bias", lambda v: v is False, "false")
    require("use_sliding_window", lambda v: v is False, "false")
    require("attention_dropout", lambda v: v == 0, "0")
    require(
        "layer_types",
        lambda v: all(t == "full_attention" for t in v),
        "only 'full_attention' layers",
    )
    rope = hf.get("rope_parameters")
    if isinstance(rope, dict) and "full_attention" in rope:  # per-layer-type form
        rope = rope["full_attention"]
    if rope is None:
        rope = dict(hf.get("rope_scaling") or {})
        rope.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(
            f"config.json rope_parameters.rope_type = {rope_type!r} is not supported; "
            "expected 'default'"
        )
    num_layers = hf["num_hidden_layers"]
    num_heads = hf["num_attention_heads"]
    fields = dict(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        # transformers' Qwen3Config defaults head_dim to 128; Qwen3-MoE's attention falls back
        # to hidden_size / heads.
        head_dim=hf.get("head_dim")
        or (128 if model_type == "qwen3" else hf["hidden_size"] // num_heads),
        intermediate_size=hf["intermediate_size"],
        rope_theta=float(rope["rope_theta"]),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=hf.get("max_position_embeddings", 32768),
        initializer_range=hf.get("initializer_range", 0.02),
    )
    if model_type == "qwen3_moe":
        num_experts = hf.get("num_experts", hf.get("num_local_experts"))
        step = hf.get("decoder_sparse_step") or 1
        mlp_only = set(hf.get("mlp_only_layers") or [])
        moe_layers = tuple(
            i for i in range(num_layers) if i not in mlp_only and (i + 1) % step == 0
        )
        fields.update(
            num_experts=num_experts,
            num_experts_per_tok=hf["num_experts_per_tok"],
            moe_intermediate_size=hf["moe_intermediate_size"],
            # transformers' Qwen3MoeConfig defaults norm_topk_prob to False.
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            moe_layers=None if len(moe_layers) == num_layers else moe_layers,
        )
    fields.update(overrides)
    return ModelConfig(**fields)


def config_to_hf(config: ModelConfig) -> dict:
    """transformers config.json dict for a ModelConfig."""
    model_type = "qwen3_moe" if config.is_moe else "qwen3"
    hf = {
        "architectures": [_ARCHITECTURES[model_type]],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.intermediate_size,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "tie_word_embeddings": config.tie_word_embeddings,
        "max_position_embeddings": config.max_position_embeddings,
        "initializer_range": config.initializer_range,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        # Both spellings: rope_parameters for transformers >= 5, rope_theta for 4.x.
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "rope_theta": config.rope_theta,
        "dtype": config.param_dtype,
        "use_cache": True,
    }
    if config.is_moe:
        moe = set(config.moe_layer_indices)
        hf.update(
            num_experts=config.num_experts,
            num_experts_per_tok=config.num_experts_per_tok,
            moe_intermediate_size=config.expert_intermediate_size,
            norm_topk_prob=config.norm_topk_prob,
            decoder_sparse_step=1,
            mlp_only_layers=[i for i in range(config.num_layers) if i not in moe],
            router_aux_loss_coef=0.001,
            output_router_logits=False,
        )
    return hf


# --------------------------------------------------------------------------- weights
#
# One table row per parameter: (policyopt state path, HF tensor name(s), from_hf, to_hf).
# from_hf maps the HF tensor(s) to the policyopt array; to_hf the reverse, returning
# one array per HF name.


def _linear_in(shape):
    """HF [out, in] -> policyopt [in, *shape(out)]."""
    return lambda w: w.T.reshape(w.shape[1], *shape)


def _weight_table(config: ModelConfig) -> Iterator[tuple[tuple, list[str], Callable, Callable]]:
    d, h, hkv, dh = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
    same = (lambda w: w, lambda x: [x])
    yield ("embed",), ["model.embed_tokens.weight"], *same
    yield ("final_norm", "scale"), ["model.norm.weight"], *same
    if not config.tie_word_embeddings:
        yield ("lm_head",), ["lm_head.weight"], (lambda w: w.T), (lambda x: [x.T])
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        yield ("layers", i, "input_norm", "scale"), [p + "input_layernorm.weight"], *same
        yield (
            ("layers", i, "post_attention_norm", "scale"),
            [p + "post_attention_layernorm.weight"],
            *same,
        )
        for name, heads in (("q_proj", h), ("k_proj", hkv), ("v_proj", hkv)):
            yield (
                ("layers", i, "attn", name),
                [p + f"self_attn.{name}.weight"],
                _linear_in((heads, dh)),
                lambda x: [x.reshape(d, -1).T],
            )
        yield (
            ("layers", i, "attn", "o_proj"),
            [p + "self_attn.o_proj.weight"],
            (lambda w: w.T.reshape(h, dh, d)),
            lambda x: [x.reshape(h * dh, d).T],
        )
        for name in ("q_norm", "k_norm"):
            yield ("layers", i, "attn", name, "scale"), [p + f"self_attn.{name}.weight"], *same
        if i in config.moe_layer_indices:
            yield (
                ("layers", i, "mlp", "router"),
                [p + "mlp.gate.weight"],
                (lambda w: w.T),
                (lambda x: [x.T]),
            )
            e = config.num_experts
            for name in ("gate_proj", "up_proj", "down_proj"):
                names = [p + f"mlp.experts.{j}.{name}.weight" for j in range(e)]
                yield (
                    ("layers", i, "mlp", name),
                    names,
                    (lambda *ws: np.stack([w.T for w in ws])),
                    (lambda x: [w.T for w in x]),
                )
        else:
            for name in ("gate_proj", "up_proj", "down_proj"):
                yield (
                    ("layers", i, "mlp", name),
                    [p + f"mlp.{name}.weight"],
                    (lambda w: w.T),
                    (lambda x: [x.T]),
                )


def _locate(config: ModelConfig, path_key: tuple) -> tuple[tuple, int | None]:
    """The state path of a weight-table row and the row's index along the stacked
    ``layers`` axis: (path_key, None) per layer; ("layers", run, ...), offset with
    ``scan_layers`` (``ModelConfig.layer_run``)."""
    if path_key[0] != "layers" or not config.scan_layers:
        return path_key, None
    run, offset = config.layer_run(path_key[1])
    return ("layers", run) + tuple(path_key[2:]), offset


def _table_by_variable(config: ModelConfig) -> dict[tuple, list]:
    """The weight table grouped by state path: {path: [(offset, row), ...]}, the rows of
    a stacked parameter in layer order (one row, offset None, for any other)."""
    groups: dict[tuple, list] = {}
    for row in _weight_table(config):
        state_path, offset = _locate(config, row[0])
        groups.setdefault(state_path, []).append((offset, row))
    return groups


class _Reader:
    """Lazy access to the tensors of a single-file or sharded safetensors checkpoint."""

    def __init__(self, path: str):
        from safetensors import safe_open

        index = os.path.join(path, _INDEX_FILE)
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        else:
            files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
            if not files:
                raise FileNotFoundError(f"no *.safetensors file (nor {_INDEX_FILE}) in {path}")
            weight_map = {}
            for name in files:
                with safe_open(os.path.join(path, name), framework="np") as f:
                    weight_map.update({key: name for key in f.keys()})
        self.path, self.weight_map, self._open = path, weight_map, {}
        self._safe_open = safe_open

    def __contains__(self, name):
        return name in self.weight_map

    def _file(self, name: str):
        if name not in self.weight_map:
            raise KeyError(f"tensor {name!r} is missing from the checkpoint in {self.path}")
        file = self.weight_map[name]
        if file not in self._open:
            self._open[file] = self._safe_open(os.path.join(self.path, file), framework="np")
        return self._open[file]

    def get(self, name: str) -> np.ndarray:
        return self._file(name).get_tensor(name)

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored shape of tensor ``name``, read from the header (no data)."""
        return tuple(self._file(name).get_slice(name).get_shape())

    def close(self):
        self._open.clear()


def _fused_experts(reader: _Reader, prefix: str, name: str, f: int):
    """Experts stored fused by transformers 5 ([E, 2F, D] gate_up and [E, D, F] down)."""
    if name == "down_proj":
        return np.swapaxes(reader.get(prefix + "mlp.experts.down_proj"), 1, 2)
    gate_up = reader.get(prefix + "mlp.experts.gate_up_proj")
    part = gate_up[:, :f] if name == "gate_proj" else gate_up[:, f:]
    return np.swapaxes(part, 1, 2)


def _read_tensor(reader: _Reader, config: ModelConfig, row, expected: tuple) -> np.ndarray:
    """The policyopt array of one weight-table row, read from the checkpoint and checked
    against ``expected`` (the shape of one layer's parameter)."""
    path_key, names, from_hf, _ = row
    target = ".".join(map(str, path_key))
    fused = len(names) > 1 and names[0] not in reader
    if fused:
        prefix = names[0].split("mlp.experts.")[0]
        source = prefix + (
            "mlp.experts.down_proj" if path_key[-1] == "down_proj" else "mlp.experts.gate_up_proj"
        )
    else:
        source = names[0]  # of several (one per expert): the first
    try:
        if fused:
            value = _fused_experts(reader, prefix, path_key[-1], config.expert_intermediate_size)
        else:
            value = from_hf(*[reader.get(n) for n in names])
    except ValueError as error:  # a reshape or stack that the shapes do not allow
        raise ValueError(
            f"tensor {source!r} has shape {reader.shape(source)}, which does "
            f"not map to {expected} for {target}: {error}"
        ) from error
    if tuple(value.shape) != expected:
        raise ValueError(
            f"tensor {source!r} has shape {reader.shape(source)}, which maps to "
            f"{tuple(value.shape)} instead of {expected} for {target}"
        )
    return value


def from_pretrained(
    path: str, *, mesh: Mesh | None = None, seed: int = 0, **config_overrides
) -> Transformer:
    """Load a Qwen3 / Qwen3-MoE checkpoint folder into a policyopt Transformer.

    The tensors are read and placed one at a time. On a mesh of several devices (``mesh``,
    or the one set by ``jax.set_mesh``) each device receives only its shard of each
    tensor, by the parameter's logical axes (``policyopt.sharding.place_host_array``, the
    placement of ``shard_params``): the host holds about one tensor at a time and no
    device more than its shards, so a checkpoint larger than one device loads. Without a
    mesh every tensor goes whole to the default device.

    Args:
      path: folder with config.json and model.safetensors or sharded
        model-XXXXX-of-YYYYY.safetensors + model.safetensors.index.json.
      mesh: the mesh to place the parameters on; default the one set by
        ``jax.set_mesh``, if any.
      seed: the adapters' key, with ``lora`` (A drawn as ``add_adapters`` draws it).
      **config_overrides: ModelConfig fields to set, e.g. dtype="bfloat16",
        param_dtype="bfloat16", moe_dispatch="capacity", scan_layers=True, remat="full",
        lora=LoRAConfig(rank=8) (adapters added to the loaded weights, B zero).
    Returns:
      Transformer with the checkpoint's weights (in param_dtype).
    """
    config_path = os.path.join(path, "config.json")
    if not os.path.exists(config_path):
        raise FileNotFoundError(f"{config_path} not found: expected a HuggingFace model folder")
    adapters = config_overrides.pop("lora", None)
    with open(config_path) as f:
        config = config_from_hf(json.load(f), **config_overrides)
    if adapters is not None and adapters.enabled:
        config.replace(lora=adapters)  # the targets and ranks checked before any tensor is read
    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    variables = dict(nnx.to_flat_state(state))
    reader = _Reader(path)
    loaded = {}
    for state_path, rows in _table_by_variable(config).items():
        variable = variables[state_path]
        expected = tuple(variable.get_value().shape)
        if rows[0][0] is not None:  # stacked: one slice per layer
            expected = expected[1:]
        values = [
            np.asarray(_read_tensor(reader, config, row, expected), config.weight_dtype)
            for _, row in rows
        ]
        value = values[0] if rows[0][0] is None else np.stack(values)
        del values
        loaded[state_path] = variable.replace(
            sharding.place_host_array(value, variable.get_metadata()["logical_axes"], mesh)
        )
    reader.close()
    missing = set(variables) - set(loaded)
    if missing:
        raise ValueError(f"parameters not set by the checkpoint: {sorted(missing)}")
    state = nnx.from_flat_state([(k, loaded[k]) for k, _ in nnx.to_flat_state(state)])
    model = nnx.merge(graphdef, state)
    if adapters is not None and adapters.enabled:
        with contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh):
            add_adapters(model, adapters, jax.random.key(seed))
    return model


def save_pretrained(
    model: Transformer,
    path: str,
    *,
    max_shard_size: int | None = None,
    dtype: str | None = None,
    merge_lora: bool = True,
    base_model_name_or_path: str | None = None,
) -> None:
    """Write ``model`` as a HuggingFace folder (config.json + safetensors).

    Args:
      model: a policyopt Transformer.
      path: output folder (created).
      max_shard_size: bytes per safetensors file; when the weights exceed it they are split
        into model-XXXXX-of-YYYYY.safetensors with model.safetensors.index.json.
      dtype: storage dtype ("float32", "bfloat16"); default the parameters' own dtype.
      merge_lora: for a model with LoRA adapters (``policyopt.models.lora``): True writes
        the model's weights with the adapters merged in (W + (alpha / r) A B, a plain
        Qwen3 folder); False writes the adapters alone as a PEFT folder
        (``save_adapters``).
      base_model_name_or_path: recorded in a PEFT folder's adapter_config.json.

    On a multi-process job every process calls this (parameters split across processes
    are gathered, ``policyopt.sharding.to_host``) and process 0 writes the folder.
    """
    from safetensors.numpy import save_file

    config = model.config
    state = nnx.state(model, nnx.Param)
    if config.lora.enabled:
        if not merge_lora:
            save_adapters(model, path, dtype=dtype, base_model_name_or_path=base_model_name_or_path)
            return
        _, adapters, frozen = lora.split(model)
        merge = jax.jit(lambda f, a: lora.merged_params(f, a, config.lora.scale))
        state = merge(frozen, adapters)
    variables = dict(nnx.to_flat_state(state))
    tensors: dict[str, np.ndarray] = {}
    for state_path, rows in _table_by_variable(config).items():
        value = sharding.to_host(variables[state_path].get_value())
        if dtype is not None:
            value = value.astype(jnp.dtype(dtype))
        for offset, (_, names, _, to_hf) in rows:
            layer_value = value if offset is None else value[offset]
            for name, array in zip(names, to_hf(layer_value)):
                tensors[name] = np.ascontiguousarray(array)
    if not sharding.is_primary():
        return
    os.makedirs(path, exist_ok=True)
    hf_config = config_to_hf(config)
    if dtype is not None:
        hf_config["dtype"] = dtype
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2, sort_keys=True)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].nbytes
        if max_shard_size is not None and shards[-1] and size + nbytes > max_shard_size:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], os.path.join(path, _SINGLE_FILE), metadata=metadata)
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(path, file), metadata=metadata)
        weight_map.update({name: file for name in shard})
    index = {
        "metadata": {"total_size": int(sum(t.nbytes for t in tensors.values()))},
        "weight_map": weight_map,
    }
    with open(os.path.join(path, _INDEX_FILE), "w") as f:
        json.dump(index, f, indent=2, sort_keys=True)


# --------------------------------------------------------------------------- PEFT adapters

_PEFT_PREFIX = "base_model.model."
_ADAPTER_CONFIG = "adapter_config.json"
_ADAPTER_FILE = "adapter_model.safetensors"


def _peft_tensors(model: Transformer) -> tuple[dict[str, np.ndarray], list[str]]:
    """PEFT's tensors of ``model``'s adapters, ``{key: array}``, and the adapted modules'
    HF names. For HF weight ``W [out, in]`` of module ``m`` (``m.weight``), PEFT keeps
    ``m.lora_A.weight [r, in]`` and ``m.lora_B.weight [out, r]`` with
    ``W' = W + (alpha / r) B A``; each expert its own pair (per-expert names, as
    ``save_pretrained`` writes the experts)."""
    config = model.config
    pairs = lora.adapter_pairs(nnx.state(model, nnx.LoRAParam))
    tensors, modules = {}, []
    for state_path, rows in _table_by_variable(config).items():
        if state_path not in pairs:
            continue
        a, b = (sharding.to_host(x) for x in pairs[state_path])
        for offset, (_, names, _, _) in rows:
            layer_a = a if offset is None else a[offset]
            layer_b = b if offset is None else b[offset]
            experts = len(names) > 1  # one HF name per expert: [E, ...] adapters
            for e, name in enumerate(names):
                ea, eb = (layer_a[e], layer_b[e]) if experts else (layer_a, layer_b)
                rank = ea.shape[-1]
                module = name.removesuffix(".weight")
                tensors[f"{_PEFT_PREFIX}{module}.lora_A.weight"] = np.ascontiguousarray(
                    ea.reshape(-1, rank).T
                )
                tensors[f"{_PEFT_PREFIX}{module}.lora_B.weight"] = np.ascontiguousarray(
                    eb.reshape(rank, -1).T
                )
                modules.append(module)
    return tensors, modules


def save_adapters(
    model: Transformer,
    path: str,
    *,
    dtype: str | None = None,
    base_model_name_or_path: str | None = None,
) -> None:
    """Write ``model``'s LoRA adapters as a PEFT folder: ``adapter_config.json`` (LORA, r,
    lora_alpha, the adapted modules as a ``target_modules`` regular expression of their
    HF names) and ``adapter_model.safetensors`` (``base_model.model.<module>.lora_A.weight``
    / ``lora_B.weight``); loaded with ``peft.PeftModel.from_pretrained`` on the base model.

    Raises:
      ValueError: ``model`` has no adapters.
    """
    from safetensors.numpy import save_file

    config = model.config
    if not config.lora.enabled:
        raise ValueError("save_adapters: the model has no LoRA adapters (config.lora.rank = 0)")
    tensors, modules = _peft_tensors(model)
    if dtype is not None:
        tensors = {k: v.astype(jnp.dtype(dtype)) for k, v in tensors.items()}
    if not sharding.is_primary():
        return
    os.makedirs(path, exist_ok=True)
    pattern = "|".join(re.escape(m) for m in sorted(set(modules)))
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": config.lora.rank,
        "lora_alpha": config.lora.alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "target_modules": f"({pattern})",
    }
    with open(os.path.join(path, _ADAPTER_CONFIG), "w") as f:
        json.dump(adapter_config, f, indent=2, sort_keys=True)
    save_file(tensors, os.path.join(path, _ADAPTER_FILE), metadata={"format": "pt"})
