"""Ragged paged attention for TPU (Mosaic), in the style of tpu-inference's RPA.

Same contract as `ragged_reference.py` (flat q [T, H, hd], query_start,
context_lens, block_tables, num_seqs); on CPU it runs under the TPU
interpreter (`interpret=True`), which simulates SMEM, VMEM, DMAs and
semaphores, and is what the tests use.

Layout. The wrapper packs the G = H / KV query heads of each KV head under
their tokens: q becomes [KV, T*G, hd] (row r of a KV head is token r // G,
head r % G), so one K/V page in VMEM serves its whole query group (GQA/MQA
costs no extra K/V traffic), and a query block of `query_block` tokens is one
[query_block * G, hd] matrix. T is padded to a multiple of `query_block`
(zeros; a copy the caller avoids by choosing T that way).

Grid (KV head, query block), both parallel: nothing crosses grid steps. A
query block is a fixed slice of the flat token axis, so it may hold the tail
of one sequence, several whole decodes and the head of a prompt chunk. The
wrapper finds, per block, the sequences overlapping it ([first, end), from
query_start and num_seqs); with the layer, the window, query_start,
context_lens and the flattened block tables they are scalar-prefetch
operands in SMEM.

Per grid step the kernel walks every (sequence, chunk) pair of the block as
one flat loop. A chunk is `pages_per_step` consecutive pages of the
sequence's live page range: from the page holding the first key inside the
window of the sequence's first query in this block, to the page holding its
last query (never past context_lens or W). Pages outside the window are never
copied. K and V pages (and, for int8 pools, the pages' [bs, KV] scale rows)
are copied HBM -> VMEM with `make_async_copy` from `pl.ANY` pool refs into
double-buffered scratch: the next chunk's copies start before the current
chunk is waited on and computed, across sequence boundaries too. Pages past
the live range in a sequence's last chunk are not copied; their stale buffer
rows (NaN in the interpreter) are masked.

Math per chunk: scores [M, n] = q . K^T in f32 (int8 K cast to q's dtype,
exact, times k_scale per key), scaled, soft-capped, masked (row belongs to the
sequence, key inside the copied live range, causal, window), then an online
softmax in f32 scratch (m, l, acc) that only rows of the current sequence
move: other rows see p = 0 and alpha = 1. V rows outside the live range are
zeroed and masked keys get p = 0 (p * v_scale for int8), so stale rows and NaN
scales never leak. Rows that saw no key (padding tokens) write zeros.

TPU layout assumptions (real hardware; the interpreter checks none of them,
and the tests lower the kernel through Pallas' Mosaic lowering on CPU, but
Mosaic's own layout passes run only when a TPU compiles it; never run yet):
- query_block * G is a multiple of 8 (sublanes), so q / out blocks are
  [8k, hd] with hd the full last dim: 128 and 256 are native lanes; hd = 64 is
  legal (full dim) but pads lanes to 128 in VMEM and halves MXU use.
- block_size is a multiple of 8 for f32 pages, 16 for bf16, 32 for int8 (the
  sublane tiling of the dtype), so merging [pages, bs, hd] -> [n, hd] of a
  loaded value is layout-free.
- K/V page copies are strided HBM reads ([bs, hd] of one KV head from rows of
  [KV, hd]); scale copies are contiguous [bs, KV] rows whose KV lanes pad to
  128 in VMEM, and the head's scales are selected after a transpose.
- SMEM holds the flattened block tables (S * W int32): keep S * W within the
  SMEM budget (about 16K entries leaves room) or the compile fails.
Not done (future): prefetching the first chunk of the next grid step,
megacore-aware splitting of long sequences, tuned default block sizes.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.ragged_reference import (
    check_ragged_args,
    live_query_lens,
    ragged_paged_attention_reference,
)

reference = ragged_paged_attention_reference

DEFAULT_PAGES_PER_STEP = 8
DEFAULT_QUERY_BLOCK = 32
MASK_VALUE = -1e30  # finite floor: exp(MASK_VALUE - m) underflows to 0, never NaN
NUM_SCALARS = 6  # layer/window, query_start, context_lens, tables, first seq, end seq


def ragged_paged_attention_tpu(
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
    pages_per_step: int = DEFAULT_PAGES_PER_STEP,
    query_block: int = DEFAULT_QUERY_BLOCK,
    interpret: bool = False,
) -> jax.Array:
    """Ragged paged attention on TPU -> [T, H, hd] in q's dtype (padding tokens 0)."""
    quantized = check_ragged_args(
        q, k_pool, v_pool, query_start, context_lens, block_tables, num_seqs,
        block_size=block_size, window=window, softcap=softcap, k_scale=k_scale, v_scale=v_scale)
    for name, value in (("pages_per_step", pages_per_step), ("query_block", query_block)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    t, h, _ = q.shape
    kv_heads = k_pool.shape[2]
    num_blocks = -(-t // query_block)
    query_start = query_start.astype(jnp.int32)
    first_seq, end_seq = block_sequences(query_start, num_seqs, num_blocks, query_block)
    scalars = (
        jnp.stack([jnp.asarray(layer, jnp.int32), jnp.asarray(window, jnp.int32)]),
        query_start, context_lens.astype(jnp.int32),
        block_tables.astype(jnp.int32).reshape(-1), first_seq, end_seq,
    )
    pools = (k_pool, v_pool, k_scale, v_scale) if quantized else (k_pool, v_pool)
    out = _call_kernel(
        _pack_queries(q, kv_heads, num_blocks * query_block), scalars, pools,
        _Static(block_size, pages_per_step, query_block, h // kv_heads,
                block_tables.shape[1], scale, softcap),
        interpret=interpret)  # [KV, T'*G, hd]
    return _unpack_outputs(out, t, h // kv_heads)


def block_sequences(
    query_start: jax.Array, num_seqs: jax.Array, num_blocks: int, query_block: int
) -> tuple[jax.Array, jax.Array]:
    """Per query block, the live sequences overlapping it: [first, end) as two [num_blocks]."""
    starts = query_start[:-1]
    ends = starts + live_query_lens(query_start, num_seqs)  # [S]; padding: empty at its start
    block_start = jnp.arange(num_blocks, dtype=jnp.int32) * query_block
    first = jnp.searchsorted(ends, block_start, side="right")  # first sequence ending later
    end = jnp.searchsorted(starts, block_start + query_block, side="left")  # starting before
    live = num_seqs[0].astype(jnp.int32)
    return (jnp.minimum(first, live).astype(jnp.int32),
            jnp.minimum(end, live).astype(jnp.int32))


class _Static(NamedTuple):
    """Compile-time sizes and options of the kernel."""

    block_size: int
    pages: int  # pages per chunk (per loop step)
    query_block: int  # tokens per grid step
    groups: int  # G: query heads per KV head
    width: int  # W: block-table entries per sequence
    scale: float
    softcap: float | None


def _pack_queries(q: jax.Array, kv_heads: int, padded_tokens: int) -> jax.Array:
    """[T, H, hd] -> [KV, T'*G, hd]: each KV head's group under its tokens, T' padded."""
    t, h, hd = q.shape
    q = jnp.pad(q, ((0, padded_tokens - t), (0, 0), (0, 0)))
    q = q.reshape(padded_tokens, kv_heads, h // kv_heads, hd).transpose(1, 0, 2, 3)
    return q.reshape(kv_heads, -1, hd)


def _unpack_outputs(out: jax.Array, tokens: int, groups: int) -> jax.Array:
    """[KV, T'*G, hd] -> [T, H, hd]."""
    kv_heads, rows, hd = out.shape
    out = out.reshape(kv_heads, rows // groups, groups, hd).transpose(1, 0, 2, 3)
    return out.reshape(rows // groups, kv_heads * groups, hd)[:tokens]


def _call_kernel(
    qg: jax.Array,  # [KV, T'*G, hd]
    scalars: tuple[jax.Array, ...],
    pools: tuple[jax.Array, ...],  # k, v [L, rows, KV, hd]; int8: + k, v scales [L, rows, KV]
    static: _Static,
    *,
    interpret: bool,
) -> jax.Array:
    """Run the kernel over the (KV head, query block) grid -> [KV, T'*G, hd]."""
    kv_heads, rows, hd = qg.shape
    m = static.query_block * static.groups
    block = pl.BlockSpec((None, m, hd), lambda k, i, *_: (k, i, 0))
    pages = (static.pages, static.block_size)
    buffers = [pltpu.VMEM((2, *pages, hd), pools[0].dtype),
               pltpu.VMEM((2, *pages, hd), pools[1].dtype)]
    buffers += [pltpu.VMEM((2, *pages, kv_heads), scales.dtype) for scales in pools[2:]]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=NUM_SCALARS,
        grid=(kv_heads, rows // m),
        in_specs=[block, *[pl.BlockSpec(memory_space=pl.ANY)] * len(pools)],
        out_specs=block,
        scratch_shapes=[*buffers, pltpu.SemaphoreType.DMA((2, len(pools))),
                        pltpu.VMEM((m, 1), jnp.float32), pltpu.VMEM((m, 1), jnp.float32),
                        pltpu.VMEM((m, hd), jnp.float32)],
    )
    kernel = functools.partial(_kernel, static=static, num_pools=len(pools),
                               precision=_dot_precision(qg.dtype))
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(qg.shape, qg.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="ragged_paged_attention_tpu",
    )(*scalars, qg, *pools)


def _dot_precision(dtype: jnp.dtype) -> lax.Precision:
    """f32 inputs get full-precision dots; bf16 runs as is."""
    return lax.Precision.HIGHEST if dtype == jnp.float32 else lax.Precision.DEFAULT


class _ScalarRefs(NamedTuple):
    """The scalar-prefetch operands, in SMEM."""

    layer_window: jax.Array  # [2]: layer, window
    query_start: jax.Array  # [S + 1]
    context_lens: jax.Array  # [S]
    tables: jax.Array  # [S * W] block tables, row-major
    first_seq: jax.Array  # [num query blocks]
    end_seq: jax.Array  # [num query blocks], exclusive


class _Span(NamedTuple):
    """One sequence's share of a query block and the keys it reads (scalars)."""

    q_lo: jax.Array  # first token (flat index into q) of the sequence in this block
    q_hi: jax.Array  # exclusive
    pos_offset: jax.Array  # a token's position = its flat index + pos_offset
    first_key: jax.Array  # first position inside the window of the first query
    end_key: jax.Array  # exclusive: the last query's position + 1
    first_page: jax.Array  # logical page holding first_key
    end_page: jax.Array  # exclusive, at most W
    num_chunks: jax.Array  # ceil((end_page - first_page) / pages); 0: nothing to read


def _span(seq: jax.Array, block_start: jax.Array, smem: _ScalarRefs, static: _Static) -> _Span:
    """Where sequence `seq` meets the query block starting at flat token `block_start`."""
    q_start, q_end = smem.query_start[seq], smem.query_start[seq + 1]
    q_lo = jnp.maximum(q_start, block_start)
    q_hi = jnp.minimum(q_end, block_start + static.query_block)
    pos_offset = smem.context_lens[seq] - q_end
    first_key = jnp.maximum(q_lo + pos_offset - smem.layer_window[1] + 1, 0)
    end_key = q_hi + pos_offset
    first_page = lax.div(first_key, static.block_size)
    end_page = jnp.minimum(_ceil_div(jnp.maximum(end_key, 0), static.block_size), static.width)
    chunks = _ceil_div(jnp.maximum(end_page - first_page, 0), static.pages)
    live = (q_hi > q_lo) & (end_key > first_key)
    return _Span(q_lo, q_hi, pos_offset, first_key, end_key, first_page, end_page,
                 jnp.where(live, chunks, 0))


def _ceil_div(a: jax.Array, b: int) -> jax.Array:
    """ceil(a / b) for a >= 0: truncating division, which Mosaic lowers without sign logic."""
    return lax.div(a + (b - 1), b)


def _kernel(*refs, static: _Static, num_pools: int, precision: lax.Precision) -> None:
    """One (KV head, query block): online softmax over every (sequence, chunk) of the block.

    refs: NUM_SCALARS SMEM refs; q [M, hd]; the HBM pools (k, v, int8: k and v
    scales); out [M, hd]; one VMEM buffer per pool [2, pages, bs, hd or KV]; DMA
    semaphores [2, num_pools]; m, l [M, 1] and acc [M, hd] f32 scratch.
    """
    smem = _ScalarRefs(*refs[:NUM_SCALARS])
    q_ref, *rest = refs[NUM_SCALARS:]
    hbm, o_ref, bufs = rest[:num_pools], rest[num_pools], rest[num_pools + 1: 2 * num_pools + 1]
    sems, m_ref, l_ref, acc_ref = rest[2 * num_pools + 1:]
    kv_head, q_block = pl.program_id(0), pl.program_id(1)
    block_start = q_block * static.query_block
    end_seq = smem.end_seq[q_block]
    span = functools.partial(_span, block_start=block_start, smem=smem, static=static)
    m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def copy_chunk(seq: jax.Array, chunk: jax.Array, half: jax.Array, start: bool) -> None:
        """Start (or wait for) the HBM -> VMEM copies of one chunk's live pages."""
        sp, layer = span(seq), smem.layer_window[0]
        for j in range(static.pages):
            page = sp.first_page + chunk * static.pages + j

            @pl.when(page < sp.end_page)  # pages past the live range are never copied
            def _(j=j, page=page):
                row0 = smem.tables[seq * static.width + page] * static.block_size
                rows = pl.ds(pl.multiple_of(row0, static.block_size), static.block_size)
                for i, (src, buf) in enumerate(zip(hbm, bufs, strict=True)):
                    src_page = src.at[layer, rows, kv_head] if i < 2 else src.at[layer, rows]
                    copy = pltpu.make_async_copy(src_page, buf.at[half, j], sems.at[half, i])
                    if start:
                        copy.start()
                    else:
                        copy.wait()

    def skip_empty(seq: jax.Array) -> jax.Array:
        """The first sequence from `seq` on with something to read (or end_seq)."""
        last = smem.context_lens.shape[0] - 1  # `&` evaluates both sides: when s reaches
        return lax.while_loop(  # end_seq = S, span must still read inside the SMEM arrays
            lambda s: (s < end_seq) & (span(jnp.minimum(s, last)).num_chunks == 0),
            lambda s: s + 1, seq)

    def body(state: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[jax.Array, ...]:
        seq, chunk, half = state
        more = chunk + 1 < span(seq).num_chunks
        next_seq = jnp.where(more, seq, skip_empty(seq + 1))
        next_chunk = jnp.where(more, chunk + 1, 0)

        @pl.when(next_seq < end_seq)  # prefetch into the other buffer
        def _():
            copy_chunk(next_seq, next_chunk, 1 - half, start=True)

        copy_chunk(seq, chunk, half, start=False)
        _attend_chunk(q_ref, [buf.at[half] for buf in bufs], (m_ref, l_ref, acc_ref),
                      span(seq), chunk, kv_head, block_start, smem.layer_window[1],
                      static=static, precision=precision)
        return next_seq, next_chunk, 1 - half

    first = skip_empty(smem.first_seq[q_block])

    @pl.when(first < end_seq)
    def _():
        copy_chunk(first, jnp.int32(0), jnp.int32(0), start=True)

    lax.while_loop(lambda state: state[0] < end_seq, body, (first, jnp.int32(0), jnp.int32(0)))
    total = l_ref[...]  # [M, 1]; 0 for rows that saw no key
    out = acc_ref[...] / jnp.where(total > 0, total, 1.0)
    o_ref[...] = jnp.where(total > 0, out, 0.0).astype(o_ref.dtype)


def _attend_chunk(
    q_ref,  # [M, hd]
    bufs: list,  # one half of the double buffer: k, v [pages, bs, hd] (int8: + scales)
    state: tuple,  # m, l [M, 1] and acc [M, hd] f32 scratch refs
    sp: _Span,
    chunk: jax.Array,
    kv_head: jax.Array,
    block_start: jax.Array,
    window: jax.Array,
    *,
    static: _Static,
    precision: lax.Precision,
) -> None:
    """Fold one chunk of pages into the online softmax of the rows of sequence `sp`."""
    m_ref, l_ref, acc_ref = state
    q = q_ref[...]  # [M, hd]
    rows, hd = q.shape
    n = static.pages * static.block_size
    key0 = (sp.first_page + chunk * static.pages) * static.block_size
    k_pos = key0 + lax.broadcasted_iota(jnp.int32, (1, n), 1)  # [1, n]
    live = (k_pos >= sp.first_key) & (k_pos < sp.end_key)  # [1, n]: copied and read
    token = block_start + lax.div(lax.broadcasted_iota(jnp.int32, (rows, 1), 0), static.groups)
    q_pos = token + sp.pos_offset  # [M, 1]
    mask = (live & (token >= sp.q_lo) & (token < sp.q_hi) & (k_pos <= q_pos)
            & (q_pos - k_pos < window))  # [M, n]
    k = bufs[0][...].reshape(n, hd).astype(q.dtype)  # reshape the value, never the ref
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                        preferred_element_type=jnp.float32)  # [M, n]
    if len(bufs) == 4:
        s = s * _head_scales(bufs[2][...], kv_head, live)
    s = s * static.scale
    if static.softcap is not None:
        s = jnp.tanh(s / static.softcap) * static.softcap
    s = jnp.where(mask, s, MASK_VALUE)
    m_prev = m_ref[...]  # [M, 1]
    m_new = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
    p = jnp.where(mask, jnp.exp(s - m_new), 0.0)  # [M, n]; rows of other sequences: 0
    alpha = jnp.exp(m_prev - m_new)  # [M, 1]; rows of other sequences: 1
    m_ref[...] = m_new
    l_ref[...] = alpha * l_ref[...] + p.sum(axis=1, keepdims=True)
    if len(bufs) == 4:
        p = p * _head_scales(bufs[3][...], kv_head, live)  # int8 V: dequantize through p
    v_pos = key0 + lax.broadcasted_iota(jnp.int32, (n, 1), 0)  # [n, 1]
    live_rows = (v_pos >= sp.first_key) & (v_pos < sp.end_key)
    v = jnp.where(live_rows, bufs[1][...].reshape(n, hd).astype(q.dtype), 0)  # stale: 0
    pv = lax.dot_general(p.astype(q.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
                         preferred_element_type=jnp.float32)  # [M, hd]
    acc_ref[...] = alpha * acc_ref[...] + pv


def _head_scales(scales: jax.Array, kv_head: jax.Array, live: jax.Array) -> jax.Array:
    """Page scales [pages, bs, KV] -> this head's [1, n], 0 outside the live keys."""
    pages, block_size, kv_heads = scales.shape
    by_head = scales.reshape(pages * block_size, kv_heads).T  # [KV, n]
    heads = lax.broadcasted_iota(jnp.int32, by_head.shape, 0)
    own = jnp.where(heads == kv_head, by_head, 0.0).sum(axis=0, keepdims=True)  # [1, n]
    return jnp.where(live, own, 0.0)
