"""Attention entry points: the XLA reference or a Pallas kernel, chosen by config.

`attention_impl`:
- `xla`: the plain-jnp reference (pallas_kernels/reference.py), the CPU default;
- `pallas`: the Pallas kernels compiled for the backend (Triton on NVIDIA GPUs);
- `pallas-interpret`: the same kernels run by the Pallas interpreter (CPU tests).

New K/V are written into the pool with an XLA scatter (`write_kv`) for every
implementation: it updates the donated pool in place, touches only the written
rows, and XLA fuses it with the K/V projection; a kernel would buy nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import jax

from jaxinfer.errors import ConfigError
from pallas_kernels.reference import NO_WINDOW, AttentionMetadata, paged_attention_reference

ATTENTION_IMPLS = ("xla", "pallas", "pallas-interpret")

AttentionFn = Callable[..., jax.Array]

__all__ = ["ATTENTION_IMPLS", "NO_WINDOW", "AttentionFn", "AttentionMetadata",
           "check_attention_impl", "get_attention_fn", "paged_attention_reference", "write_kv"]


def check_attention_impl(impl: str) -> None:
    """Raise ConfigError unless `impl` names an attention implementation."""
    if impl not in ATTENTION_IMPLS:
        raise ConfigError(
            f"attention_impl must be one of {', '.join(ATTENTION_IMPLS)}, got {impl!r}"
        )


def get_attention_fn(impl: str) -> AttentionFn:
    """The attention function for `impl`, all with the reference's signature."""
    if impl == "xla":
        return paged_attention_reference
    check_attention_impl(impl)
    return partial(_pallas_attention, interpret=impl == "pallas-interpret")


def _pallas_attention(q: jax.Array, *args: object, interpret: bool, **kwargs: object) -> jax.Array:
    """Decode steps (one query per row) take the paged decode kernel, prefill the flash one."""
    from pallas_kernels.flash_prefill import flash_prefill_attention
    from pallas_kernels.paged_decode import paged_decode_attention

    kernel = paged_decode_attention if q.shape[1] == 1 else flash_prefill_attention
    return kernel(q, *args, interpret=interpret, **kwargs)


def write_kv(
    pool: jax.Array, layer: jax.Array, new: jax.Array, slot_mapping: jax.Array
) -> jax.Array:
    """Scatter new [B, T, KV, hd] into pool [L, rows, KV, hd] at `layer`.

    Padding tokens carry out-of-range slots and are dropped.
    """
    rows = slot_mapping.reshape(-1)
    values = new.reshape(-1, *new.shape[2:]).astype(pool.dtype)
    return pool.at[layer, rows].set(values, mode="drop")
