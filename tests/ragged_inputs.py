"""Random ragged-step inputs, built one way for the ragged kernel tests and scripts/gpu_check.py.

Each case lays out sequences (query length, context length) back to back in a
flat q, with padding tokens at the end and padding sequences after the live
ones. Every live sequence's K/V go into layer `LAYER` of a pool through a
shuffled, non-contiguous block table (unused table entries name random
blocks); every other row (layer 0, unowned blocks, tails past a context) is
noise, or NaN in the poisoned cases, where the table entries of pages no query
reads (wholly outside the window, past the context, padding sequences) name
blocks past the end of the pool, so a kernel copying one fails the TPU
interpreter's bounds check. `dense_attention` is a float64 oracle that reads
each sequence's K/V back from the exact rows the builder wrote and shares no
code with the kernels or the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.ops.int8 import dequantize_int8, quantize_int8

LAYERS = 2
LAYER = 1  # layer 0 is noise: reading it fails the comparison


@dataclass(frozen=True)
class Case:
    q: jax.Array  # [T, H, hd]
    k_pool: jax.Array  # [L, rows, KV, hd], float or int8
    v_pool: jax.Array
    query_start: jax.Array  # [S + 1]
    context_lens: jax.Array  # [S]
    block_tables: jax.Array  # [S, W]
    num_seqs: jax.Array  # [1]
    k_scale: jax.Array | None  # [L, rows, KV], int8 pools only
    v_scale: jax.Array | None
    k_seqs: tuple[np.ndarray, ...]  # per live sequence [ctx, KV, hd] float64, as stored
    v_seqs: tuple[np.ndarray, ...]
    block_size: int

    @property
    def scale(self) -> float:
        return float(self.q.shape[-1]) ** -0.5

    @property
    def metadata(self) -> tuple[jax.Array, ...]:
        """query_start, context_lens, block_tables, num_seqs, in argument order."""
        return self.query_start, self.context_lens, self.block_tables, self.num_seqs

    def scales(self) -> dict[str, jax.Array]:
        return {} if self.k_scale is None else {"k_scale": self.k_scale, "v_scale": self.v_scale}


def make_case(
    seqs: list[tuple[int, int]], *, pad_seqs: int = 1, pad_tokens: int = 3, kv_heads: int = 1,
    group: int = 4, head_dim: int = 64, block_size: int = 16, dtype=jnp.float32,
    int8: bool = False, poison_window: int | None = None, seed: int = 0,
) -> Case:
    """Sequences given as (query length, context length) laid into a shuffled pool.

    poison_window: set every pool row no query can read under that window to NaN
    (NaN scales for int8 pools) instead of noise, and point the table entries of
    pages no query reads past the end of the pool.
    """
    rng = np.random.default_rng(seed)
    q_lens = np.array([n for n, _ in seqs] + [0] * pad_seqs, np.int32)
    ctx = np.array([c for _, c in seqs] + [7] * pad_seqs, np.int32)  # padding: stale lengths
    width = max(1, max(-(-c // block_size) for _, c in seqs))
    num_blocks = 2 * len(q_lens) * width + 3
    table = rng.integers(0, num_blocks, (len(q_lens), width)).astype(np.int32)
    physical = iter(rng.permutation(num_blocks))
    pool_shape = (LAYERS, num_blocks * block_size, kv_heads, head_dim)
    k_pool, v_pool = (rng.standard_normal(pool_shape) for _ in range(2))
    readable = np.zeros(pool_shape[:2], bool)  # rows some query reads
    seq_rows = []
    for s, (n, c) in enumerate(seqs):
        table[s, : -(-c // block_size)] = [next(physical) for _ in range(-(-c // block_size))]
        pos = np.arange(c)
        rows = table[s, pos // block_size] * block_size + pos % block_size
        seq_rows.append(rows)
        first = 0 if poison_window is None else max(0, c - n - poison_window + 1)
        readable[LAYER, rows[first:]] = True
        if poison_window is not None:
            unread = np.arange(width)
            unread = (unread < first // block_size) | (unread >= -(-c // block_size))
            table[s, unread] = num_blocks + 7
    if poison_window is not None:
        table[len(seqs):] = num_blocks + 7
    k_pool, v_pool, k_scale, v_scale = _store(k_pool, v_pool, dtype, int8)
    if poison_window is not None:
        for array in (k_scale, v_scale) if int8 else (k_pool, v_pool):
            array[~readable] = np.nan
    stored = [_as_float64(p, s) for p, s in ((k_pool, k_scale), (v_pool, v_scale))]
    q = rng.standard_normal((int(q_lens.sum()) + pad_tokens, kv_heads * group, head_dim))
    return Case(
        jnp.asarray(q, dtype), jnp.asarray(k_pool), jnp.asarray(v_pool),
        jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32), jnp.asarray(ctx),
        jnp.asarray(table), jnp.array([len(seqs)], jnp.int32),
        None if k_scale is None else jnp.asarray(k_scale),
        None if v_scale is None else jnp.asarray(v_scale),
        tuple(stored[0][LAYER, rows] for rows in seq_rows),
        tuple(stored[1][LAYER, rows] for rows in seq_rows), block_size)


def shuffled_block_tables(
    rng: np.random.Generator, rows: int, blocks_per_row: int, spare_blocks: int
) -> tuple[np.ndarray, int]:
    """Distinct physical blocks in random order -> (tables [rows, blocks_per_row] int32,
    number of blocks in the pool); the spare blocks end up unused between used ones."""
    num_blocks = rows * blocks_per_row + spare_blocks
    tables = rng.permutation(num_blocks)[: rows * blocks_per_row].reshape(rows, blocks_per_row)
    return tables.astype(np.int32), num_blocks


def _store(k: np.ndarray, v: np.ndarray, dtype, int8: bool) -> tuple[np.ndarray, ...]:
    """Pools as the cache holds them: dtype-rounded floats, or int8 values with scales."""
    if not int8:
        return (np.array(jnp.asarray(k, dtype)), np.array(jnp.asarray(v, dtype)), None, None)
    (kq, ks), (vq, vs) = quantize_int8(k.astype(np.float32)), quantize_int8(v.astype(np.float32))
    return kq, vq, ks, vs


def _as_float64(pool: np.ndarray, scale: np.ndarray | None) -> np.ndarray:
    if scale is None:
        return np.asarray(jnp.asarray(pool).astype(jnp.float32), np.float64)
    return np.asarray(dequantize_int8(pool, scale), np.float64)


def dense_attention(case: Case, window: int, softcap: float | None = None) -> np.ndarray:
    """Float64 attention per live sequence over its contiguous K/V -> [T, H, hd]."""
    q = np.asarray(case.q.astype(jnp.float32), np.float64)
    t, h, hd = q.shape
    starts, ctx = np.asarray(case.query_start), np.asarray(case.context_lens)
    out = np.zeros((t, h, hd))
    for s, (k, v) in enumerate(zip(case.k_seqs, case.v_seqs, strict=True)):
        group = h // k.shape[1]
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # [c, H, hd]
        queries = q[starts[s]: starts[s + 1]]  # [n, H, hd]
        q_pos = ctx[s] - len(queries) + np.arange(len(queries))[:, None]
        k_pos = np.arange(ctx[s])[None, :]
        mask = (k_pos <= q_pos) & (q_pos - k_pos < window)  # [n, c]
        scores = np.einsum("nhd,chd->hnc", queries, k) * case.scale
        if softcap is not None:
            scores = np.tanh(scores / softcap) * softcap
        scores = np.where(mask, scores, -np.inf)
        p = np.exp(scores - scores.max(axis=-1, keepdims=True))
        v = np.where(mask.any(axis=0)[:, None, None], v, 0.0)  # rows no query reads may be NaN
        out[starts[s]: starts[s + 1]] = np.einsum("hnc,chd->nhd", p / p.sum(-1, keepdims=True), v)
    return out
