"""Building blocks of the decoder: norms, RoPE, projections, the gated MLP."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.model.capture import tap
from jaxinfer.model.config import ModelConfig, RopeScaling
from jaxinfer.model.quant import QuantizedWeight, quantized_matmul


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, offset: float) -> jax.Array:
    """RMSNorm in f32; multiplies by `offset + weight` ((1+w) for Gemma)."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * (offset + weight.astype(jnp.float32))).astype(x.dtype)


def linear(
    x: jax.Array, weight: jax.Array | QuantizedWeight, bias: jax.Array | None = None
) -> jax.Array:
    """x [..., in] times weight [out, in] (contracted on its last axis) -> [..., out]."""
    if isinstance(weight, QuantizedWeight):
        y = quantized_matmul(x, weight).astype(x.dtype)
    else:
        y = jnp.einsum("...k,nk->...n", x, weight.astype(x.dtype))
    return y if bias is None else y + bias.astype(x.dtype)


def activation(x: jax.Array, kind: str) -> jax.Array:
    if kind == "gelu_tanh":
        return jax.nn.gelu(x, approximate=True)
    return jax.nn.silu(x)


def gated_mlp(x: jax.Array, layer: dict[str, jax.Array], kind: str) -> jax.Array:
    """down(act(gate(x)) * up(x)); x [..., d_model]. Taps down's input as "mlp_hidden"."""
    gate = activation(linear(x, layer["gate_proj"]), kind)
    hidden = tap("mlp_hidden", gate * linear(x, layer["up_proj"]))
    return linear(hidden, layer["down_proj"])


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> jax.Array:
    """Inverse frequencies [head_dim // 2] with optional linear, Llama-3 or per-frequency
    scaling."""
    exponents = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "factors":
        if len(scaling.factors) != head_dim // 2:
            raise ValueError(f"{len(scaling.factors)} RoPE factors for head_dim {head_dim}")
        return inv_freq / jnp.asarray(scaling.factors, jnp.float32)
    return _llama3_scale(inv_freq, scaling)


def _llama3_scale(inv_freq: jax.Array, s: RopeScaling) -> jax.Array:
    low_wavelen = s.original_max_position / s.low_freq_factor
    high_wavelen = s.original_max_position / s.high_freq_factor
    wavelen = 2 * jnp.pi / inv_freq
    scaled = jnp.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return jnp.where(is_medium, smoothed, scaled)


def rope_tables(positions: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin [..., head_dim] for positions [...] (halves duplicated, HF layout)."""
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., hd/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate x [..., heads, hd] with cos/sin [..., hd] (rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = cos[..., None, :].astype(x.dtype), sin[..., None, :].astype(x.dtype)
    return x * cos + rotated * sin


def layer_rope(config: ModelConfig, positions: jax.Array) -> dict[str, jax.Array]:
    """RoPE tables for both layer kinds, stacked as [2, *positions.shape, hd]: index 1 = local."""
    global_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
    local_freq = rope_inv_freq(config.head_dim, config.local_theta, None)
    cos_g, sin_g = rope_tables(positions, global_freq)
    cos_l, sin_l = rope_tables(positions, local_freq)
    return {"cos": jnp.stack([cos_g, cos_l]), "sin": jnp.stack([sin_g, sin_l])}
