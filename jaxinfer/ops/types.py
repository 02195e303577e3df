"""Core types of the attention step, shared by the model, the runner and the attention entry.

Kernels in `pallas_kernels/` never see these: `jaxinfer.ops.attention` unpacks
`AttentionMetadata` into the plain arrays a kernel reads.
"""

from __future__ import annotations

import jax
from flax import struct

NO_WINDOW = 1 << 30  # "window" of a global layer: larger than any context


@struct.dataclass
class AttentionMetadata:
    """Where a flat step's tokens sit in their sequences and in the KV pool.

    The step's T query tokens are every scheduled sequence's tokens back to back:
    sequence s owns tokens [query_start[s], query_start[s + 1]), at positions
    context_lens[s] - (its query length) onwards. Sequences s >= num_seqs are
    padding (no tokens, context 0), as are tokens past query_start[num_seqs].
    """

    positions: jax.Array  # [T] int32, absolute position of each query token
    kv_rows: jax.Array  # [T] int32, pool row for each new token (>= pool size: padding)
    query_start: jax.Array  # [S + 1] int32, cumulative query offsets into the tokens
    context_lens: jax.Array  # [S] int32, tokens in the cache after this step
    block_tables: jax.Array  # [S, W] int32, physical block of each logical block
    num_seqs: jax.Array  # [1] int32, sequences in use (the rest are padding)
