"""The one symmetric int8 rule (jaxinfer/ops/int8.py), on host and device arrays.

Its users (the KV write, int8 weights, w8a8 activations) are tested where they
live; here only the rule: the round-trip bound, zero vectors, dtypes and shapes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.ops.int8 import dequantize_int8, quantize_int8
from jaxinfer.weights.quantize import quantize_int8 as quantize_weight_int8


def _vectors() -> np.ndarray:
    """[4, 3, 64] f32: three magnitudes per token and one all-zero token."""
    rng = np.random.default_rng(0)
    magnitudes = np.array([1e-3, 1.0, 50.0, 0.0])[:, None, None]  # per token; last: all zero
    return (rng.standard_normal((4, 3, 64)) * magnitudes).astype(np.float32)


def test_quantize_round_trip_is_within_half_a_step() -> None:
    x = jnp.asarray(_vectors())
    values, scale = quantize_int8(x)
    assert values.dtype == jnp.int8 and scale.dtype == jnp.float32 and scale.shape == (4, 3)
    assert int(jnp.abs(values.astype(jnp.int32)).max()) == 127  # the largest element hits 127
    err = jnp.abs(dequantize_int8(values, scale) - x)
    assert bool(jnp.all(err <= scale[..., None] * (0.5 + 1e-5)))  # half a quantization step
    np.testing.assert_allclose(scale, jnp.abs(x).max(-1) / 127, rtol=1e-6)
    assert not values[3].any() and not scale[3].any()  # zero vectors: scale 0, no NaN


def test_zero_vectors_round_trip_to_exact_zeros() -> None:
    for x in (np.zeros((2, 8), np.float32), jnp.zeros((2, 8), jnp.float32)):
        values, scale = quantize_int8(x)
        out = dequantize_int8(values, scale)
        assert not np.asarray(values).any() and not np.asarray(scale).any()
        assert np.isfinite(np.asarray(out)).all() and not np.asarray(out).any()


def test_host_and_device_arrays_follow_the_same_rule() -> None:
    """numpy in, numpy out (weights quantize on the host); the same integers and scales."""
    x = _vectors()
    host_values, host_scale = quantize_int8(x)
    device_values, device_scale = jax.jit(quantize_int8)(jnp.asarray(x))
    assert isinstance(host_values, np.ndarray) and isinstance(host_scale, np.ndarray)
    assert host_values.dtype == np.int8 and host_scale.dtype == np.float32
    np.testing.assert_array_equal(host_values, np.asarray(device_values))
    np.testing.assert_array_equal(host_scale, np.asarray(device_scale))
    host = dequantize_int8(host_values, host_scale)
    assert isinstance(host, np.ndarray) and host.dtype == np.float32
    np.testing.assert_array_equal(host, np.asarray(dequantize_int8(device_values, device_scale)))


def test_grouped_weights_quantize_each_group_by_the_rule() -> None:
    w = _vectors().reshape(12, 64)  # [out, in]; rows 9..11 all zero
    weight = quantize_weight_int8(w, group_size=32)
    values, scale = quantize_int8(w.reshape(12, 2, 32))
    np.testing.assert_array_equal(weight.values, values.reshape(12, 64))
    np.testing.assert_array_equal(weight.scales, scale)
