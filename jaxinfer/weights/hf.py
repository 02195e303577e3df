"""Hugging Face checkpoints: a folder with config.json and *.safetensors.

`config_from_hf` turns a transformers config dict into our ModelConfig through
its family (`weights.families`: Llama, Mistral, Qwen2/3, Gemma 3 text or
multimodal); `load_hf_folder` reads the safetensors files (one file, or shards
listed in model.safetensors.index.json) into the params pytree.

The mapping is driven by the config: for every weight `param_shapes(config)`
expects, the family's table gives the HF tensor name, so a missing tensor is
reported by its HF name. HF's nn.Linear stores [out, in] like our params, so no
matrix is transposed, and Gemma's norms keep HF's (1 + w) convention
(norm_offset 1.0).

Multimodal Gemma 3 folders hold the text model under `language_model.model.`
(Hub layout) or `model.language_model.` (transformers >= 4.52); tensors outside
the text model (vision tower, projector) are not read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import ml_dtypes  # noqa: F401 - registers numpy's bfloat16, which safetensors' numpy API needs
import numpy as np
from safetensors import SafetensorError, safe_open

from jaxinfer.errors import ModelLoadError
from jaxinfer.model.config import ModelConfig
from jaxinfer.model.params import Params, check_param_shapes, layer_param_shapes, stack_layers
from jaxinfer.weights.families import family_for_hf, family_of

HF_TOP_NAMES = {"embed": "embed_tokens.weight", "final_norm": "norm.weight"}

# (prefix of the text model, name of the LM head), tried in order; "" (bare names) last.
_LAYOUTS: tuple[tuple[str, str], ...] = (
    ("model.", "lm_head.weight"),
    ("model.language_model.", "lm_head.weight"),
    ("language_model.model.", "language_model.lm_head.weight"),
    ("", "lm_head.weight"),
)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints saved

# Where a params leaf goes: (layer index or None for top-level, our name).
ParamKey = tuple[int | None, str]


# ----------------------------------------------------------------------------- config


def config_from_hf(hf_config: dict[str, Any], name: str) -> ModelConfig:
    """Translate a transformers config.json dict into a ModelConfig (by its family)."""
    model_type = hf_config.get("model_type")
    return family_for_hf(model_type).config_from_hf(hf_config, model_type, name)


# ----------------------------------------------------------------------------- weights


def load_hf_folder(path: str | Path, dtype: Any = np.float32) -> tuple[ModelConfig, Params]:
    """Read a HF model folder into (config, params) with numpy arrays of `dtype`."""
    folder = Path(path)
    config = config_from_hf(read_json(folder / "config.json"), name=folder.resolve().name)
    index = tensor_index(folder)
    prefix, head_name = _find_layout(index, folder)
    wanted = _wanted_tensors(config, prefix, head_name)
    optional = {head_name} if config.tie_embeddings else set()
    _check_names(index, wanted, optional, prefix, folder)
    present = {name: key for name, key in wanted.items() if name in index}
    tensors = _read_tensors(present, index, dtype)
    _check_tensor_shapes(config, present, tensors, folder)
    params = _assemble(config, tensors, folder)
    check_param_shapes(config, params)
    return config, params


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ModelLoadError(f"{path} not found (a Hugging Face model folder needs config.json)")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"cannot read {path}: {err}") from err


def tensor_index(folder: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it."""
    index_path = folder / "model.safetensors.index.json"
    if index_path.is_file():
        weight_map = read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"{index_path} has no 'weight_map' dict")
        files = {name: folder / file for name, file in weight_map.items()}
        for file in sorted(set(files.values())):
            if not file.is_file():
                raise ModelLoadError(f"{index_path} lists {file.name}, which is missing")
        return files
    return _scan_files(folder)


def _scan_files(folder: Path) -> dict[str, Path]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors files in {folder}")
    index: dict[str, Path] = {}
    for file in files:
        for name in _tensor_names(file):
            if name in index:
                raise ModelLoadError(f"tensor {name} is in both {index[name]} and {file}")
            index[name] = file
    return index


def _tensor_names(file: Path) -> list[str]:
    try:
        with safe_open(file, framework="numpy") as handle:
            return list(handle.keys())
    except (SafetensorError, OSError) as err:
        raise ModelLoadError(f"corrupt or truncated safetensors file {file}: {err}") from err


def _find_layout(index: dict[str, Path], folder: Path) -> tuple[str, str]:
    for prefix, head_name in _LAYOUTS:
        if prefix + HF_TOP_NAMES["embed"] in index:
            return prefix, head_name
    raise ModelLoadError(
        f"no embedding tensor in {folder}: looked for "
        + ", ".join(prefix + HF_TOP_NAMES["embed"] for prefix, _ in _LAYOUTS)
    )


def _wanted_tensors(config: ModelConfig, prefix: str, head_name: str) -> dict[str, ParamKey]:
    """HF tensor name -> params key, for every weight the config needs (plus a tied
    model's lm_head, read if present so that it can be checked and dropped)."""
    names = family_of(config.architecture).hf_layer_names
    wanted: dict[str, ParamKey] = {prefix + hf: (None, ours) for ours, hf in HF_TOP_NAMES.items()}
    wanted[head_name] = (None, "lm_head")
    for i in range(config.num_layers):
        for ours in layer_param_shapes(config):
            wanted[f"{prefix}layers.{i}.{names[ours]}"] = (i, ours)
    return wanted


def _check_names(
    index: dict[str, Path], wanted: dict[str, ParamKey], optional: set[str], prefix: str,
    folder: Path,
) -> None:
    """Every needed tensor present; nothing in the text model left unread."""
    missing = [name for name in wanted if name not in index and name not in optional]
    if missing:
        raise ModelLoadError(f"{folder} lacks {len(missing)} tensor(s): {_short_list(missing)}")
    unused = [
        name for name in index
        if name.startswith(prefix) and name not in wanted and not name.endswith(_IGNORED_SUFFIXES)
    ]
    if unused:
        raise ModelLoadError(
            f"{folder} has {len(unused)} tensor(s) this config does not use: {_short_list(unused)}"
        )


def _short_list(names: list[str], limit: int = 8) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _read_tensors(
    wanted: dict[str, ParamKey], index: dict[str, Path], dtype: Any
) -> dict[ParamKey, np.ndarray]:
    """Read the wanted tensors, one file open at a time, converted to `dtype`."""
    out: dict[ParamKey, np.ndarray] = {}
    for file in sorted({index[name] for name in wanted}):
        names = [name for name in wanted if index[name] == file]
        try:
            with safe_open(file, framework="numpy") as handle:
                for name in names:
                    out[wanted[name]] = np.asarray(handle.get_tensor(name), dtype=dtype)
        except (SafetensorError, OSError) as err:
            raise ModelLoadError(f"corrupt or truncated safetensors file {file}: {err}") from err
    return out


def _check_tensor_shapes(
    config: ModelConfig, names: dict[str, ParamKey], tensors: dict[ParamKey, np.ndarray],
    folder: Path,
) -> None:
    """Name each misshapen tensor by its HF name (before stacking hides which layer)."""
    wrong = [
        f"{name} has shape {tensors[key].shape}, expected {_param_shape(config, key)}"
        for name, key in names.items()
        if tensors[key].shape != _param_shape(config, key)
    ]
    if wrong:
        raise ModelLoadError(f"{folder} does not match its config.json: {_short_list(wrong)}")


def _param_shape(config: ModelConfig, key: ParamKey) -> tuple[int, ...]:
    layer, ours = key
    if layer is not None:
        return layer_param_shapes(config)[ours]
    return (config.d_model,) if ours == "final_norm" else (config.vocab_size, config.d_model)


def _assemble(config: ModelConfig, tensors: dict[ParamKey, np.ndarray], folder: Path) -> Params:
    """Param keys -> the params pytree with [L, ...] stacked layers."""
    per_layer = [
        {ours: tensors[(i, ours)] for ours in layer_param_shapes(config)}
        for i in range(config.num_layers)
    ]
    params: Params = {
        "embed": tensors[(None, "embed")],  # [vocab, d_model]
        "final_norm": tensors[(None, "final_norm")],  # [d_model]
        "layers": stack_layers(per_layer),
    }
    head = tensors.get((None, "lm_head"))  # [vocab, d_model]; absent only when tied
    if not config.tie_embeddings:
        params["lm_head"] = head
    elif head is not None and not np.array_equal(head, params["embed"]):
        raise ModelLoadError(
            f"{folder}: config ties embeddings (tie_word_embeddings) but lm_head.weight "
            "differs from embed_tokens.weight"
        )
    return params
