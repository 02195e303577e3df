"""Engine settings: one frozen dataclass, validated once; presets in configs/engine/*.toml.

`EngineConfig` is the one source of truth for how the engine batches and
caches, and `__post_init__` is the one place its values are checked. Two
sizes may be left as None to follow the model; `resolve(max_position)` fills
them in when the engine meets its model. The model runner and the scheduler
each take a small view of the resolved config (`cache_config()`,
`scheduler_config()`): the fields they read and nothing to check again.

This module imports no JAX: the scheduler reads its view from here.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import math
import tomllib
from dataclasses import dataclass
from typing import Any

from jaxinfer.choices import ATTENTION_IMPLS, KV_CACHE_DTYPES, check_choice
from jaxinfer.errors import ConfigError

DEFAULT_MAX_MODEL_LEN = 2048  # max_model_len=None: the model's context, capped here
MIN_BATCHED_TOKENS = 2048  # max_num_batched_tokens=None: max(this, max_model_len)


@dataclass(frozen=True)
class CacheConfig:
    """The model runner's view: how much KV cache to hold and how it is cut into blocks."""

    max_model_len: int
    max_num_seqs: int
    block_size: int
    attention_impl: str
    kv_cache_dtype: str
    kv_cache_memory: int | None  # bytes per device; None: see `runner.kv_cache_budget`
    kv_cache_fraction: float  # of free accelerator memory, when it is known
    tensor_parallel_size: int  # devices the model is split over (mesh axis 'model')
    data_parallel_size: int  # replicas, each with its own KV pool (mesh axis 'data')

    @property
    def max_blocks_per_seq(self) -> int:
        return math.ceil(self.max_model_len / self.block_size)


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler's view: its two budgets, and whether a prompt may be cut into chunks."""

    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool


@dataclass(frozen=True)
class EngineConfig:
    """How the engine batches and caches. `None` sizes follow the model (see `resolve`)."""

    max_model_len: int | None = None  # default: min(model context, 2048)
    max_num_seqs: int = 8
    max_num_batched_tokens: int | None = None  # default: max(2048, max_model_len)
    block_size: int = 16  # tokens per KV block, a power of two
    kv_cache_memory: int | None = None  # bytes per device; default: `runner.kv_cache_budget`
    kv_cache_fraction: float = 0.9  # of free accelerator memory, without kv_cache_memory
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    attention_impl: str = "xla"  # one of choices.ATTENTION_IMPLS
    kv_cache_dtype: str = "auto"  # auto (the model dtype) | int8 (per-token, per-head scales)
    tensor_parallel_size: int = 1  # devices the model is split over (Megatron layout)
    data_parallel_size: int = 1  # model replicas; batch sizes and budgets are per replica

    def __post_init__(self) -> None:
        _check_int("max_model_len", self.max_model_len, 2, optional=True)
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1, optional=True)
        _check_int("kv_cache_memory", self.kv_cache_memory, 1, optional=True)
        _check_int("block_size", self.block_size, 1)
        _check_int("tensor_parallel_size", self.tensor_parallel_size, 1)
        _check_int("data_parallel_size", self.data_parallel_size, 1)
        if self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two >= 1, got {self.block_size}")
        fraction = self.kv_cache_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, int | float) or not (
                0 < fraction <= 1):
            raise ConfigError(f"kv_cache_fraction must be in (0, 1], got {fraction!r}")
        for name in ("enable_prefix_caching", "enable_chunked_prefill"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        check_choice("attention_impl", self.attention_impl, ATTENTION_IMPLS)
        check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        self._check_budget()

    def _check_budget(self) -> None:
        """Without chunked prefill a whole prompt runs in one step, so it must fit the budget."""
        batched, max_len = self.max_num_batched_tokens, self.max_model_len
        if self.enable_chunked_prefill or batched is None or max_len is None:
            return
        if batched < max_len:
            raise ConfigError(
                f"without chunked prefill, max_num_batched_tokens ({batched}) must be >= "
                f"max_model_len ({max_len}) so every prompt fits a step"
            )

    def replace(self, **changes: Any) -> EngineConfig:
        """A copy with the non-None `changes` applied."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})

    def resolve(self, max_position: int) -> EngineConfig:
        """A copy with the sizes left to the model filled in, for a model of
        `max_position` positions; a ConfigError if max_model_len exceeds them."""
        max_len = self.max_model_len or min(max_position, DEFAULT_MAX_MODEL_LEN)
        if max_len > max_position:
            raise ConfigError(
                f"max_model_len ({max_len}) exceeds the model's context length ({max_position})"
            )
        batched = self.max_num_batched_tokens or max(MIN_BATCHED_TOKENS, max_len)
        return dataclasses.replace(self, max_model_len=max_len, max_num_batched_tokens=batched)

    def cache_config(self) -> CacheConfig:
        """The model runner's view (max_model_len must be set: see `resolve`)."""
        return CacheConfig(
            max_model_len=self._required("max_model_len"), max_num_seqs=self.max_num_seqs,
            block_size=self.block_size, attention_impl=self.attention_impl,
            kv_cache_dtype=self.kv_cache_dtype, kv_cache_memory=self.kv_cache_memory,
            kv_cache_fraction=self.kv_cache_fraction,
            tensor_parallel_size=self.tensor_parallel_size,
            data_parallel_size=self.data_parallel_size,
        )

    def scheduler_config(self) -> SchedulerConfig:
        """The scheduler's view (max_num_batched_tokens must be set: see `resolve`)."""
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self._required("max_num_batched_tokens"),
            enable_chunked_prefill=self.enable_chunked_prefill,
        )

    def _required(self, name: str) -> int:
        value = getattr(self, name)
        if value is None:
            raise ConfigError(f"{name} is not set: resolve(max_position) fills it in")
        return value


def _check_int(name: str, value: object, minimum: int, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")


def list_engine_presets() -> list[str]:
    """The names of configs/engine/*.toml."""
    folder = importlib.resources.files("jaxinfer.presets").joinpath("engine")
    return sorted(p.name.removesuffix(".toml") for p in folder.iterdir()
                  if p.name.endswith(".toml"))


def load_engine_preset(name: str) -> EngineConfig:
    """An engine preset from configs/engine/<name>.toml."""
    file = importlib.resources.files("jaxinfer.presets").joinpath("engine", f"{name}.toml")
    if not file.is_file():
        raise ConfigError(f"unknown engine preset {name!r}; presets: "
                          f"{', '.join(list_engine_presets())}")
    raw = tomllib.loads(file.read_text())
    known = {f.name for f in dataclasses.fields(EngineConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"{file.name}: unknown engine settings {', '.join(unknown)}")
    return EngineConfig(**raw)
