"""Engine settings: one frozen dataclass, presets in configs/engine/*.toml."""

from __future__ import annotations

import dataclasses
import importlib.resources
import tomllib
from dataclasses import dataclass
from typing import Any

from jaxinfer.errors import ConfigError
from jaxinfer.ops.attention import check_attention_impl, check_kv_cache_dtype


@dataclass(frozen=True)
class EngineConfig:
    """How the engine batches and caches. `None` sizes follow the model and device."""

    max_model_len: int | None = None  # default: min(model context, 2048)
    max_num_seqs: int = 8
    max_num_batched_tokens: int | None = None  # default: max(2048, max_model_len)
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    attention_impl: str = "xla"
    kv_cache_dtype: str = "auto"  # auto (the model dtype) | int8 (per-token, per-head scales)

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_num_batched_tokens", "kv_cache_memory"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be >= 1, got {value}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        check_attention_impl(self.attention_impl)
        check_kv_cache_dtype(self.kv_cache_dtype)

    def replace(self, **changes: Any) -> EngineConfig:
        """A copy with the non-None `changes` applied."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})


def load_engine_preset(name: str) -> EngineConfig:
    """An engine preset from configs/engine/<name>.toml."""
    folder = importlib.resources.files("jaxinfer.presets").joinpath("engine")
    file = folder.joinpath(f"{name}.toml")
    if not file.is_file():
        names = sorted(p.name.removesuffix(".toml") for p in folder.iterdir()
                       if p.name.endswith(".toml"))
        raise ConfigError(f"unknown engine preset {name!r}; presets: {', '.join(names)}")
    raw = tomllib.loads(file.read_text())
    known = {f.name for f in dataclasses.fields(EngineConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"{file.name}: unknown engine settings {', '.join(unknown)}")
    return EngineConfig(**raw)
