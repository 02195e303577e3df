"""Core types of the attention step, shared by the model, the runner and the kernel adapter.

Kernels in `pallas_kernels/` never see these: `jaxinfer.ops.attention` unpacks
`AttentionMetadata` into the plain arrays a kernel reads.
"""

from __future__ import annotations

import jax
from flax import struct

NO_WINDOW = 1 << 30  # "window" of a global layer: larger than any context


@struct.dataclass
class AttentionMetadata:
    """Where the step's tokens sit in their sequences and in the KV pool."""

    positions: jax.Array  # [B, T] int32, absolute position of each query token
    kv_rows: jax.Array  # [B, T] int32, pool row for each new token (>= pool size: padding)
    block_tables: jax.Array  # [B, max_blocks] int32, physical block of each logical block
    context_lens: jax.Array  # [B] int32, tokens in the cache after this step
