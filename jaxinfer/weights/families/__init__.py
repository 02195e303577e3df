"""Model families: everything that differs between Gemma 3, the Llama family and Qwen.

One module per family holds what is particular to it: the `model_type`s of
Hugging Face's config.json and the `general.architecture`s of GGUF files it
reads, how each becomes a `ModelConfig` (defaults transformers assumes,
quirks), the HF names of its layer weights and llama.cpp's conventions to undo.
The readers (`weights.hf`, `weights.gguf_loader`) hold only what the formats
share. Adding a family is a module here, a preset in configs/models and a tiny
fixture (scripts/make_tiny_fixtures.py).
"""

from __future__ import annotations

from collections.abc import Callable

from jaxinfer.errors import ModelLoadError
from jaxinfer.weights.families import gemma3, llama, qwen
from jaxinfer.weights.families.common import Family

FAMILIES: tuple[Family, ...] = (gemma3.FAMILY, llama.FAMILY, qwen.FAMILY)
HF_MODEL_TYPES: tuple[str, ...] = tuple(t for f in FAMILIES for t in f.hf_model_types)
GGUF_ARCHITECTURES: tuple[str, ...] = tuple(a for f in FAMILIES for a in f.gguf_architectures)


def family_for_hf(model_type: object) -> Family:
    """The family of a config.json `model_type`; ModelLoadError listing the supported ones."""
    return _find(lambda f: model_type in f.hf_model_types,
                 f"unsupported Hugging Face model_type {model_type!r}; "
                 f"supported: {', '.join(sorted(HF_MODEL_TYPES))}")


def family_for_gguf(architecture: object) -> Family:
    """The family of a GGUF `general.architecture`."""
    return _find(lambda f: architecture in f.gguf_architectures,
                 f"unsupported GGUF architecture {architecture!r}; "
                 f"supported: {', '.join(sorted(GGUF_ARCHITECTURES))}")


def _find(reads: Callable[[Family], bool], unsupported: str) -> Family:
    for family in FAMILIES:
        if reads(family):
            return family
    raise ModelLoadError(unsupported)


def family_of(architecture: str) -> Family:
    """The family whose models run as our `ModelConfig.architecture`."""
    return next(f for f in FAMILIES if f.architecture == architecture)


__all__ = ["FAMILIES", "Family", "family_for_gguf", "family_for_hf", "family_of"]
