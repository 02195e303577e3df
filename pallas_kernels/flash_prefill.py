"""Flash (tiled) attention for prefill chunks over the paged KV pool, in Pallas.

Target: NVIDIA GPUs through Pallas' Triton lowering (H200 first). TPU (Mosaic)
is out of scope: see "TPU" below for what would have to change. On CPU the
kernel runs with `interpret=True` (tests); the CPU fast path stays the XLA
`reference`, which has the same signature and sits beside the kernel.

Layout. The G = H / KV query heads that share one KV head are regrouped with a
tile of `q_tile` query tokens into one matrix of M = q_tile * Gp rows (row r is
token r // Gp, head r % Gp), so every K/V tile loaded from the pool is used by
all heads of its group (GQA/MQA costs no extra K/V traffic). Gp is G rounded up
to a power of two, and raised further until M >= 16 (the smallest M of
`tl.dot`); padded heads are zero queries whose outputs are dropped.

Grid: (batch row, kv head, query tile). Each program keeps its [M, hd] query
tile resident and runs a `lax.fori_loop` over the logical KV blocks it needs,
from the first block inside the sliding window of its first query to the
block holding its last query (never past the context). The wrapper computes
those bounds from positions, context lengths and the window, so blocks outside
the window and past the context are never read, and tiles made only of padding
slots run zero iterations and write zeros. One loop step reads one block: the
physical block id from the block table, then `k_ref[layer, pl.ds(row0,
block_size), kv_head, :]` straight from the full pool ref (no gather copy),
and applies the causal / in-context / window mask and an online softmax
(running max m, sum l, accumulator in f32; K/V are cast to q's dtype and p
too for the second matmul, as in FlashAttention-2 and the reference).

int8 pools. With `k_scale` / `v_scale` [L, rows, KV] (see reference.py) the
loop also loads the block's two [block_size] scale vectors from the whole
scale pools, and folds them in f32: scores of the int8 K tile (cast to q's
dtype, exact) are multiplied by k_scale per key, and p by v_scale per key
before the p . V dot; masked keys get weight 0, so stale rows (even NaN
scales) never leak. A float pool compiles the kernel without the scale refs.

Masked scores take a finite floor, so rows masked in every block (padding
slots) give finite values and rows with no block at all give zeros: never NaN.
Padding query slots (index >= context_len - positions[b, 0]) are masked
entirely; their outputs are meaningless and ignored by the caller.

Tile dims must be powers of two for Triton: q_tile, Gp, block_size and
head_dim (checked); on GPU block_size and head_dim must also be >= 16 (the N
and K of `tl.dot`), which the interpreter does not need. Queries and outputs
are reshaped to [B, KV, T*Gp, hd] in the wrapper (one transpose each way,
cheap next to attention).

TPU (not done here): Mosaic wants the block table and loop bounds as scalar
prefetch (SMEM) instead of ref loads, K/V blocks copied HBM->VMEM by explicit
async DMA (double buffered) instead of dynamic `pl.ds` loads from an ANY-space
pool, tiles aligned to Mosaic's (8, 128) layout with several pool blocks per
KV step (a 16-token block is too small a matmul for the MXU), and the
online-softmax state in VMEM scratch across a KV grid axis.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.reference import check_kv_scales, paged_attention_reference

reference = paged_attention_reference

MASK_VALUE = -1e30  # finite floor for masked scores: fully masked rows stay NaN-free
MIN_DOT_ROWS = 16  # tl.dot needs M >= 16


@dataclasses.dataclass(frozen=True)
class _Tiling:
    """How query tokens and heads of one KV head are packed into tiles."""

    q_tile: int  # query tokens per tile (power of two)
    groups: int  # G: query heads per KV head
    groups_padded: int  # Gp >= G, power of two, q_tile * Gp >= MIN_DOT_ROWS
    num_tiles: int  # query tiles per batch row

    @property
    def rows(self) -> int:
        """M: rows of one tile's query matrix."""
        return self.q_tile * self.groups_padded

    @property
    def padded_len(self) -> int:
        return self.q_tile * self.num_tiles


def flash_prefill_attention(
    q: jax.Array,  # [B, T, H, hd]
    k_pool: jax.Array,  # [L, rows, KV, hd]
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
    interpret: bool = False,
    q_tile: int = 16,
    num_warps: int = 4,
    num_stages: int = 2,
) -> jax.Array:
    """Tiled paged attention for prefill chunks -> [B, T, H, hd] in q's dtype."""
    _check_args(q, k_pool, v_pool, block_size, q_tile)
    scales = (k_scale, v_scale) if check_kv_scales(k_pool, v_pool, k_scale, v_scale) else ()
    kv_heads = k_pool.shape[2]
    tiling = _make_tiling(q.shape[1], q.shape[2] // kv_heads, q_tile)
    q_len = _query_lens(positions, context_lens)  # [B]
    pos = _padded_positions(positions, q_len, tiling)  # [B, nt * q_tile]
    bounds = _kv_block_bounds(pos, context_lens, window, block_size, tiling)  # [B, nt, 2]
    row_pos = jnp.repeat(pos, tiling.groups_padded, axis=1)  # [B, nt * M]: Gp rows a token
    scalars = jnp.stack([jnp.asarray(layer), jnp.asarray(window)]).astype(jnp.int32)  # [2]
    kernel = functools.partial(_kernel, block_size=block_size, scale=scale, softcap=softcap,
                               quantized=bool(scales))
    call = _pallas_call(kernel, q, kv_heads, tiling, len(scales), interpret, num_warps, num_stages)
    out = call(
        scalars,
        bounds,
        context_lens.astype(jnp.int32),
        block_tables.astype(jnp.int32),
        row_pos,
        _group_queries(q, kv_heads, tiling),
        k_pool,
        v_pool,
        *scales,
    )  # [B, KV, nt * M, hd]
    return _ungroup_outputs(out, q.shape, tiling)


def _check_args(
    q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, block_size: int, q_tile: int
) -> None:
    """Precise errors for shapes the Triton tiles cannot take."""
    head_dim, kv_heads = q.shape[3], k_pool.shape[2]
    if k_pool.shape != v_pool.shape or k_pool.shape[3] != head_dim:
        raise ValueError(f"k_pool {k_pool.shape} / v_pool {v_pool.shape} must match, hd={head_dim}")
    if q.shape[2] % kv_heads:
        raise ValueError(f"query heads ({q.shape[2]}) must be a multiple of kv heads ({kv_heads})")
    for name, value in (("head_dim", head_dim), ("block_size", block_size), ("q_tile", q_tile)):
        if value < 1 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two, got {value}")


def _make_tiling(seq_len: int, groups: int, q_tile: int) -> _Tiling:
    """Shrink q_tile to the chunk, then pad heads until M = q_tile * Gp >= 16."""
    q_tile = min(q_tile, pl.next_power_of_2(seq_len))
    groups_padded = max(pl.next_power_of_2(groups), pl.cdiv(MIN_DOT_ROWS, q_tile))
    return _Tiling(q_tile, groups, groups_padded, pl.cdiv(seq_len, q_tile))


def _query_lens(positions: jax.Array, context_lens: jax.Array) -> jax.Array:
    """[B] real query tokens per row: the chunk ends at context_len - 1."""
    t = positions.shape[1]
    return jnp.clip(context_lens - positions[:, 0], 0, t).astype(jnp.int32)


def _padded_positions(positions: jax.Array, q_len: jax.Array, tiling: _Tiling) -> jax.Array:
    """[B, nt * q_tile] positions of real slots, -1 for padding slots."""
    t = positions.shape[1]
    pos = jnp.pad(positions.astype(jnp.int32), ((0, 0), (0, tiling.padded_len - t)))
    index = jnp.arange(tiling.padded_len, dtype=jnp.int32)
    return jnp.where(index[None, :] < q_len[:, None], pos, -1)


def _kv_block_bounds(
    padded_positions: jax.Array,  # [B, nt * q_tile], -1 for padding slots
    context_lens: jax.Array,  # [B]
    window: jax.Array | int,
    block_size: int,
    tiling: _Tiling,
) -> jax.Array:
    """[B, nt, 2] int32 (first, end) logical KV blocks each query tile needs."""
    pos = padded_positions.reshape(-1, tiling.num_tiles, tiling.q_tile)
    real = pos >= 0
    any_real = jnp.any(real, axis=-1)  # [B, nt]
    first_q = jnp.min(jnp.where(real, pos, jnp.iinfo(jnp.int32).max), axis=-1)
    first_q = jnp.where(any_real, first_q, 0)  # [B, nt]
    last_q = jnp.minimum(jnp.max(pos, axis=-1), context_lens[:, None] - 1)
    first = jnp.maximum(first_q - window + 1, 0) // block_size
    end = (last_q + block_size) // block_size  # one past the block of last_q
    end = jnp.where(any_real, jnp.maximum(end, first), first)  # padding tiles: no blocks
    return jnp.stack([first, end], axis=-1).astype(jnp.int32)


def _group_queries(q: jax.Array, kv_heads: int, tiling: _Tiling) -> jax.Array:
    """[B, T, H, hd] -> [B, KV, nt * M, hd], rows ordered (token, head in group)."""
    b, t, _, hd = q.shape
    qg = q.reshape(b, t, kv_heads, tiling.groups, hd)
    pad = ((0, 0), (0, tiling.padded_len - t), (0, 0), (0, tiling.groups_padded - tiling.groups))
    qg = jnp.pad(qg, (*pad, (0, 0)))  # [B, Tp, KV, Gp, hd]
    return qg.transpose(0, 2, 1, 3, 4).reshape(b, kv_heads, -1, hd)


def _ungroup_outputs(out: jax.Array, q_shape: tuple[int, ...], tiling: _Tiling) -> jax.Array:
    """[B, KV, nt * M, hd] -> [B, T, H, hd], dropping padded tokens and heads."""
    b, t, h, hd = q_shape
    out = out.reshape(b, -1, tiling.padded_len, tiling.groups_padded, hd)
    out = out[:, :, :t, : tiling.groups].transpose(0, 2, 1, 3, 4)  # [B, T, KV, G, hd]
    return out.reshape(b, t, h, hd)


def _pallas_call(kernel, q, kv_heads, tiling, num_scale_pools, interpret, num_warps, num_stages):
    """Grid (batch row, kv head, query tile); pools, tables and scalars stay whole."""
    b, _, _, hd = q.shape
    m = tiling.rows
    whole = pl.no_block_spec
    return pl.pallas_call(
        kernel,
        grid=(b, kv_heads, tiling.num_tiles),
        in_specs=[
            whole,  # scalars [2]: layer, window
            whole,  # bounds [B, nt, 2]
            whole,  # context_lens [B]
            whole,  # block_tables [B, max_blocks]
            pl.BlockSpec((None, m), lambda i, h, j: (i, j)),  # row positions
            pl.BlockSpec((None, None, m, hd), lambda i, h, j: (i, h, j, 0)),  # queries
            whole,  # k_pool [L, rows, KV, hd]
            whole,  # v_pool
            *[whole] * num_scale_pools,  # int8: k_scale, v_scale [L, rows, KV]
        ],
        out_specs=pl.BlockSpec((None, None, m, hd), lambda i, h, j: (i, h, j, 0)),
        out_shape=jax.ShapeDtypeStruct((b, kv_heads, tiling.num_tiles * m, hd), q.dtype),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="flash_prefill_attention",
    )


def _kernel(
    scalars_ref,  # [2] int32: layer, window
    bounds_ref,  # [B, nt, 2] int32: first / end logical KV block per tile
    context_lens_ref,  # [B] int32
    block_tables_ref,  # [B, max_blocks] int32
    pos_ref,  # [M] int32: position of each tile row, -1 for padding
    q_ref,  # [M, hd]
    k_ref,  # [L, rows, KV, hd], float or int8
    v_ref,  # [L, rows, KV, hd]
    *refs,  # int8: k_scale_ref, v_scale_ref [L, rows, KV]; then o_ref [M, hd]
    block_size: int,
    scale: float,
    softcap: float | None,
    quantized: bool,
):
    """One (row, kv head, query tile): online softmax over the tile's KV blocks."""
    *scale_refs, o_ref = refs
    b, kv_head, tile = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer, window = scalars_ref[0], scalars_ref[1]
    context_len = context_lens_ref[b]
    q = q_ref[...]  # [M, hd]
    q_pos = pos_ref[...]  # [M]

    def body(j, carry):
        rows = pl.ds(block_tables_ref[b, j] * block_size, block_size)
        k = k_ref[layer, rows, kv_head, :].astype(q.dtype)  # [bs, hd]
        v = v_ref[layer, rows, kv_head, :].astype(q.dtype)  # [bs, hd]
        k_pos = j * block_size + jnp.arange(block_size, dtype=jnp.int32)  # [bs]
        k_scale, v_scale = (ref[layer, rows, kv_head] for ref in scale_refs) if quantized else (
            None, None)  # [bs] f32
        s = _scores(q, k, scale, softcap, k_scale)  # [M, bs]
        mask = _mask(q_pos, k_pos, context_len, window)
        weights = None if v_scale is None else jnp.where(mask, v_scale[None, :], 0.0)
        return _online_softmax_step(carry, jnp.where(mask, s, MASK_VALUE), v, weights)

    m_rows, hd = q.shape
    init = (
        jnp.zeros((m_rows, hd), jnp.float32),  # acc
        jnp.full((m_rows,), MASK_VALUE, jnp.float32),  # running max
        jnp.zeros((m_rows,), jnp.float32),  # running sum
    )
    acc, _, total = lax.fori_loop(bounds_ref[b, tile, 0], bounds_ref[b, tile, 1], body, init)
    total = jnp.where(total > 0.0, total, 1.0)  # tiles with no KV block write zeros
    o_ref[...] = (acc / total[:, None]).astype(o_ref.dtype)


def _scores(
    q: jax.Array, k: jax.Array, scale: float, softcap: float | None, k_scale: jax.Array | None
) -> jax.Array:
    """[M, hd] x [bs, hd] -> [M, bs] f32 logits (int8 K: times k_scale [bs]), tanh-capped."""
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    if k_scale is not None:
        s = s * k_scale[None, :]
    s = s * scale
    if softcap is not None:
        s = jnp.tanh(s / softcap) * softcap
    return s


def _mask(q_pos: jax.Array, k_pos: jax.Array, context_len, window) -> jax.Array:
    """[M, bs] causal, in-context and sliding-window mask."""
    qp, kp = q_pos[:, None], k_pos[None, :]
    return (kp <= qp) & (qp - kp < window) & (kp < context_len)


def _online_softmax_step(carry, s: jax.Array, v: jax.Array, v_weights: jax.Array | None):
    """Fold one [M, bs] block of masked logits and its [bs, hd] values into (acc, m, l).

    int8 V: `v_weights` [M, bs] are the keys' v scales, 0 where masked.
    """
    acc, m_prev, l_prev = carry
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))  # [M]
    alpha = jnp.exp(m_prev - m_next)  # rescales what was summed so far
    p = jnp.exp(s - m_next[:, None])  # [M, bs]
    pw = p if v_weights is None else p * v_weights  # int8 V: dequantize through p
    pv = lax.dot_general(
        pw.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
    )  # [M, hd]
    return acc * alpha[:, None] + pv, m_next, l_prev * alpha + jnp.sum(p, axis=1)
