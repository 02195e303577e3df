"""Paged decode kernel (Pallas, interpret mode) against the jnp reference and a dense oracle.

Each case holds per-sequence K/V in a pool behind a random, non-contiguous
block table (tests/paged_inputs.py: permuted physical blocks, unused blocks
between, noise everywhere else, layer 0 all noise). The dense oracle reads the
contiguous K/V directly in float64, so it shares no gather code with either
implementation.
"""

from __future__ import annotations

from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paged_inputs import LAYER, PagedInputs, make_paged_inputs

from jaxinfer.ops.types import NO_WINDOW
from pallas_kernels.paged_decode import (
    MAX_SPLITS,
    choose_num_splits,
    paged_decode_attention,
    reference,
    split_block_range,
)

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}

_kernel = jax.jit(
    paged_decode_attention,
    static_argnames=("block_size", "scale", "softcap", "interpret", "num_splits",
                     "blocks_per_split"),
)
_reference = jax.jit(reference, static_argnames=("block_size", "scale", "softcap"))


def dense_attention(case: PagedInputs, window: int, softcap: float | None = None) -> np.ndarray:
    """Float64 decode attention over the contiguous K/V -> [B, 1, H, hd]; padding rows 0."""
    q = np.asarray(case.q.astype(jnp.float32), np.float64)[:, 0]  # [B, H, hd]
    b, h, hd = q.shape
    group = h // case.k_seq.shape[2]
    out = np.zeros((b, 1, h, hd))
    for row, n in enumerate(case.ctx):
        keys = slice(max(0, n - window), n)  # query at n - 1 sees k_pos > n - 1 - window
        for head in range(h):
            k, v = case.k_seq[row, keys, head // group], case.v_seq[row, keys, head // group]
            s = k @ q[row, head] * case.scale  # [n_keys]
            if softcap is not None:
                s = np.tanh(s / softcap) * softcap
            if s.size:
                p = np.exp(s - s.max())
                out[row, 0, head] = p @ v / p.sum()
    return out


def run_kernel(case: PagedInputs, window: int, **options) -> np.ndarray:
    out = _kernel(case.q, case.k_pool, case.v_pool, jnp.int32(LAYER), *case.paging,
                  block_size=case.block_size, scale=case.scale, window=jnp.int32(window),
                  interpret=True, **options)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    return np.asarray(out.astype(jnp.float32), np.float64)


def run_reference(case: PagedInputs, window: int, softcap: float | None = None) -> np.ndarray:
    out = _reference(case.q, case.k_pool, case.v_pool, jnp.int32(LAYER), *case.paging,
                     block_size=case.block_size, scale=case.scale, window=jnp.int32(window),
                     softcap=softcap)
    return np.asarray(out.astype(jnp.float32), np.float64)


def assert_matches(case: PagedInputs, window: int, softcap: float | None = None, **options) -> None:
    """Kernel == reference == dense oracle on the real rows, within the dtype's tolerance."""
    tol = TOL[case.q.dtype.type]
    got = run_kernel(case, window, softcap=softcap, **options)
    real = case.ctx > 0
    np.testing.assert_allclose(got, dense_attention(case, window, softcap), atol=tol, rtol=0)
    want = run_reference(case, window, softcap)
    np.testing.assert_allclose(got[real], want[real], atol=tol, rtol=0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(
    ("group", "kv_heads", "head_dim"),
    [(1, 2, 64), (4, 1, 256), (8, 2, 128)],
    ids=["mha-hd64", "gqa4-mqa-hd256", "gqa8-hd128"],
)
def test_gqa_ratios_and_head_dims(group: int, kv_heads: int, head_dim: int, dtype) -> None:
    case = make_paged_inputs([37, 16, 5], kv_heads=kv_heads, group=group, head_dim=head_dim,
                     dtype=dtype, seed=group)
    assert_matches(case, NO_WINDOW)


@pytest.mark.parametrize(
    "ctx_lens",
    [[16, 32, 64], [17, 33, 49], [15, 31, 1]],
    ids=["on-boundary", "just-past-boundary", "just-before-boundary"],
)
def test_block_boundaries(ctx_lens: list[int]) -> None:
    case = make_paged_inputs(ctx_lens, max_blocks=4, seed=1)
    assert_matches(case, NO_WINDOW)


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize(
    "window", [1, 8, 16, 40, 41, 100, NO_WINDOW],
    ids=["w1", "w8-inside-block", "w16-block", "w40-equal", "w41-larger", "w100", "global"],
)
def test_sliding_window(window: int, num_splits: int) -> None:
    case = make_paged_inputs([40, 17, 64], max_blocks=4, seed=2)  # window vs row 0's context of 40
    assert_matches(case, window, num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [1, 2, 4])
def test_split_k_gives_the_same_answer(num_splits: int) -> None:
    case = make_paged_inputs([200, 37, 1, 96], kv_heads=2, group=4, seed=3)
    single = run_kernel(case, NO_WINDOW, num_splits=1)
    got = run_kernel(case, NO_WINDOW, num_splits=num_splits)
    np.testing.assert_allclose(got, single, atol=1e-6, rtol=0)
    assert_matches(case, NO_WINDOW, num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_padding_row_gives_zeros(num_splits: int) -> None:
    case = make_paged_inputs([0, 20, 0], max_blocks=4, seed=4)
    got = run_kernel(case, NO_WINDOW, num_splits=num_splits)
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got[[0, 2]], 0.0)
    assert_matches(case, NO_WINDOW, num_splits=num_splits)


@pytest.mark.parametrize("window", [NO_WINDOW, 512], ids=["global", "w512"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_mixed_short_and_long_context(dtype, window: int) -> None:
    case = make_paged_inputs([1, 1000], kv_heads=1, group=4, head_dim=256, dtype=dtype, seed=5)
    assert choose_num_splits(case.block_tables.shape[1]) > 1  # auto split-K engaged
    assert_matches(case, window)


def test_softcap() -> None:
    case = make_paged_inputs([45, 3, 64], max_blocks=4, seed=6)
    uncapped = dense_attention(case, NO_WINDOW)
    assert np.abs(dense_attention(case, NO_WINDOW, 2.0) - uncapped).max() > 1e-2  # cap matters
    assert_matches(case, NO_WINDOW, softcap=2.0)


def test_stale_nan_rows_do_not_leak() -> None:
    """Rows past the context in the last block and rows before the window may hold NaN."""
    case = make_paged_inputs([40, 17, 64], max_blocks=4, seed=8)
    window = 8
    k_pool, v_pool = np.array(case.k_pool), np.array(case.v_pool)
    table = np.asarray(case.block_tables)
    for row, n in enumerate(case.ctx):
        stale = [p for p in range(-(-n // 16) * 16) if p >= n or p < n - window]
        phys = table[row, np.array(stale) // 16] * 16 + np.array(stale) % 16
        k_pool[LAYER, phys] = v_pool[LAYER, phys] = np.nan
    case = replace(case, k_pool=jnp.asarray(k_pool), v_pool=jnp.asarray(v_pool))
    got = run_kernel(case, window)
    np.testing.assert_allclose(got, dense_attention(case, window), atol=TOL[np.float32], rtol=0)


@pytest.mark.parametrize(
    ("ctx", "window", "num_splits", "blocks"),
    [
        (40, NO_WINDOW, 1, range(0, 3)),
        (40, 8, 1, range(2, 3)),  # keys 32..39
        (32, 16, 2, range(1, 2)),  # keys 16..31: context ends on a boundary
        (33, 17, 2, range(1, 3)),  # keys 16..32
        (1000, 512, 4, range(30, 63)),  # keys 488..999
        (1, NO_WINDOW, 4, range(0, 1)),
        (0, NO_WINDOW, 2, range(0)),  # padding row
        (40, 0, 1, range(0)),  # empty window
    ],
)
def test_split_block_range_skips_blocks_outside_the_window(
    ctx: int, window: int, num_splits: int, blocks: range
) -> None:
    ranges = [
        tuple(int(x) for x in split_block_range(
            jnp.int32(max(ctx - 1, 0)), jnp.int32(ctx), jnp.int32(window), jnp.int32(s),
            16, num_splits, 63))
        for s in range(num_splits)
    ]
    visited = [j for start, stop in ranges for j in range(start, stop)]
    assert visited == list(blocks)  # each live block exactly once, in order
    assert all(stop - start <= -(-len(blocks) // num_splits) for start, stop in ranges)


def test_choose_num_splits() -> None:
    assert choose_num_splits(4) == 1
    assert choose_num_splits(32, blocks_per_split=32) == 1
    assert choose_num_splits(33, blocks_per_split=32) == 2
    assert choose_num_splits(10_000) == MAX_SPLITS
    with pytest.raises(ValueError, match="blocks_per_split"):
        choose_num_splits(8, blocks_per_split=0)


def test_rejects_more_than_one_query_token() -> None:
    case = make_paged_inputs([5], seed=7)
    q2 = jnp.concatenate([case.q, case.q], axis=1)
    with pytest.raises(ValueError, match="one token per row"):
        paged_decode_attention(q2, case.k_pool, case.v_pool, jnp.int32(LAYER), *case.paging,
                               block_size=case.block_size, scale=1.0, window=NO_WINDOW,
                               interpret=True)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_lowers_through_pallas_triton(dtype) -> None:
    """The kernel stays inside what Pallas' Triton lowering supports (no GPU needed)."""
    case = make_paged_inputs([1, 100, 0], kv_heads=1, group=4, head_dim=256, dtype=dtype, seed=9)
    attend = jax.jit(lambda q, k, v, layer, paging, window: paged_decode_attention(
        q, k, v, layer, *paging, block_size=16, scale=case.scale, window=window, softcap=30.0,
        num_splits=2))
    lowered = attend.trace(case.q, case.k_pool, case.v_pool, jnp.int32(LAYER), case.paging,
                           jnp.int32(NO_WINDOW)).lower(lowering_platforms=("cuda",))
    assert "triton" in lowered.as_text()
