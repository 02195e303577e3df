"""Pallas kernels, one per file, each beside its plain-jnp reference.

- `reference.py`: paged attention in plain jnp (also jaxinfer's XLA/CPU path).
- `flash_prefill.py`: tiled (flash) attention for prompt chunks over the paged pool.
- `paged_decode.py`: paged decode attention with split-K.

Both kernels share the reference's signature: plain arrays (query positions,
block tables, context lengths; int8 pools add `k_scale` / `v_scale` keywords).
This package imports nothing of jaxinfer; `jaxinfer.ops.attention` unpacks the
engine's metadata into these arguments and picks a kernel by `attention_impl`.
"""
