"""Errors a user can act on. Each names the offending input and what is allowed."""


class JaxinferError(Exception):
    """Base class for every error jaxinfer raises on purpose."""


class ConfigError(JaxinferError, ValueError):
    """An invalid model, engine or sampling setting."""


class ModelLoadError(JaxinferError):
    """A checkpoint is missing, corrupt, truncated or of an unsupported kind."""


class RequestError(JaxinferError, ValueError):
    """A request that cannot be served as given (prompt too long, bad token id, ...)."""
