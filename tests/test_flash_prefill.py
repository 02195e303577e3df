"""Flash prefill kernel (Pallas, interpret mode) against the paged reference and dense attention.

Every case holds a contiguous K/V per sequence in a paged pool behind a random
NON-contiguous block table (tests/paged_inputs.py: permuted blocks with unused
ones in between, a second layer of noise), then compares, on real query slots only:
the kernel against `paged_attention_reference`, and the kernel against a dense
causal attention computed here in float64 numpy straight from contiguous K/V.
Shapes are shared between cases so each jitted function compiles a few times.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paged_inputs import LAYER, PagedInputs, make_paged_inputs

from jaxinfer.ops.types import NO_WINDOW
from pallas_kernels.flash_prefill import flash_prefill_attention, reference

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}

_kernel = jax.jit(
    functools.partial(flash_prefill_attention, interpret=True),
    static_argnames=("block_size", "scale", "softcap", "q_tile"),
)
_reference = jax.jit(reference, static_argnames=("block_size", "scale", "softcap"))


@dataclasses.dataclass(frozen=True)
class Shape:
    """Static shapes of one family of cases (one compilation per family)."""

    batch: int
    seq: int  # T: query slots per row
    groups: int  # G = H / KV
    kv_heads: int
    head_dim: int
    max_blocks: int
    dtype: type = jnp.float32
    block_size: int = 16
    spare_blocks: int = 7  # unused pool blocks scattered between the used ones


GEMMA = Shape(batch=2, seq=48, groups=4, kv_heads=1, head_dim=256, max_blocks=4)
GEMMA_BF16 = dataclasses.replace(GEMMA, dtype=jnp.bfloat16)


def make_problem(shape: Shape, context_lens: list[int], q_lens: list[int],
                 seed: int = 0) -> PagedInputs:
    """Random q/K/V of one shape family; K/V in the pool through a shuffled block table."""
    assert len(context_lens) == shape.batch
    return make_paged_inputs(
        context_lens, q_lens, seq=shape.seq, kv_heads=shape.kv_heads, group=shape.groups,
        head_dim=shape.head_dim, block_size=shape.block_size, max_blocks=shape.max_blocks,
        dtype=shape.dtype, spare_blocks=shape.spare_blocks, seed=seed,
    )


def dense_attention(p: PagedInputs, window: int,
                    softcap: float | None = None) -> list[np.ndarray]:
    """Per row [q_len, H, hd]: causal softmax attention over contiguous K/V, float64."""
    hd = p.q.shape[-1]
    g = p.q.shape[2] // p.k_seq.shape[2]
    q_all = np.asarray(p.q.astype(jnp.float32), np.float64)  # [B, T, H, hd]
    outs = []
    for b, n in enumerate(p.q_lens):
        ctx = int(p.ctx[b])
        q = q_all[b, :n].reshape(n, -1, g, hd)  # [n, KV, G, hd]
        k, v = p.k_seq[b, :ctx], p.v_seq[b, :ctx]  # [ctx, KV, hd]
        s = np.einsum("nkgd,ckd->nkgc", q, k) * p.scale
        if softcap is not None:
            s = np.tanh(s / softcap) * softcap
        q_pos = np.arange(ctx - n, ctx)[:, None]
        k_pos = np.arange(ctx)[None, :]
        keep = (k_pos <= q_pos) & (q_pos - k_pos < window)  # [n, ctx]
        s = np.where(keep[:, None, None], s, -np.inf)
        w = np.exp(s - s.max(axis=-1, keepdims=True))
        w /= w.sum(axis=-1, keepdims=True)
        outs.append(np.einsum("nkgc,ckd->nkgd", w, v).reshape(n, -1, hd))
    return outs


def run(fn, p: PagedInputs, window: int, softcap: float | None = None, **kw) -> np.ndarray:
    """Call kernel or reference on a problem; window is traced (no recompiles)."""
    out = fn(p.q, p.k_pool, p.v_pool, jnp.int32(LAYER), *p.paging, block_size=p.block_size,
             scale=p.scale, window=jnp.int32(window), softcap=softcap, **kw)
    assert out.shape == p.q.shape and out.dtype == p.q.dtype
    return np.asarray(out.astype(jnp.float32), np.float64)


def assert_rows_close(got: np.ndarray, want, q_lens: list[int], tol: float, what: str):
    """Max abs error over real query slots only."""
    for b, n in enumerate(q_lens):
        err = float(np.max(np.abs(got[b, :n] - np.asarray(want[b])[:n])))
        assert err <= tol, f"{what}, row {b}: max abs error {err:.3g} > {tol}"


def check(p: PagedInputs, window: int = NO_WINDOW, softcap: float | None = None,
          **kw) -> np.ndarray:
    """Kernel vs reference and vs dense, within the dtype's tolerance."""
    got = run(_kernel, p, window, softcap, **kw)
    tol = TOL[p.q.dtype.type]
    assert_rows_close(got, run(_reference, p, window, softcap), p.q_lens, tol, "vs reference")
    assert_rows_close(got, dense_attention(p, window, softcap), p.q_lens, tol, "vs dense")
    return got


@pytest.mark.parametrize("shape", [GEMMA, GEMMA_BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("length", [16, 17, 32, 33, 48])
def test_lengths_on_and_past_block_boundaries(shape: Shape, length: int):
    """Whole prompts ending exactly on a block boundary (16, 32, 48) or one past it."""
    other = 65 - length  # a chunk after a cached prefix, sharing the pool
    check(make_problem(shape, [length, other], [length, max(1, other // 2)], seed=length))


@pytest.mark.parametrize("shape", [GEMMA, GEMMA_BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("window", [1, 5, 16, 45, 46, 60, NO_WINDOW])
def test_sliding_window(shape: Shape, window: int):
    """Windows smaller than, equal to (45) and larger than the context of row 0."""
    check(make_problem(shape, [45, 61], [45, 40], seed=window), window)


@pytest.mark.parametrize("chunk", [1, 11, 27])
@pytest.mark.parametrize("window", [NO_WINDOW, 20])
def test_chunked_prefill_after_cached_prefix(chunk: int, window: int):
    """Queries start after a cached 37-token prefix (chunked prefill / prefix-cache hit)."""
    check(make_problem(GEMMA, [37 + chunk, 37 + chunk], [chunk, chunk], seed=chunk), window)


@pytest.mark.parametrize("groups", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_gqa_ratios_and_head_dims(groups: int, head_dim: int):
    """G query heads per KV head, two KV heads, a cached prefix and a padded tile."""
    shape = Shape(batch=2, seq=20, groups=groups, kv_heads=2, head_dim=head_dim, max_blocks=3)
    check(make_problem(shape, [37, 12], [20, 12], seed=groups * head_dim), window=30)


@pytest.mark.parametrize("window", [NO_WINDOW, 24])
def test_ragged_batch(window: int):
    """Rows of different lengths, some after a cached prefix, in one batch."""
    shape = Shape(batch=4, seq=40, groups=2, kv_heads=2, head_dim=64, max_blocks=5)
    check(make_problem(shape, [1, 17, 80, 40], [1, 17, 33, 40], seed=3), window)


@pytest.mark.parametrize("window", [NO_WINDOW, 128])
def test_one_and_thousand_token_rows(window: int):
    """A 1-token prompt batched with a 1,000-token prompt."""
    shape = Shape(batch=2, seq=1000, groups=1, kv_heads=1, head_dim=64, max_blocks=63)
    check(make_problem(shape, [1, 1000], [1, 1000], seed=1), window, q_tile=64)


@pytest.mark.parametrize("softcap", [5.0])
def test_softcap(softcap: float):
    check(make_problem(GEMMA, [40, 64], [40, 30], seed=5), 33, softcap)


def test_masked_blocks_are_never_read_and_padding_stays_finite():
    """NaN in every pool block the kernel must skip: outside the window, past the context,
    and unused. Real rows still match dense attention; padding rows are finite, and
    query tiles past a row's real length write zeros."""
    p = make_problem(GEMMA, [64, 20], [16, 3], seed=7)  # row 0: positions 48..63
    window, tables = 10, np.asarray(p.block_tables)
    used = {tables[0, 2], tables[0, 3], tables[1, 0], tables[1, 1]}  # blocks the window needs
    poison = [blk not in used for blk in range(p.k_pool.shape[1] // GEMMA.block_size)]
    rows = np.flatnonzero(np.repeat(poison, GEMMA.block_size))  # pool rows
    p = dataclasses.replace(p, k_pool=p.k_pool.at[LAYER, rows].set(np.nan),
                            v_pool=p.v_pool.at[LAYER, rows].set(np.nan))
    got = run(_kernel, p, window)
    assert np.isfinite(got).all()
    assert_rows_close(got, dense_attention(p, window), p.q_lens, TOL[GEMMA.dtype], "vs dense")
    assert not got[:, 16:].any()  # query tiles with no real query write zeros


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_lowers_to_triton_for_cuda(dtype):
    """The GPU path lowers (Pallas -> Triton IR) without a GPU attached."""
    s = jax.ShapeDtypeStruct
    b, t, pool = 2, 40, (2, 256, 1, 256)
    paging = (s((b, t), jnp.int32), s((b, 6), jnp.int32), s((b,), jnp.int32))
    fn = jax.jit(functools.partial(flash_prefill_attention, block_size=16, scale=0.1))
    traced = fn.trace(
        s((b, t, 4, 256), dtype),
        s(pool, dtype),
        s(pool, dtype),
        s((), jnp.int32),
        *paging,
        window=s((), jnp.int32),
    )
    assert "__gpu$xla.gpu.triton" in traced.lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize(
    ("head_dim", "block_size", "q_tile", "field"),
    [(96, 16, 16, "head_dim"), (64, 12, 16, "block_size"), (64, 16, 24, "q_tile")],
)
def test_rejects_tiles_triton_cannot_take(head_dim, block_size, q_tile, field):
    q = jnp.zeros((1, 4, 2, head_dim))
    pool = jnp.zeros((1, 4 * block_size, 1, head_dim))
    positions, block_tables = jnp.zeros((1, 4), jnp.int32), jnp.zeros((1, 4), jnp.int32)
    with pytest.raises(ValueError, match=field):
        flash_prefill_attention(
            q, pool, pool, 0, positions, block_tables, jnp.ones(1), block_size=block_size,
            scale=1.0, window=8, q_tile=q_tile,
        )
