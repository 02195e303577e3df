"""Ragged paged attention: the flat step layout's plain-jnp reference.

One engine step holds every sequence's query tokens back to back in `q [T, H,
hd]`: decodes (one token), prompt chunks (from position 0 or mid-block after a
cached prefix) and, later, draft tokens to verify, all the same case. Sequence
s owns the tokens q[query_start[s]:query_start[s + 1]]; the cache holds
`context_lens[s]` tokens after this step (its cached prefix plus these
queries), so its query j sits at position context_lens[s] - q_len[s] + j. It
attends to keys p <= its position with position - p < window, read through
its block-table row from the pool (the pool of each layer is a flat array of
cache rows, [num_blocks * block_size, KV, hd]; block b owns rows [b*bs,
(b+1)*bs)). Sequences s >= num_seqs are padding (query length 0); tokens at or
past query_start[num_seqs] come out as zeros. Query heads share KV heads in
groups (GQA/MQA). Masked keys get weight exactly 0, so stale or NaN rows, and
NaN scales, never leak, and a query with no key (only possible with window <
1) gets zeros. Writing new tokens into the pool is not attention's job (the
caller scatters them first).

int8 KV cache. A pool may hold int8 values with one f32 scale per (row, KV
head): `k_scale` / `v_scale` [L, rows, KV], symmetric, x ≈ values * scale with
scale = max|x| / 127 (0 for an all-zero vector). Every implementation takes the
scales as keyword arguments (None for a float pool) and folds them into the
math instead of dequantizing K/V tiles: scores = (q . k_int8) * k_scale, and
p * v_scale before the p . V dot, both in f32. int8 values are exact in bf16
and f32, so the dots see the stored integers unchanged.

How the reference computes it (it is also the `xla` path the engine runs on
CPU, so it avoids padded work where it can). Sequences with one query token
(decodes) are attended together: one batched gather of each sequence's W
blocks and one query row each, as a decode step always did. Longer query runs
(prompt chunks, draft tokens) are cut into tiles of QUERY_TILE tokens that
never cross a sequence; `lax.scan` walks the tiles, gathering a sequence's W
blocks of K/V once, at its first tile (only blocks its table names), and
skipping tiles past the last real one (`lax.cond`), so the static tile bound,
ceil(T / QUERY_TILE) + min(S, T // 2), costs nothing where the step holds
fewer. A step of decodes only skips the tile loop altogether.

Cost per call: S one-query rows over W*bs keys, plus one gather of W*bs K/V
rows per longer run and H*QUERY_TILE*W*bs scores per tile; peak memory is one
sequence's context and one tile's scores, never a context per query token.
Windows do not shrink the gather (the kernels skip those blocks).

Dynamic facts that cannot be checked under jit, and are the caller's promise:
query_start is non-decreasing with query_start[num_seqs] <= T, num_seqs <= S,
q_len[s] <= context_lens[s] <= W * block_size for live sequences, and table
entries of live blocks are valid block ids.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

QUERY_TILE = 64  # query tokens per reference tile


class Context(NamedTuple):
    """One sequence's gathered K/V rows (and int8 scales)."""

    k: jax.Array  # [C, KV, hd]
    v: jax.Array  # [C, KV, hd]
    k_scale: jax.Array | None  # [C, KV] f32, int8 pools only
    v_scale: jax.Array | None


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


def check_ragged_args(
    q: jax.Array,  # [T, H, hd]
    k_pool: jax.Array,  # [L, rows, KV, hd]
    v_pool: jax.Array,  # [L, rows, KV, hd]
    query_start: jax.Array,  # [S + 1]
    context_lens: jax.Array,  # [S]
    block_tables: jax.Array,  # [S, W]
    num_seqs: jax.Array,  # [1]
    *,
    block_size: int,
    window: jax.Array | int,
    softcap: float | None,
    k_scale: jax.Array | None,
    v_scale: jax.Array | None,
) -> bool:
    """Static checks shared by the reference and the kernels; True for an int8 pool."""
    if q.ndim != 3:
        raise ValueError(f"q must be [T, H, hd], got shape {q.shape}")
    _, h, hd = q.shape
    if k_pool.ndim != 4 or v_pool.shape != k_pool.shape or k_pool.shape[3] != hd:
        raise ValueError(f"k_pool {k_pool.shape} / v_pool {v_pool.shape} must both be "
                         f"[L, rows, KV, hd] with hd = q's head dim ({hd})")
    _, rows, kv_heads, _ = k_pool.shape
    if h % kv_heads:
        raise ValueError(f"q heads ({h}) must be a multiple of kv heads ({kv_heads})")
    if block_size < 1 or rows % block_size:
        raise ValueError(f"block_size ({block_size}) must be >= 1 and divide the pool "
                         f"rows ({rows})")
    _check_metadata(query_start, context_lens, block_tables, num_seqs)
    if isinstance(window, int) and window < 1:
        raise ValueError(f"window must be >= 1 (a global layer passes a large one), got {window}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be None or > 0, got {softcap}")
    return check_kv_scales(k_pool, v_pool, k_scale, v_scale)


def _check_metadata(
    query_start: jax.Array, context_lens: jax.Array, block_tables: jax.Array,
    num_seqs: jax.Array,
) -> None:
    """Shapes and integer dtypes of the per-sequence arrays."""
    if block_tables.ndim != 2 or block_tables.shape[1] < 1:
        raise ValueError(f"block_tables must be [S, W] with W >= 1, got {block_tables.shape}")
    s = block_tables.shape[0]
    expected = {"query_start": (s + 1,), "context_lens": (s,), "num_seqs": (1,)}
    arrays = {"query_start": query_start, "context_lens": context_lens,
              "num_seqs": num_seqs, "block_tables": block_tables}
    for name, shape in expected.items():
        if arrays[name].shape != shape:
            raise ValueError(f"{name} must have shape {shape} for S = {s} sequences "
                             f"(block_tables rows), got {arrays[name].shape}")
    for name, array in arrays.items():
        if not jnp.issubdtype(array.dtype, jnp.integer):
            raise ValueError(f"{name} must hold integers (int32), got {array.dtype}")


def live_query_lens(query_start: jax.Array, num_seqs: jax.Array) -> jax.Array:
    """[S] query tokens of each sequence this step; 0 for padding sequences."""
    lens = query_start[1:] - query_start[:-1]
    return jnp.where(jnp.arange(lens.shape[0]) < num_seqs[0], lens, 0)


def ragged_paged_attention_reference(
    q: jax.Array,  # [T, H, hd]
    k_pool: jax.Array,  # [L, rows, KV, hd], float or int8
    v_pool: jax.Array,  # [L, rows, KV, hd]
    layer: jax.Array,  # scalar int32: which layer's pool
    query_start: jax.Array,  # [S + 1] int32, cumulative query offsets into q
    context_lens: jax.Array,  # [S] int32, tokens in the cache after this step
    block_tables: jax.Array,  # [S, W] int32
    num_seqs: jax.Array,  # [1] int32, sequences in use
    *,
    block_size: int,
    scale: float,
    window: jax.Array | int,  # keys with q_pos - k_pos >= window are masked
    softcap: float | None = None,
    k_scale: jax.Array | None = None,  # [L, rows, KV] f32, int8 pools only
    v_scale: jax.Array | None = None,  # [L, rows, KV] f32
) -> jax.Array:
    """Reference ragged paged attention -> [T, H, hd] in q's dtype (padding tokens 0)."""
    quantized = check_ragged_args(
        q, k_pool, v_pool, query_start, context_lens, block_tables, num_seqs,
        block_size=block_size, window=window, softcap=softcap, k_scale=k_scale, v_scale=v_scale)
    gather = partial(_gather_sequence, k_pool=k_pool, v_pool=v_pool, layer=layer,
                     scales=(k_scale, v_scale) if quantized else None, block_size=block_size)
    attend = partial(_attend_context, scale=scale, window=window, softcap=softcap)
    query_start = query_start.astype(jnp.int32)
    lens = live_query_lens(query_start, num_seqs)  # [S]
    seqs = _Sequences(query_start, lens, context_lens.astype(jnp.int32), block_tables)
    out = _attend_single_queries(jnp.zeros_like(q), q, seqs, gather, attend)
    if q.shape[0] < 2:  # no room for a longer run
        return out
    return lax.cond(  # a step of decodes only skips the tile loop at once
        jnp.any(lens > 1), lambda o: _attend_runs(o, q, seqs, gather, attend), lambda o: o, out)


class _Sequences(NamedTuple):
    query_start: jax.Array  # [S + 1]
    lens: jax.Array  # [S] live query lengths (0 for padding)
    context_lens: jax.Array  # [S]
    block_tables: jax.Array  # [S, W]


def _attend_single_queries(
    out: jax.Array, q: jax.Array, seqs: _Sequences, gather: Callable[..., Context],
    attend: Callable[..., jax.Array],
) -> jax.Array:
    """Sequences with one query token, all in one batched gather -> out with their rows set."""
    t = q.shape[0]
    rows = jnp.minimum(seqs.query_start[:-1], t - 1)  # [S] each sequence's first token
    single = seqs.lens == 1
    q_pos = (seqs.context_lens - 1)[:, None]  # [S, 1]
    contexts = jax.vmap(gather)(seqs.block_tables)
    outs = jax.vmap(attend)(q[rows][:, None], q_pos, single[:, None], contexts)
    return out.at[jnp.where(single, rows, t)].set(outs[:, 0], mode="drop")


def _attend_runs(
    out: jax.Array, q: jax.Array, seqs: _Sequences, gather: Callable[..., Context],
    attend: Callable[..., jax.Array],
) -> jax.Array:
    """Sequences with more than one query token, in tiles that skip when empty. The
    tiles of a sequence are consecutive: its context is gathered once, at its first."""
    t, h, hd = q.shape
    tile = min(QUERY_TILE, t)
    run_lens = jnp.where(seqs.lens > 1, seqs.lens, 0)  # [S] one-token sequences are done
    tiles = query_tiles(seqs.query_start, run_lens, t, tile,
                        max_runs=min(run_lens.shape[0], t // 2))
    q_padded = jnp.pad(q, ((0, tile), (0, 0), (0, 0)))  # a tile may start anywhere below T

    def attend_tile(carry: tuple[jax.Array, Context], args: tuple[jax.Array, ...]):
        last_seq, context = carry
        seq, start, valid = args
        context = lax.cond(valid & (seq != last_seq),
                           lambda: gather(seqs.block_tables[seq]), lambda: context)
        rows = start + jnp.arange(tile, dtype=jnp.int32)  # [tile] token index in q
        row_ok = valid & (rows < seqs.query_start[seq] + run_lens[seq])
        q_pos = seqs.context_lens[seq] - seqs.lens[seq] + rows - seqs.query_start[seq]
        computed = lax.cond(
            valid, lambda: attend(lax.dynamic_slice_in_dim(q_padded, start, tile), q_pos,
                                  row_ok, context),
            lambda: jnp.zeros((tile, h, hd), q.dtype))
        return (seq, context), (computed, jnp.where(row_ok, rows, t))  # t: dropped

    empty = jax.tree.map(jnp.zeros_like, jax.eval_shape(gather, seqs.block_tables[0]))
    _, (outs, targets) = lax.scan(attend_tile, (jnp.int32(-1), empty), tiles)
    return out.at[targets.reshape(-1)].set(outs.reshape(-1, h, hd), mode="drop")


def query_tiles(
    query_start: jax.Array, lens: jax.Array, num_tokens: int, tile: int, max_runs: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Cut each sequence's `lens` [S] tokens from `query_start` into tiles of `tile`
    -> seq, start, valid [N].

    N = ceil(num_tokens / tile) + max_runs bounds the real count when at most
    `max_runs` sequences have tokens; tiles past it are invalid.
    """
    num_seq_slots = lens.shape[0]
    counts = -(-lens // tile)  # [S] tiles per sequence
    ends = jnp.cumsum(counts)  # [S] inclusive
    index = jnp.arange(-(-num_tokens // tile) + max_runs, dtype=jnp.int32)  # [N]
    seq = jnp.searchsorted(ends, index, side="right").astype(jnp.int32)  # [N]
    valid = seq < num_seq_slots
    seq = jnp.minimum(seq, num_seq_slots - 1)
    start = query_start[seq] + (index - (ends[seq] - counts[seq])) * tile
    return seq, jnp.where(valid, start, 0), valid


def _gather_sequence(
    table: jax.Array,  # [W] a sequence's block-table row
    *,
    k_pool: jax.Array,  # [L, rows, KV, hd]
    v_pool: jax.Array,
    layer: jax.Array,
    scales: tuple[jax.Array, jax.Array] | None,  # int8: k_scale, v_scale [L, rows, KV]
    block_size: int,
) -> Context:
    """The rows a sequence's table names: K, V [C, KV, hd] (C = W * block_size) and,
    for int8 pools, their scales [C, KV]; None otherwise."""
    rows = (table[:, None] * block_size + jnp.arange(block_size, dtype=jnp.int32)).reshape(-1)
    k, v = k_pool[layer, rows], v_pool[layer, rows]
    if scales is None:
        return Context(k, v, None, None)
    return Context(k, v, scales[0][layer, rows], scales[1][layer, rows])


def _attend_context(
    q: jax.Array,  # [tile, H, hd]
    q_pos: jax.Array,  # [tile] int32 query positions
    row_ok: jax.Array,  # [tile] bool: the token belongs to the sequence
    context: Context,
    *,
    scale: float,
    window: jax.Array | int,
    softcap: float | None,
) -> jax.Array:
    """Masked softmax attention of one tile over its sequence's context -> [tile, H, hd]."""
    tile, h, hd = q.shape
    k, v = context.k, context.v
    kv_heads = k.shape[1]
    qg = q.reshape(tile, kv_heads, h // kv_heads, hd)
    scores = jnp.einsum("tkgd,ckd->kgtc", qg, k.astype(q.dtype),
                        preferred_element_type=jnp.float32)  # [KV, G, tile, C]
    quantized = context.k_scale is not None
    if quantized:
        k_scale, v_scale = (s.astype(jnp.float32).T[:, None, None, :]
                            for s in (context.k_scale, context.v_scale))  # [KV, 1, 1, C]
        scores = scores * k_scale
    scores = scores * scale
    if softcap is not None:
        scores = jnp.tanh(scores / softcap) * softcap
    k_pos = jnp.arange(k.shape[0], dtype=jnp.int32)[None, :]
    mask = row_ok[:, None] & (k_pos <= q_pos[:, None]) & (q_pos[:, None] - k_pos < window)
    probs = _masked_softmax(scores, mask)  # [KV, G, tile, C]
    if quantized:
        probs = jnp.where(mask, probs * v_scale, 0.0)
    v = jnp.where(mask.any(axis=0)[:, None, None], v.astype(q.dtype), 0)  # unread rows -> 0
    out = jnp.einsum("kgtc,ckd->tkgd", probs.astype(q.dtype), v)
    return out.reshape(tile, h, hd)


def _masked_softmax(scores: jax.Array, mask: jax.Array) -> jax.Array:
    """Softmax over the last axis where mask [tile, C] holds; masked -> exactly 0."""
    row_max = jnp.max(jnp.where(mask, scores, -jnp.inf), axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)  # rows with no key
    p = jnp.where(mask, jnp.exp(scores - row_max), 0.0)
    total = p.sum(axis=-1, keepdims=True)
    return p / jnp.where(total > 0, total, 1.0)
