"""The decoder forward pass, functional: params and KV pool in, hidden states and pool out.

Layers run under one `lax.scan` over the stacked layer weights, so the compiled
program holds a single layer body whatever the depth. The KV pool of every
layer travels in the scan carry and is updated in place (a scatter at the
layer's index), which lets XLA alias it with the donated input buffer.

Gemma 3's local (sliding-window) and global layers differ only by data: each
layer gets its window length and picks its RoPE table by index, so one body
serves both kinds.

Each layer marks the intermediates in `TAPS` with `capture.tap`; a function
wrapped by `capture.capture_intermediates` gets them stacked over layers
[L, ...]. Unwrapped, the taps cost nothing.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct

from jaxinfer.model import capture
from jaxinfer.model.config import ModelConfig
from jaxinfer.model.layers import apply_rope, gated_mlp, layer_rope, linear, rms_norm
from jaxinfer.model.params import Params, compute_dtype
from jaxinfer.model.quant import QuantizedWeight, take_rows
from jaxinfer.ops.attention import (
    AttentionFn,
    check_kv_cache_dtype,
    write_kv,
    write_kv_int8,
    xla_attention,
)
from jaxinfer.ops.types import NO_WINDOW, AttentionMetadata

TAPS = {  # the intermediates each layer marks, and the weights that read them
    "attn_in": "[T, d_model] normed layer input: read by q_proj, k_proj, v_proj",
    "attn_out": "[T, heads * head_dim] attention output: read by o_proj",
    "mlp_in": "[T, d_model] normed MLP input: read by gate_proj, up_proj",
    "mlp_hidden": "[T, ffn] act(gate(x)) * up(x): read by down_proj",
    "layer_out": "[T, d_model] the residual stream after the layer",
}


@struct.dataclass
class KVCache:
    """The paged K/V pools of all layers; int8 pools carry one f32 scale per row and head."""

    k: jax.Array  # [L, num_blocks * block_size, kv_heads, head_dim], model dtype or int8
    v: jax.Array  # [L, num_blocks * block_size, kv_heads, head_dim]
    k_scale: jax.Array | None = None  # [L, num_blocks * block_size, kv_heads] f32 (int8)
    v_scale: jax.Array | None = None  # [L, num_blocks * block_size, kv_heads] f32 (int8)

    @property
    def num_rows(self) -> int:
        return self.k.shape[1]

    @property
    def nbytes(self) -> int:
        return sum(leaf.nbytes for leaf in jax.tree.leaves(self))


def init_kv_cache(
    config: ModelConfig, num_rows: int, dtype: jnp.dtype, kv_cache_dtype: str = "auto"
) -> KVCache:
    """Zeroed pools: K/V in `dtype` ("auto"), or int8 values with f32 scales ("int8")."""
    check_kv_cache_dtype(kv_cache_dtype)
    shape = (config.num_layers, num_rows, config.num_kv_heads, config.head_dim)
    if kv_cache_dtype == "auto":
        return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))
    return KVCache(
        k=jnp.zeros(shape, jnp.int8), v=jnp.zeros(shape, jnp.int8),
        k_scale=jnp.zeros(shape[:3], jnp.float32), v_scale=jnp.zeros(shape[:3], jnp.float32),
    )


def kv_bytes_per_token(config: ModelConfig, dtype: jnp.dtype, kv_cache_dtype: str) -> int:
    """Pool bytes one token takes over all layers: 2 L KV hd x itemsize, plus
    2 L KV x 4 bytes of scales for int8."""
    check_kv_cache_dtype(kv_cache_dtype)
    if kv_cache_dtype == "int8":
        return config.kv_bytes_per_token(1, scale_bytes=4)
    return config.kv_bytes_per_token(jnp.dtype(dtype).itemsize)


def write_kv_cache(
    kv: KVCache, layer: jax.Array, k: jax.Array, v: jax.Array, kv_rows: jax.Array
) -> KVCache:
    """Write one layer's new k, v [T, KV, hd] at `kv_rows` [T] (int8: quantized)."""
    if kv.k_scale is None:
        return kv.replace(k=write_kv(kv.k, layer, k, kv_rows),
                          v=write_kv(kv.v, layer, v, kv_rows))
    k_pool, k_scale = write_kv_int8(kv.k, kv.k_scale, layer, k, kv_rows)
    v_pool, v_scale = write_kv_int8(kv.v, kv.v_scale, layer, v, kv_rows)
    return KVCache(k=k_pool, v=v_pool, k_scale=k_scale, v_scale=v_scale)


def embed_tokens(params: Params, config: ModelConfig, tokens: jax.Array) -> jax.Array:
    """tokens [...] -> [..., d_model], scaled by sqrt(d_model) for Gemma."""
    embed = params["embed"]
    if isinstance(embed, QuantizedWeight):
        h = take_rows(embed, tokens).astype(compute_dtype(params))
    else:
        h = jnp.take(embed, tokens, axis=0)
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
    tokens: jax.Array,  # [T] int32, the step's query tokens back to back
    kv: KVCache,
    meta: AttentionMetadata,
    *,
    block_size: int,
    attention_fn: AttentionFn = xla_attention,
    unroll_layers: bool = False,
) -> tuple[jax.Array, KVCache]:
    """Run all layers; writes the new K/V into the pool. Returns hidden [T, d_model].

    `unroll_layers` unrolls the layer scan into one copy of the body per layer: the
    same math and a longer compile, for XLA's cost analysis (which counts a loop body
    once whatever its trip count) or for comparing schedules.
    """
    h = embed_tokens(params, config, tokens)
    rope = layer_rope(config, meta.positions)
    is_local = jnp.array([t == "local" for t in config.layer_types], jnp.int32)  # [L]
    windows = jnp.where(is_local == 1, config.sliding_window or NO_WINDOW, NO_WINDOW)

    def body(carry, xs):
        h, kv = carry
        layer, index, local, window = xs
        cos, sin = rope["cos"][local], rope["sin"][local]
        h, kv = _decoder_layer(config, layer, h, kv, index, meta, cos, sin, window,
                               block_size=block_size, attention_fn=attention_fn)
        return (h, kv), None

    xs = (params["layers"], jnp.arange(config.num_layers), is_local, windows)
    (h, kv), _ = capture.scan(body, (h, kv), xs,
                              unroll=config.num_layers if unroll_layers else 1)
    return h, kv


def dense_forward(params: Params, config: ModelConfig, tokens: jax.Array) -> jax.Array:
    """Hidden states [B, T, d_model] at every position of tokens [B, T], from position 0.

    No cache to keep: the B sequences run as one flat step, each writing its K/V
    into a throwaway block of T rows. For calibration and scoring a whole text at
    once; taps captured from it are flat, [L, B * T, ...].
    """
    tokens = jnp.asarray(tokens, jnp.int32)
    b, t = tokens.shape
    kv = init_kv_cache(config, b * t, compute_dtype(params))
    meta = AttentionMetadata(
        positions=jnp.tile(jnp.arange(t, dtype=jnp.int32), b),
        kv_rows=jnp.arange(b * t, dtype=jnp.int32),
        query_start=jnp.arange(b + 1, dtype=jnp.int32) * t,
        context_lens=jnp.full((b,), t, jnp.int32),
        block_tables=jnp.arange(b, dtype=jnp.int32)[:, None],
        num_seqs=jnp.array([b], jnp.int32),
    )
    h, _ = forward(params, config, tokens.reshape(-1), kv, meta, block_size=t)
    return h.reshape(b, t, -1)


def _decoder_layer(
    config: ModelConfig,
    layer: Params,
    h: jax.Array,  # [T, d_model]
    kv: KVCache,  # all layers' pools; this layer's rows are written at `index`
    index: jax.Array,
    meta: AttentionMetadata,
    cos: jax.Array,  # [T, hd]
    sin: jax.Array,
    window: jax.Array,
    *,
    block_size: int,
    attention_fn: AttentionFn,
) -> tuple[jax.Array, KVCache]:
    eps, offset = config.norm_eps, config.norm_offset
    x = capture.tap("attn_in", rms_norm(h, layer["attn_norm"], eps, offset))
    q, k, v = _project_qkv(config, layer, x, cos, sin)
    kv = write_kv_cache(kv, index, k, v, meta.kv_rows)
    attn = attention_fn(
        q, kv.k, kv.v, index, meta, block_size=block_size, scale=config.attn_scale,
        window=window, softcap=config.attn_logit_softcap, k_scale=kv.k_scale,
        v_scale=kv.v_scale,
    )
    attn = capture.tap("attn_out", attn.reshape(attn.shape[0], -1))
    out = linear(attn, layer["o_proj"])
    if config.sandwich_norms:
        out = rms_norm(out, layer["post_attn_norm"], eps, offset)
    h = h + out
    x = capture.tap("mlp_in", rms_norm(h, layer["mlp_norm"], eps, offset))
    out = gated_mlp(x, layer, config.activation)
    if config.sandwich_norms:
        out = rms_norm(out, layer["post_mlp_norm"], eps, offset)
    return capture.tap("layer_out", h + out), kv


def _project_qkv(
    config: ModelConfig, layer: Params, x: jax.Array, cos: jax.Array, sin: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [T, d] -> q [T, H, hd], k and v [T, KV, hd], normed and rotated."""
    t = x.shape[0]
    hd = config.head_dim
    q = linear(x, layer["q_proj"], layer.get("q_bias")).reshape(t, config.num_heads, hd)
    k = linear(x, layer["k_proj"], layer.get("k_bias")).reshape(t, config.num_kv_heads, hd)
    v = linear(x, layer["v_proj"], layer.get("v_bias")).reshape(t, config.num_kv_heads, hd)
    if config.qk_norm:
        q = rms_norm(q, layer["q_norm"], config.norm_eps, config.norm_offset)
        k = rms_norm(k, layer["k_norm"], config.norm_eps, config.norm_offset)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v
