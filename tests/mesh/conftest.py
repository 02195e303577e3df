"""The mesh suite: tests that need 8 devices, run as 8 CPU devices.

XLA reads `--xla_force_host_platform_device_count` when JAX first starts, so
these tests run in their own pytest process: tests/test_mesh.py starts it with
the flag set (run it alone the same way: `XLA_FLAGS=--xla_force_host_platform_device_count=8
JAXINFER_MESH_SUITE=1 python -m pytest tests/mesh`).
"""

from __future__ import annotations

import jax
import pytest

DEVICES = 8


def pytest_configure(config: pytest.Config) -> None:
    if jax.device_count() < DEVICES:
        raise pytest.UsageError(
            f"the mesh suite needs {DEVICES} devices, JAX sees {jax.device_count()}: set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={DEVICES}")
