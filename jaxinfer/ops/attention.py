"""Attention entry points: the XLA reference or a Pallas kernel, chosen by config.

`attention_impl`:
- `xla`: the plain-jnp reference (pallas_kernels/reference.py), the CPU default;
- `pallas`: the Pallas kernels compiled for the default backend, chosen when
  the step is built: the ragged Mosaic kernel on TPU, the Triton kernels
  (flash prefill, paged decode) on GPU; on any other backend a ConfigError
  that points at the interpreted choices;
- `pallas-interpret`: the GPU (Triton) kernels under the Pallas interpreter;
- `pallas-tpu-interpret`: the ragged TPU (Mosaic) kernel under the TPU interpreter.

Every implementation takes the model's `AttentionMetadata` (jaxinfer/ops/types.py)
and hands the kernels the plain arrays they read (positions, block tables,
context lengths), so the kernels depend on no jaxinfer type. The ragged TPU
kernel reads the flat step layout; until the runner builds flat steps,
`ragged_tpu_attention` adapts the batched rows to it (see there).

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
import jax.numpy as jnp

from jaxinfer.choices import ATTENTION_IMPLS, KV_CACHE_DTYPES, check_choice
from jaxinfer.errors import ConfigError
from jaxinfer.ops.int8 import quantize_int8
from jaxinfer.ops.types import AttentionMetadata
from pallas_kernels.reference import paged_attention_reference

# (q, k_pool, v_pool, layer, meta, *, block_size, scale, window, softcap, k_scale, v_scale)
AttentionFn = Callable[..., jax.Array]

__all__ = ["ATTENTION_IMPLS", "KV_CACHE_DTYPES", "AttentionFn", "check_attention_impl",
           "check_kv_cache_dtype", "get_attention_fn", "ragged_tpu_attention", "write_kv",
           "write_kv_int8", "xla_attention"]


def check_attention_impl(impl: str) -> None:
    """Raise ConfigError unless `impl` names an attention implementation."""
    check_choice("attention_impl", impl, ATTENTION_IMPLS)


def check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    """Raise ConfigError unless `kv_cache_dtype` names a KV cache storage type."""
    check_choice("kv_cache_dtype", kv_cache_dtype, KV_CACHE_DTYPES)


def get_attention_fn(impl: str, backend: str | None = None) -> AttentionFn:
    """The attention function for `impl`; all take the step's `AttentionMetadata`.

    `pallas` resolves on `backend` (default: JAX's default backend, read now), so
    a runner learns at construction that its platform has no compiled kernels.
    """
    check_attention_impl(impl)
    if impl == "pallas":
        return _compiled_pallas(backend or jax.default_backend())
    interpreted = {
        "pallas-interpret": partial(_pallas_attention, interpret=True),
        "pallas-tpu-interpret": partial(ragged_tpu_attention, interpret=True),
    }
    return interpreted.get(impl, xla_attention)


def _compiled_pallas(backend: str) -> AttentionFn:
    """`pallas` on `backend`: the kernels written for it, or a ConfigError where there are none."""
    if backend == "tpu":
        return partial(ragged_tpu_attention, interpret=False)
    if backend == "gpu":
        return partial(_pallas_attention, interpret=False)
    raise ConfigError(
        f"attention_impl 'pallas' compiles kernels for TPU (Mosaic) or GPU (Triton), but the "
        f"default JAX backend is {backend!r}: use 'xla', or run the kernels under an "
        f"interpreter with 'pallas-interpret' (GPU kernels) or 'pallas-tpu-interpret' "
        f"(TPU kernel)"
    )


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


def ragged_tpu_attention(
    q: jax.Array,  # [B, T, H, hd]
    k_pool: jax.Array,  # [L, rows, KV, hd]
    v_pool: jax.Array,  # [L, rows, KV, hd]
    layer: jax.Array,
    meta: AttentionMetadata,
    *,
    interpret: bool,
    **options: object,
) -> jax.Array:
    """The batched step through the ragged TPU kernel -> [B, T, H, hd] (padding tokens 0).

    A bridge that goes away when the runner builds flat steps: the kernel wants
    every sequence's queries back to back, while a batched row holds its n
    queries first and padding after. The runner puts them at positions
    context_lens - n .. context_lens - 1 (prompt chunks after any cached prefix
    and decodes with T = 1 alike; padding rows have context_lens 0), so
    n = context_lens - positions[:, 0], clamped to [0, min(T, context_lens)] (a
    row without context has no queries, whatever its positions). One gather packs the
    [B*T] tokens flat (padding at the end), another takes the outputs back.
    """
    from pallas_kernels.ragged_tpu import ragged_paged_attention_tpu

    b, t, h, hd = q.shape
    context = meta.context_lens.astype(jnp.int32)  # [B]
    lens = jnp.clip(context - meta.positions[:, 0], 0, jnp.minimum(context, t))  # [B]
    query_start = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(lens, dtype=jnp.int32)])
    flat_q = q.reshape(b * t, h, hd)[_flat_sources(query_start, t)]  # [B*T, H, hd]
    flat_out = ragged_paged_attention_tpu(
        flat_q, k_pool, v_pool, layer, query_start, context, meta.block_tables,
        jnp.full((1,), b, jnp.int32), interpret=interpret, **options)  # [B*T, H, hd]
    token = jnp.arange(t, dtype=jnp.int32)
    valid = token[None, :] < lens[:, None]  # [B, T]
    out = flat_out[jnp.where(valid, query_start[:-1, None] + token, 0)]  # [B, T, H, hd]
    return jnp.where(valid[..., None, None], out, 0)


def _flat_sources(query_start: jax.Array, t: int) -> jax.Array:
    """[B*T] row-major batched index of each flat token (0 for the padding at the end).

    query_start: [B + 1] cumulative query lengths of the B rows of T tokens.
    """
    rows = query_start.shape[0] - 1
    flat = jnp.arange(rows * t, dtype=jnp.int32)
    row = jnp.searchsorted(query_start[1:], flat, side="right")  # first row ending after it
    clamped = jnp.minimum(row, rows - 1)
    return jnp.where(row < rows, clamped * t + flat - query_start[clamped], 0)


def _kernel_arrays(meta: AttentionMetadata) -> tuple[jax.Array, jax.Array, jax.Array]:
    """What attention reads of the metadata, in the kernels' argument order.

    The KV write rows are left out: they belong to the KV write (`write_kv`).
    """
    return meta.positions, meta.block_tables, meta.context_lens


def write_kv(
    pool: jax.Array, layer: jax.Array, new: jax.Array, kv_rows: jax.Array
) -> jax.Array:
    """Scatter new [B, T, KV, ...] into pool [L, rows, KV, ...] at `layer`.

    Padding tokens carry out-of-range KV rows and are dropped.
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
