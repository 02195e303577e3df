"""Data parallelism: the step runs once per rank of the mesh axis 'data'.

Each rank is a replica of the (possibly tensor-parallel) model serving its own
sequences: its own slice of the KV pool (block ids count from 0 within it), its
own penalty rows, its own flat batch. The host stacks the ranks' batches on a
leading axis of the same bucketed shape, and `per_rank` runs the step under
`shard_map`, manual over 'data' only: inside, a rank sees its batch without the
rank axis and its own pool rows, while 'model' stays with GSPMD. One jitted call
covers the whole mesh.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

RANKS = P("data")  # a leading rank axis: stacked batches, outputs, penalty rows
POOL_ROWS = P(None, "data")  # K/V pools [L, rows, ...]: each rank's rows


def per_rank(step: Callable[..., Any], mesh: Mesh) -> Callable[..., Any]:
    """`step(params, kv, penalties, batch, sampling, **static)` run on every rank at once:
    batch and sampling (and the outputs) gain a leading rank axis; kv pools split by
    rows, penalty rows by rank."""

    def stepped(params: Any, kv: Any, penalties: Any, batch: Any, sampling: Any,
                **static: Any) -> Any:
        def local(params, kv, penalties, batch, sampling):
            batch, sampling = jax.tree.map(lambda x: x[0], (batch, sampling))
            output, kv, penalties = step(params, kv, penalties, batch, sampling, **static)
            return jax.tree.map(lambda x: x[None], output), kv, penalties

        pools = jax.tree.map(lambda _: POOL_ROWS, kv)
        return jax.shard_map(
            local, mesh=mesh, in_specs=(P(), pools, RANKS, RANKS, RANKS),
            out_specs=(RANKS, pools, RANKS), axis_names={"data"}, check_vma=False,
        )(params, kv, penalties, batch, sampling)

    return stepped
