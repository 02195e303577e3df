"""The Llama family: Llama 2/3/3.1+, Mistral (every layer a sliding-window layer), SmolLM.

llama.cpp permutes the rows of Q and K of these GGUFs for its interleaved RoPE
(the reader undoes it). Llama 3.1+ RoPE scaling is `rope_scaling` llama3 in
config.json and a `rope_freqs` tensor of per-frequency factors in a GGUF.
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
    gguf_rope_freqs,
    gguf_rope_scaling,
    hf_common_fields,
    hf_layer_types,
    hf_rope_settings,
    reject_biases,
    required,
)

_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": LLAMA_DEFAULTS,
    "mistral": LLAMA_DEFAULTS | {"max_position_embeddings": 131_072, "sliding_window": 4096},
}


def config_from_hf(raw: dict[str, Any], model_type: str, name: str) -> ModelConfig:
    hf = _DEFAULTS[model_type] | raw
    reject_biases(hf, model_type, ("attention_bias", "mlp_bias"))
    theta, scaling = hf_rope_settings(hf, None, hf["rope_theta"])
    layer_types = _layer_types(hf, model_type)
    return ModelConfig(
        architecture="llama", **hf_common_fields(hf, name),
        rope_theta=theta, rope_scaling=scaling, layer_types=layer_types,
        sliding_window=hf.get("sliding_window") if "local" in layer_types else None,
        activation=activation(hf.get("hidden_act")),
    )


def _layer_types(hf: dict[str, Any], model_type: str) -> tuple[LayerType, ...]:
    """All global; Mistral's all local when it sets a sliding_window."""
    num_layers = required(hf, "num_hidden_layers")
    if hf.get("layer_types"):
        return hf_layer_types(hf)
    if model_type == "mistral" and hf.get("sliding_window"):
        return ("local",) * num_layers
    return ("global",) * num_layers


def config_from_gguf(common: dict[str, Any], meta: Meta, reader: GGUFFile) -> ModelConfig:
    window = int(meta("attention.sliding_window", 0))  # declared: every layer (Mistral)
    return ModelConfig(
        architecture="llama", activation="silu",
        rope_scaling=gguf_rope_freqs(reader, common["head_dim"]) or gguf_rope_scaling(meta),
        sliding_window=window or None,
        layer_types=("local",) * common["num_layers"] if window else (), **common,
    )


FAMILY = Family(
    architecture="llama", hf_model_types=("llama", "mistral"),
    gguf_architectures=("llama", "mistral"), config_from_hf=config_from_hf,
    config_from_gguf=config_from_gguf, hf_layer_names=HF_LAYER_NAMES,
    gguf_permuted_qk=("llama", "mistral"),
)
