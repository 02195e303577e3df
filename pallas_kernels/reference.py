"""Paged attention, the plain-jnp reference every Pallas kernel here is tested against.

The pool of each layer is a flat array of cache rows, [num_blocks * block_size,
kv_heads, head_dim]; block `b` owns rows [b * block_size, (b + 1) * block_size).
A sequence reads the blocks listed in its block-table row. A contiguous
per-sequence cache is the special case where each sequence owns a fixed run of
blocks. Writing new tokens into the pool is not attention's job (the caller
scatters them first).

Every implementation takes plain arrays: the query positions [B, T], the block
tables [B, max_blocks] and the context lengths [B] (tokens in the cache,
including this step's), so kernels depend on no type of the engine above them.

The reference gathers only the blocks a sequence owns (never the whole pool),
then runs masked softmax attention with grouped query heads (GQA/MQA). It is
also the XLA path jaxinfer runs on CPU. Queries of a row are consecutive
positions ending at `context_lens - 1`; padding query rows are computed but
ignored by the caller. A global layer passes a window larger than any context.

int8 KV cache. A pool may hold int8 values with one f32 scale per (row, kv
head): `k_scale` / `v_scale` [L, rows, KV], symmetric, x ≈ values * scale with
scale = max|x| / 127 (0 for an all-zero vector). Every implementation takes the
scales as keyword arguments (None for a float pool) and folds them into the
math instead of dequantizing K/V tiles: scores = (q . k_int8) * k_scale, and
p * v_scale before the p . V dot, both in f32. int8 values are exact in bf16
and f32, so the dots see the stored integers unchanged. Masked keys get weight
0 (not p * scale), so stale rows, even with NaN scales, never leak.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


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
    positions: jax.Array,  # [B, T] int32, absolute position of each query token
    block_tables: jax.Array,  # [B, max_blocks] int32, physical block of each logical block
    context_lens: jax.Array,  # [B] int32, tokens in the cache after this step
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
    k = gather_context(k_pool, layer, block_tables, block_size)  # [B, C, KV, hd]
    v = gather_context(v_pool, layer, block_tables, block_size)
    qg = q.reshape(b, t, kv_heads, h // kv_heads, hd)
    scores = jnp.einsum("btkgd,bckd->bkgtc", qg, k.astype(q.dtype)).astype(jnp.float32)
    if quantized:
        k_scale, v_scale = (_context_scales(s, layer, block_tables, block_size)
                            for s in (k_scale, v_scale))
        scores = scores * k_scale
    scores = scores * scale
    if softcap is not None:
        scores = jnp.tanh(scores / softcap) * softcap
    mask = _attention_mask(positions, context_lens, k.shape[1], window)  # [B, T, C]
    # A finite floor keeps fully masked (padding) rows NaN-free.
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1)
    if quantized:
        probs = jnp.where(mask[:, None, None], probs * v_scale, 0.0)
    out = jnp.einsum("bkgtc,bckd->btkgd", probs.astype(q.dtype), v.astype(q.dtype))
    return out.reshape(b, t, h, hd)


def _context_scales(
    scales: jax.Array, layer: jax.Array, block_tables: jax.Array, block_size: int
) -> jax.Array:
    """Scale pool [L, rows, KV] -> each sequence's scales, [B, KV, 1, 1, C] f32."""
    gathered = gather_context(scales, layer, block_tables, block_size)  # [B, C, KV]
    return gathered.astype(jnp.float32).transpose(0, 2, 1)[:, :, None, None, :]


def _attention_mask(
    positions: jax.Array, context_lens: jax.Array, context: int, window: jax.Array | int
) -> jax.Array:
    """[B, T, C] causal, in-context and sliding-window mask."""
    k_pos = jnp.arange(context, dtype=jnp.int32)[None, None, :]
    q_pos = positions[:, :, None]
    in_context = k_pos < context_lens[:, None, None]
    return in_context & (k_pos <= q_pos) & (q_pos - k_pos < window)
