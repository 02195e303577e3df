"""Pallas kernels, one per file, each beside its plain-jnp reference.

- `reference.py`: paged attention in plain jnp (also jaxinfer's XLA/CPU path).
- `flash_prefill.py`: tiled (flash) attention for prompt chunks over the paged pool.
- `paged_decode.py`: paged decode attention with split-K.

Both kernels share the reference's signature (int8 pools: `k_scale` / `v_scale`
keywords); `jaxinfer.ops.attention` picks one by `attention_impl`.
"""
