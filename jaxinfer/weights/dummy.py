"""Random weights of the right shapes, for benchmarks without the real checkpoint."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxinfer.model.config import ModelConfig
from jaxinfer.model.params import Params, param_shapes


def dummy_params(config: ModelConfig, dtype: Any = jnp.float32, seed: int = 0) -> Params:
    """Normal(0, 0.02) matrices and zero-offset norms, generated on device."""
    shapes = param_shapes(config)
    leaves, treedef = jax.tree.flatten(shapes, is_leaf=lambda x: isinstance(x, tuple))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(
        shapes, is_leaf=lambda x: isinstance(x, tuple))[0]]
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    arrays = [
        _leaf(key, shape, "norm" in path, config, dtype)
        for key, shape, path in zip(keys, leaves, paths, strict=True)
    ]
    return jax.tree.unflatten(treedef, arrays)


def _leaf(key: jax.Array, shape: tuple[int, ...], is_norm: bool, config: ModelConfig,
          dtype: Any) -> jax.Array:
    if is_norm:  # scale exactly 1 under either norm convention
        return jnp.full(shape, 1.0 - config.norm_offset, dtype)
    return (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
