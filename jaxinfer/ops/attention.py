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

import jax

from pallas_kernels.reference import NO_WINDOW, AttentionMetadata, paged_attention_reference

ATTENTION_IMPLS = ("xla",)

__all__ = ["ATTENTION_IMPLS", "NO_WINDOW", "AttentionMetadata", "paged_attention_reference",
           "write_kv"]


def write_kv(
    pool: jax.Array, layer: jax.Array, new: jax.Array, slot_mapping: jax.Array
) -> jax.Array:
    """Scatter new [B, T, KV, hd] into pool [L, rows, KV, hd] at `layer`.

    Padding tokens carry out-of-range slots and are dropped.
    """
    rows = slot_mapping.reshape(-1)
    values = new.reshape(-1, *new.shape[2:]).astype(pool.dtype)
    return pool.at[layer, rows].set(values, mode="drop")
