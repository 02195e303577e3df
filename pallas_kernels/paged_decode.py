"""Paged attention for decode (one query token per sequence) as a Pallas kernel.

Target: NVIDIA GPUs (H200) through Pallas' Triton lowering. TPU (Mosaic) is out
of scope: see "TPU" below for what would change. On CPU the same kernel runs
with `interpret=True`; the reference sits beside it as `reference`, with the
same signature.

Grid and data flow. The grid is (batch row, kv head, split). Each program loads
the G query heads that share its KV head as one [Gp, hd] tile, then walks its
share of the row's live KV blocks with `lax.fori_loop`: the block table names
the physical block, and the K/V tiles [block_size, hd] are dynamic slices of
the whole pool refs (their BlockSpec is the full array, left in HBM, so only
the live tiles are read). Live blocks run from the block holding the first key
inside the sliding window to the block holding the query itself; blocks outside
that range are never loaded. Softmax is online (running max `m`, sum `l`, accumulator
`acc`), all in f32 whatever the input dtype; K/V tiles are multiplied in their
own dtype (bf16 on tensor cores) with f32 accumulation.

GQA. Triton's `tl.dot` needs M, N, K >= 16, and a decode group is 1..8 heads.
We pad the group with zero query rows to Gp = max(16, next power of two of G)
and use `dot` rather than a broadcast-multiply-reduce: decode is memory bound,
so the padded rows cost tensor-core cycles that are idle anyway, while the
broadcast form materialises a [G, block_size, hd] f32 product in registers
(32K floats at G=8, hd=256) and spills. The K/V tile is loaded once per KV head
and serves all G heads either way. The padding is done on q in the wrapper
(a few KiB); the padded rows are sliced off after the combine.

Split-K (flash decoding). With few sequences a (batch, kv head) grid leaves
most SMs idle, so each row's live block range is divided evenly between
`num_splits` programs. Each writes an unnormalised partial (acc, m, l); the
splits are merged after the kernel in jnp with the log-sum-exp rule. When
`num_splits` is None it is chosen from the context bucket (the static width of
the block table): one split per `blocks_per_split` blocks, at most MAX_SPLITS,
so short buckets use one split. The division is dynamic (per row, after the
window), so a split never walks blocks that the window excludes.

Padding rows (context 0) have an empty block range: every split writes l = 0
and the combine returns zeros, never NaN. Masked scores get a finite floor, not
-inf, and masked V rows are zeroed before the p·V dot, so stale rows (past the
context in the last block, e.g. left by a freed sequence) never leak, even NaN.

int8 pools. With `k_scale` / `v_scale` [L, rows, KV] (see reference.py) each
loop step also loads the block's two [block_size] scale vectors (strided
loads from the whole scale pools) and folds them in f32: q . K_int8 (K cast
to q's dtype, exact) times k_scale per key, and p times v_scale per key
before the p . V dot. Masked keys get scale 0, so stale scales never leak. A
float pool compiles the kernel without the scale refs.

GPU constraints: block_size and head_dim must be powers of two and
block_size >= 16 (Triton tile sizes and `tl.dot` minimums); interpret mode has
no such limits.

TPU. Mosaic would need: block tables, lengths, positions and the layer as
scalar-prefetch operands in SMEM; K/V copied from HBM (`memory_space=ANY`)
with explicit async DMAs into double-buffered VMEM scratch, several blocks per
step so tiles reach the (8, 128) layout; the group padded to 8 sublanes rather
than 16 rows; and the fori_loop replaced by a grid axis or a DMA pipeline.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.reference import check_kv_scales, paged_attention_reference

reference = paged_attention_reference

MIN_DOT_ROWS = 16  # tl.dot needs M, N, K >= 16
MAX_SPLITS = 16
DEFAULT_BLOCKS_PER_SPLIT = 32  # 512 tokens per split at block_size 16
NEG_INF = -1e30  # finite floor: exp(NEG_INF - m) underflows to 0, never NaN


def paged_decode_attention(
    q: jax.Array,  # [B, 1, H, hd]
    k_pool: jax.Array,  # [L, rows, KV, hd]
    v_pool: jax.Array,  # [L, rows, KV, hd]
    layer: jax.Array,  # scalar int32: which layer's pool to read
    positions: jax.Array,  # [B, 1] int32, position of each query token
    block_tables: jax.Array,  # [B, max_blocks] int32, physical block of each logical block
    context_lens: jax.Array,  # [B] int32, tokens in the cache after this step (0: padding)
    *,
    block_size: int,
    scale: float,
    window: jax.Array | int,  # keys with q_pos - k_pos >= window are masked
    softcap: float | None = None,
    k_scale: jax.Array | None = None,  # [L, rows, KV] f32, int8 pools only
    v_scale: jax.Array | None = None,  # [L, rows, KV] f32
    interpret: bool = False,
    num_splits: int | None = None,
    blocks_per_split: int = DEFAULT_BLOCKS_PER_SPLIT,
) -> jax.Array:
    """Decode attention over the paged KV pool -> [B, 1, H, hd] in q's dtype."""
    b, _, h, hd = q.shape
    kv_heads = k_pool.shape[2]
    _check_shapes(q, k_pool, v_pool, block_tables, context_lens, block_size)
    scales = (k_scale, v_scale) if check_kv_scales(k_pool, v_pool, k_scale, v_scale) else ()
    max_blocks = block_tables.shape[1]
    splits = num_splits if num_splits is not None else choose_num_splits(
        max_blocks, blocks_per_split
    )
    if splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {splits}")
    qg = _group_queries(q, kv_heads)  # [B, KV, Gp, hd]
    acc, row_max, row_sum = _decode_partials(
        qg, (k_pool, v_pool, *scales), layer, (positions, block_tables, context_lens), window,
        block_size=block_size, scale=scale, softcap=softcap, num_splits=splits,
        interpret=interpret,
    )
    out = combine_splits(acc, row_max, row_sum)  # [B, KV, Gp, hd] f32
    return out[:, :, : h // kv_heads].reshape(b, 1, h, hd).astype(q.dtype)


def choose_num_splits(max_blocks: int, blocks_per_split: int = DEFAULT_BLOCKS_PER_SPLIT) -> int:
    """Splits for a context bucket of `max_blocks` blocks: 1 for short buckets."""
    if blocks_per_split < 1:
        raise ValueError(f"blocks_per_split must be >= 1, got {blocks_per_split}")
    return max(1, min(MAX_SPLITS, pl.cdiv(max_blocks, blocks_per_split)))


def combine_splits(acc: jax.Array, row_max: jax.Array, row_sum: jax.Array) -> jax.Array:
    """Merge split partials with log-sum-exp.

    acc [B, KV, S, Gp, hd] (unnormalised), row_max / row_sum [B, KV, S, Gp] -> [B, KV, Gp, hd].
    """
    weight = jnp.exp(row_max - row_max.max(axis=2, keepdims=True))  # [B, KV, S, Gp]
    total = (weight * row_sum).sum(axis=2)  # [B, KV, Gp]; empty splits have weight 0
    acc = (weight[..., None] * acc).sum(axis=2)  # [B, KV, Gp, hd]
    return acc / jnp.where(total > 0, total, 1.0)[..., None]  # padding rows -> 0


def _check_shapes(
    q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, block_tables: jax.Array,
    context_lens: jax.Array, block_size: int,
) -> None:
    """Static shape checks, with the field and the allowed values in the message."""
    b, t, h, hd = q.shape
    _, rows, kv_heads, k_hd = k_pool.shape
    if t != 1:
        raise ValueError(f"q: decode takes one token per row, got q.shape[1] = {t}")
    if v_pool.shape != k_pool.shape or k_hd != hd:
        raise ValueError(f"k_pool {k_pool.shape} / v_pool {v_pool.shape} must match, hd {hd}")
    if h % kv_heads:
        raise ValueError(f"q heads ({h}) must be a multiple of kv heads ({kv_heads})")
    if block_size < 1 or rows % block_size:
        raise ValueError(f"block_size ({block_size}) must divide the pool rows ({rows})")
    if block_tables.shape[0] != b or context_lens.shape != (b,):
        raise ValueError(f"block_tables {block_tables.shape} / context_lens "
                         f"{context_lens.shape} must have {b} rows (q's batch)")


def _group_queries(q: jax.Array, kv_heads: int) -> jax.Array:
    """[B, 1, H, hd] -> [B, KV, Gp, hd], the group zero-padded to a dot-friendly Gp."""
    b, _, h, hd = q.shape
    g = h // kv_heads
    gp = max(MIN_DOT_ROWS, pl.next_power_of_2(g))
    qg = q.reshape(b, kv_heads, g, hd)
    return jnp.pad(qg, ((0, 0), (0, 0), (0, gp - g), (0, 0)))


def _decode_partials(
    qg: jax.Array,  # [B, KV, Gp, hd]
    pools: tuple[jax.Array, ...],  # k, v [L, rows, KV, hd]; int8: + k, v scales [L, rows, KV]
    layer: jax.Array,
    paging: tuple[jax.Array, jax.Array, jax.Array],  # positions, block_tables, context_lens
    window: jax.Array | int,
    *,
    block_size: int,
    scale: float,
    softcap: float | None,
    num_splits: int,
    interpret: bool,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Run the kernel -> per-split acc [B, KV, S, Gp, hd], m and l [B, KV, S, Gp] (f32)."""
    b, kv_heads, gp, hd = qg.shape
    positions, block_tables, context_lens = paging
    scalars = jnp.stack([jnp.asarray(layer, jnp.int32), jnp.asarray(window, jnp.int32)])
    q_positions = positions[:, 0].astype(jnp.int32)  # [B]
    kernel = functools.partial(
        _decode_kernel, block_size=block_size, scale=scale, softcap=softcap,
        num_splits=num_splits, precision=_dot_precision(qg.dtype), quantized=len(pools) == 4,
    )
    whole = pl.BlockSpec()  # the full array: indexed inside the kernel
    tile = pl.BlockSpec((None, None, None, gp, hd), lambda i, j, s: (i, j, s, 0, 0))
    stat = pl.BlockSpec((None, None, None, gp), lambda i, j, s: (i, j, s, 0))
    out_shape = (
        jax.ShapeDtypeStruct((b, kv_heads, num_splits, gp, hd), jnp.float32),
        jax.ShapeDtypeStruct((b, kv_heads, num_splits, gp), jnp.float32),
        jax.ShapeDtypeStruct((b, kv_heads, num_splits, gp), jnp.float32),
    )
    return pl.pallas_call(
        kernel,
        grid=(b, kv_heads, num_splits),
        in_specs=[whole, whole, whole, whole,
                  pl.BlockSpec((None, None, gp, hd), lambda i, j, s: (i, j, 0, 0)),
                  *[whole] * len(pools)],
        out_specs=(tile, stat, stat),
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="paged_decode_attention",
    )(scalars, q_positions, context_lens.astype(jnp.int32), block_tables.astype(jnp.int32),
      qg, *pools)


def _dot_precision(dtype: jnp.dtype) -> lax.Precision:
    """f32 inputs get IEEE dots (Triton defaults to TF32); bf16 runs as is."""
    return lax.Precision.HIGHEST if dtype == jnp.float32 else lax.Precision.DEFAULT


def _decode_kernel(
    scalars_ref,  # [2] int32: layer, window
    pos_ref,  # [B] int32: query position
    ctx_ref,  # [B] int32: context length (0: padding row)
    table_ref,  # [B, max_blocks] int32
    q_ref,  # [Gp, hd]
    k_ref,  # [L, rows, KV, hd], whole pool, float or int8
    v_ref,  # [L, rows, KV, hd], whole pool
    *refs,  # int8: k_scale_ref, v_scale_ref [L, rows, KV]; then acc [Gp, hd], m, l [Gp] f32
    block_size: int,
    scale: float,
    softcap: float | None,
    num_splits: int,
    precision: lax.Precision,
    quantized: bool,
) -> None:
    """One (row, kv head, split): online softmax over this split's live blocks."""
    *scale_refs, acc_ref, m_ref, l_ref = refs
    row, kv_head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer, window = scalars_ref[0], scalars_ref[1]
    q_pos, ctx = pos_ref[row], ctx_ref[row]
    start, stop = split_block_range(
        q_pos, ctx, window, split, block_size, num_splits, table_ref.shape[1]
    )
    q = q_ref[...]  # [Gp, hd]

    def body(j, carry):
        rows = pl.ds(pl.multiple_of(table_ref[row, j] * block_size, block_size), block_size)
        k = k_ref[layer, rows, kv_head, :].astype(q.dtype)  # [bs, hd]
        v = v_ref[layer, rows, kv_head, :].astype(q.dtype)  # [bs, hd]
        k_pos = j * block_size + lax.broadcasted_iota(jnp.int32, (block_size,), 0)  # [bs]
        valid = (k_pos < ctx) & (k_pos <= q_pos) & (q_pos - k_pos < window)  # [bs]
        k_scale = v_scale = None
        if quantized:
            k_scale, v_scale = (jnp.where(valid, ref[layer, rows, kv_head], 0.0)
                                for ref in scale_refs)  # [bs] f32
        s = _scores(q, k, valid, scale, softcap, precision, k_scale)  # [Gp, bs]
        return _online_softmax_step(carry, s, valid, v, precision, v_scale)

    gp, hd = q.shape
    init = (
        jnp.zeros((gp, hd), jnp.float32),
        jnp.full((gp,), NEG_INF, jnp.float32),
        jnp.zeros((gp,), jnp.float32),
    )
    acc, row_max, row_sum = lax.fori_loop(start, stop, body, init)
    acc_ref[...] = acc
    m_ref[...] = row_max
    l_ref[...] = row_sum


def split_block_range(
    q_pos: jax.Array, ctx: jax.Array, window: jax.Array, split: jax.Array,
    block_size: int, num_splits: int, max_blocks: int,
) -> tuple[jax.Array, jax.Array]:
    """[start, stop) logical blocks of this split: its share of the live range.

    Live keys are [first_key, end_key): inside the window, the context and the
    causal limit. Live blocks are the blocks holding them, divided evenly
    between splits (trailing splits may be empty).
    """
    first_key = jnp.maximum(q_pos - window + 1, 0)
    end_key = jnp.maximum(jnp.minimum(ctx, q_pos + 1), 0)  # exclusive
    first = first_key // block_size
    last = jnp.minimum((end_key + block_size - 1) // block_size, max_blocks)  # exclusive
    count = jnp.where(end_key > first_key, last - first, 0)  # each live block has a valid key
    per_split = (count + num_splits - 1) // num_splits
    start = first + split * per_split
    return start, jnp.minimum(start + per_split, first + count)


def _scores(
    q: jax.Array, k: jax.Array, valid: jax.Array, scale: float, softcap: float | None,
    precision: lax.Precision, k_scale: jax.Array | None = None,
) -> jax.Array:
    """Masked f32 scores q·kᵀ [Gp, bs] (int8 K: times k_scale [bs]), soft-capped when asked."""
    s = lax.dot_general(
        q, k, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
    )  # [Gp, bs]
    if k_scale is not None:
        s = s * k_scale[None, :]
    s = s * scale
    if softcap is not None:
        s = jnp.tanh(s / softcap) * softcap
    return jnp.where(valid[None, :], s, NEG_INF)


def _online_softmax_step(
    carry: tuple[jax.Array, jax.Array, jax.Array],
    s: jax.Array,  # [Gp, bs] f32
    valid: jax.Array,  # [bs]
    v: jax.Array,  # [bs, hd]
    precision: lax.Precision,
    v_scale: jax.Array | None = None,  # [bs] f32, int8 V only (0 where masked)
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Fold one block into (acc [Gp, hd], row max [Gp], row sum [Gp]).

    Every visited block holds a valid key, so the new max is a real score and
    masked scores (NEG_INF) give p = 0 exactly.
    """
    acc, row_max, row_sum = carry
    new_max = jnp.maximum(row_max, s.max(axis=1))  # [Gp]
    p = jnp.exp(s - new_max[:, None])  # [Gp, bs]
    alpha = jnp.exp(row_max - new_max)  # [Gp]
    v = jnp.where(valid[:, None], v, jnp.zeros_like(v))  # stale rows may hold anything
    pw = p if v_scale is None else p * v_scale[None, :]  # int8 V: dequantize through p
    pv = lax.dot_general(
        pw.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
        preferred_element_type=jnp.float32,
    )  # [Gp, hd]
    return acc * alpha[:, None] + pv, new_max, row_sum * alpha + p.sum(axis=1)
