"""jaxinfer: an LLM inference engine on JAX/XLA.

    from jaxinfer import LLM, SamplingParams
    llm = LLM("gemma3-270m")
    print(llm.generate("The capital of France is", SamplingParams(max_tokens=16))[0].text)

The names that load JAX are imported on first use, so a submodule that needs
no JAX (the scheduler, the block manager, the CLI's flags) imports none.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from jaxinfer.errors import ConfigError, JaxinferError, ModelLoadError, RequestError

if TYPE_CHECKING:
    from jaxinfer.llm import LLM
    from jaxinfer.outputs import CompletionOutput, RequestOutput
    from jaxinfer.sampling import SamplingParams

__version__ = "0.1.0"

_LAZY = {"LLM": "jaxinfer.llm", "CompletionOutput": "jaxinfer.outputs",
         "RequestOutput": "jaxinfer.outputs", "SamplingParams": "jaxinfer.sampling"}

__all__ = [
    "LLM",
    "CompletionOutput",
    "ConfigError",
    "JaxinferError",
    "ModelLoadError",
    "RequestError",
    "RequestOutput",
    "SamplingParams",
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'jaxinfer' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
