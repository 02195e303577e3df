"""Computations tests use as oracles and the package itself does not need."""

from __future__ import annotations

import jax

from jaxinfer.model.config import ModelConfig
from jaxinfer.model.params import Params
from jaxinfer.model.transformer import dense_forward, lm_head


def full_logits(params: Params, config: ModelConfig, tokens: jax.Array) -> jax.Array:
    """Logits at every position of tokens [B, T] (positions 0..T-1) -> [B, T, vocab]:
    the whole text in one call, no paging or bucketing."""
    return lm_head(params, config, dense_forward(params, config, tokens))
