"""Ragged paged attention for NVIDIA GPUs (Pallas on Triton).

Same contract as `ragged_reference.py` (flat q [T, H, hd], query_start,
context_lens, block_tables, num_seqs); on CPU it runs under the Pallas
interpreter (`interpret=True`), which is what the tests use, and lowers to
Triton IR without a GPU (the tests check that too). Query tiles walk their
sequence's pages with an online softmax; the GQA group is padded to a dot's
rows; int8 pools fold their scales into the math. Decodes and prompt chunks
share one call.

Tiles. The wrapper cuts each live sequence's tokens into query tiles of
`query_block` tokens that never cross a sequence (`query_tiles` from the
reference: ceil(T / query_block) + S tiles bound the real count; the rest are
empty). A decode is one tile; a 1,000-token chunk is ceil(1000 /
query_block) tiles. For each tile the wrapper also works out, in jnp, its
token range, the offset from a token's flat index to its position, and the
live keys [first_key, end_key): from the first key inside the window of the
tile's first query to its last query. That [N, 7] int32 table is one kernel
input; empty tiles run no page step and write zeros.

Grid (tile, KV head), all parallel. A program loads its tile's query rows
from the whole packed q [KV, T'*Gp, hd] (row r of a KV head is token r // Gp,
query head r % Gp of the group, G padded to Gp), so the G query heads of one
KV head share every K/V page load. It walks the live pages with
`lax.fori_loop`, `pages_per_step` pages a step: each page's physical block
comes from the block table, its K/V [bs, hd] are dynamic slices of the whole
pool refs (left in HBM; only live pages are read; pages past the live range
in the last step re-read the last live page and are masked, so a garbage
table entry is never followed). Pages wholly outside the window are never
read. Scores are q . K^T in f32 (int8 K cast to q's dtype, exact, times
k_scale per key), scaled, soft-capped, masked (row in the sequence, causal,
window, key live) and folded into an online softmax (m, l, acc in f32), one
max update per step. Masked keys get p = 0 exactly and V rows and v_scale
outside the live keys are zeroed before use, so stale or NaN rows, and NaN
scales, never leak. Rows that saw no key write zeros. The wrapper gathers
each token's row back into [T, H, hd] and zeroes padding tokens.

Triton constraints (checked): tile dims must be powers of two, so
query_block, block_size and head_dim are powers of two and Gp is G rounded
up to one; `tl.dot` needs M, N, K >= 16, so Gp is raised until M =
query_block * Gp >= 16 (padded rows cost idle tensor-core cycles, not
memory traffic), and on GPU block_size and head_dim must be >= 16 (the
interpreter needs neither). f32 inputs use IEEE dots (Triton defaults to
TF32).

Not done (future): split-K over long contexts for batches of few long
decodes (the grid has one program per tile and KV head), tuned defaults.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.ragged_reference import (
    check_ragged_args,
    live_query_lens,
    query_tiles,
    ragged_paged_attention_reference,
)

reference = ragged_paged_attention_reference

MIN_DOT = 16  # tl.dot needs M, N, K >= 16
DEFAULT_TILE_ROWS = 32  # query rows (tokens x padded group) per tile when query_block is None
DEFAULT_PAGES_PER_STEP = 4
MASK_VALUE = -1e30  # finite floor: exp(MASK_VALUE - m) underflows to 0, never NaN
TILE_FIELDS = ("seq", "q_lo", "q_hi", "pos_offset", "first_key", "end_key", "steps")


class Tiling(NamedTuple):
    """Compile-time tile sizes and options of the kernel."""

    block_size: int
    pages: int  # pages per loop step
    query_block: int  # tokens per tile
    groups_padded: int  # Gp: query heads per KV head, padded
    width: int  # W: block-table entries per sequence
    scale: float
    softcap: float | None


def ragged_paged_attention_gpu(
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
    query_block: int | None = None,  # tokens per tile; None: DEFAULT_TILE_ROWS rows
    pages_per_step: int = DEFAULT_PAGES_PER_STEP,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
) -> jax.Array:
    """Ragged paged attention on GPU -> [T, H, hd] in q's dtype (padding tokens 0)."""
    quantized = check_ragged_args(
        q, k_pool, v_pool, query_start, context_lens, block_tables, num_seqs,
        block_size=block_size, window=window, softcap=softcap, k_scale=k_scale, v_scale=v_scale)
    t, h, hd = q.shape
    kv_heads = k_pool.shape[2]
    groups_padded = pl.next_power_of_2(h // kv_heads)
    if query_block is None:
        query_block = max(1, DEFAULT_TILE_ROWS // groups_padded)
    check_triton_tiles(hd, block_size, query_block, pages_per_step, interpret=interpret)
    static = Tiling(block_size, pages_per_step, query_block,
                    max(groups_padded, -(-MIN_DOT // query_block)), block_tables.shape[1],
                    scale, softcap)  # Gp raised until M = query_block * Gp >= MIN_DOT
    query_start = query_start.astype(jnp.int32)
    tiles = tile_table(query_start, context_lens.astype(jnp.int32), num_seqs, window, t, static)
    layer_window = jnp.stack([jnp.asarray(layer, jnp.int32), jnp.asarray(window, jnp.int32)])
    pools = (k_pool, v_pool, k_scale, v_scale) if quantized else (k_pool, v_pool)
    out = _call_kernel(
        (layer_window, tiles, block_tables.astype(jnp.int32)),
        _pack_queries(q, kv_heads, static), pools, static,
        interpret=interpret, num_warps=num_warps, num_stages=num_stages)  # [N, KV, M, hd]
    return _gather_outputs(out, query_start, num_seqs, q.shape, static)


def check_triton_tiles(
    head_dim: int, block_size: int, query_block: int, pages_per_step: int, *, interpret: bool
) -> None:
    """Precise errors for tile sizes Triton cannot take (see the module docstring)."""
    if pages_per_step < 1:
        raise ValueError(f"pages_per_step must be >= 1, got {pages_per_step}")
    sizes = (("head_dim", head_dim), ("block_size", block_size), ("query_block", query_block))
    for name, value in sizes:
        if value < 1 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two (a Triton tile dim), got {value}")
    for name, value in sizes[:2]:
        if not interpret and value < MIN_DOT:
            raise ValueError(f"{name} must be >= {MIN_DOT} on GPU (tl.dot minimum), got {value}")


def tile_table(
    query_start: jax.Array,  # [S + 1] int32
    context_lens: jax.Array,  # [S] int32
    num_seqs: jax.Array,  # [1]
    window: jax.Array | int,
    num_tokens: int,
    static: Tiling,
) -> jax.Array:
    """[N, len(TILE_FIELDS)] int32: each query tile's sequence, tokens, offset, keys, steps."""
    seq, q_lo, valid = query_tiles(query_start, live_query_lens(query_start, num_seqs),
                                   num_tokens, static.query_block,
                                   max_runs=context_lens.shape[0])
    q_hi = jnp.where(valid, jnp.minimum(q_lo + static.query_block, query_start[seq + 1]), q_lo)
    pos_offset = context_lens[seq] - query_start[seq + 1]  # a token's position - its index
    first_key = jnp.maximum(q_lo + pos_offset - window + 1, 0)
    end_key = q_hi + pos_offset  # exclusive: the last query's position + 1
    first_page = first_key // static.block_size
    end_page = jnp.minimum(-(-end_key // static.block_size), static.width)
    steps = -(-(end_page - first_page) // static.pages)
    steps = jnp.where(valid & (end_key > first_key) & (end_page > first_page), steps, 0)
    fields = (seq, q_lo, q_hi, pos_offset, first_key, end_key, steps)
    return jnp.stack([jnp.asarray(f, jnp.int32) for f in fields], axis=1)


def _pack_queries(q: jax.Array, kv_heads: int, static: Tiling) -> jax.Array:
    """[T, H, hd] -> [KV, (T + query_block) * Gp, hd]: group under its token, zero-padded.

    The extra query_block tokens let a tile starting at any token below T load
    M whole rows.
    """
    t, h, hd = q.shape
    q = q.reshape(t, kv_heads, h // kv_heads, hd)
    q = jnp.pad(q, ((0, static.query_block), (0, 0),
                    (0, static.groups_padded - h // kv_heads), (0, 0)))
    return q.transpose(1, 0, 2, 3).reshape(kv_heads, -1, hd)


def _gather_outputs(
    out: jax.Array,  # [N, KV, M, hd]
    query_start: jax.Array,  # [S + 1]
    num_seqs: jax.Array,  # [1]
    q_shape: tuple[int, int, int],  # T, H, hd
    static: Tiling,
) -> jax.Array:
    """Each token's row of its tile -> [T, H, hd]; padding tokens 0."""
    t, heads, hd = q_shape
    tiles, kv_heads = out.shape[:2]
    out = out.reshape(tiles, kv_heads, static.query_block, static.groups_padded, hd)
    out = out.transpose(0, 2, 1, 3, 4).reshape(-1, kv_heads, static.groups_padded, hd)
    rows, live = token_rows(query_start, num_seqs, t, static.query_block)
    out = out[rows, :, : heads // kv_heads].reshape(-1, heads, hd)  # [T, H, hd]
    return jnp.where(live[:, None, None], out, 0)


def token_rows(
    query_start: jax.Array, num_seqs: jax.Array, num_tokens: int, query_block: int
) -> tuple[jax.Array, jax.Array]:
    """Where each token sits in the tiles of `query_tiles`: flat row, live [T].

    Row = tile * query_block + offset in the tile; padding tokens get row 0.
    """
    lens = live_query_lens(query_start, num_seqs)  # [S]
    counts = -(-lens // query_block)  # [S] tiles per sequence
    first_tile = jnp.cumsum(counts) - counts  # [S]
    token = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.searchsorted(query_start[:-1] + lens, token, side="right")  # first ending later
    seq = jnp.minimum(seq, lens.shape[0] - 1)
    live = token < query_start[num_seqs[0]]
    rows = first_tile[seq] * query_block + token - query_start[seq]
    return jnp.where(live, rows, 0).astype(jnp.int32), live


def _call_kernel(
    scalars: tuple[jax.Array, jax.Array, jax.Array],  # [2] layer, window; tiles; tables [S, W]
    qg: jax.Array,  # [KV, T'*Gp, hd]
    pools: tuple[jax.Array, ...],  # k, v [L, rows, KV, hd]; int8: + k, v scales [L, rows, KV]
    static: Tiling,
    *,
    interpret: bool,
    num_warps: int,
    num_stages: int,
) -> jax.Array:
    """Run the kernel over the (tile, KV head) grid -> [N, KV, M, hd] in q's dtype."""
    kv_heads, _, hd = qg.shape
    num_tiles = scalars[1].shape[0]
    m = static.query_block * static.groups_padded
    whole = pl.no_block_spec  # indexed inside the kernel
    kernel = functools.partial(_kernel, static=static, precision=_dot_precision(qg.dtype))
    return pl.pallas_call(
        kernel,
        grid=(num_tiles, kv_heads),
        in_specs=[whole] * (len(scalars) + 1 + len(pools)),
        out_specs=pl.BlockSpec((None, None, m, hd), lambda i, k: (i, k, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((num_tiles, kv_heads, m, hd), qg.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="ragged_paged_attention_gpu",
    )(*scalars, qg, *pools)


def _dot_precision(dtype: jnp.dtype) -> lax.Precision:
    """f32 inputs get IEEE dots (Triton defaults to TF32); bf16 runs as is."""
    return lax.Precision.HIGHEST if dtype == jnp.float32 else lax.Precision.DEFAULT


class _Tile(NamedTuple):
    """One row of the tile table (scalars), named as TILE_FIELDS."""

    seq: jax.Array
    q_lo: jax.Array  # first token (flat index into q)
    q_hi: jax.Array  # exclusive
    pos_offset: jax.Array  # a token's position = its flat index + pos_offset
    first_key: jax.Array  # first position inside the window of the first query
    end_key: jax.Array  # exclusive: the last query's position + 1
    steps: jax.Array  # page steps to run; 0 for an empty tile


def _kernel(
    layer_window_ref,  # [2] int32: layer, window
    tiles_ref,  # [N, len(TILE_FIELDS)] int32
    tables_ref,  # [S, W] int32
    q_ref,  # [KV, T'*Gp, hd], whole
    k_ref,  # [L, rows, KV, hd], whole pool, float or int8
    v_ref,  # [L, rows, KV, hd]
    *refs,  # int8: k_scale_ref, v_scale_ref [L, rows, KV]; then out [M, hd]
    static: Tiling,
    precision: lax.Precision,
) -> None:
    """One (tile, KV head): online softmax over the tile's live pages."""
    *scale_refs, o_ref = refs
    index, kv_head = pl.program_id(0), pl.program_id(1)
    tile = _Tile(*(tiles_ref[index, f] for f in range(len(TILE_FIELDS))))
    m, hd = o_ref.shape
    q = q_ref[kv_head, pl.ds(tile.q_lo * static.groups_padded, m), :]  # [M, hd]
    token = tile.q_lo + lax.broadcasted_iota(jnp.int32, (m,), 0) // static.groups_padded
    rows = _Rows(token < tile.q_hi, token + tile.pos_offset, layer_window_ref[1])
    first_page = tile.first_key // static.block_size
    last_page = jnp.minimum(-(-tile.end_key // static.block_size), static.width) - 1

    def body(step: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        pages = []
        for j in range(static.pages):
            page = first_page + step * static.pages + j  # logical; past last_page: masked
            block = tables_ref[tile.seq, jnp.minimum(page, last_page)]
            pages.append(_load_page(
                q, (k_ref, v_ref, *scale_refs), layer_window_ref[0], kv_head, block,
                page * static.block_size, tile, rows, static, precision))
        return _online_softmax_step(carry, pages, precision)

    init = (jnp.zeros((m, hd), jnp.float32), jnp.full((m,), MASK_VALUE, jnp.float32),
            jnp.zeros((m,), jnp.float32))
    acc, _, total = lax.fori_loop(0, tile.steps, body, init)
    out = acc / jnp.where(total > 0, total, 1.0)[:, None]
    o_ref[...] = jnp.where(total[:, None] > 0, out, 0.0).astype(o_ref.dtype)


class _Rows(NamedTuple):
    """Per query row of a tile: in the tile's sequence, position [M]; the window."""

    ok: jax.Array
    pos: jax.Array
    window: jax.Array


class _Page(NamedTuple):
    """One page folded into scores: masked f32 scores [M, bs], mask, V [bs, hd], v scales."""

    scores: jax.Array
    mask: jax.Array
    v: jax.Array  # zero outside the live keys
    v_scale: jax.Array | None  # [bs] f32, int8 only; zero outside the live keys


def _load_page(
    q: jax.Array,  # [M, hd]
    refs: tuple,  # k, v [L, rows, KV, hd]; int8: + k, v scales [L, rows, KV]
    layer: jax.Array,
    kv_head: jax.Array,
    block: jax.Array,  # physical block
    key0: jax.Array,  # position of the page's first key
    tile: _Tile,
    rows: _Rows,
    static: Tiling,
    precision: lax.Precision,
) -> _Page:
    """Read one page and score it against the tile's queries."""
    bs = static.block_size
    pool_rows = pl.ds(pl.multiple_of(block * bs, bs), bs)
    k_pos = key0 + lax.broadcasted_iota(jnp.int32, (bs,), 0)  # [bs]
    live = (k_pos >= tile.first_key) & (k_pos < tile.end_key)  # [bs]: read, so never stale
    qp, kp = rows.pos[:, None], k_pos[None, :]
    mask = rows.ok[:, None] & live[None, :] & (kp <= qp) & (qp - kp < rows.window)  # [M, bs]
    k = refs[0][layer, pool_rows, kv_head, :].astype(q.dtype)  # [bs, hd]
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                        preferred_element_type=jnp.float32)  # [M, bs]
    v_scale = None
    if len(refs) == 4:
        k_scale, v_scale = (jnp.where(live, ref[layer, pool_rows, kv_head], 0.0)
                            for ref in refs[2:])  # [bs] f32
        s = s * k_scale[None, :]
    s = s * static.scale
    if static.softcap is not None:
        s = jnp.tanh(s / static.softcap) * static.softcap
    v = refs[1][layer, pool_rows, kv_head, :].astype(q.dtype)  # [bs, hd]
    v = jnp.where(live[:, None], v, jnp.zeros_like(v))
    return _Page(jnp.where(mask, s, MASK_VALUE), mask, v, v_scale)


def _online_softmax_step(
    carry: tuple[jax.Array, jax.Array, jax.Array],  # acc [M, hd], m [M], l [M] f32
    pages: list[_Page],
    precision: lax.Precision,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Fold one step's pages into (acc, m, l) with one max update."""
    acc, m_prev, l_prev = carry
    m_new = m_prev
    for page in pages:
        m_new = jnp.maximum(m_new, page.scores.max(axis=1))
    alpha = jnp.exp(m_prev - m_new)  # [M] rescales what was summed so far
    acc, total = acc * alpha[:, None], l_prev * alpha
    for page in pages:
        p = jnp.where(page.mask, jnp.exp(page.scores - m_new[:, None]), 0.0)  # [M, bs]
        total = total + p.sum(axis=1)
        if page.v_scale is not None:
            p = p * page.v_scale[None, :]  # int8 V: dequantize through p
        acc = acc + lax.dot_general(p.astype(page.v.dtype), page.v, (((1,), (0,)), ((), ())),
                                    precision=precision, preferred_element_type=jnp.float32)
    return acc, m_new, total
