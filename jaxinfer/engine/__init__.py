"""The host side of serving: block management and scheduling (pure Python, no jax)."""
