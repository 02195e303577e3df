"""Ragged paged attention: the jnp reference, the TPU kernel (TPU interpreter) and
the GPU kernel (Pallas interpreter).

The reference is checked against a float64 dense oracle, each kernel against
both, on the same cases (built by tests/ragged_inputs.py): the `kernel`
fixture runs every kernel case once per kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ragged_inputs import LAYER, Case, dense_attention, make_case

from jaxinfer.ops.types import NO_WINDOW
from pallas_kernels.ragged_gpu import (
    Tiling,
    ragged_paged_attention_gpu,
    tile_table,
    token_rows,
)
from pallas_kernels.ragged_reference import (
    live_query_lens,
    query_tiles,
    ragged_paged_attention_reference,
)
from pallas_kernels.ragged_tpu import block_sequences, ragged_paged_attention_tpu

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}
STATIC = ("block_size", "scale", "softcap")

KERNEL_OPTIONS = {"query_block": 8, "pages_per_step": 2}  # blocks cross sequences, 2+ chunks

_reference = jax.jit(ragged_paged_attention_reference, static_argnames=STATIC)
KERNELS = {  # under their CPU interpreters
    name: jax.jit(functools.partial(fn, interpret=True),
                  static_argnames=(*STATIC, "pages_per_step", "query_block"))
    for name, fn in (("tpu", ragged_paged_attention_tpu), ("gpu", ragged_paged_attention_gpu))
}


@pytest.fixture(params=sorted(KERNELS))
def kernel(request):
    return KERNELS[request.param]


def attend(fn, case: Case, window: int, softcap: float | None = None, **options) -> np.ndarray:
    out = fn(case.q, case.k_pool, case.v_pool, jnp.int32(LAYER), *case.metadata,
             block_size=case.block_size, scale=case.scale, window=jnp.int32(window),
             softcap=softcap, **case.scales(), **options)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    return np.asarray(out.astype(jnp.float32), np.float64)


def assert_matches(kernel, case: Case, window: int, softcap: float | None = None,
                   **kernel_options) -> np.ndarray:
    """Reference == float64 oracle, kernel == reference and oracle; padding tokens exactly 0.

    Returns the kernel's output.
    """
    tol = TOL[case.q.dtype.type]
    oracle = dense_attention(case, window, softcap)
    want = attend(_reference, case, window, softcap)
    np.testing.assert_allclose(want, oracle, atol=tol, rtol=0)
    got = attend(kernel, case, window, softcap, **{**KERNEL_OPTIONS, **kernel_options})
    np.testing.assert_allclose(got, want, atol=tol, rtol=0)
    np.testing.assert_allclose(got, oracle, atol=tol, rtol=0)
    live = int(case.query_start[int(case.num_seqs[0])])
    np.testing.assert_array_equal(want[live:], 0.0)
    np.testing.assert_array_equal(got[live:], 0.0)
    return got


# ----------------------------------------------------------------- cases

MIXED = [(1, 37), (1000, 1000), (1, 130), (1, 1)]  # decodes beside a 1,000-token prompt
MID_BLOCK = [(20, 45), (5, 21), (1, 17), (16, 16)]  # chunks after cached prefixes, mid-block
WINDOWED = [(10, 40), (1, 17), (33, 64)]


@pytest.mark.parametrize("window", [NO_WINDOW, 512], ids=["global", "w512"])
def test_decodes_beside_a_long_chunk(kernel, window: int) -> None:
    case = make_case(MIXED, head_dim=128, seed=1)
    assert_matches(kernel, case, window, query_block=64, pages_per_step=8)


def test_chunks_after_cached_prefix(kernel) -> None:
    assert_matches(kernel, make_case(MID_BLOCK, kv_heads=2, seed=2), NO_WINDOW)


@pytest.mark.parametrize("window", [1, 8, 40, 41, 100], ids=lambda w: f"w{w}")
def test_windows(kernel, window: int) -> None:
    assert_matches(kernel, make_case(WINDOWED, seed=3), window)  # 40: sequence 0's whole context


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(("group", "kv_heads", "head_dim"),
                         [(1, 2, 64), (4, 1, 256), (8, 2, 128)],
                         ids=["mha-hd64", "gqa4-mqa-hd256", "gqa8-hd128"])
def test_gqa_and_head_dims(kernel, group: int, kv_heads: int, head_dim: int, dtype) -> None:
    case = make_case(MID_BLOCK, kv_heads=kv_heads, group=group, head_dim=head_dim,
                     dtype=dtype, seed=group)
    assert_matches(kernel, case, NO_WINDOW)


def test_every_sequence_slot_live(kernel) -> None:
    """num_seqs == S: the kernel's walk ends on the last slot without reading past it."""
    assert_matches(kernel, make_case(MID_BLOCK, pad_seqs=0, seed=9), NO_WINDOW)


def test_softcap(kernel) -> None:
    case = make_case(WINDOWED, seed=4)
    assert np.abs(dense_attention(case, NO_WINDOW, 2.0)
                  - dense_attention(case, NO_WINDOW)).max() > 1e-2  # the cap matters
    assert_matches(kernel, case, NO_WINDOW, softcap=2.0)


@pytest.mark.parametrize("window", [NO_WINDOW, 16], ids=["global", "w16"])
def test_int8(kernel, window: int) -> None:
    case = make_case(MID_BLOCK, kv_heads=2, int8=True, seed=5)
    assert_matches(kernel, case, window, softcap=30.0)


@pytest.mark.parametrize("int8", [False, True], ids=["float", "int8"])
def test_unread_pages_are_never_copied_and_nan_never_leaks(kernel, int8: bool) -> None:
    window = 8
    clean = make_case(WINDOWED, int8=int8, seed=6)
    poisoned = make_case(WINDOWED, int8=int8, poison_window=window, seed=6)
    got = assert_matches(kernel, poisoned, window)
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got, attend(kernel, clean, window, **KERNEL_OPTIONS))
    np.testing.assert_array_equal(attend(_reference, poisoned, window),
                                  attend(_reference, clean, window))


@pytest.mark.parametrize(("query_block", "pages_per_step"), [(1, 1), (16, 3), (64, 8)])
def test_kernel_block_sizes(kernel, query_block: int, pages_per_step: int) -> None:
    """One query row per block, blocks spanning several sequences, one chunk per sequence."""
    case = make_case(MID_BLOCK, kv_heads=2, pad_tokens=6, seed=8)  # T = 48: no padding to 16
    assert_matches(kernel, case, 16, query_block=query_block, pages_per_step=pages_per_step)


def test_block_sequences() -> None:
    starts = jnp.array([0, 5, 5, 40, 41, 41], jnp.int32)  # an empty live sequence, then padding
    first, end = block_sequences(starts, jnp.array([4], jnp.int32), 4, 16)
    assert first.tolist() == [0, 2, 2, 4] and end.tolist() == [3, 3, 4, 4]


def test_query_tiles_cover_each_sequence_once() -> None:
    starts = jnp.array([0, 5, 5, 40, 41, 41], jnp.int32)  # an empty live sequence, then padding
    lens = live_query_lens(starts, jnp.array([4], jnp.int32))
    seq, start, valid = query_tiles(starts, lens, 44, 16, max_runs=5)
    tiles = [(int(s), int(b)) for s, b, ok in zip(seq, start, valid, strict=True) if ok]
    assert tiles == [(0, 0), (2, 5), (2, 21), (2, 37), (3, 40)]


def test_gpu_tile_table_reads_only_pages_inside_the_window() -> None:
    """Window 8, block 16, 2 pages a step: each tile's live keys and page steps."""
    starts = jnp.array([0, 5, 5, 40, 41, 41], jnp.int32)  # an empty live sequence, then padding
    context_lens = jnp.array([20, 3, 100, 60, 7], jnp.int32)
    static = Tiling(block_size=16, pages=2, query_block=16, groups_padded=16, width=8,
                        scale=1.0, softcap=None)
    table = tile_table(starts, context_lens, jnp.array([4], jnp.int32), 8, 44, static)
    live = [tuple(int(x) for x in row) for row in table if row[-1] > 0]
    # seq, q_lo, q_hi, pos_offset, first_key, end_key, steps
    assert live == [(0, 0, 5, 15, 8, 20, 1),  # positions 15..19: pages 0-1
                    (2, 5, 21, 60, 58, 81, 2),  # positions 65..80: pages 3-5
                    (2, 21, 37, 60, 74, 97, 2),  # pages 4-6
                    (2, 37, 40, 60, 90, 100, 1),  # pages 5-6
                    (3, 40, 41, 19, 52, 60, 1)]  # a decode at 59: page 3


def test_gpu_token_rows_find_each_token_in_its_tile() -> None:
    starts = jnp.array([0, 5, 5, 40, 41, 41], jnp.int32)
    rows, live = token_rows(starts, jnp.array([4], jnp.int32), 44, 16)
    tiles = [*range(5), *range(16, 51), 64]  # seq 0: tile 0, seq 2: tiles 1-3, seq 3: tile 4
    assert rows.tolist() == [*tiles, 0, 0, 0] and live.tolist() == [True] * 41 + [False] * 3


# ----------------------------------------------------------------- bad arguments


def _call_args(case: Case) -> dict:
    return {"q": case.q, "k_pool": case.k_pool, "v_pool": case.v_pool, "layer": jnp.int32(1),
            "query_start": case.query_start, "context_lens": case.context_lens,
            "block_tables": case.block_tables, "num_seqs": case.num_seqs,
            "block_size": case.block_size, "scale": case.scale, "window": NO_WINDOW}


def bad_arguments(case: Case) -> dict[str, tuple[dict, str]]:
    """Name -> (arguments to change, what the error must mention)."""
    pool = case.k_pool.shape
    int8_pool = jnp.zeros(pool, jnp.int8)
    return {
        "q-rank": ({"q": case.q[None]}, "q must be"),
        "head-dim": ({"q": case.q[..., :32]}, "hd"),
        "heads": ({"q": case.q[:, :3]}, "multiple of kv heads"),
        "block-size": ({"block_size": 12}, "block_size"),
        "query-start": ({"query_start": case.query_start[:-1]}, "query_start"),
        "context-lens": ({"context_lens": case.context_lens[:-1]}, "context_lens"),
        "num-seqs": ({"num_seqs": case.num_seqs[0]}, "num_seqs"),
        "float-lengths": ({"context_lens": case.context_lens.astype(jnp.float32)}, "integers"),
        "table-rank": ({"block_tables": case.block_tables[0]}, "block_tables"),
        "window": ({"window": 0}, "window"),
        "softcap": ({"softcap": 0.0}, "softcap"),
        "int8-without-scales": ({"k_pool": int8_pool, "v_pool": int8_pool}, "k_scale"),
        "scales-for-float": ({"k_scale": jnp.zeros(pool[:3]), "v_scale": jnp.zeros(pool[:3])},
                             "int8"),
        "scale-shape": ({"k_pool": int8_pool, "v_pool": int8_pool,
                         "k_scale": jnp.zeros(pool[:2]), "v_scale": jnp.zeros(pool[:2])},
                        "L, rows, KV"),
    }


BAD_CASE = make_case([(3, 5), (1, 9), (16, 16)], kv_heads=2, group=2, seed=7)


@pytest.mark.parametrize("fn", [ragged_paged_attention_reference, ragged_paged_attention_tpu,
                                ragged_paged_attention_gpu], ids=["reference", "tpu", "gpu"])
@pytest.mark.parametrize("name", bad_arguments(BAD_CASE))
def test_rejects_bad_arguments(name: str, fn) -> None:
    change, message = bad_arguments(BAD_CASE)[name]
    with pytest.raises(ValueError, match=message):
        fn(**{**_call_args(BAD_CASE), **change})


@pytest.mark.parametrize("fn", [ragged_paged_attention_tpu, ragged_paged_attention_gpu],
                         ids=["tpu", "gpu"])
@pytest.mark.parametrize("option", ["pages_per_step", "query_block"])
def test_kernel_rejects_bad_options(option: str, fn) -> None:
    with pytest.raises(ValueError, match=option):
        fn(**_call_args(BAD_CASE), **{option: 0}, interpret=True)


@pytest.mark.parametrize(("change", "interpret", "message"), [
    ({"query_block": 24}, True, "query_block must be a power of two"),
    ({"block_size": 8}, False, "block_size must be >= 16 on GPU"),
    ({"q": BAD_CASE.q[..., :48], "k_pool": BAD_CASE.k_pool[..., :48],
      "v_pool": BAD_CASE.v_pool[..., :48]}, True, "head_dim must be a power of two"),
], ids=["query-block", "gpu-block-size", "head-dim"])
def test_gpu_rejects_tiles_triton_cannot_take(change: dict, interpret: bool, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ragged_paged_attention_gpu(**{**_call_args(BAD_CASE), **change}, interpret=interpret)


@pytest.mark.parametrize("int8", [False, True], ids=["bf16", "int8"])
def test_lowers_through_mosaic(int8: bool) -> None:
    """The kernel stays inside what Pallas' Mosaic lowering supports (no TPU needed;
    Mosaic's own layout checks run only when a TPU compiles it)."""
    case = make_case(MID_BLOCK, kv_heads=2, head_dim=128, block_size=32, dtype=jnp.bfloat16,
                     int8=int8, seed=9)
    attend_tpu = jax.jit(lambda q, k, v, metadata, scales, window: ragged_paged_attention_tpu(
        q, k, v, jnp.int32(LAYER), *metadata, block_size=32, scale=case.scale, window=window,
        softcap=30.0, query_block=16, pages_per_step=4, **scales))
    lowered = attend_tpu.trace(case.q, case.k_pool, case.v_pool, case.metadata, case.scales(),
                               jnp.int32(512)).lower(lowering_platforms=("tpu",))
    assert "tpu_custom_call" in lowered.as_text()


@pytest.mark.parametrize(("dtype", "int8"), [(jnp.bfloat16, False), (jnp.float32, True)],
                         ids=["bf16", "f32-int8"])
def test_gpu_lowers_to_triton(dtype, int8: bool) -> None:
    """The GPU kernel lowers (Pallas -> Triton IR) without a GPU attached."""
    case = make_case(MID_BLOCK, kv_heads=2, head_dim=128, dtype=dtype, int8=int8, seed=9)
    attend_gpu = jax.jit(lambda q, k, v, metadata, scales, window: ragged_paged_attention_gpu(
        q, k, v, jnp.int32(LAYER), *metadata, block_size=16, scale=case.scale, window=window,
        softcap=30.0, **scales))
    lowered = attend_gpu.trace(case.q, case.k_pool, case.v_pool, case.metadata, case.scales(),
                               jnp.int32(512)).lower(lowering_platforms=("cuda",))
    assert "__gpu$xla.gpu.triton" in lowered.as_text()
