"""The ('data', 'model') device mesh of an engine."""

from __future__ import annotations

import jax
from jax.sharding import AxisType, Mesh

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
    return jax.make_mesh((data_parallel_size, tensor_parallel_size), MESH_AXES,
                         axis_types=(AxisType.Auto, AxisType.Auto), devices=devices[:needed])


def model_shards(mesh: Mesh) -> int:
    """How many ways the model is split (the 'model' axis size)."""
    return mesh.shape["model"]
