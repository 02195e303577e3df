"""Core types and rules of the step, and the attention entry point.

- `types.py`: `AttentionMetadata` (where the step's tokens sit in their
  sequences and in the KV pool) and `NO_WINDOW`.
- `int8.py`: the one symmetric int8 rule (KV cache, int8 weights, w8a8 activations).
- `attention.py`: picks the XLA reference or a Pallas kernel and writes K/V.

Kernels (`pallas_kernels/`) depend on none of this: they take plain arrays.
"""
