"""Pallas kernels, one per file, each beside its plain-jnp reference.

- `ragged_reference.py`: ragged paged attention in plain jnp for the flat step
  layout (every sequence's query tokens back to back, per-sequence query
  starts, context lengths and block tables); also jaxinfer's XLA (CPU) path.
- `ragged_tpu.py`: the same contract as a TPU (Mosaic) kernel: scalar prefetch,
  async page DMAs into double-buffered VMEM; runs under the TPU interpreter on CPU.
- `ragged_gpu.py`: the same contract as a GPU (Triton) kernel: sequence-bounded
  query tiles walking their live pages; runs under the Pallas interpreter on CPU.

The kernels share the reference's signature: plain arrays (query starts, context
lengths, block tables, the live sequence count; int8 pools add `k_scale` /
`v_scale` keywords).
This package imports nothing of jaxinfer; `jaxinfer.ops.attention` unpacks the
engine's metadata into these arguments and picks a kernel by `attention_impl`.
"""
