"""Runs tests/mesh (tensor parallelism on 8 CPU devices) in its own process.

XLA fixes the number of CPU devices when JAX starts, and this process has one;
the mesh suite gets eight through XLA_FLAGS in a fresh interpreter.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

MESH_SUITE = Path(__file__).parent / "mesh"
TIMEOUT_S = 1500


def run_mesh_suite(marker: str) -> None:
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
           "JAXINFER_MESH_SUITE": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", marker,
         str(MESH_SUITE)],
        env=env, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    assert run.returncode == 0, run.stdout[-8000:] + run.stderr[-4000:]
    assert " passed" in run.stdout.splitlines()[-1], run.stdout[-2000:]


def test_mesh_suite_tiny_models() -> None:
    run_mesh_suite("not real_model")


@pytest.mark.real_model
def test_mesh_suite_real_model() -> None:
    run_mesh_suite("real_model")
