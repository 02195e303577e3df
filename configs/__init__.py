"""Model presets, installed as the `jaxinfer.presets` package (see pyproject.toml)."""
