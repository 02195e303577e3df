"""JAX's persistent compilation cache, on by default for the `jaxinfer` commands.

Compiling the step functions of a real model takes most of a cold start (tens
of seconds on a CPU). With the cache on, every compiled program is written to
a folder keyed by its HLO, the backend and the JAX version, and a later
process that compiles the same program reads it back instead.

Where it lives, first match wins:
1. `enable(path)` (the CLI's `--compilation-cache-dir DIR`);
2. the environment variable `JAXINFER_COMPILATION_CACHE`, when set and not empty;
3. `$XDG_CACHE_HOME/jaxinfer/xla`, else `~/.cache/jaxinfer/xla`.
The value `off` (in 1 or 2) turns it off; JAX's own settings are then left
alone. Delete the folder to clear it; stale entries are never read, since a
changed program has another key.

`enable` must run before the first compilation of the process to cover it;
the CLI calls it first thing, and library users call it themselves:

    from jaxinfer import compilation_cache
    compilation_cache.enable()          # or enable("/fast/disk/xla"), enable("off")
"""

from __future__ import annotations

import os
from pathlib import Path

from jaxinfer.errors import ConfigError

ENV_VAR = "JAXINFER_COMPILATION_CACHE"
OFF = "off"


def default_dir() -> Path:
    """`$XDG_CACHE_HOME/jaxinfer/xla`, else `~/.cache/jaxinfer/xla`."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "jaxinfer" / "xla"


def cache_dir(path: str | os.PathLike[str] | None = None) -> Path | None:
    """The folder `enable(path)` would use, or None when the cache is off."""
    chosen = os.fspath(path) if path is not None else os.environ.get(ENV_VAR)
    if chosen is None or chosen == "":
        return default_dir()
    return None if chosen == OFF else Path(chosen).expanduser()


def enable(path: str | os.PathLike[str] | None = None) -> Path | None:
    """Turn the persistent compilation cache on in `path` (see the module docstring
    for the default and for `off`); returns the folder, or None when off.

    Every program is cached, however quick its compilation or small its entry:
    a server's step shapes are many small programs, and together they are the
    cold start.
    """
    folder = cache_dir(path)
    if folder is None:
        return None
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create the compilation cache folder {folder} ({exc.strerror}):"
                          f" pick another with --compilation-cache-dir or {ENV_VAR}, or turn "
                          f"it off with {ENV_VAR}={OFF}") from None
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    compilation_cache.reset_cache()  # a process that compiled already picks up the folder
    return folder
