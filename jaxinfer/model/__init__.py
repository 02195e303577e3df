"""Functional decoder model: params in, (logits, kv) out. No host state."""

from jaxinfer.model.config import ModelConfig, RopeScaling

__all__ = ["ModelConfig", "RopeScaling"]
