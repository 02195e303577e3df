"""The gRPC server: `Inference` over an AsyncLLMEngine, plus health, reflection
and a Prometheus endpoint.

Threads: grpc.aio handlers run on one asyncio loop; the engine steps in its
own thread (AsyncLLMEngine) and hands deltas to per-request unbounded queues,
so a slow client never stalls the device loop; the metrics endpoint serves
from a daemon thread and reads engine gauges at scrape time.

Shutdown (SIGTERM or SIGINT under `run`, or `InferenceServer.shutdown`):
1. health turns NOT_SERVING, so load balancers stop routing here;
2. new Generate calls get UNAVAILABLE (the other RPCs still answer);
3. open streams get `shutdown_grace` seconds to finish; any still open are
   aborted (their last message says FINISH_REASON_ABORT);
4. the gRPC server stops, the engine thread and the metrics endpoint close.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import grpc
import jax
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from jaxinfer.engine.async_engine import AsyncLLMEngine
from jaxinfer.engine.llm_engine import LLMEngine
from jaxinfer.engine.metrics import PrometheusMetrics
from jaxinfer.errors import ConfigError
from serve.config import ServerConfig
from serve.metrics import MetricsEndpoint, ServerMetrics
from serve.model_info import model_info
from serve.proto.jaxinfer.v1 import inference_pb2 as pb
from serve.servicer import InferenceServicer
from serve.wire import tolerant

logger = logging.getLogger(__name__)
SERVICE = pb.DESCRIPTOR.services_by_name["Inference"]
SERVICE_NAME = SERVICE.full_name  # "jaxinfer.v1.Inference"
ABORT_WAIT = 5.0  # seconds aborted streams get to send their last message
ENGINE_POLL = 0.5  # seconds between checks that the engine loop is alive
T = TypeVar("T")


class InferenceServer:
    """One model behind one gRPC port; `start()` and `shutdown()` on a running loop."""

    def __init__(self, engine: LLMEngine, config: ServerConfig | None = None) -> None:
        self.config = config or ServerConfig()
        self.engine = engine
        self.front = AsyncLLMEngine(engine)
        self.prometheus = PrometheusMetrics(engine.snapshot, engine.stats)
        metrics = ServerMetrics(self.prometheus.registry, lambda: self.front.num_open_streams)
        self.servicer = InferenceServicer(self.front, self.config, metrics, model_info(engine))
        self.health = health.aio.HealthServicer()
        self.port: int | None = None
        self.metrics_port: int | None = None
        self._server: grpc.aio.Server | None = None
        self._endpoint: MetricsEndpoint | None = None
        self._watch: asyncio.Task | None = None

    async def start(self) -> None:
        """Listen (metrics first, then gRPC) and report SERVING; a port that cannot
        be bound is a ConfigError naming it."""
        if self.config.metrics_port is not None:
            self._endpoint = _metrics_endpoint(self.prometheus, self.config)
            self.metrics_port = self._endpoint.port
        server = grpc.aio.server()
        _add_inference(server, self.servicer)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        try:
            self.port = _bind(server, self.config.address)
        except ConfigError:
            self.front.shutdown()
            if self._endpoint is not None:
                self._endpoint.close()
            raise
        await server.start()
        self._server = server
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._watch = asyncio.create_task(self._watch_engine())

    async def _watch_engine(self) -> None:
        """Health turns NOT_SERVING if the engine loop dies (every Generate would fail)."""
        while self.front.error is None:
            await asyncio.sleep(ENGINE_POLL)
        logger.error("the engine loop failed: %r; health is NOT_SERVING", self.front.error)
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    async def shutdown(self, grace: float | None = None) -> None:
        """Drain and stop (the module docstring's sequence); safe to call twice."""
        if self._server is None:
            return
        server, self._server = self._server, None
        if self._watch is not None:
            self._watch.cancel()
        grace = self.config.shutdown_grace if grace is None else grace
        await self.health.enter_graceful_shutdown()
        self.servicer.draining = True
        logger.info("shutting down: %d open streams, grace %.1fs",
                    len(self.servicer.active), grace)
        if not await self.servicer.drain(grace):
            logger.warning("aborting %d streams still open", len(self.servicer.active))
            self.servicer.abort_all()
            await self.servicer.drain(ABORT_WAIT)
        await server.stop(1.0)
        self.front.shutdown()
        if self._endpoint is not None:
            self._endpoint.close()


def _bind(server: grpc.aio.Server, address: str) -> int:
    try:
        port = server.add_insecure_port(address)
    except RuntimeError as exc:
        raise ConfigError(f"cannot listen on {address} (--host/--port): {exc}") from exc
    if port == 0:
        raise ConfigError(f"cannot listen on {address} (--host/--port)")
    return port


def _metrics_endpoint(prometheus: PrometheusMetrics, config: ServerConfig) -> MetricsEndpoint:
    try:
        return MetricsEndpoint(prometheus.registry, config.host, config.metrics_port or 0)
    except OSError as exc:
        raise ConfigError(f"cannot serve metrics on {config.host}:{config.metrics_port} "
                          f"(--metrics-port): {exc}") from exc


def _add_inference(server: grpc.aio.Server, servicer: InferenceServicer) -> None:
    """Register the Inference methods, decoding requests with `wire.tolerant`."""
    handlers = {}
    for method in SERVICE.methods:
        request_cls = getattr(pb, method.input_type.name)
        response_cls = getattr(pb, method.output_type.name)
        make = (grpc.unary_stream_rpc_method_handler if method.server_streaming
                else grpc.unary_unary_rpc_method_handler)
        handlers[method.name] = make(
            getattr(servicer, method.name), request_deserializer=tolerant(request_cls),
            response_serializer=response_cls.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME,
                                                                          handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


# --------------------------------------------------------------------------- entry points


def announce(server: InferenceServer) -> None:
    """The start-up line on stderr (tests read the port from it)."""
    host, engine = server.config.host, server.engine
    metrics = ("" if server.metrics_port is None
               else f", metrics on http://{host}:{server.metrics_port}/metrics")
    if jax.process_count() > 1:
        metrics += f", {jax.process_count()} processes over {engine.runner.num_devices} devices"
    print(f"jaxinfer serve: {engine.model.config.name} listening on {host}:{server.port}"
          f"{metrics} ({engine.runner.num_blocks} KV blocks of {engine.config.block_size} "
          "tokens)", file=sys.stderr, flush=True)


def run(engine: LLMEngine, config: ServerConfig,
        on_ready: Callable[[InferenceServer], None] | None = announce) -> int:
    """Serve until SIGTERM or SIGINT, then shut down gracefully; returns 0."""
    return asyncio.run(_serve(engine, config, on_ready))


async def _serve(engine: LLMEngine, config: ServerConfig,
                 on_ready: Callable[[InferenceServer], None] | None) -> int:
    server = InferenceServer(engine, config)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if on_ready is not None:
        on_ready(server)
    await stop.wait()
    await server.shutdown()
    return 0


class ServerThread:
    """An InferenceServer on its own event loop in a background thread
    (for tests and notebooks): `with ServerThread(engine, config) as s: s.address`."""

    def __init__(self, engine: LLMEngine, config: ServerConfig | None = None) -> None:
        self.server = InferenceServer(engine, config)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="jaxinfer-serve",
                                        daemon=True)

    def start(self) -> ServerThread:
        self._thread.start()
        self._call(self.server.start())
        return self

    def stop(self, grace: float = 0.0) -> None:
        """Shut down as on SIGTERM, with `grace` seconds for open streams."""
        self._call(self.server.shutdown(grace), timeout=grace + ABORT_WAIT + 30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    @property
    def address(self) -> str:
        return f"{self.server.config.host}:{self.server.port}"

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()
