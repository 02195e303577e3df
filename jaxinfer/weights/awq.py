"""Activation-aware int4 (in the spirit of AWQ, Lin et al. 2023).

A few input channels of each matrix see much larger activations than the rest;
their weights matter most. AWQ scales those columns up before quantizing (and the
activations down by the same factor at run time), so they land on a finer grid.
Per matrix and layer, the scale is `s = mean|x|^alpha` (normalized), with alpha
searched on a grid to minimise the matmul's output error on calibration inputs;
alpha = 0 is plain int4, so the search never does worse than it on that data.

Calibration text: docstrings of Python standard-library modules, shuffled with a
fixed seed (always installed, never used by the quality evaluation).
"""

from __future__ import annotations

import importlib
import random
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.model.capture import capture_intermediates
from jaxinfer.model.config import ModelConfig
from jaxinfer.model.transformer import dense_forward
from jaxinfer.tokenizer import Tokenizer
from jaxinfer.weights.quantize import (
    DEFAULT_GROUP_SIZE,
    LAYER_MATRICES,
    fitting_group,
    matrix_quantizer,
    quantize_int4,
)

CALIBRATION_MODULES = ("argparse", "asyncio", "collections", "csv", "datetime", "decimal",
                       "email", "functools", "heapq", "json", "logging", "pathlib", "pickle",
                       "re", "sqlite3", "string", "textwrap", "threading", "unittest", "zipfile")
ALPHAS = tuple(i / 10 for i in range(11))
CALIBRATION_TOKENS = 512
SAMPLED_ROWS = 256
INPUT_OF = {"q_proj": "attn_in", "k_proj": "attn_in", "v_proj": "attn_in", "o_proj": "attn_out",
            "gate_proj": "mlp_in", "up_proj": "mlp_in", "down_proj": "mlp_hidden"}  # model taps


def calibration_tokens(
    tokenizer: Tokenizer | None, config: ModelConfig, num_tokens: int = CALIBRATION_TOKENS,
    seed: int = 0,
) -> np.ndarray:
    """[num_tokens] ids: stdlib docstrings (seeded order), or seeded random ids."""
    rng = random.Random(seed)
    if tokenizer is None:
        return np.asarray([rng.randrange(config.vocab_size) for _ in range(num_tokens)])
    docs = [importlib.import_module(name).__doc__ or "" for name in CALIBRATION_MODULES]
    rng.shuffle(docs)
    ids = tokenizer.encode("\n\n".join(docs))
    while len(ids) < num_tokens:
        ids = ids + ids
    return np.asarray(ids[:num_tokens], np.int32)


def quantize_awq(
    params: dict[str, Any], config: ModelConfig, tokenizer: Tokenizer | None,
    group_size: int = DEFAULT_GROUP_SIZE, seed: int = 0,
) -> dict[str, Any]:
    """Float params -> AWQ int4 layers (embedding / LM head int8 per channel)."""
    tokens = calibration_tokens(tokenizer, config, seed=seed)
    inputs = _calibration_inputs(params, config, tokens, seed)
    plain = matrix_quantizer("int4", group_size)  # embedding / LM head: int8; vectors as is
    out = {name: plain(name, w) for name, w in params.items() if name != "layers"}
    layers = dict(params["layers"])
    for name in LAYER_MATRICES:
        w = np.asarray(layers[name], np.float32)
        group = fitting_group(w.shape[-1], group_size)
        layers[name] = quantize_int4(w, group, act_scale=best_act_scale(w, inputs[INPUT_OF[name]],
                                                                        group))
    out["layers"] = layers
    return out


def _calibration_inputs(
    params: dict[str, Any], config: ModelConfig, tokens: np.ndarray, seed: int
) -> dict[str, np.ndarray]:
    """Each layer's matmul inputs on the calibration tokens, SAMPLED_ROWS rows: [L, n, in],
    keyed by tap name (`INPUT_OF`)."""
    run = jax.jit(capture_intermediates(dense_forward, set(INPUT_OF.values())),
                  static_argnums=1)
    _, taps = run(jax.tree.map(np.asarray, params), config, tokens[None])
    rows = np.random.default_rng(seed).permutation(len(tokens))[:SAMPLED_ROWS]
    return {name: np.asarray(x[:, rows], np.float32) for name, x in taps.items()}  # [L, T, ..]


def best_act_scale(w: np.ndarray, x: np.ndarray, group: int) -> np.ndarray:
    """Per layer, the act_scale [L, in] minimising ||x w^T - x w_q^T|| over ALPHAS.

    w [L, out, in], x [L, n, in]; act_scale = 1 / s with s = mean|x|^alpha normalized.
    """
    w, x = jnp.asarray(w), jnp.asarray(x)
    mean_abs = jnp.maximum(jnp.mean(jnp.abs(x), axis=1), 1e-8)  # [L, in]
    reference = jnp.einsum("lni,loi->lno", x, w)
    scales = [_alpha_scale(mean_abs, alpha) for alpha in ALPHAS]
    errors = jnp.stack([_scaled_int4_error(w, x, reference, s, group) for s in scales])
    best = np.asarray(jnp.argmin(errors, axis=0))  # [L]
    stacked = np.stack([np.asarray(s) for s in scales])  # [alphas, L, in]
    return stacked[best, np.arange(w.shape[0])]


def _alpha_scale(mean_abs: jax.Array, alpha: float) -> jax.Array:
    """act_scale = 1 / s, s = mean|x|^alpha normalized to a geometric mean range of 1."""
    s = mean_abs**alpha
    s = s / jnp.sqrt(s.max(axis=-1, keepdims=True) * s.min(axis=-1, keepdims=True))
    return (1.0 / s).astype(jnp.float32)


@partial(jax.jit, static_argnames="group")
def _scaled_int4_error(
    w: jax.Array, x: jax.Array, reference: jax.Array, act_scale: jax.Array, group: int
) -> jax.Array:
    """Mean squared output error per layer [L] of int4(w / act_scale) * act_scale."""
    scaled = w / act_scale[:, None, :]
    grouped = scaled.reshape(*scaled.shape[:-1], -1, group)
    low, high = grouped.min(axis=-1, keepdims=True), grouped.max(axis=-1, keepdims=True)
    step = jnp.where(high > low, (high - low) / 15.0, 1.0)
    fake = jnp.clip(jnp.round((grouped - low) / step), 0, 15) * step + low
    w_q = fake.reshape(scaled.shape) * act_scale[:, None, :]
    return jnp.mean((jnp.einsum("lni,loi->lno", x, w_q) - reference) ** 2, axis=(1, 2))
