"""What the engine needs to know about a model, read once from a Hugging Face model folder.

`config.json` goes through transformers' `AutoConfig`, which normalises the older keys
(`rope_theta`, `rope_scaling`, as most published checkpoints carry them) and the newer
`rope_parameters` into one `rope_parameters` dict; EOS ids come from `generation_config.json`
when it exists, else from `config.json`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import AutoConfig

from engine.models.registry import SUPPORTED_ARCHITECTURES, unsupported_message

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    # The normalised RoPE parameters ("rope_type" plus what that type needs), as transformers has them.
    rope_parameters: dict[str, Any] = field(default_factory=dict)
    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    # Per layer: attend only to the last `window` positions, or None for full attention.
    sliding_windows: tuple[int | None, ...] = ()
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    checkpoint_dtype: str | None = None
    # The MLP activation ("silu"; Gemma: "gelu_pytorch_tanh").
    hidden_act: str = "silu"
    # Per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3).
    qk_norm: bool = False
    # Attention score scale; None means head_dim ** -0.5 (Gemma 3: query_pre_attn_scalar ** -0.5).
    attention_scale: float | None = None
    # Mixture of experts (Qwen3-MoE): experts per MoE layer, experts per token, each expert's
    # MLP width, whether the top-k weights are renormalised, and which layers are MoE layers.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[bool, ...] = ()
    # Mixtral keeps the routing weights in float32 and scales each expert's output by them
    # there; Qwen3-MoE casts them to the model dtype first.
    moe_weights_float32: bool = False
    # Gemma 3: RoPE of the sliding-window layers (the full layers use rope_parameters), the
    # embedding multiplier and tanh soft-capping of the final logits.
    local_rope_parameters: dict[str, Any] = field(default_factory=dict)
    embed_scale: float | None = None
    final_logit_softcapping: float | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(unsupported_message(self.architecture))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads {self.num_heads} must be a multiple of "
                f"num_key_value_heads {self.num_kv_heads}"
            )
        for rope in (self.rope_parameters, self.local_rope_parameters):
            rope_type = rope.get("rope_type", "default")
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ValueError(
                    f"rope type {rope_type!r} is not supported; use one of {SUPPORTED_ROPE_TYPES}"
                )
            if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
                raise ValueError(
                    "partial rotary embeddings (partial_rotary_factor < 1) are not supported"
                )
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(
                f"hidden_act {self.hidden_act!r} is not supported; use one of {SUPPORTED_ACTIVATIONS}"
            )
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok {self.num_experts_per_tok} must be in 1..{self.num_experts}"
            )
        if len(self.moe_layers) not in (0, self.num_layers):
            raise ValueError("moe_layers must have one entry per layer")
        if len(self.sliding_windows) not in (0, self.num_layers):
            raise ValueError("sliding_windows must have one entry per layer")

    @property
    def rope_type(self) -> str:
        return str(self.rope_parameters.get("rope_type", "default"))

    @property
    def release_window(self) -> int | None:
        """The smallest window when every layer slides, else None. One block table serves all
        layers, so a block goes back to the pool only once no layer's window reaches it: with a
        full-attention layer (Gemma 3's every sixth) none does."""
        windows = self.sliding_windows
        if not windows or any(w is None for w in windows):
            return None
        return min(w for w in windows if w is not None)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ModelConfig:
        """Read `model_dir/config.json` (and `generation_config.json` if present)."""
        model_dir = Path(model_dir)
        if not (model_dir / "config.json").is_file():
            raise FileNotFoundError(
                f"{model_dir} has no config.json; is it a Hugging Face model folder?"
            )
        # checked before transformers reads the config: it may not know the model type at all
        raw = json.loads((model_dir / "config.json").read_text())
        architectures = list(raw.get("architectures") or [])
        architecture = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
        if architecture is None:
            raise ValueError(f"{model_dir}: {unsupported_message(architectures)}")
        hf_config = AutoConfig.from_pretrained(str(model_dir))
        return cls(architecture=architecture, **_fields_from_hf(hf_config, model_dir))


def _fields_from_hf(hf_config: Any, model_dir: Path) -> dict[str, Any]:
    num_heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    rope_parameters = dict(getattr(hf_config, "rope_parameters", None) or {})
    local_rope_parameters: dict[str, Any] = {}
    if "full_attention" in rope_parameters:  # Gemma 3: one RoPE per layer type
        local_rope_parameters = dict(rope_parameters.get("sliding_attention") or {})
        local_rope_parameters.setdefault("rope_type", "default")
        rope_parameters = dict(rope_parameters["full_attention"])
    rope_parameters.setdefault("rope_type", "default")
    rope_theta = float(rope_parameters.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))
    model_type = hf_config.model_type
    attention_bias = bool(getattr(hf_config, "attention_bias", False))
    dtype = getattr(hf_config, "dtype", None)
    return dict(
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_layers=hf_config.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        rms_norm_eps=float(hf_config.rms_norm_eps),
        max_position_embeddings=hf_config.max_position_embeddings,
        rope_theta=rope_theta,
        rope_parameters=rope_parameters,
        # Qwen2 has biases on q/k/v only; Llama's attention_bias covers all four projections.
        qkv_bias=model_type == "qwen2" or attention_bias,
        o_proj_bias=model_type != "qwen2" and attention_bias,
        mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        sliding_windows=_sliding_windows(hf_config),
        eos_token_ids=_eos_token_ids(hf_config, model_dir),
        bos_token_id=getattr(hf_config, "bos_token_id", None),
        checkpoint_dtype=str(dtype).removeprefix("torch.") if dtype is not None else None,
        hidden_act=str(getattr(hf_config, "hidden_activation", None) or hf_config.hidden_act),
        qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
        local_rope_parameters=local_rope_parameters,
        **_gemma_fields(hf_config),
        **_moe_fields(hf_config),
    )


def _gemma_fields(hf_config: Any) -> dict[str, Any]:
    if hf_config.model_type != "gemma3_text":
        return {}
    if getattr(hf_config, "attn_logit_softcapping", None) is not None:
        raise ValueError("attention logit soft-capping (attn_logit_softcapping) is not supported")
    if getattr(hf_config, "use_bidirectional_attention", False):
        raise ValueError("bidirectional attention (use_bidirectional_attention) is not supported")
    softcap = getattr(hf_config, "final_logit_softcapping", None)
    return dict(
        attention_scale=float(hf_config.query_pre_attn_scalar) ** -0.5,
        embed_scale=float(hf_config.hidden_size) ** 0.5,
        final_logit_softcapping=float(softcap) if softcap is not None else None,
    )


def _moe_fields(hf_config: Any) -> dict[str, Any]:
    """Qwen3-MoE: a layer is sparse unless listed in mlp_only_layers or off decoder_sparse_step.
    Mixtral: every layer is sparse, experts as wide as intermediate_size, top-k renormalised."""
    num_experts = int(getattr(hf_config, "num_experts", 0) or 0)
    if hf_config.model_type == "mixtral":
        return dict(
            num_experts=int(hf_config.num_local_experts),
            num_experts_per_tok=int(hf_config.num_experts_per_tok),
            moe_intermediate_size=int(hf_config.intermediate_size),
            norm_topk_prob=True,
            moe_layers=(True,) * hf_config.num_hidden_layers,
            moe_weights_float32=True,
        )
    if hf_config.model_type != "qwen3_moe" or not num_experts:
        return {}
    dense = set(getattr(hf_config, "mlp_only_layers", None) or [])
    step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
    moe_layers = tuple(
        i not in dense and (i + 1) % step == 0 for i in range(hf_config.num_hidden_layers)
    )
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=int(hf_config.num_experts_per_tok),
        moe_intermediate_size=int(hf_config.moe_intermediate_size),
        norm_topk_prob=bool(hf_config.norm_topk_prob),
        moe_layers=moe_layers,
    )


def _sliding_windows(hf_config: Any) -> tuple[int | None, ...]:
    """Mistral slides on every layer; Qwen2 on the layers its `layer_types` mark as sliding."""
    window = getattr(hf_config, "sliding_window", None)
    num_layers = hf_config.num_hidden_layers
    if window is None:
        return (None,) * num_layers
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is None:
        return (int(window),) * num_layers
    return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _eos_token_ids(hf_config: Any, model_dir: Path) -> tuple[int, ...]:
    generation_config = model_dir / "generation_config.json"
    if generation_config.is_file():
        eos = _as_id_tuple(json.loads(generation_config.read_text()).get("eos_token_id"))
        if eos:
            return eos
    return _as_id_tuple(getattr(hf_config, "eos_token_id", None))
