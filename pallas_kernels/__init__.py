"""Pallas kernels, one per file, each beside its plain-jnp reference.

The attention kernels (tiled prefill attention, paged decode attention) land
with the paged KV cache; until then every step uses the XLA reference in
`jaxinfer.ops.attention`.
"""
