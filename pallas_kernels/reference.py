"""Paged attention, the plain-jnp reference every Pallas kernel here is tested against.

The pool of each layer is a flat array of cache rows, [num_blocks * block_size,
kv_heads, head_dim]; block `b` owns rows [b * block_size, (b + 1) * block_size).
A sequence reads the blocks listed in its block-table row, and new tokens are
written to the rows named by the slot mapping. A contiguous per-sequence cache
is the special case where each sequence owns a fixed run of blocks.

The reference gathers only the blocks a sequence owns (never the whole pool),
then runs masked softmax attention with grouped query heads (GQA/MQA). It is
also the XLA path jaxinfer runs on CPU. Queries of a row are consecutive
positions ending at `context_lens - 1`; padding query rows are computed but
ignored by the caller.

int8 KV cache. A pool may hold int8 values with one f32 scale per (row, kv
head): `k_scale` / `v_scale` [L, rows, KV], symmetric, scale = max|x| / 127
(`quantize_int8`). Every implementation takes the scales as keyword arguments
(None for a float pool) and folds them into the math instead of dequantizing
K/V tiles: scores = (q . k_int8) * k_scale, and p * v_scale before the p . V
dot, both in f32. int8 values are exact in bf16 and f32, so the dots see the
stored integers unchanged. Masked keys get weight 0 (not p * scale), so
stale rows, even with NaN scales, never leak.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

NO_WINDOW = 1 << 30  # "window" of a global layer: larger than any context


@struct.dataclass
class AttentionMetadata:
    """Where the step's tokens sit in their sequences and in the KV pool."""

    positions: jax.Array  # [B, T] int32, absolute position of each query token
    slot_mapping: jax.Array  # [B, T] int32, pool row for each new token (>= pool size: padding)
    block_tables: jax.Array  # [B, max_blocks] int32, physical block of each logical block
    context_lens: jax.Array  # [B] int32, tokens in the cache after this step


INT8_MAX = 127


def quantize_int8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Symmetric int8 over the last axis: x [..., hd] -> (int8 [..., hd], f32 scale [...]).

    scale = max|x| / 127; an all-zero vector gets scale 0 and zeros.
    """
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1)
    inverse = jnp.where(amax > 0, INT8_MAX / jnp.where(amax > 0, amax, 1.0), 0.0)
    values = jnp.clip(jnp.round(x * inverse[..., None]), -INT8_MAX, INT8_MAX)
    return values.astype(jnp.int8), amax / INT8_MAX


def dequantize_int8(values: jax.Array, scale: jax.Array) -> jax.Array:
    """int8 [..., hd] and f32 scale [...] -> f32 [..., hd]."""
    return values.astype(jnp.float32) * scale[..., None]


def check_kv_scales(
    k_pool: jax.Array, v_pool: jax.Array, k_scale: jax.Array | None, v_scale: jax.Array | None
) -> bool:
    """True for an int8 pool with scales [L, rows, KV]; False for a float pool; else raise."""
    if (k_scale is None) != (v_scale is None):
        raise ValueError("k_scale and v_scale must be given together (int8 KV pools)")
    quantized = k_scale is not None
    for name, pool in (("k_pool", k_pool), ("v_pool", v_pool)):
        if (pool.dtype == jnp.int8) != quantized:
            raise ValueError(
                f"{name} is {pool.dtype}: int8 pools need k_scale/v_scale, float pools take none"
            )
    if quantized and (k_scale.shape != k_pool.shape[:3] or v_scale.shape != v_pool.shape[:3]):
        raise ValueError(
            f"k_scale {k_scale.shape} / v_scale {v_scale.shape} must be [L, rows, KV] "
            f"= {k_pool.shape[:3]}"
        )
    return quantized


def gather_context(
    pool: jax.Array, layer: jax.Array, block_tables: jax.Array, block_size: int
) -> jax.Array:
    """Rows each sequence owns: pool [L, rows, KV, ...] -> [B, max_blocks*block_size, KV, ...]."""
    offsets = jnp.arange(block_size, dtype=jnp.int32)
    rows = (block_tables[:, :, None] * block_size + offsets).reshape(block_tables.shape[0], -1)
    return pool[layer, rows]


def paged_attention_reference(
    q: jax.Array,  # [B, T, H, hd]
    k_pool: jax.Array,  # [L, rows, KV, hd], float or int8
    v_pool: jax.Array,  # [L, rows, KV, hd]
    layer: jax.Array,  # scalar int32: which layer's pool to read
    meta: AttentionMetadata,
    *,
    block_size: int,
    scale: float,
    window: jax.Array | int,  # keys with q_pos - k_pos >= window are masked
    softcap: float | None = None,
    k_scale: jax.Array | None = None,  # [L, rows, KV] f32, int8 pools only
    v_scale: jax.Array | None = None,  # [L, rows, KV] f32
) -> jax.Array:
    """Reference paged attention for prefill chunks and decode alike -> [B, T, H, hd]."""
    quantized = check_kv_scales(k_pool, v_pool, k_scale, v_scale)
    b, t, h, hd = q.shape
    kv_heads = k_pool.shape[2]
    k = gather_context(k_pool, layer, meta.block_tables, block_size)  # [B, C, KV, hd]
    v = gather_context(v_pool, layer, meta.block_tables, block_size)
    qg = q.reshape(b, t, kv_heads, h // kv_heads, hd)
    scores = jnp.einsum("btkgd,bckd->bkgtc", qg, k.astype(q.dtype)).astype(jnp.float32)
    if quantized:
        k_scale, v_scale = (_context_scales(s, layer, meta, block_size) for s in (k_scale, v_scale))
        scores = scores * k_scale
    scores = scores * scale
    if softcap is not None:
        scores = jnp.tanh(scores / softcap) * softcap
    mask = _attention_mask(meta, k.shape[1], window)  # [B, T, C]
    # A finite floor keeps fully masked (padding) rows NaN-free.
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1)
    if quantized:
        probs = jnp.where(mask[:, None, None], probs * v_scale, 0.0)
    out = jnp.einsum("bkgtc,bckd->btkgd", probs.astype(q.dtype), v.astype(q.dtype))
    return out.reshape(b, t, h, hd)


def _context_scales(
    scales: jax.Array, layer: jax.Array, meta: AttentionMetadata, block_size: int
) -> jax.Array:
    """Scale pool [L, rows, KV] -> each sequence's scales, [B, KV, 1, 1, C] f32."""
    gathered = gather_context(scales, layer, meta.block_tables, block_size)  # [B, C, KV]
    return gathered.astype(jnp.float32).transpose(0, 2, 1)[:, :, None, None, :]


def _attention_mask(meta: AttentionMetadata, context: int, window: jax.Array | int) -> jax.Array:
    """[B, T, C] causal, in-context and sliding-window mask."""
    k_pos = jnp.arange(context, dtype=jnp.int32)[None, None, :]
    q_pos = meta.positions[:, :, None]
    in_context = k_pos < meta.context_lens[:, None, None]
    return in_context & (k_pos <= q_pos) & (q_pos - k_pos < window)
