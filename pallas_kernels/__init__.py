"""Pallas kernels, one per file, each beside its plain-jnp reference.

- `reference.py`: paged attention in plain jnp (also jaxinfer's XLA/CPU path).
- `flash_prefill.py`: tiled (flash) attention for prompt chunks over the paged pool.
- `paged_decode.py`: paged decode attention with split-K.
- `ragged_reference.py`: ragged paged attention in plain jnp for the flat step
  layout (every sequence's query tokens back to back, per-sequence query
  starts, context lengths and block tables).
- `ragged_tpu.py`: the same contract as a TPU (Mosaic) kernel: scalar prefetch,
  async page DMAs into double-buffered VMEM; runs under the TPU interpreter on CPU.
- `ragged_gpu.py`: the same contract as a GPU (Triton) kernel: sequence-bounded
  query tiles walking their live pages; runs under the Pallas interpreter on CPU.

The two GPU kernels share the reference's signature: plain arrays (query positions,
block tables, context lengths; int8 pools add `k_scale` / `v_scale` keywords).
This package imports nothing of jaxinfer; `jaxinfer.ops.attention` unpacks the
engine's metadata into these arguments and picks a kernel by `attention_impl`.
"""
