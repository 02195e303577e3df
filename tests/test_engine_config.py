"""EngineConfig: validated once, resolved against the model once, viewed by the runner
and the scheduler; every field reachable from the CLI. No JAX, no model."""

from __future__ import annotations

import dataclasses

import pytest

from jaxinfer.args import engine_config_from_args
from jaxinfer.engine.config import (
    DEFAULT_MAX_MODEL_LEN,
    MIN_BATCHED_TOKENS,
    EngineConfig,
    load_engine_preset,
)
from jaxinfer.errors import ConfigError
from serve.cli import build_parser


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"max_model_len": 1}, "max_model_len must be an integer >= 2, got 1"),
        ({"max_num_seqs": 0}, "max_num_seqs must be an integer >= 1, got 0"),
        ({"max_num_seqs": "8"}, "max_num_seqs must be an integer >= 1, got '8'"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens must be an integer >= 1"),
        ({"kv_cache_memory": 0}, "kv_cache_memory must be an integer >= 1, got 0"),
        ({"block_size": 12}, "block_size must be a power of two >= 1, got 12"),
        ({"block_size": 0}, "block_size must be an integer >= 1, got 0"),
        ({"kv_cache_fraction": 0.0}, r"kv_cache_fraction must be in \(0, 1\], got 0.0"),
        ({"kv_cache_fraction": 1.5}, r"kv_cache_fraction must be in \(0, 1\], got 1.5"),
        ({"enable_prefix_caching": "yes"}, "enable_prefix_caching must be true or false"),
        ({"attention_impl": "cuda"}, "attention_impl must be one of xla, pallas, pallas-int"),
        ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype must be one of auto, int8, got 'fp8'"),
        ({"max_model_len": 64, "max_num_batched_tokens": 16, "enable_chunked_prefill": False},
         r"without chunked prefill, max_num_batched_tokens \(16\) must be >= max_model_len"),
    ],
)
def test_every_bad_value_names_its_field_and_range(settings: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        EngineConfig(**settings)


def test_resolve_fills_the_sizes_left_to_the_model() -> None:
    config = EngineConfig().resolve(max_position=32768)
    assert config.max_model_len == DEFAULT_MAX_MODEL_LEN
    assert config.max_num_batched_tokens == max(MIN_BATCHED_TOKENS, DEFAULT_MAX_MODEL_LEN)
    small = EngineConfig().resolve(max_position=128)
    assert (small.max_model_len, small.max_num_batched_tokens) == (128, MIN_BATCHED_TOKENS)
    set_ = EngineConfig(max_model_len=100, max_num_batched_tokens=50).resolve(128)
    assert (set_.max_model_len, set_.max_num_batched_tokens) == (100, 50)
    with pytest.raises(ConfigError, match=r"max_model_len \(256\) exceeds the model's context"):
        EngineConfig(max_model_len=256).resolve(max_position=128)
    with pytest.raises(ConfigError, match="without chunked prefill"):  # checked once resolved
        EngineConfig(max_num_batched_tokens=64, enable_chunked_prefill=False).resolve(128)


def test_the_views_carry_the_config_and_need_its_sizes() -> None:
    config = EngineConfig(max_num_seqs=3, block_size=4, kv_cache_fraction=0.5).resolve(30)
    cache, scheduler = config.cache_config(), config.scheduler_config()
    for view in (cache, scheduler):
        for field in dataclasses.fields(view):
            assert getattr(view, field.name) == getattr(config, field.name)
    assert cache.max_blocks_per_seq == 8  # ceil(30 / 4)
    with pytest.raises(ConfigError, match="max_model_len is not set"):
        EngineConfig().cache_config()
    with pytest.raises(ConfigError, match="max_num_batched_tokens is not set"):
        EngineConfig().scheduler_config()


@pytest.mark.parametrize("command", [["generate", "hi"], ["serve"], ["bench", "offline"],
                                     ["perplexity"]])
def test_every_field_has_a_flag(command: list[str]) -> None:
    parser = build_parser()
    assert engine_config_from_args(parser.parse_args(command)) == EngineConfig()
    args = parser.parse_args([*command, "--kv-cache-fraction", "0.5", "--block-size", "8",
                              "--no-prefix-caching", "--attention-impl", "pallas-interpret"])
    config = engine_config_from_args(args)
    assert config == EngineConfig(kv_cache_fraction=0.5, block_size=8,
                                  enable_prefix_caching=False,
                                  attention_impl="pallas-interpret")
    for field in dataclasses.fields(EngineConfig):
        assert hasattr(args, field.name), field.name
    with pytest.raises(ConfigError, match="kv_cache_fraction must be in"):
        engine_config_from_args(parser.parse_args([*command, "--kv-cache-fraction", "2"]))


def test_presets_are_engine_configs() -> None:
    assert isinstance(load_engine_preset("cpu-offline"), EngineConfig)
    with pytest.raises(ConfigError, match="unknown engine preset 'gpu'; presets: cpu-"):
        load_engine_preset("gpu")
