"""Attention entry points: the XLA reference or a Pallas kernel, chosen by config.

Every implementation takes the flat step layout (jaxinfer/ops/types.py): the
step's query tokens back to back, q [T, H, hd], and per-sequence query starts,
context lengths and block tables.

`attention_impl`:
- `xla`: the plain-jnp ragged reference (pallas_kernels/ragged_reference.py),
  the CPU default;
- `pallas`: the Pallas kernel compiled for the default backend, chosen when
  the step is built: the ragged Mosaic kernel on TPU, the ragged Triton kernel
  on GPU; on any other backend a ConfigError that points at the interpreted
  choices;
- `pallas-interpret`: the GPU (Triton) kernel under the Pallas interpreter;
- `pallas-tpu-interpret`: the TPU (Mosaic) kernel under the TPU interpreter.

`jaxinfer.ops.attention` hands the kernels the plain arrays they read, so they
depend on no jaxinfer type.

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
from jaxinfer.errors import ConfigError
from jaxinfer.ops.int8 import quantize_int8
from jaxinfer.ops.types import AttentionMetadata
from pallas_kernels.ragged_reference import ragged_paged_attention_reference

# (q, k_pool, v_pool, layer, meta, *, block_size, scale, window, softcap, k_scale, v_scale)
AttentionFn = Callable[..., jax.Array]

__all__ = ["ATTENTION_IMPLS", "KV_CACHE_DTYPES", "AttentionFn", "check_attention_impl",
           "check_kv_cache_dtype", "get_attention_fn", "gpu_attention", "tpu_attention",
           "write_kv", "write_kv_int8", "xla_attention"]


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
        "pallas-interpret": partial(gpu_attention, interpret=True),
        "pallas-tpu-interpret": partial(tpu_attention, interpret=True),
    }
    return interpreted.get(impl, xla_attention)


def _compiled_pallas(backend: str) -> AttentionFn:
    """`pallas` on `backend`: the kernels written for it, or a ConfigError where there are none."""
    if backend == "tpu":
        return partial(tpu_attention, interpret=False)
    if backend == "gpu":
        return partial(gpu_attention, interpret=False)
    raise ConfigError(
        f"attention_impl 'pallas' compiles kernels for TPU (Mosaic) or GPU (Triton), but the "
        f"default JAX backend is {backend!r}: use 'xla', or run the kernels under an "
        f"interpreter with 'pallas-interpret' (GPU kernel) or 'pallas-tpu-interpret' "
        f"(TPU kernel)"
    )


def xla_attention(
    q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, layer: jax.Array,
    meta: AttentionMetadata, **options: object,
) -> jax.Array:
    """The `xla` implementation: the jnp ragged reference on the step's metadata."""
    return ragged_paged_attention_reference(q, k_pool, v_pool, layer, *_kernel_arrays(meta),
                                            **options)


def gpu_attention(
    q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, layer: jax.Array,
    meta: AttentionMetadata, *, interpret: bool, **options: object,
) -> jax.Array:
    """The ragged Triton kernel (GPU), compiled or under the Pallas interpreter."""
    from pallas_kernels.ragged_gpu import ragged_paged_attention_gpu

    return ragged_paged_attention_gpu(q, k_pool, v_pool, layer, *_kernel_arrays(meta),
                                      interpret=interpret, **options)


def tpu_attention(
    q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, layer: jax.Array,
    meta: AttentionMetadata, *, interpret: bool, **options: object,
) -> jax.Array:
    """The ragged Mosaic kernel (TPU), compiled or under the TPU interpreter."""
    from pallas_kernels.ragged_tpu import ragged_paged_attention_tpu

    return ragged_paged_attention_tpu(q, k_pool, v_pool, layer, *_kernel_arrays(meta),
                                      interpret=interpret, **options)


def _kernel_arrays(
    meta: AttentionMetadata,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """What attention reads of the metadata, in the kernels' argument order.

    Positions and KV write rows are left out: a token's position follows from
    its sequence's context length, and the rows belong to the KV write (`write_kv`).
    """
    return meta.query_start, meta.context_lens, meta.block_tables, meta.num_seqs


def write_kv(
    pool: jax.Array, layer: jax.Array, new: jax.Array, kv_rows: jax.Array
) -> jax.Array:
    """Scatter new [T, KV, ...] into pool [L, rows, KV, ...] at `layer`.

    Padding tokens carry out-of-range KV rows and are dropped.
    """
    rows = kv_rows.reshape(-1)
    values = new.reshape(-1, *pool.shape[2:]).astype(pool.dtype)
    return pool.at[layer, rows].set(values, mode="drop")


def write_kv_int8(
    pool: jax.Array,  # [L, rows, KV, hd] int8
    scales: jax.Array,  # [L, rows, KV] f32
    layer: jax.Array,
    new: jax.Array,  # [T, KV, hd]
    kv_rows: jax.Array,  # [T]
) -> tuple[jax.Array, jax.Array]:
    """Quantize new K or V per token and head, then scatter values and scales like `write_kv`."""
    values, scale = quantize_int8(new)  # [T, KV, hd] int8, [T, KV] f32
    return write_kv(pool, layer, values, kv_rows), write_kv(scales, layer, scale, kv_rows)
