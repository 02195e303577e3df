"""Gemma 3 (text): five sliding-window layers to one global, q/k norms, sandwich norms,
embeddings scaled by sqrt(d_model), norms stored as (1 + w).

config.json comes as `gemma3_text`, or as the multimodal `gemma3` whose text
model settings sit under `text_config`. A GGUF stores the norms with the 1
already added (the reader subtracts `norm_offset`); llama.cpp and HF fix the
sliding-window layers' RoPE base at 10,000.
"""

from __future__ import annotations

from typing import Any

from jaxinfer.errors import ModelLoadError
from jaxinfer.gguf_file import GGUFFile
from jaxinfer.model.config import LayerType, ModelConfig, gemma3_layer_types
from jaxinfer.weights.families.common import (
    HF_LAYER_NAMES,
    Family,
    Meta,
    activation,
    gguf_rope_scaling,
    hf_common_fields,
    hf_layer_types,
    hf_rope_settings,
    reject_biases,
)

# Gemma3TextConfig's defaults; multimodal text_configs omit most of these
_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
    "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
    "head_dim": 256, "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6,
    "query_pre_attn_scalar": 256, "sliding_window": 4096, "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0, "hidden_activation": "gelu_pytorch_tanh",
    "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
}
# post_attention_layernorm is Gemma 3's sandwich norm after attention, not the pre-MLP one
_LAYER_NAMES = HF_LAYER_NAMES | {
    "post_attn_norm": "post_attention_layernorm.weight",
    "mlp_norm": "pre_feedforward_layernorm.weight",
    "post_mlp_norm": "post_feedforward_layernorm.weight",
}


def config_from_hf(raw: dict[str, Any], model_type: str, name: str) -> ModelConfig:
    hf = _multimodal_text_config(raw) if model_type == "gemma3" else _TEXT_DEFAULTS | raw
    if hf.get("use_bidirectional_attention"):
        raise ModelLoadError("Gemma 3 with use_bidirectional_attention (an encoder) is unsupported")
    reject_biases(hf, "gemma3", ("attention_bias",))
    global_theta, global_scaling = hf_rope_settings(hf, "full_attention", hf["rope_theta"])
    local_theta, local_scaling = hf_rope_settings(hf, "sliding_attention",
                                                  hf["rope_local_base_freq"])
    if local_scaling is not None:
        raise ModelLoadError("RoPE scaling on Gemma 3 sliding-window layers is unsupported")
    return ModelConfig(
        architecture="gemma3", **hf_common_fields(hf, name),
        rope_theta=global_theta, rope_local_theta=local_theta, rope_scaling=global_scaling,
        sliding_window=hf["sliding_window"], layer_types=_layer_types(hf),
        query_pre_attn_scalar=float(hf["query_pre_attn_scalar"]), qk_norm=True,
        sandwich_norms=True, activation=activation(hf.get("hidden_activation")),
        norm_offset=1.0, scale_embeddings=True,
        attn_logit_softcap=hf.get("attn_logit_softcapping"),
        final_logit_softcap=hf.get("final_logit_softcapping"),
    )


def _multimodal_text_config(hf_config: dict[str, Any]) -> dict[str, Any]:
    """Gemma3ForConditionalGeneration: the text model's settings, defaults filled in."""
    text = hf_config.get("text_config")
    if not isinstance(text, dict):
        raise ModelLoadError("gemma3 (multimodal) config.json has no 'text_config' dict")
    # Token ids and embedding tying live at the top level of multimodal configs.
    top = {k: hf_config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id",
                                      "tie_word_embeddings") if hf_config.get(k) is not None}
    return _TEXT_DEFAULTS | text | top


def _layer_types(hf: dict[str, Any]) -> tuple[LayerType, ...]:
    if hf.get("layer_types"):
        return hf_layer_types(hf)
    pattern = hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6
    return gemma3_layer_types(hf["num_hidden_layers"], pattern)


def config_from_gguf(common: dict[str, Any], meta: Meta, reader: GGUFFile) -> ModelConfig:
    return ModelConfig(
        architecture="gemma3",
        activation="gelu_tanh",
        norm_offset=1.0,
        scale_embeddings=True,
        sandwich_norms=True,
        qk_norm=True,
        sliding_window=int(meta("attention.sliding_window")),
        layer_types=gemma3_layer_types(common["num_layers"]),
        rope_local_theta=10_000.0,
        query_pre_attn_scalar=float(common["head_dim"]),
        rope_scaling=gguf_rope_scaling(meta),
        **common,
    )


FAMILY = Family(
    architecture="gemma3", hf_model_types=("gemma3_text", "gemma3"),
    gguf_architectures=("gemma3",), config_from_hf=config_from_hf,
    config_from_gguf=config_from_gguf, hf_layer_names=_LAYER_NAMES,
)
