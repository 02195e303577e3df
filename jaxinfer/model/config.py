"""The model configuration: one frozen dataclass describes every decoder we run.

Gemma 3 and the Llama family (Llama 2/3, Mistral, Qwen2) differ only in a handful
of switches (norm offset, sandwich norms, QK-norm, activation, biases, RoPE
variants, sliding-window layers), so one config and one forward function serve
them all; there is no second code path per architecture.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from jaxinfer.errors import ConfigError

Architecture = Literal["gemma3", "llama"]
LayerType = Literal["global", "local"]
Activation = Literal["gelu_tanh", "silu"]

SUPPORTED_ARCHITECTURES: tuple[str, ...] = ("gemma3", "llama")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling: `linear` (position interpolation), `llama3`, or
    `factors` (each inverse frequency divided by its own factor, as a GGUF's
    `rope_freqs` tensor gives them: llama.cpp's form of Llama 3.1+ scaling)."""

    kind: Literal["linear", "llama3", "factors"]
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    factors: tuple[float, ...] = ()  # [head_dim // 2], kind "factors" only

    def __post_init__(self) -> None:
        if self.kind not in ("linear", "llama3", "factors"):
            raise ConfigError(f"rope_scaling.kind must be 'linear', 'llama3' or 'factors', "
                              f"got {self.kind!r}")
        if self.factor <= 0:
            raise ConfigError(f"rope_scaling.factor must be > 0, got {self.factor}")
        object.__setattr__(self, "factors", tuple(float(f) for f in self.factors))
        if (self.kind == "factors") != bool(self.factors) or any(f <= 0 for f in self.factors):
            raise ConfigError("rope_scaling.factors: positive values, given with kind "
                              "'factors' only")


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a decoder-only transformer.

    Norm weights follow the checkpoint's convention: the norm multiplies by
    `norm_offset + weight` (1.0 for Gemma's (1+w) RMSNorm, 0.0 for Llama).
    """

    architecture: Architecture
    vocab_size: int
    d_model: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_dim: int
    max_position: int
    norm_eps: float = 1e-6
    rope_theta: float = 10_000.0
    rope_local_theta: float | None = None  # RoPE base of sliding-window layers (Gemma 3)
    rope_scaling: RopeScaling | None = None  # applies to global layers only
    sliding_window: int | None = None
    layer_types: tuple[LayerType, ...] = ()
    query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power
    qkv_bias: bool = False
    qk_norm: bool = False
    sandwich_norms: bool = False  # post-attention and post-FFN norms (Gemma)
    activation: Activation = "silu"
    norm_offset: float = 0.0
    scale_embeddings: bool = False  # multiply embeddings by sqrt(d_model) (Gemma)
    tie_embeddings: bool = True
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int = 0
    name: str = "model"
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"unsupported architecture {self.architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "ffn_dim", "max_position"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if not self.layer_types:
            object.__setattr__(self, "layer_types", ("global",) * self.num_layers)
        if len(self.layer_types) != self.num_layers:
            raise ConfigError(
                f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers"
            )
        if "local" in self.layer_types and not self.sliding_window:
            raise ConfigError("local (sliding-window) layers need sliding_window >= 1")
        if self.activation not in ("gelu_tanh", "silu"):
            raise ConfigError(f"activation must be 'gelu_tanh' or 'silu', got {self.activation!r}")

    @property
    def attn_scale(self) -> float:
        scalar = self.query_pre_attn_scalar or self.head_dim
        return 1.0 / math.sqrt(scalar)

    @property
    def local_theta(self) -> float:
        return self.rope_local_theta if self.rope_local_theta is not None else self.rope_theta

    def kv_bytes_per_token(self, dtype_bytes: int, scale_bytes: int = 0) -> int:
        """Bytes of K and V one token occupies across all layers: `dtype_bytes` per
        element, plus `scale_bytes` per (layer, kv head) for a quantized cache."""
        per_head = self.head_dim * dtype_bytes + scale_bytes
        return 2 * self.num_layers * self.num_kv_heads * per_head

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["layer_types"] = list(self.layer_types)
        out["eos_token_ids"] = list(self.eos_token_ids)
        return out

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ConfigError(f"unknown model config keys: {', '.join(unknown)}")
        values = dict(raw)
        if isinstance(values.get("rope_scaling"), dict):
            values["rope_scaling"] = RopeScaling(**values["rope_scaling"])
        values["layer_types"] = tuple(values.get("layer_types", ()))
        values["eos_token_ids"] = tuple(values.get("eos_token_ids", ()))
        return cls(**values)


def gemma3_layer_types(num_layers: int, pattern: int = 6) -> tuple[LayerType, ...]:
    """Gemma 3 interleaving: every `pattern`-th layer is global, the rest local."""
    return tuple("global" if (i + 1) % pattern == 0 else "local" for i in range(num_layers))
