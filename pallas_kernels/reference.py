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


def gather_context(
    pool: jax.Array, layer: jax.Array, block_tables: jax.Array, block_size: int
) -> jax.Array:
    """Rows each sequence owns: pool [L, rows, KV, hd] -> [B, max_blocks*block_size, KV, hd]."""
    offsets = jnp.arange(block_size, dtype=jnp.int32)
    rows = (block_tables[:, :, None] * block_size + offsets).reshape(block_tables.shape[0], -1)
    return pool[layer, rows]


def paged_attention_reference(
    q: jax.Array,  # [B, T, H, hd]
    k_pool: jax.Array,  # [L, rows, KV, hd]
    v_pool: jax.Array,  # [L, rows, KV, hd]
    layer: jax.Array,  # scalar int32: which layer's pool to read
    meta: AttentionMetadata,
    *,
    block_size: int,
    scale: float,
    window: jax.Array | int,  # keys with q_pos - k_pos >= window are masked
    softcap: float | None = None,
) -> jax.Array:
    """Reference paged attention for prefill chunks and decode alike -> [B, T, H, hd]."""
    b, t, h, hd = q.shape
    kv_heads = k_pool.shape[2]
    k = gather_context(k_pool, layer, meta.block_tables, block_size)  # [B, C, KV, hd]
    v = gather_context(v_pool, layer, meta.block_tables, block_size)
    qg = q.reshape(b, t, kv_heads, h // kv_heads, hd)
    scores = jnp.einsum("btkgd,bckd->bkgtc", qg, k.astype(q.dtype)).astype(jnp.float32) * scale
    if softcap is not None:
        scores = jnp.tanh(scores / softcap) * softcap
    mask = _attention_mask(meta, k.shape[1], window)  # [B, T, C]
    # A finite floor keeps fully masked (padding) rows NaN-free.
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    out = jnp.einsum("bkgtc,bckd->btkgd", probs, v.astype(q.dtype))
    return out.reshape(b, t, h, hd)


def _attention_mask(meta: AttentionMetadata, context: int, window: jax.Array | int) -> jax.Array:
    """[B, T, C] causal, in-context and sliding-window mask."""
    k_pos = jnp.arange(context, dtype=jnp.int32)[None, None, :]
    q_pos = meta.positions[:, :, None]
    in_context = k_pos < meta.context_lens[:, None, None]
    return in_context & (k_pos <= q_pos) & (q_pos - k_pos < window)
