"""Server settings: one frozen dataclass, validated with messages a user can act on."""

from __future__ import annotations

from dataclasses import dataclass

from jaxinfer.errors import ConfigError


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 50051  # 0 = any free port
    metrics_port: int | None = 9090  # None = no metrics endpoint; 0 = any free port
    max_waiting: int = 64  # queued sequences; past it Generate answers RESOURCE_EXHAUSTED
    retry_after_ms: int = 500  # the retry hint sent with RESOURCE_EXHAUSTED
    shutdown_grace: float = 30.0  # seconds in-flight streams get to finish on SIGTERM

    def __post_init__(self) -> None:
        _check(0 <= self.port <= 65535, "port", "in [0, 65535]", self.port)
        ok = self.metrics_port is None or 0 <= self.metrics_port <= 65535
        _check(ok, "metrics_port", "None or in [0, 65535]", self.metrics_port)
        _check(self.max_waiting >= 1, "max_waiting", ">= 1", self.max_waiting)
        _check(self.retry_after_ms >= 0, "retry_after_ms", ">= 0", self.retry_after_ms)
        _check(self.shutdown_grace >= 0, "shutdown_grace", ">= 0 seconds", self.shutdown_grace)

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


def _check(ok: bool, name: str, allowed: str, value: object) -> None:
    if not ok:
        raise ConfigError(f"ServerConfig.{name} must be {allowed}, got {value!r}")
