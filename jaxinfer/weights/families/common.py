"""What the families share: the `Family` record and the config readers they all use."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxinfer.errors import ModelLoadError
from jaxinfer.gguf_file import GGUFFile
from jaxinfer.model.config import LayerType, ModelConfig, RopeScaling

Meta = Callable[..., Any]  # meta(key, default=None): "<arch>.<key>", an error when absent
# (raw config.json dict, its model_type, model name) -> ModelConfig
HFConfigReader = Callable[[dict[str, Any], str, str], ModelConfig]
# (fields every GGUF gives, metadata getter of the architecture, the file) -> ModelConfig
GGUFConfigReader = Callable[[dict[str, Any], Meta, GGUFFile], ModelConfig]

# Our layer weight name -> HF name inside `layers.{i}.`, as most families spell it.
HF_LAYER_NAMES: dict[str, str] = {
    "attn_norm": "input_layernorm.weight",
    "q_proj": "self_attn.q_proj.weight",
    "k_proj": "self_attn.k_proj.weight",
    "v_proj": "self_attn.v_proj.weight",
    "o_proj": "self_attn.o_proj.weight",
    "q_bias": "self_attn.q_proj.bias",
    "k_bias": "self_attn.k_proj.bias",
    "v_bias": "self_attn.v_proj.bias",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    "gate_proj": "mlp.gate_proj.weight",
    "up_proj": "mlp.up_proj.weight",
    "down_proj": "mlp.down_proj.weight",
    "mlp_norm": "post_attention_layernorm.weight",  # the pre-MLP norm (Gemma 3 differs)
}
# Values transformers assumes when a Llama-like config.json omits a key.
LLAMA_DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-6, "max_position_embeddings": 2048, "rope_theta": 10_000.0,
    "tie_word_embeddings": False, "hidden_act": "silu",
}
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh",
                "gelu_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}
_LAYER_KINDS: dict[str, LayerType] = {"full_attention": "global", "sliding_attention": "local"}


@dataclass(frozen=True)
class Family:
    """One model family: what it reads and how, and llama.cpp's conventions for it."""

    architecture: str  # our ModelConfig.architecture
    hf_model_types: tuple[str, ...]
    gguf_architectures: tuple[str, ...]
    config_from_hf: HFConfigReader
    config_from_gguf: GGUFConfigReader
    hf_layer_names: Mapping[str, str]
    gguf_permuted_qk: tuple[str, ...] = ()  # GGUF archs whose Q/K rows llama.cpp permuted


# ----------------------------------------------------------------------------- config.json


def hf_common_fields(hf: dict[str, Any], name: str) -> dict[str, Any]:
    """The fields every family reads the same way."""
    heads = required(hf, "num_attention_heads")
    eos = hf.get("eos_token_id")
    return {
        "vocab_size": required(hf, "vocab_size"),
        "d_model": required(hf, "hidden_size"),
        "num_layers": required(hf, "num_hidden_layers"),
        "num_heads": heads,
        "num_kv_heads": hf.get("num_key_value_heads") or heads,
        "head_dim": hf.get("head_dim") or required(hf, "hidden_size") // heads,
        "ffn_dim": required(hf, "intermediate_size"),
        "max_position": required(hf, "max_position_embeddings"),
        "norm_eps": float(hf["rms_norm_eps"]),
        "tie_embeddings": bool(hf["tie_word_embeddings"]),
        "bos_token_id": hf.get("bos_token_id"),
        "eos_token_ids": () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,),
        "pad_token_id": hf.get("pad_token_id") or 0,
        "name": name,
        "extra": {"hf_model_type": hf["model_type"]},
    }


def required(hf: dict[str, Any], key: str) -> Any:
    if hf.get(key) is None:
        raise ModelLoadError(f"config.json lacks {key!r} (model_type {hf.get('model_type')!r})")
    return hf[key]


def reject_biases(hf: dict[str, Any], model_type: str, keys: tuple[str, ...]) -> None:
    for key in keys:
        if hf.get(key):
            raise ModelLoadError(f"{model_type} with {key}=true is unsupported (no such params)")


def activation(hf_name: str | None) -> str:
    if hf_name not in _ACTIVATIONS:
        raise ModelLoadError(
            f"unsupported activation {hf_name!r}; supported: {', '.join(_ACTIVATIONS)}"
        )
    return _ACTIVATIONS[hf_name]


def hf_rope_settings(
    hf: dict[str, Any], layer_kind: str | None, legacy_theta: float
) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) for one layer kind from `rope_parameters` (transformers 5,
    keyed by layer type for Gemma 3) or the older `rope_theta` + `rope_scaling`."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and layer_kind is not None and layer_kind in params:
        params = params[layer_kind]
    if isinstance(params, dict):
        return float(params.get("rope_theta", legacy_theta)), _hf_rope_scaling(params)
    scaling = hf.get("rope_scaling") if layer_kind != "sliding_attention" else None
    return float(legacy_theta), _hf_rope_scaling(scaling or {})


def _hf_rope_scaling(params: dict[str, Any]) -> RopeScaling | None:
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in (None, "default"):
        return None
    if kind == "linear":
        return RopeScaling("linear", float(params["factor"]))
    if kind == "llama3":
        return RopeScaling(
            "llama3", float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position=int(params["original_max_position_embeddings"]),
        )
    raise ModelLoadError(f"unsupported rope_type {kind!r}; supported: default, linear, llama3")


def hf_layer_types(hf: dict[str, Any]) -> tuple[LayerType, ...]:
    """config.json's `layer_types` list as ours."""
    unknown = sorted(set(hf["layer_types"]) - _LAYER_KINDS.keys())
    if unknown:
        raise ModelLoadError(f"unsupported layer_types {unknown}; supported: {list(_LAYER_KINDS)}")
    return tuple(_LAYER_KINDS[kind] for kind in hf["layer_types"])


# ----------------------------------------------------------------------------- GGUF


def gguf_rope_scaling(meta: Meta) -> RopeScaling | None:
    """Linear scaling from `rope.scaling.*` metadata (the only kind GGUF states so)."""
    kind = meta("rope.scaling.type", "none")
    if kind not in ("none", "linear"):
        raise ModelLoadError(f"unsupported RoPE scaling {kind!r} in GGUF (supported: linear)")
    factor = float(meta("rope.scaling.factor", 1.0))
    if kind == "linear" and factor != 1.0:
        return RopeScaling("linear", factor)
    return None


def gguf_rope_freqs(reader: GGUFFile, head_dim: int) -> RopeScaling | None:
    """Per-frequency RoPE factors from a `rope_freqs` tensor (how llama.cpp's converter
    writes Llama 3.1+ scaling), or None when the file has none."""
    tensor = reader.tensors.get("rope_freqs.weight")
    if tensor is None:
        return None
    factors = tensor.dequantize().reshape(-1)
    if factors.size != head_dim // 2 or not np.all(factors > 0):
        raise ModelLoadError(f"rope_freqs.weight has {factors.size} values (need "
                             f"{head_dim // 2} positive ones for head_dim {head_dim})")
    return RopeScaling("factors", factors=tuple(factors.tolist()))


def gguf_has_qk_norm(reader: GGUFFile) -> bool:
    return "blk.0.attn_q_norm.weight" in reader.tensors
