"""Attention entry points: pick the Pallas kernel or the XLA reference."""
