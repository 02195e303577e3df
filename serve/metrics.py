"""Server metrics on the engine's Prometheus registry: RPCs by method and status.

The engine's own gauges and histograms (queues, KV blocks, TTFT, ...) come from
`jaxinfer.engine.metrics.PrometheusMetrics`; this adds what only the server
sees: every RPC's final status code, and the streams open now.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server


class ServerMetrics:
    def __init__(self, registry: CollectorRegistry, open_streams: Callable[[], int]) -> None:
        self.requests = Counter("jaxinfer_grpc_requests", "gRPC requests by method and status",
                                ["method", "code"], registry=registry)
        streams = Gauge("jaxinfer_grpc_open_streams", "Generate streams open now",
                        registry=registry)
        streams.set_function(open_streams)

    def count(self, method: str, code: grpc.StatusCode) -> None:
        self.requests.labels(method=method, code=code.name).inc()


class MetricsEndpoint:
    """`registry` over HTTP at http://host:port/metrics, in a daemon thread."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        self._httpd, self._thread = start_http_server(port, addr=host, registry=registry)
        self.port: int = self._httpd.server_port

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)
