"""The allowed values of every setting that names one of a few choices.

Plain tuples with no JAX import: `EngineConfig` and the loaders validate
against them, the modules that act on a choice import them, and the CLI
builds its `choices=` from them, so a typo is caught before JAX loads.
"""

from __future__ import annotations

from jaxinfer.errors import ConfigError

# see jaxinfer/ops/attention.py
ATTENTION_IMPLS = ("xla", "pallas", "pallas-interpret", "pallas-tpu-interpret")
KV_CACHE_DTYPES = ("auto", "int8")  # auto: the model's dtype; int8: int8 + f32 scales
QUANTIZATIONS = ("none", "int8", "w8a8", "int4", "int4-awq", "gguf")  # weights/quantize.py
DTYPE_NAMES = ("float32", "bfloat16")  # the dtypes weights load in
LOAD_FORMATS = ("auto", "dummy")  # dummy: random weights of the right shapes


def check_choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    """Raise ConfigError naming the setting and its choices unless `value` is one."""
    if value not in allowed:
        raise ConfigError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
