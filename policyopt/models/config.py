"""Model configuration shared by the dense and Mixture-of-Experts transformer.

``Architecture`` is what a checkpoint fixes (sizes, heads, experts, vocabulary, RoPE,
norms): ``num_experts == 0`` gives the dense Qwen3 architecture, ``num_experts > 0`` the
Qwen3-MoE one (MoE blocks on every layer, or on the layers listed in ``moe_layers``).
``Kernels`` is what a run chooses to compute it with (dtypes, attention and MoE kernels,
scan, remat). ``ModelConfig`` is both, and the LoRA adapters, read as one flat record
(``config.hidden_size``, ``config.moe_dispatch``); ``config.architecture`` and
``config.kernels`` are its two halves. The HuggingFace names of the architecture's fields
are in ``policyopt.models.hf``.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from policyopt.models.attention_ops import IMPLEMENTATIONS, check_implementation
from policyopt.models.lora import LoRAConfig

_DTYPES = ("float32", "bfloat16", "float16")
_DISPATCH = ("ragged", "megablox", "blocked", "dense", "gathered", "capacity")
_GATHER = ("auto", "take", "onehot")
_REMAT = ("none", "full", "save_dots")

_EP_TRANSPORT = ("auto", "ragged_all_to_all", "all_to_all")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Architecture:
    """The architecture of a Qwen3 / Qwen3-MoE style decoder: what a checkpoint fixes.

    Attributes:
      vocab_size: number of token ids V.
      hidden_size: residual width D.
      num_layers: number of decoder blocks L.
      num_heads: query heads H.
      num_kv_heads: key/value heads (grouped-query attention; H % num_kv_heads == 0).
      head_dim: width of one attention head Dh (need not equal D / H, as in Qwen3).
      intermediate_size: SwiGLU width of the dense MLP (dense model, or dense layers of an
        MoE model).
      num_experts: experts per MoE block E; 0 means a dense model.
      num_experts_per_tok: experts chosen per token k (top-k routing).
      moe_intermediate_size: SwiGLU width of one expert; None = intermediate_size.
      moe_layers: indices of the layers that are MoE blocks; None = every layer (when
        num_experts > 0).
      norm_topk_prob: renormalise the k gathered router probabilities to sum to one
        (Qwen3-MoE: True; Mixtral-style softmax-then-top-k without it: False).
      rope_theta: RoPE base (Qwen3: 1e6).
      rms_norm_eps: epsilon of every RMSNorm.
      tie_word_embeddings: output projection = input embedding transposed.
      max_position_embeddings: recorded for checkpoint export only (RoPE needs no table).
      initializer_range: standard deviation of the normal initialiser of weight matrices.
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: int | None = None
    moe_layers: tuple[int, ...] | None = None
    norm_topk_prob: bool = True
    rope_theta: float = 1e6
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    initializer_range: float = 0.02

    def __post_init__(self):
        if self.moe_layers is not None and not isinstance(self.moe_layers, tuple):
            object.__setattr__(self, "moe_layers", tuple(int(i) for i in self.moe_layers))
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if self.num_experts < 0:
            raise ValueError(f"ModelConfig.num_experts must be >= 0, got {self.num_experts}")
        if self.num_experts > 0:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ValueError(
                    "ModelConfig.num_experts_per_tok must be in "
                    f"[1, num_experts={self.num_experts}]"
                    f", got {self.num_experts_per_tok}"
                )
            if self.moe_layers is not None:
                bad = [i for i in self.moe_layers if not 0 <= i < self.num_layers]
                if bad or len(set(self.moe_layers)) != len(self.moe_layers):
                    raise ValueError(
                        "ModelConfig.moe_layers must be distinct layer indices in "
                        f"[0, {self.num_layers})"
                        f", got {self.moe_layers}"
                    )

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def expert_intermediate_size(self) -> int:
        return self.moe_intermediate_size or self.intermediate_size

    @property
    def moe_layer_indices(self) -> tuple[int, ...]:
        """Sorted indices of the MoE layers (empty for a dense model)."""
        if not self.is_moe:
            return ()
        if self.moe_layers is None:
            return tuple(range(self.num_layers))
        return tuple(sorted(self.moe_layers))

    @property
    def layer_runs(self) -> tuple[tuple[int, int], ...]:
        """Maximal runs [start, stop) of consecutive layers of one kind (all dense or all
        MoE), in order: ((0, L),) for a dense or an all-MoE model. With scan_layers each
        run is one stacked Block, scanned."""
        moe = set(self.moe_layer_indices)
        runs, start = [], 0
        for i in range(1, self.num_layers + 1):
            if i == self.num_layers or (i in moe) != (start in moe):
                runs.append((start, i))
                start = i
        return tuple(runs)

    def layer_run(self, layer: int) -> tuple[int, int]:
        """(run, offset): the run of ``layer_runs`` holding ``layer`` and its index in it."""
        for run, (start, stop) in enumerate(self.layer_runs):
            if start <= layer < stop:
                return run, layer - start
        raise ValueError(f"layer {layer} is not in [0, num_layers={self.num_layers})")

    @property
    def num_moe_layers(self) -> int:
        """L_moe: the leading dimension of the routing array."""
        return len(self.moe_layer_indices)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Kernels:
    """How a run computes the model: dtypes, kernels, layout of the layers, remat.

    Attributes:
      dtype: computation dtype of matmuls ("float32", "bfloat16", "float16"); norms,
        softmaxes, router and log-softmax always run in float32.
      param_dtype: storage dtype of the parameters.
      moe_dispatch: "ragged" (dropless: sort by expert + jax.lax.ragged_dot; the choice
        on TPUs, which have grouped-matmul kernels), "megablox" (as "ragged", the grouped
        matmuls by the megablox GMM Pallas kernel for TPUs that ships with JAX, also on
        each device's local experts on a mesh with an expert axis; on other backends it
        runs in Pallas interpret mode, for tests only), "blocked" (dropless:
        sort by expert, pad groups to blocks of moe_block_size rows, batched matmul; the
        fast choice for training on CPUs and GPUs, where XLA lowers ragged_dot to a dense
        product over every expert), "dense" (dropless: every token through every expert, weighted by
        its gates, 0 for the experts it did not choose, so a NaN or inf in any expert's
        output reaches every token; E / k times the expert FLOPs and [E, N, F]
        intermediates, in three batched matmuls with no sort or gather; for decoding
        small models), "gathered" (dropless: each expert's tokens gathered into a buffer
        of a small multiple of the mean load, chosen per call from a few static sizes,
        "dense" when the busiest expert overflows them all; for decoding, e.g. the CPU
        presets' moe_decode_dispatch) or "capacity" (one-hot dispatch into fixed
        per-expert buffers; overflow dropped).
      moe_decode_dispatch: the dispatch of calls with one token per row (the sampler's
        decode steps); None: moe_dispatch (set it explicitly to override a preset's). On
        an H200 at moe_0p5b's shape, "ragged" decoded faster (its dense product over the
        experts reads each weight once) and "blocked" trained and prefilled faster.
        Dropless dispatches agree up to float summation order.
      moe_block_size: rows per block of the "blocked" dispatch (CPU: 16-64; GPU: 256-512,
        so that each block's matmul is large enough for the matrix units).
      moe_chunk_rows: at most this many padded rows of the "blocked" dispatch go through
        the expert matmuls at a time: a ``jax.lax.map`` over chunks of blocks, each
        rematerialised in the backward, so the matmuls' activations, their gradients and
        the blocks' weight copies are one chunk's, not the whole buffer's (Qwen3-30B-A3B
        at 32k tokens a device: 524,288 rows). None: all at once. Rounded down to whole
        blocks (at least one).
      moe_weight_gather: how the "blocked" dispatch hands each block its expert's
        weights: "take" (indexed gather; fastest on CPU), "onehot" (a matmul with the
        one-hot block-to-expert matrix, whose gradient is a matmul rather than a
        scatter-add; for accelerators) or "auto" (by the default JAX backend).
      moe_ep_transport: how tokens reach their experts' devices when the mesh has an
        ``expert`` axis of size > 1 (``policyopt.models.expert_parallel``):
        "ragged_all_to_all" (exact-size slices; GPUs and TPUs: XLA:CPU does not compile
        it), "all_to_all" (fixed-size per-destination buffers; every backend) or "auto"
        (ragged_all_to_all on accelerators, all_to_all on CPUs).
      moe_ep_buffer_factor: buffers of the expert-parallel dispatch in units of the mean
        load: ceil(f m / expert) copies per device pair for "all_to_all" (m = local
        token copies), which runs as many passes as the most loaded pair needs;
        ceil(f m) rows received per device for "ragged_all_to_all", whose steps that
        would overflow it take the all_to_all passes. Never drops.
      capacity_factor: per-expert buffer = ceil(capacity_factor * tokens * k / E) token
        copies, for moe_dispatch == "capacity" (GShard / Switch Transformer).
      attention: implementation of full-sequence attention (training and scoring
        forwards; decoding with a KV cache always runs the einsum):
        "auto" (cuDNN flash attention on a GPU where it applies, splash on a TPU, else
        the einsum below policyopt.models.attention_ops.XLA_MAX_LENGTH tokens and
        "blockwise" from there), "xla" (einsum + softmax: float32 [B, H, T, T] scores),
        "blockwise" (flash-style online softmax in plain JAX, memory linear in T, every
        backend), "cudnn" (GPU, bf16/fp16) or "splash" (TPU Pallas kernel). See
        policyopt.models.attention_ops.
      attention_block_size: query and key rows per block of "blockwise".
      scan_layers: store each maximal run of identical decoder blocks (``layer_runs``:
        all dense or all MoE) as one Block whose parameters have a leading ``layers``
        axis, and run it with ``jax.lax.scan``: the compiled program holds one copy of
        the block per run, so compile time stops growing with depth (a 48-layer model
        compiles in about the time of one layer) and rematerialisation frees memory
        on XLA:CPU (see remat). For deep models and long sequences; the small CPU
        presets keep False (a scan adds a loop and a cache-slice copy per layer to each
        decode step). Changes the parameters' layout (and so checkpoints); HF import /
        export map it to and from HuggingFace's per-layer tensors.
      remat: rematerialisation of each decoder block in the backward pass
        (``jax.checkpoint``): "none" (keep every intermediate), "full" (keep only each
        block's input, recompute the rest) or "save_dots" (keep the outputs of the
        matmuls without batch dimensions, ``jax.checkpoint_policies.
        dots_with_no_batch_dims_saveable``: the q / k / v / o, dense MLP and router
        projections; recompute norms, RoPE, the attention scores and softmax, whose
        einsums batch over rows and heads, and the batched expert matmuls). Works
        with and without scan_layers, but XLA:CPU frees a rematerialised layer's
        memory only inside the scan (unrolled, ~5.4 GiB per Qwen3-8B-sized layer at
        32k tokens stayed live; scanned, ~0.55 GiB, its carried residual), so turn it
        on together with scan_layers for long sequences.
    """

    dtype: str = "float32"
    param_dtype: str = "float32"
    moe_dispatch: str = "ragged"
    moe_decode_dispatch: str | None = None
    moe_block_size: int = 64
    moe_chunk_rows: int | None = None
    moe_weight_gather: str = "auto"
    moe_ep_transport: str = "auto"
    moe_ep_buffer_factor: float = 2.0
    capacity_factor: float = 1.25
    attention: str = "auto"
    attention_block_size: int = 512
    scan_layers: bool = False
    remat: str = "none"

    def __post_init__(self):
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in _DTYPES:
                raise ValueError(
                    f"ModelConfig.{name} must be one of {_DTYPES}, got {getattr(self, name)!r}"
                )
        if self.moe_dispatch not in _DISPATCH:
            raise ValueError(
                f"ModelConfig.moe_dispatch must be one of {_DISPATCH}, got {self.moe_dispatch!r}"
            )
        if self.moe_decode_dispatch is not None and self.moe_decode_dispatch not in _DISPATCH:
            raise ValueError(
                f"ModelConfig.moe_decode_dispatch must be None or one of {_DISPATCH}, "
                f"got {self.moe_decode_dispatch!r}"
            )
        if self.moe_weight_gather not in _GATHER:
            raise ValueError(
                f"ModelConfig.moe_weight_gather must be one of {_GATHER}, "
                f"got {self.moe_weight_gather!r}"
            )
        if self.moe_ep_transport not in _EP_TRANSPORT:
            raise ValueError(
                f"ModelConfig.moe_ep_transport must be one of {_EP_TRANSPORT}, "
                f"got {self.moe_ep_transport!r}"
            )
        if not self.moe_ep_buffer_factor > 0:
            raise ValueError(
                f"ModelConfig.moe_ep_buffer_factor must be > 0, got {self.moe_ep_buffer_factor}"
            )
        if self.moe_block_size <= 0:
            raise ValueError(f"ModelConfig.moe_block_size must be > 0, got {self.moe_block_size}")
        if self.moe_chunk_rows is not None and (
            not isinstance(self.moe_chunk_rows, int) or self.moe_chunk_rows <= 0
        ):
            raise ValueError(
                "ModelConfig.moe_chunk_rows (model.moe_chunk_rows) must be None or an int "
                f"> 0, got {self.moe_chunk_rows!r}"
            )
        if self.attention not in IMPLEMENTATIONS:
            raise ValueError(
                f"ModelConfig.attention (model.attention) must be one of "
                f"{IMPLEMENTATIONS}, got {self.attention!r}"
            )
        if not isinstance(self.attention_block_size, int) or self.attention_block_size <= 0:
            raise ValueError(
                f"ModelConfig.attention_block_size must be a positive int, "
                f"got {self.attention_block_size!r}"
            )
        if not self.capacity_factor > 0:
            raise ValueError(f"ModelConfig.capacity_factor must be > 0, got {self.capacity_factor}")
        if not isinstance(self.scan_layers, bool):
            raise ValueError(f"ModelConfig.scan_layers must be a bool, got {self.scan_layers!r}")
        if self.remat not in _REMAT:
            raise ValueError(f"ModelConfig.remat must be one of {_REMAT}, got {self.remat!r}")

    def resolved_weight_gather(self) -> str:
        """``moe_weight_gather`` with "auto" resolved: "take" on CPU, else "onehot"."""
        if self.moe_weight_gather != "auto":
            return self.moe_weight_gather
        return "take" if jax.default_backend() == "cpu" else "onehot"

    def resolved_ep_transport(self) -> str:
        """``moe_ep_transport`` with "auto" resolved: "all_to_all" on CPU, else
        "ragged_all_to_all"."""
        if self.moe_ep_transport != "auto":
            return self.moe_ep_transport
        return "all_to_all" if jax.default_backend() == "cpu" else "ragged_all_to_all"

    @property
    def compute_dtype(self):
        return jnp.dtype(self.dtype)

    @property
    def weight_dtype(self):
        return jnp.dtype(self.param_dtype)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig(Kernels, Architecture):
    """A Qwen3 / Qwen3-MoE style decoder: its ``Architecture``, the ``Kernels`` a run
    computes it with, and its LoRA adapters, as one flat record (see the two halves for
    the fields).

    Attributes:
      lora: LoRA adapters (``policyopt.models.lora.LoRAConfig``; rank 0: none), checked
        against this model's targets and sizes when the config is built.
    """

    lora: LoRAConfig = LoRAConfig()

    def __post_init__(self):
        Architecture.__post_init__(self)
        Kernels.__post_init__(self)
        if not isinstance(self.lora, LoRAConfig):
            raise ValueError(f"ModelConfig.lora must be a LoRAConfig, got {self.lora!r}")
        if self.lora.enabled:
            self.lora.check(self)

    @classmethod
    def of(
        cls,
        architecture: Architecture,
        kernels: Kernels | None = None,
        lora: LoRAConfig | None = None,
    ) -> "ModelConfig":
        """The model of ``architecture`` computed with ``kernels`` (default: ``Kernels()``)."""
        return cls(
            **_values(architecture), **_values(kernels or Kernels()), lora=lora or LoRAConfig()
        )

    @property
    def architecture(self) -> Architecture:
        """What a checkpoint of this model fixes."""
        return Architecture(**_values(self, Architecture))

    @property
    def kernels(self) -> Kernels:
        """What a run chooses to compute this model with."""
        return Kernels(**_values(self, Kernels))

    def resolved_attention(self, *, interpret: bool = False) -> str:
        """``attention``, checked against the default JAX backend before anything is
        compiled ("auto" stays "auto": each call picks by its length and masks).

        Raises:
          ValueError: naming model.attention and the backend, when an explicit
            implementation cannot run here ("cudnn" off a GPU or outside bf16/fp16 or
            its head dims, "splash" off a TPU unless ``interpret``).
        """
        check_implementation(
            self.attention,
            backend=jax.default_backend(),
            dtype=self.compute_dtype,
            head_dim=self.head_dim,
            interpret=interpret,
        )
        return self.attention

    def expert_capacity(self, num_tokens: int) -> int:
        """Token copies one expert can take in the capacity path: ceil(cf * N * k / E)."""
        return max(
            1,
            math.ceil(
                self.capacity_factor * num_tokens * self.num_experts_per_tok / self.num_experts
            ),
        )

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


def _values(record, kind=None) -> dict:
    """The fields of dataclass ``kind`` (default: ``record``'s own) read from ``record``, by
    name and as they are (``dataclasses.asdict`` would convert them)."""
    return {f.name: getattr(record, f.name) for f in dataclasses.fields(kind or record)}
