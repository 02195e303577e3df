"""The one symmetric int8 rule: the KV cache, int8 weights and w8a8 activations use it.

A vector x (the last axis) becomes int8 values and one f32 scale:

    scale = max|x| / 127,  values = round(x / scale) in [-127, 127],  x ≈ values * scale

Rounding is to nearest, ties to even. An all-zero vector gets scale 0 and zero
values: the stored scale is max|x| / 127 without exception, dequantizing gives
exactly 0, and the division uses 1 in its place, so nothing divides by zero.
-128 is never used, so the range is symmetric and negation is exact.

Both functions take numpy arrays (weights quantize on the host at load time, with
no device copy) or jax arrays (inside jitted steps), and return the same kind.
Grouped quantization (per output channel and group of inputs) reshapes the groups
onto the last axis first.
"""

from __future__ import annotations

from types import ModuleType

import jax
import jax.numpy as jnp
import numpy as np

INT8_MAX = 127

Array = np.ndarray | jax.Array


def array_module(x: Array) -> ModuleType:
    """numpy for host arrays, jax.numpy for everything else (device arrays, tracers)."""
    return np if isinstance(x, np.ndarray) else jnp


def quantize_int8(x: Array) -> tuple[Array, Array]:
    """x [..., n] -> (int8 values [..., n], f32 scale [...]), over the last axis."""
    xp = array_module(x)
    x = xp.asarray(x, dtype=xp.float32)
    scale = xp.max(xp.abs(x), axis=-1) / INT8_MAX  # [...]
    divisor = xp.where(scale > 0, scale, xp.ones_like(scale))  # zero vectors: 0 / 1
    values = xp.clip(xp.round(x / divisor[..., None]), -INT8_MAX, INT8_MAX)
    return values.astype(xp.int8), scale


def dequantize_int8(values: Array, scale: Array) -> Array:
    """int8 values [..., n] and f32 scale [...] -> f32 [..., n]."""
    xp = array_module(values)
    return values.astype(xp.float32) * scale[..., None]
