"""The params pytree every loader produces, and its shapes.

Layer weights are stacked along a leading layer axis so the forward pass can
`lax.scan` over layers (one compiled layer body instead of `num_layers`).
Matrices are stored [out_features, in_features], the layout of PyTorch and GGUF,
and contracted on their last axis: the form XLA fuses best with a weight
dequantization on CPU (see shared CPU notes).

    embed          [vocab, d_model]
    final_norm     [d_model]
    lm_head        [vocab, d_model]            (only when embeddings are untied)
    layers/
      attn_norm    [L, d_model]
      q_proj       [L, num_heads*head_dim, d_model]
      k_proj       [L, num_kv_heads*head_dim, d_model]
      v_proj       [L, num_kv_heads*head_dim, d_model]
      o_proj       [L, d_model, num_heads*head_dim]
      q_bias       [L, num_heads*head_dim]     (qkv_bias)
      k_bias       [L, num_kv_heads*head_dim]  (qkv_bias)
      v_bias       [L, num_kv_heads*head_dim]  (qkv_bias)
      q_norm       [L, head_dim]               (qk_norm)
      k_norm       [L, head_dim]               (qk_norm)
      post_attn_norm [L, d_model]              (sandwich_norms)
      mlp_norm     [L, d_model]
      gate_proj    [L, ffn_dim, d_model]
      up_proj      [L, ffn_dim, d_model]
      down_proj    [L, d_model, ffn_dim]
      post_mlp_norm [L, d_model]               (sandwich_norms)
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jaxinfer.errors import ModelLoadError
from jaxinfer.model.config import ModelConfig

Params = dict[str, Any]


def compute_dtype(params: Params) -> np.dtype:
    """The activation dtype: that of the (never quantized) norm weights."""
    return np.dtype(params["final_norm"].dtype)


def layer_param_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shape of one layer's weights (without the leading layer axis)."""
    d, hd = config.d_model, config.head_dim
    q_out, kv_out = config.num_heads * hd, config.num_kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {
        "attn_norm": (d,),
        "q_proj": (q_out, d),
        "k_proj": (kv_out, d),
        "v_proj": (kv_out, d),
        "o_proj": (d, q_out),
        "mlp_norm": (d,),
        "gate_proj": (config.ffn_dim, d),
        "up_proj": (config.ffn_dim, d),
        "down_proj": (d, config.ffn_dim),
    }
    if config.qkv_bias:
        shapes |= {"q_bias": (q_out,), "k_bias": (kv_out,), "v_bias": (kv_out,)}
    if config.qk_norm:
        shapes |= {"q_norm": (hd,), "k_norm": (hd,)}
    if config.sandwich_norms:
        shapes |= {"post_attn_norm": (d,), "post_mlp_norm": (d,)}
    return shapes


def param_shapes(config: ModelConfig) -> dict[str, Any]:
    """The full params pytree as shapes."""
    shapes: dict[str, Any] = {
        "embed": (config.vocab_size, config.d_model),
        "final_norm": (config.d_model,),
        "layers": {
            name: (config.num_layers, *shape)
            for name, shape in layer_param_shapes(config).items()
        },
    }
    if not config.tie_embeddings:
        shapes["lm_head"] = (config.vocab_size, config.d_model)
    return shapes


def stack_layers(per_layer: list[dict[str, Any]]) -> dict[str, Any]:
    """Stack a list of per-layer dicts into one dict of [L, ...] arrays (or quantized
    weights, stacked leaf by leaf)."""
    names = per_layer[0].keys()
    return {
        name: jax.tree.map(lambda *xs: np.stack(xs), *[layer[name] for layer in per_layer])
        for name in names
    }


def check_param_shapes(config: ModelConfig, params: Params) -> None:
    """Raise ModelLoadError naming every missing, unexpected or misshapen weight."""
    expected = param_shapes(config)
    problems: list[str] = []
    _compare_tree(expected, params, "", problems)
    if problems:
        raise ModelLoadError("checkpoint does not match the model config: " + "; ".join(problems))


def _compare_tree(expected: Any, actual: Any, prefix: str, problems: list[str]) -> None:
    if isinstance(expected, dict):
        if not isinstance(actual, dict):
            problems.append(f"{prefix or 'params'} should be a dict")
            return
        for key in expected.keys() - actual.keys():
            problems.append(f"missing {prefix}{key}")
        for key in actual.keys() - expected.keys():
            problems.append(f"unexpected {prefix}{key}")
        for key in expected.keys() & actual.keys():
            _compare_tree(expected[key], actual[key], f"{prefix}{key}/", problems)
        return
    shape = tuple(np.shape(actual))
    if shape != tuple(expected):
        problems.append(f"{prefix.rstrip('/')} has shape {shape}, expected {tuple(expected)}")
