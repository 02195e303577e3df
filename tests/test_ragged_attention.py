"""Ragged paged attention: the jnp reference and the TPU kernel (TPU interpreter).

The reference is checked against a float64 dense oracle, the kernel against
both, on the same cases.

Each case lays out sequences (query length, context length) back to back in a
flat q, with padding tokens at the end and padding sequences after the live
ones. Every live sequence's K/V go into layer 1 of a pool through a shuffled,
non-contiguous block table (unused table entries name random blocks); every
other row (layer 0, unowned blocks, tails past a context) is noise, or NaN in
the poisoned cases, where the table entries of pages no query reads (wholly
outside the window, past the context, padding sequences) name blocks past the
end of the pool, so a kernel copying one fails the interpreter's bounds check.
The oracle reads each sequence's K/V back from the exact
rows the builder wrote, in float64, and shares no code with the reference.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.ops.int8 import dequantize_int8, quantize_int8
from jaxinfer.ops.types import NO_WINDOW
from pallas_kernels.ragged_reference import query_tiles, ragged_paged_attention_reference
from pallas_kernels.ragged_tpu import block_sequences, ragged_paged_attention_tpu

LAYERS = 2
LAYER = 1  # layer 0 is noise: reading it fails the comparison
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}
STATIC = ("block_size", "scale", "softcap")

KERNEL_OPTIONS = {"query_block": 8, "pages_per_step": 2}  # blocks cross sequences, 2+ chunks

_reference = jax.jit(ragged_paged_attention_reference, static_argnames=STATIC)
_tpu = jax.jit(functools.partial(ragged_paged_attention_tpu, interpret=True),
               static_argnames=(*STATIC, "pages_per_step", "query_block"))


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


def attend(fn, case: Case, window: int, softcap: float | None = None, **options) -> np.ndarray:
    out = fn(case.q, case.k_pool, case.v_pool, jnp.int32(LAYER), *case.metadata,
             block_size=case.block_size, scale=case.scale, window=jnp.int32(window),
             softcap=softcap, **case.scales(), **options)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    return np.asarray(out.astype(jnp.float32), np.float64)


def assert_matches(case: Case, window: int, softcap: float | None = None,
                   **kernel_options) -> np.ndarray:
    """Reference == float64 oracle, kernel == reference and oracle; padding tokens exactly 0.

    Returns the kernel's output.
    """
    tol = TOL[case.q.dtype.type]
    oracle = dense_attention(case, window, softcap)
    want = attend(_reference, case, window, softcap)
    np.testing.assert_allclose(want, oracle, atol=tol, rtol=0)
    got = attend(_tpu, case, window, softcap, **{**KERNEL_OPTIONS, **kernel_options})
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
def test_decodes_beside_a_long_chunk(window: int) -> None:
    case = make_case(MIXED, head_dim=128, seed=1)
    assert_matches(case, window, query_block=64, pages_per_step=8)


def test_chunks_after_cached_prefix() -> None:
    assert_matches(make_case(MID_BLOCK, kv_heads=2, seed=2), NO_WINDOW)


@pytest.mark.parametrize("window", [1, 8, 40, 41, 100], ids=lambda w: f"w{w}")
def test_windows(window: int) -> None:
    assert_matches(make_case(WINDOWED, seed=3), window)  # 40: sequence 0's whole context


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(("group", "kv_heads", "head_dim"),
                         [(1, 2, 64), (4, 1, 256), (8, 2, 128)],
                         ids=["mha-hd64", "gqa4-mqa-hd256", "gqa8-hd128"])
def test_gqa_and_head_dims(group: int, kv_heads: int, head_dim: int, dtype) -> None:
    case = make_case(MID_BLOCK, kv_heads=kv_heads, group=group, head_dim=head_dim,
                     dtype=dtype, seed=group)
    assert_matches(case, NO_WINDOW)


def test_every_sequence_slot_live() -> None:
    """num_seqs == S: the kernel's walk ends on the last slot without reading past it."""
    assert_matches(make_case(MID_BLOCK, pad_seqs=0, seed=9), NO_WINDOW)


def test_softcap() -> None:
    case = make_case(WINDOWED, seed=4)
    assert np.abs(dense_attention(case, NO_WINDOW, 2.0)
                  - dense_attention(case, NO_WINDOW)).max() > 1e-2  # the cap matters
    assert_matches(case, NO_WINDOW, softcap=2.0)


@pytest.mark.parametrize("window", [NO_WINDOW, 16], ids=["global", "w16"])
def test_int8(window: int) -> None:
    assert_matches(make_case(MID_BLOCK, kv_heads=2, int8=True, seed=5), window, softcap=30.0)


@pytest.mark.parametrize("int8", [False, True], ids=["float", "int8"])
def test_unread_pages_are_never_copied_and_nan_never_leaks(int8: bool) -> None:
    window = 8
    clean = make_case(WINDOWED, int8=int8, seed=6)
    poisoned = make_case(WINDOWED, int8=int8, poison_window=window, seed=6)
    got = assert_matches(poisoned, window)
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got, attend(_tpu, clean, window, **KERNEL_OPTIONS))
    np.testing.assert_array_equal(attend(_reference, poisoned, window),
                                  attend(_reference, clean, window))


@pytest.mark.parametrize(("query_block", "pages_per_step"), [(1, 1), (16, 3), (64, 8)])
def test_kernel_block_sizes(query_block: int, pages_per_step: int) -> None:
    """One query row per block, blocks spanning several sequences, one chunk per sequence."""
    case = make_case(MID_BLOCK, kv_heads=2, pad_tokens=6, seed=8)  # T = 48: no padding to 16
    assert_matches(case, 16, query_block=query_block, pages_per_step=pages_per_step)


def test_block_sequences() -> None:
    starts = jnp.array([0, 5, 5, 40, 41, 41], jnp.int32)  # an empty live sequence, then padding
    first, end = block_sequences(starts, jnp.array([4], jnp.int32), 4, 16)
    assert first.tolist() == [0, 2, 2, 4] and end.tolist() == [3, 3, 4, 4]


def test_query_tiles_cover_each_sequence_once() -> None:
    starts = jnp.array([0, 5, 5, 40, 41, 41], jnp.int32)  # an empty live sequence, then padding
    seq, start, valid = query_tiles(starts, jnp.array([4], jnp.int32), 44, 16)
    tiles = [(int(s), int(b)) for s, b, ok in zip(seq, start, valid, strict=True) if ok]
    assert tiles == [(0, 0), (2, 5), (2, 21), (2, 37), (3, 40)]


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


@pytest.mark.parametrize("fn", [ragged_paged_attention_reference, ragged_paged_attention_tpu],
                         ids=["reference", "tpu"])
@pytest.mark.parametrize("name", bad_arguments(BAD_CASE))
def test_rejects_bad_arguments(name: str, fn) -> None:
    change, message = bad_arguments(BAD_CASE)[name]
    with pytest.raises(ValueError, match=message):
        fn(**{**_call_args(BAD_CASE), **change})


@pytest.mark.parametrize("option", ["pages_per_step", "query_block"])
def test_kernel_rejects_bad_options(option: str) -> None:
    with pytest.raises(ValueError, match=option):
        ragged_paged_attention_tpu(**_call_args(BAD_CASE), **{option: 0}, interpret=True)


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
