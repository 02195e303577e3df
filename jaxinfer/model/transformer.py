"""The decoder forward pass, functional: params and KV pool in, hidden states and pool out.

Layers run under one `lax.scan` over the stacked layer weights, so the compiled
program holds a single layer body whatever the depth. The KV pool of every
layer travels in the scan carry and is updated in place (a scatter at the
layer's index), which lets XLA alias it with the donated input buffer.

Gemma 3's local (sliding-window) and global layers differ only by data: each
layer gets its window length and picks its RoPE table by index, so one body
serves both kinds.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct

from jaxinfer.model.config import ModelConfig
from jaxinfer.model.layers import apply_rope, gated_mlp, layer_rope, linear, rms_norm
from jaxinfer.model.params import Params
from jaxinfer.ops.attention import (
    NO_WINDOW,
    AttentionFn,
    AttentionMetadata,
    paged_attention_reference,
    write_kv,
)


@struct.dataclass
class KVCache:
    """The paged K/V pools of all layers."""

    k: jax.Array  # [L, num_blocks * block_size, kv_heads, head_dim]
    v: jax.Array  # [L, num_blocks * block_size, kv_heads, head_dim]

    @property
    def num_rows(self) -> int:
        return self.k.shape[1]


def init_kv_cache(config: ModelConfig, num_rows: int, dtype: jnp.dtype) -> KVCache:
    shape = (config.num_layers, num_rows, config.num_kv_heads, config.head_dim)
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


def embed_tokens(params: Params, config: ModelConfig, tokens: jax.Array) -> jax.Array:
    """tokens [B, T] -> [B, T, d_model], scaled by sqrt(d_model) for Gemma."""
    h = jnp.take(params["embed"], tokens, axis=0)
    if config.scale_embeddings:
        h = h * jnp.asarray(math.sqrt(config.d_model), h.dtype)
    return h


def lm_head(params: Params, config: ModelConfig, h: jax.Array) -> jax.Array:
    """Final norm and vocabulary projection: h [..., d_model] -> f32 logits [..., vocab]."""
    h = rms_norm(h, params["final_norm"], config.norm_eps, config.norm_offset)
    head = params["embed"] if config.tie_embeddings else params["lm_head"]
    logits = linear(h, head).astype(jnp.float32)
    if config.final_logit_softcap is not None:
        cap = config.final_logit_softcap
        logits = jnp.tanh(logits / cap) * cap
    return logits


def forward(
    params: Params,
    config: ModelConfig,
    tokens: jax.Array,  # [B, T] int32
    kv: KVCache,
    meta: AttentionMetadata,
    *,
    block_size: int,
    attention_fn: AttentionFn = paged_attention_reference,
) -> tuple[jax.Array, KVCache]:
    """Run all layers; writes the new K/V into the pool. Returns hidden [B, T, d_model]."""
    h = embed_tokens(params, config, tokens)
    rope = layer_rope(config, meta.positions)
    is_local = jnp.array([t == "local" for t in config.layer_types], jnp.int32)  # [L]
    windows = jnp.where(is_local == 1, config.sliding_window or NO_WINDOW, NO_WINDOW)

    def body(carry, xs):
        h, k_pool, v_pool = carry
        layer, index, local, window = xs
        cos, sin = rope["cos"][local], rope["sin"][local]
        h, k_pool, v_pool = _decoder_layer(
            config, layer, h, k_pool, v_pool, index, meta, cos, sin, window,
            block_size=block_size, attention_fn=attention_fn,
        )
        return (h, k_pool, v_pool), None

    xs = (params["layers"], jnp.arange(config.num_layers), is_local, windows)
    (h, k_pool, v_pool), _ = jax.lax.scan(body, (h, kv.k, kv.v), xs)
    return h, KVCache(k=k_pool, v=v_pool)


def _decoder_layer(
    config: ModelConfig,
    layer: Params,
    h: jax.Array,  # [B, T, d_model]
    k_pool: jax.Array,  # [L, rows, KV, hd]
    v_pool: jax.Array,
    index: jax.Array,
    meta: AttentionMetadata,
    cos: jax.Array,  # [B, T, hd]
    sin: jax.Array,
    window: jax.Array,
    *,
    block_size: int,
    attention_fn: AttentionFn,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    eps, offset = config.norm_eps, config.norm_offset
    x = rms_norm(h, layer["attn_norm"], eps, offset)
    q, k, v = _project_qkv(config, layer, x, cos, sin)
    k_pool = write_kv(k_pool, index, k, meta.slot_mapping)
    v_pool = write_kv(v_pool, index, v, meta.slot_mapping)
    attn = attention_fn(
        q, k_pool, v_pool, index, meta, block_size=block_size, scale=config.attn_scale,
        window=window, softcap=config.attn_logit_softcap,
    )
    out = linear(attn.reshape(*attn.shape[:2], -1), layer["o_proj"])
    if config.sandwich_norms:
        out = rms_norm(out, layer["post_attn_norm"], eps, offset)
    h = h + out
    x = rms_norm(h, layer["mlp_norm"], eps, offset)
    out = gated_mlp(x, layer, config.activation)
    if config.sandwich_norms:
        out = rms_norm(out, layer["post_mlp_norm"], eps, offset)
    return h + out, k_pool, v_pool


def _project_qkv(
    config: ModelConfig, layer: Params, x: jax.Array, cos: jax.Array, sin: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [B, T, d] -> q [B, T, H, hd], k and v [B, T, KV, hd], normed and rotated."""
    b, t, _ = x.shape
    hd = config.head_dim
    q = linear(x, layer["q_proj"], layer.get("q_bias")).reshape(b, t, config.num_heads, hd)
    k = linear(x, layer["k_proj"], layer.get("k_bias")).reshape(b, t, config.num_kv_heads, hd)
    v = linear(x, layer["v_proj"], layer.get("v_bias")).reshape(b, t, config.num_kv_heads, hd)
    if config.qk_norm:
        q = rms_norm(q, layer["q_norm"], config.norm_eps, config.norm_offset)
        k = rms_norm(k, layer["k_norm"], config.norm_eps, config.norm_offset)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def full_logits(params: Params, config: ModelConfig, tokens: jax.Array) -> jax.Array:
    """Logits at every position of tokens [B, T] (positions 0..T-1) -> [B, T, vocab].

    A convenience for tests and scoring: one block of T rows per sequence.
    """
    tokens = jnp.asarray(tokens, jnp.int32)
    b, t = tokens.shape
    dtype = params["embed"].dtype
    kv = init_kv_cache(config, b * t, dtype)
    meta = AttentionMetadata(
        positions=jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)),
        slot_mapping=jnp.arange(b * t, dtype=jnp.int32).reshape(b, t),
        block_tables=jnp.arange(b, dtype=jnp.int32)[:, None],
        context_lens=jnp.full((b,), t, jnp.int32),
    )
    h, _ = forward(params, config, tokens, kv, meta, block_size=t)
    return lm_head(params, config, h)
