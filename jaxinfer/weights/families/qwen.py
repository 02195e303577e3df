"""Qwen2/2.5 (q/k/v biases) and Qwen3 (per-head q/k RMSNorm, no biases), dense models.

They run as our Llama architecture. Sliding windows apply only with
`use_sliding_window`, from layer `max_window_layers` on. llama.cpp does not
permute their Q/K rows (they use NeoX-style RoPE, our layout).
"""

from __future__ import annotations

from typing import Any

from jaxinfer.gguf_file import GGUFFile
from jaxinfer.model.config import LayerType, ModelConfig
from jaxinfer.weights.families.common import (
    HF_LAYER_NAMES,
    LLAMA_DEFAULTS,
    Family,
    Meta,
    activation,
    gguf_has_qk_norm,
    gguf_rope_freqs,
    gguf_rope_scaling,
    hf_common_fields,
    hf_layer_types,
    hf_rope_settings,
    reject_biases,
    required,
)

_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen2": LLAMA_DEFAULTS | {"max_position_embeddings": 32_768, "max_window_layers": 28},
    "qwen3": LLAMA_DEFAULTS | {"max_position_embeddings": 40_960, "max_window_layers": 28},
}


def config_from_hf(raw: dict[str, Any], model_type: str, name: str) -> ModelConfig:
    hf = _DEFAULTS[model_type] | raw
    qkv_bias = model_type == "qwen2"  # Qwen2 always has q/k/v biases, never an o bias
    if not qkv_bias:
        reject_biases(hf, model_type, ("attention_bias", "mlp_bias"))
    theta, scaling = hf_rope_settings(hf, None, hf["rope_theta"])
    layer_types = _layer_types(hf)
    return ModelConfig(
        architecture="llama", **hf_common_fields(hf, name),
        rope_theta=theta, rope_scaling=scaling, layer_types=layer_types,
        sliding_window=hf.get("sliding_window") if "local" in layer_types else None,
        qkv_bias=qkv_bias, activation=activation(hf.get("hidden_act")),
        qk_norm=model_type == "qwen3",  # per-head RMSNorm of q and k before RoPE
    )


def _layer_types(hf: dict[str, Any]) -> tuple[LayerType, ...]:
    num_layers = required(hf, "num_hidden_layers")
    if not hf.get("use_sliding_window"):
        return ("global",) * num_layers
    if hf.get("layer_types"):
        return hf_layer_types(hf)
    first = hf["max_window_layers"]
    return tuple("local" if i >= first else "global" for i in range(num_layers))


def config_from_gguf(common: dict[str, Any], meta: Meta, reader: GGUFFile) -> ModelConfig:
    return ModelConfig(
        architecture="llama", activation="silu",
        qkv_bias="blk.0.attn_q.bias" in reader.tensors, qk_norm=gguf_has_qk_norm(reader),
        rope_scaling=gguf_rope_freqs(reader, common["head_dim"]) or gguf_rope_scaling(meta),
        **common,
    )


FAMILY = Family(
    architecture="llama", hf_model_types=("qwen2", "qwen3"),
    gguf_architectures=("qwen2", "qwen3"), config_from_hf=config_from_hf,
    config_from_gguf=config_from_gguf, hf_layer_names=HF_LAYER_NAMES,
)
