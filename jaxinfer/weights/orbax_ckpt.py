"""Converted checkpoints: params via orbax, plus the model config and tokenizer.

A checkpoint folder holds `params/` (orbax PyTree), `model_config.json`,
`jaxinfer_checkpoint.json` (format marker, and for quantized weights the method and
each quantized matrix's bits, group size and stored fields) and the tokenizer files.
Restoring reads the arrays directly: no dequantization, so it loads faster than a
GGUF. A quantized matrix is saved as a dict of its arrays (values, scales, ...).
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
from jaxinfer.model.quant import QuantizedWeight

QUANT_FIELDS = ("values", "scales", "offsets", "act_scale")

MARKER = "jaxinfer_checkpoint.json"
FORMAT_VERSION = 1


def is_checkpoint(path: Path) -> bool:
    return (path / MARKER).is_file()


def save_checkpoint(
    out: Path, config: ModelConfig, params: Params, quantization: str = "none"
) -> None:
    """Write params, config and marker into `out` (created; must not hold a checkpoint)."""
    out = Path(out).resolve()
    if (out / "params").exists():
        raise ModelLoadError(f"{out} already holds a checkpoint; remove it or pick another OUT")
    out.mkdir(parents=True, exist_ok=True)
    tree, layouts = _saveable(params)
    with ocp.PyTreeCheckpointer() as checkpointer:
        checkpointer.save(out / "params", jax.tree.map(np.asarray, tree))
    (out / "model_config.json").write_text(json.dumps(config.to_dict(), indent=1))
    marker = {"format_version": FORMAT_VERSION, "quantization": quantization,
              "quantized": layouts}
    (out / MARKER).write_text(json.dumps(marker, indent=1))


def load_checkpoint(path: Path, dtype: Any = np.float32) -> tuple[ModelConfig, Params, str]:
    """(config, params, quantization method) of a converted checkpoint."""
    path = Path(path)
    try:
        marker = json.loads((path / MARKER).read_text())
        config = ModelConfig.from_dict(json.loads((path / "model_config.json").read_text()))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path} is not a readable jaxinfer checkpoint: {exc}") from exc
    if marker.get("format_version") != FORMAT_VERSION:
        raise ModelLoadError(f"{path}: unsupported checkpoint format {marker!r}")
    layouts = marker.get("quantized", {})
    tree = _restore(path / "params", config, dtype, layouts)
    params = _rebuild(tree, layouts)
    check_param_shapes(config, params)
    return config, params, marker.get("quantization", "none")


def _saveable(params: Params) -> tuple[Params, dict[str, dict[str, Any]]]:
    """Quantized matrices as dicts of arrays, and their layouts keyed 'layers/q_proj'."""
    layouts: dict[str, dict[str, Any]] = {}

    def convert(tree: Params, prefix: str) -> Params:
        out: Params = {}
        for name, value in tree.items():
            if isinstance(value, dict):
                out[name] = convert(value, f"{prefix}{name}/")
            elif isinstance(value, QuantizedWeight):
                fields = [f for f in QUANT_FIELDS if getattr(value, f) is not None]
                layouts[prefix + name] = {"bits": value.bits, "group_size": value.group_size,
                                          "w8a8": value.w8a8,
                                          "fields": fields}
                out[name] = {f: getattr(value, f) for f in fields}
            else:
                out[name] = value
        return out

    return convert(params, ""), layouts


def _rebuild(tree: Params, layouts: dict[str, dict[str, Any]]) -> Params:
    """The inverse of `_saveable`."""
    for key, layout in layouts.items():
        *parents, name = key.split("/")
        node = tree
        for parent in parents:
            node = node[parent]
        arrays = node[name]
        node[name] = QuantizedWeight(
            **{f: arrays.get(f) for f in QUANT_FIELDS},
            bits=layout["bits"], group_size=layout["group_size"],
            w8a8=layout.get("w8a8", False),
        )
    return tree


def _restore(
    params_dir: Path, config: ModelConfig, dtype: Any, layouts: dict[str, dict[str, Any]]
) -> Params:
    target = jax.tree.map(
        lambda shape: ocp.RestoreArgs(restore_type=np.ndarray, dtype=dtype),
        param_shapes(config), is_leaf=lambda x: isinstance(x, tuple),
    )
    for key, layout in layouts.items():  # quantized arrays keep their stored dtypes
        *parents, name = key.split("/")
        node = target
        for parent in parents:
            node = node[parent]
        node[name] = {f: ocp.RestoreArgs(restore_type=np.ndarray) for f in layout["fields"]}
    try:
        with ocp.PyTreeCheckpointer() as checkpointer:
            return checkpointer.restore(params_dir, restore_args=target)
    except Exception as exc:  # orbax raises many kinds on damaged folders
        raise ModelLoadError(f"cannot restore params from {params_dir}: {exc}") from exc
