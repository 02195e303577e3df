"""Attention entry points: the XLA reference or a Pallas kernel, chosen by config.

`attention_impl`:
- `xla`: the plain-jnp reference (pallas_kernels/reference.py), the CPU default;
- `pallas`: the Pallas kernels compiled for the backend (Triton on NVIDIA GPUs);
- `pallas-interpret`: the same kernels run by the Pallas interpreter (CPU tests).

Every implementation takes the model's `AttentionMetadata` (jaxinfer/ops/types.py)
and hands the kernels the plain arrays they read (positions, block tables,
context lengths), so the kernels depend on no jaxinfer type.

New K/V are written into the pool with an XLA scatter (`write_kv`) for every
implementation: it updates the donated pool in place, touches only the written
rows, and XLA fuses it with the K/V projection; a kernel would buy nothing.

`kv_cache_dtype`:
- `auto`: the pool stores K/V in the model's dtype;
- `int8`: int8 values plus one f32 scale per token and KV head
  (`write_kv_int8` quantizes on write by the rule of ops/int8.py; every
  attention implementation takes the scale pools as `k_scale` / `v_scale`),
  about 4x (f32) or 2x (bf16) more tokens in the same memory.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import jax

from jaxinfer.choices import ATTENTION_IMPLS, KV_CACHE_DTYPES, check_choice
from jaxinfer.ops.int8 import quantize_int8
from jaxinfer.ops.types import AttentionMetadata
from pallas_kernels.reference import paged_attention_reference

# (q, k_pool, v_pool, layer, meta, *, block_size, scale, window, softcap, k_scale, v_scale)
AttentionFn = Callable[..., jax.Array]

__all__ = ["ATTENTION_IMPLS", "KV_CACHE_DTYPES", "AttentionFn", "check_attention_impl",
           "check_kv_cache_dtype", "get_attention_fn", "write_kv", "write_kv_int8",
           "xla_attention"]


def check_attention_impl(impl: str) -> None:
    """Raise ConfigError unless `impl` names an attention implementation."""
    check_choice("attention_impl", impl, ATTENTION_IMPLS)


def check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    """Raise ConfigError unless `kv_cache_dtype` names a KV cache storage type."""
    check_choice("kv_cache_dtype", kv_cache_dtype, KV_CACHE_DTYPES)


def get_attention_fn(impl: str) -> AttentionFn:
    """The attention function for `impl`; all take the step's `AttentionMetadata`."""
    if impl == "xla":
        return xla_attention
    check_attention_impl(impl)
    return partial(_pallas_attention, interpret=impl == "pallas-interpret")


def xla_attention(
    q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, layer: jax.Array,
    meta: AttentionMetadata, **options: object,
) -> jax.Array:
    """The `xla` implementation: the jnp reference kernel on the step's metadata."""
    return paged_attention_reference(q, k_pool, v_pool, layer, *_kernel_arrays(meta), **options)


def _pallas_attention(
    q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, layer: jax.Array,
    meta: AttentionMetadata, *, interpret: bool, **options: object,
) -> jax.Array:
    """Decode steps (one query per row) take the paged decode kernel, prefill the flash one."""
    from pallas_kernels.flash_prefill import flash_prefill_attention
    from pallas_kernels.paged_decode import paged_decode_attention

    kernel = paged_decode_attention if q.shape[1] == 1 else flash_prefill_attention
    return kernel(q, k_pool, v_pool, layer, *_kernel_arrays(meta), interpret=interpret, **options)


def _kernel_arrays(meta: AttentionMetadata) -> tuple[jax.Array, jax.Array, jax.Array]:
    """What attention reads of the metadata, in the kernels' argument order.

    The KV write rows are left out: they belong to the KV write (`write_kv`).
    """
    return meta.positions, meta.block_tables, meta.context_lens


def write_kv(
    pool: jax.Array, layer: jax.Array, new: jax.Array, kv_rows: jax.Array
) -> jax.Array:
    """Scatter new [B, T, KV, ...] into pool [L, rows, KV, ...] at `layer`.

    Padding tokens carry out-of-range slots and are dropped.
    """
    rows = kv_rows.reshape(-1)
    values = new.reshape(-1, *new.shape[2:]).astype(pool.dtype)
    return pool.at[layer, rows].set(values, mode="drop")


def write_kv_int8(
    pool: jax.Array,  # [L, rows, KV, hd] int8
    scales: jax.Array,  # [L, rows, KV] f32
    layer: jax.Array,
    new: jax.Array,  # [B, T, KV, hd]
    kv_rows: jax.Array,  # [B, T]
) -> tuple[jax.Array, jax.Array]:
    """Quantize new K or V per token and head, then scatter values and scales like `write_kv`."""
    values, scale = quantize_int8(new)  # [B, T, KV, hd] int8, [B, T, KV] f32
    return write_kv(pool, layer, values, kv_rows), write_kv(scales, layer, scale, kv_rows)
