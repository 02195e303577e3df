"""Random paged-attention inputs, built one way for every kernel test and scripts/gpu_check.py.

Each sequence's K/V live in layer `LAYER` of a `LAYERS`-layer pool behind a
shuffled block table: physical blocks are permuted, spare blocks sit between
used ones, and everything else (layer 0, table entries past the context, spare
blocks) holds noise, so reading a wrong block, layer or row fails a comparison.
Query positions run up to context_len - 1; query slots past a row's real
length hold garbage positions the kernels must ignore. `k_seq` / `v_seq` keep
each sequence's K/V contiguous in float64 (rounded to the pool's dtype) for
dense oracles that share no gather code with the kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.ops.int8 import quantize_int8

LAYERS = 2
LAYER = 1  # the layer holding the sequences: reading layer 0 (noise) fails the comparison


def shuffled_block_tables(
    rng: np.random.Generator, rows: int, blocks_per_row: int, spare_blocks: int
) -> tuple[np.ndarray, int]:
    """Distinct physical blocks in random order -> (tables [rows, blocks_per_row] int32,
    number of blocks in the pool); the spare blocks end up unused between used ones."""
    num_blocks = rows * blocks_per_row + spare_blocks
    tables = rng.permutation(num_blocks)[: rows * blocks_per_row].reshape(rows, blocks_per_row)
    return tables.astype(np.int32), num_blocks


@dataclass(frozen=True)
class PagedInputs:
    q: jax.Array  # [B, T, H, hd]
    k_pool: jax.Array  # [LAYERS, num_blocks * block_size, KV, hd]
    v_pool: jax.Array  # [LAYERS, num_blocks * block_size, KV, hd]
    positions: jax.Array  # [B, T] int32
    block_tables: jax.Array  # [B, max_blocks] int32
    context_lens: jax.Array  # [B] int32
    q_lens: tuple[int, ...]  # real query slots per row
    k_seq: np.ndarray  # [B, max_blocks * block_size, KV, hd] float64, contiguous
    v_seq: np.ndarray  # [B, max_blocks * block_size, KV, hd] float64
    block_size: int

    @property
    def scale(self) -> float:
        return float(self.q.shape[-1]) ** -0.5

    @property
    def ctx(self) -> np.ndarray:
        """Context lengths on the host, [B]."""
        return np.asarray(self.context_lens)

    @property
    def paging(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The kernels' positions, block tables and context lengths, in argument order."""
        return self.positions, self.block_tables, self.context_lens

    def int8(self) -> dict[str, jax.Array]:
        """The pools quantized (int8 values, float scales), as the kernels' keywords."""
        (k, ks), (v, vs) = quantize_int8(self.k_pool), quantize_int8(self.v_pool)
        return {"k_pool": k, "v_pool": v, "k_scale": ks, "v_scale": vs}


def make_paged_inputs(
    context_lens: list[int], q_lens: list[int] | None = None, *, seq: int | None = None,
    kv_heads: int = 1, group: int = 4, head_dim: int = 64, block_size: int = 16,
    max_blocks: int | None = None, dtype: Any = jnp.float32, spare_blocks: int = 7,
    seed: int = 0,
) -> PagedInputs:
    """Random inputs for B = len(context_lens) rows of `group * kv_heads` query heads.

    `q_lens` defaults to decode (one query per row with a context, none for a
    padding row); `seq` (T, query slots per row) to the longest of them;
    `max_blocks` to what the longest context needs.
    """
    rng = np.random.default_rng(seed)
    ctx = np.asarray(context_lens, np.int32)
    q_lens = [1 if c else 0 for c in context_lens] if q_lens is None else list(q_lens)
    seq = seq or max(1, *q_lens)
    max_blocks = max_blocks or max(1, -(-int(ctx.max()) // block_size))
    tables, num_blocks = shuffled_block_tables(rng, len(ctx), max_blocks, spare_blocks)
    pool_shape = (LAYERS, num_blocks * block_size, kv_heads, head_dim)
    k_pool, v_pool = (_random(rng, pool_shape, dtype) for _ in range(2))
    rows = (tables[:, :, None] * block_size + np.arange(block_size)).reshape(len(ctx), -1)
    q = _random(rng, (len(ctx), seq, kv_heads * group, head_dim), dtype)
    return PagedInputs(
        jnp.asarray(q), jnp.asarray(k_pool), jnp.asarray(v_pool),
        jnp.asarray(_positions(rng, seq, ctx, q_lens)), jnp.asarray(tables), jnp.asarray(ctx),
        tuple(q_lens), k_pool[LAYER][rows].astype(np.float64),
        v_pool[LAYER][rows].astype(np.float64), block_size,
    )


def _random(rng: np.random.Generator, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    return rng.standard_normal(shape, np.float32).astype(dtype)


def _positions(
    rng: np.random.Generator, seq: int, ctx: np.ndarray, q_lens: list[int]
) -> np.ndarray:
    """[B, T] chunk positions ending at context_len - 1; garbage in padding slots."""
    positions = rng.integers(-100, 5000, size=(len(ctx), seq))
    for row, (c, n) in enumerate(zip(ctx, q_lens, strict=True)):
        if not 0 <= n <= min(c, seq):
            raise ValueError(f"q_lens[{row}] must be in [0, min(context, seq)], got {n}")
        positions[row, :n] = np.arange(c - n, c)
    return positions.astype(np.int32)
