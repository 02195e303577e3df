"""Random weights of the right shapes, for benchmarks without the real checkpoint.

Each value is a hash of its leaf's seed and its own index (uniform, std 0.02),
computed where it is stored: XLA fuses the hash into the write, so making a
leaf needs no temporaries, and on a mesh every device makes only its own shard
of the tensor-parallel layout. A model bigger than one device (or than host
memory twice over) never exists whole, and the values do not depend on the
split: a split model computes what the unsplit one does.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding

from jaxinfer.model.config import ModelConfig
from jaxinfer.model.params import Params, param_shapes
from jaxinfer.parallel.shardings import param_shardings

STD = 0.02
_MASK = 0xFFFFFFFF


def dummy_params(config: ModelConfig, dtype: Any = jnp.float32, seed: int = 0,
                 mesh: Mesh | None = None) -> Params:
    """Uniform matrices of std 0.02 and norms of scale exactly 1; on `mesh`, made split."""
    shapes = param_shapes(config)
    is_shape = lambda x: isinstance(x, tuple)  # noqa: E731
    flat, treedef = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=is_shape)
    shardings: list[NamedSharding | None] = [None] * len(flat)
    if mesh is not None:
        structs = jax.tree.map(lambda shape: jax.ShapeDtypeStruct(shape, dtype), shapes,
                               is_leaf=is_shape)
        shardings = jax.tree.leaves(param_shardings(structs, mesh))
    arrays = []
    for index, ((path, shape), sharding) in enumerate(zip(flat, shardings, strict=True)):
        norm = "norm" in jax.tree_util.keystr(path)
        arrays.append(_make_leaf(
            jnp.uint32(_mix_int(seed * 1_000_003 + index)), shape=shape, dtype=jnp.dtype(dtype),
            fill=1.0 - config.norm_offset if norm else None, sharding=sharding))
    return jax.tree.unflatten(treedef, arrays)


@partial(jax.jit, static_argnames=("shape", "dtype", "fill", "sharding"))
def _make_leaf(word: jax.Array, *, shape: tuple[int, ...], dtype: Any, fill: float | None,
               sharding: NamedSharding | None) -> jax.Array:
    """A norm's constant `fill` (scale exactly 1 under either norm convention), else
    each element's hash of (`word`, its index) as a uniform value of std STD."""
    if fill is not None:
        leaf = jnp.full(shape, fill, dtype)
    else:
        bits = jnp.full(shape, word, jnp.uint32)
        for axis in range(len(shape)):
            bits = _mix(bits ^ lax.broadcasted_iota(jnp.uint32, shape, axis))
        unit = (bits >> 8).astype(jnp.float32) * 2.0**-24  # [0, 1)
        leaf = ((unit - 0.5) * (STD * math.sqrt(12.0))).astype(dtype)
    return leaf if sharding is None else lax.with_sharding_constraint(leaf, sharding)


def _mix(x: jax.Array) -> jax.Array:
    """A 32-bit integer hash (lowbias32): every output bit depends on every input bit."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def _mix_int(x: int) -> int:
    """`_mix` on a Python int (a leaf's seed word)."""
    x &= _MASK
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _MASK
    x ^= x >> 15
    x = (x * 0x846CA68B) & _MASK
    return x ^ (x >> 16)
