"""Converted checkpoints: params via orbax, plus the model config and tokenizer.

A checkpoint folder holds `params/` (orbax PyTree), `model_config.json`,
`jaxinfer_checkpoint.json` (format marker) and the tokenizer files. Restoring
reads the arrays directly: no dequantization, so it loads faster than a GGUF.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxinfer.errors import ModelLoadError
from jaxinfer.model.config import ModelConfig
from jaxinfer.model.params import Params, check_param_shapes, param_shapes

MARKER = "jaxinfer_checkpoint.json"
FORMAT_VERSION = 1


def is_checkpoint(path: Path) -> bool:
    return (path / MARKER).is_file()


def save_checkpoint(out: Path, config: ModelConfig, params: Params) -> None:
    """Write params, config and marker into `out` (created; must not hold a checkpoint)."""
    out = Path(out).resolve()
    if (out / "params").exists():
        raise ModelLoadError(f"{out} already holds a checkpoint; remove it or pick another OUT")
    out.mkdir(parents=True, exist_ok=True)
    with ocp.PyTreeCheckpointer() as checkpointer:
        checkpointer.save(out / "params", jax.tree.map(np.asarray, params))
    (out / "model_config.json").write_text(json.dumps(config.to_dict(), indent=1))
    (out / MARKER).write_text(json.dumps({"format_version": FORMAT_VERSION}))


def load_checkpoint(path: Path, dtype: Any = np.float32) -> tuple[ModelConfig, Params]:
    path = Path(path)
    try:
        marker = json.loads((path / MARKER).read_text())
        config = ModelConfig.from_dict(json.loads((path / "model_config.json").read_text()))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path} is not a readable jaxinfer checkpoint: {exc}") from exc
    if marker.get("format_version") != FORMAT_VERSION:
        raise ModelLoadError(f"{path}: unsupported checkpoint format {marker!r}")
    params = _restore(path / "params", config, dtype)
    check_param_shapes(config, params)
    return config, params


def _restore(params_dir: Path, config: ModelConfig, dtype: Any) -> Params:
    target = jax.tree.map(
        lambda shape: ocp.RestoreArgs(restore_type=np.ndarray, dtype=dtype),
        param_shapes(config), is_leaf=lambda x: isinstance(x, tuple),
    )
    try:
        with ocp.PyTreeCheckpointer() as checkpointer:
            return checkpointer.restore(params_dir, restore_args=target)
    except Exception as exc:  # orbax raises many kinds on damaged folders
        raise ModelLoadError(f"cannot restore params from {params_dir}: {exc}") from exc
