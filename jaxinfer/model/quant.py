"""Quantized weights and the matmuls that read them without a full-precision copy.

A `QuantizedWeight` stands in for a float matrix `w [..., out, in]` of the params
pytree (leading axes: the stacked layer axis):

- int8 (`bits=8`): `w ≈ values * scale`, values int8 `[..., out, in]`, one scale
  per output row and group of `group_size` inputs (`group_size == in`: per channel).
- int8 with `offsets`: `w = values * scale + offset` per group (a GGUF tensor whose
  layers mix Q4_K and Q6_K blocks, in one exact form: see gguf_quants.common_form).
- int4 (`bits=4`): `w ≈ u * scale + offset`, u in 0..15 packed two per byte along
  the input axis (element 2j in the low nibble of byte j, 2j+1 in the high one),
  an asymmetric scale/offset pair per group (AWQ's and llama.cpp's Q4_K form).
- `act_scale [..., in]` (optional, AWQ): the input is multiplied by it before the
  matmul; the stored weight was divided by it, so salient input channels keep
  more of their precision.

Which matmul form runs is chosen per call from the static number of activation
rows (see shared CPU notes, measured on XLA CPU):
- weight-only (the default): the int8->f32 convert (and scale, or int4 unpack) is an
  elementwise producer of the dot. For one row (batch-1 decode) XLA fuses it into
  the matrix-vector product: the weight is read once, compact. Up to
  `ROW_LOOP_MAX_ROWS` rows run as that many fused products; with more rows XLA on
  CPU converts one layer's matrix at a time inside the layer scan (a few MB,
  amortized over the rows: as fast as f32 at 512 rows, 2x slower at 8-32).
- `w8a8=True`, from `W8A8_MIN_ROWS` rows: activations are quantized per row (and
  per weight group, for grouped weights) and the dot runs int8 x int8 -> int32: 3-5x
  faster than f32 on this CPU from two rows up, at a cost in accuracy (Gemma's MLP
  activations have outlier channels). Finer activation groups (128 inputs) halved
  the logit error but made 1k-token prefill 4x slower than f32 on XLA CPU (one
  partial dot per group), so rows stay whole. The LM head always takes this path:
  converting its 262k x 640 weight per step would cost 10x, and its input (the
  final normed hidden state) quantizes per row with little loss.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxinfer.ops.int8 import array_module, dequantize_int8, quantize_int8

W8A8_MIN_ROWS = 2  # from this many activation rows, w8a8 weights use the int8 x int8 dot
ROW_LOOP_MAX_ROWS = 3  # weight-only: up to this many rows, one fused product per row


@struct.dataclass
class QuantizedWeight:
    values: jax.Array  # int8 [..., out, in] | uint8 [..., out, in // 2] (bits=4)
    scales: jax.Array  # f32 [..., out, in // group_size]
    offsets: jax.Array | None = None  # f32 [..., out, in // group_size] (bits=4)
    act_scale: jax.Array | None = None  # f32 [..., in] (AWQ)
    bits: int = struct.field(pytree_node=False, default=8)
    group_size: int = struct.field(pytree_node=False, default=0)
    w8a8: bool = struct.field(pytree_node=False, default=False)  # int8 activations at batch

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical shape of the float matrix this stands for."""
        *lead, out, packed = self.values.shape
        return (*lead, out, packed * 8 // self.bits)

    @property
    def num_groups(self) -> int:
        return self.scales.shape[-1]



def unpack_int4(packed: jax.Array) -> jax.Array:
    """uint8 [..., n // 2] -> uint8 [..., n], low nibble first (numpy in, numpy out)."""
    xp = array_module(packed)
    pairs = xp.stack([packed & 15, packed >> 4], axis=-1)
    return pairs.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def dequantize(weight: QuantizedWeight, dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """The float matrix [..., out, in] (folding act_scale back in). For tests, error
    measurement and rows of the embedding; never called on a whole weight inside a step.
    A weight of numpy arrays (as quantized on the host) gives a numpy matrix."""
    values = unpack_int4(weight.values) if weight.bits == 4 else weight.values
    *lead, out, n_in = values.shape
    grouped = values.reshape(*lead, out, weight.num_groups, -1)
    if weight.offsets is None:
        w = dequantize_int8(grouped, weight.scales)
    else:
        w = grouped.astype(jnp.float32) * weight.scales[..., None] + weight.offsets[..., None]
    w = w.reshape(*lead, out, n_in)
    if weight.act_scale is not None:
        w = w * weight.act_scale[..., None, :]
    return w.astype(dtype)


def take_rows(weight: QuantizedWeight, ids: jax.Array) -> jax.Array:
    """Rows `ids` of a 2-D quantized matrix, dequantized: the embedding lookup."""
    rows = QuantizedWeight(
        values=jnp.take(weight.values, ids, axis=0),
        scales=jnp.take(weight.scales, ids, axis=0),
        offsets=None if weight.offsets is None else jnp.take(weight.offsets, ids, axis=0),
        act_scale=weight.act_scale, bits=weight.bits, group_size=weight.group_size,
    )
    return dequantize(rows)


def quantized_matmul(x: jax.Array, weight: QuantizedWeight) -> jax.Array:
    """x [..., in] times the quantized weight [out, in] -> f32 [..., out]."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).astype(jnp.float32)  # [rows, in]
    if weight.act_scale is not None:
        x2 = x2 * weight.act_scale
    use_int8_activations = weight.w8a8 and x2.shape[0] >= W8A8_MIN_ROWS
    y = _w8a8(x2, weight) if use_int8_activations else _weight_only(x2, weight)
    return y.reshape(*lead, y.shape[-1])


def _weight_only(x: jax.Array, weight: QuantizedWeight) -> jax.Array:
    """Dequantization as the dot's elementwise producer (fused at small row counts).

    The form matters: `x @ w.T.astype(f32)` (transpose, then convert) fuses on XLA
    CPU, while `einsum("rk,nk->rn", x, w.astype(f32))` materializes the f32 weight
    (tests/test_quant.py checks the compiled temporaries).
    """
    if 1 < x.shape[0] <= ROW_LOOP_MAX_ROWS:
        return jnp.concatenate([_weight_only(row[None], weight) for row in x], axis=0)
    if weight.bits == 8 and weight.num_groups == 1 and weight.offsets is None:
        return (x @ weight.values.T.astype(jnp.float32)) * weight.scales[:, 0]
    return x @ dequantize(weight.replace(act_scale=None)).T  # x was scaled by the caller


def _w8a8(x: jax.Array, weight: QuantizedWeight) -> jax.Array:
    """int8 x int8 -> int32 dot(s) with per-row activation scales (one partial dot per
    weight group for grouped weights)."""
    rows, n_in = x.shape
    groups = weight.num_groups
    xq, x_scale = quantize_int8(x.reshape(rows, groups, n_in // groups))  # [rows, G, g]
    x_scale = x_scale[..., None]  # [rows, G, 1]
    if groups == 1:
        acc = jax.lax.dot_general(xq[:, 0], weight.values, (((1,), (1,)), ((), ())),
                                  preferred_element_type=jnp.int32)  # [rows, out]
        return acc.astype(jnp.float32) * x_scale[:, 0] * weight.scales[:, 0]
    w_groups = weight.values.reshape(weight.values.shape[0], groups, -1)  # [out, G, g]
    acc = jax.lax.dot_general(xq, w_groups, (((2,), (2,)), ((1,), (1,))),
                              preferred_element_type=jnp.int32)  # [G, rows, out]
    scaled = acc.astype(jnp.float32) * jnp.transpose(x_scale, (1, 0, 2))
    return jnp.einsum("grn,ng->rn", scaled, weight.scales)
