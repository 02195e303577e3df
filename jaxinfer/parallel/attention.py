"""Attention per tensor-parallel shard: each device attends with its own heads.

Under the Megatron layout a shard holds H / TP query heads and the KV heads
they read, so attention needs no communication. `shard_by_heads` runs any
attention implementation under `shard_map` over 'model': the function sees
q [T, H / TP, hd] and pools [L, rows, KV / TP, hd], exactly the single-device
contract, which is what the Pallas kernels (custom calls GSPMD cannot split)
need. The step's metadata is replicated.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxinfer.ops.attention import AttentionFn
from jaxinfer.ops.types import AttentionMetadata
from jaxinfer.parallel.mesh import shard_map_over_model

HEADS = P(None, "model", None)  # q and the output [T, H, hd]
POOL = P(None, None, "model", None)  # K/V pools [L, rows, KV, hd]
POOL_SCALES = P(None, None, "model")  # int8 scales [L, rows, KV]


def shard_by_heads(attention_fn: AttentionFn, mesh: Mesh) -> AttentionFn:
    """`attention_fn` run per 'model' shard on its heads (same signature)."""

    def sharded(
        q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, layer: jax.Array,
        meta: AttentionMetadata, *, window: jax.Array | int,
        k_scale: jax.Array | None = None, v_scale: jax.Array | None = None,
        **options: object,
    ) -> jax.Array:
        scales = () if k_scale is None else (k_scale, v_scale)

        def local(q, k_pool, v_pool, layer, meta, window, *scales):
            k_s, v_s = scales or (None, None)
            return attention_fn(q, k_pool, v_pool, layer, meta, window=window,
                                k_scale=k_s, v_scale=v_s, **options)

        specs = (HEADS, POOL, POOL, P(), P(), P(), *[POOL_SCALES] * len(scales))
        return shard_map_over_model(local, mesh, specs, HEADS)(
            q, k_pool, v_pool, layer, meta, jnp.asarray(window, jnp.int32), *scales)

    return sharded
