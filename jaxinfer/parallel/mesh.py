"""The ('data', 'model') device mesh of an engine."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import AxisType, Mesh, get_abstract_mesh

from jaxinfer.errors import ConfigError

MESH_AXES = ("data", "model")


def make_mesh(tensor_parallel_size: int, data_parallel_size: int = 1) -> Mesh:
    """A mesh of data_parallel_size x tensor_parallel_size devices, Auto axes.

    Auto axis types let plain matmuls over a sharded contracting dimension stay
    legal (GSPMD inserts the reduction); jax.make_mesh defaults to Explicit.
    """
    needed = tensor_parallel_size * data_parallel_size
    devices = jax.devices()
    if needed > len(devices):
        raise ConfigError(
            f"tensor_parallel_size x data_parallel_size = {needed} devices, but JAX sees "
            f"{len(devices)} ({devices[0].platform}); on CPU start the process with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={needed}"
        )
    if jax.process_count() > 1 and needed != len(devices):
        raise ConfigError(
            f"a job of {jax.process_count()} processes has {len(devices)} devices: "
            f"tensor_parallel_size x data_parallel_size must use them all, got {needed}")
    return jax.make_mesh((data_parallel_size, tensor_parallel_size), MESH_AXES,
                         axis_types=(AxisType.Auto, AxisType.Auto), devices=devices[:needed])


def split_mesh(tensor_parallel_size: int, data_parallel_size: int = 1) -> Mesh | None:
    """The engine's mesh when the model is split over devices (weights made on it
    are made split), else None."""
    return make_mesh(tensor_parallel_size, data_parallel_size) if tensor_parallel_size > 1 \
        else None


def model_shards(mesh: Mesh) -> int:
    """How many ways the model is split (the 'model' axis size)."""
    return mesh.shape["model"]


def shard_map_over_model(f: Callable[..., Any], mesh: Mesh, in_specs: Any,
                         out_specs: Any) -> Callable[..., Any]:
    """`f` per 'model' shard, with every mesh axis manual (the TPU interpreter's
    callbacks need that): at top level all of them ('data' replicated by the specs),
    inside a data-parallel rank's shard_map, where 'data' is manual already, 'model'
    of the traced context mesh."""
    current = get_abstract_mesh()
    if current.empty:
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                             check_vma=False)
    return jax.shard_map(f, mesh=current, in_specs=in_specs, out_specs=out_specs,
                         axis_names={"model"}, check_vma=False)
