"""The `jaxinfer` console command: the engine's commands and the server's, in one parser.

    jaxinfer generate | convert | serve | client | perplexity | bench {latency,offline,serve}

`jaxinfer.cli` holds the commands that need only the engine; `serve` sits
above `jaxinfer`, so whatever starts a server or talks to one is here:
`serve`, `client`, and the `bench serve` mode. This module composes the two
lists; it is the one place that sees every command. Building the parser
loads no JAX: each handler imports what it runs.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from jaxinfer import cli
from jaxinfer.args import (
    Command,
    add_compilation_cache_flag,
    add_distributed_flags,
    add_engine_flags,
    add_model_flags,
    distributed_config_from_args,
    enable_compilation_cache,
    engine_config_from_args,
    load_from_args,
)
from jaxinfer.bench.cli import BENCH_MODES, BenchMode, Report, add_workload_flags, bench_command
from serve.client import DEFAULT_SERVER, add_sampling_flags

if TYPE_CHECKING:
    from jaxinfer.parallel.multihost import Process, StepBroadcast


def main(argv: Sequence[str] | None = None) -> int:
    return cli.main(argv, COMMANDS)


def build_parser() -> argparse.ArgumentParser:
    return cli.build_parser(COMMANDS)


def _add_serve(parser: argparse.ArgumentParser) -> None:
    add_model_flags(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=50051, help="gRPC port (0 = any free)")
    parser.add_argument("--metrics-port", type=int, default=9090,
                        help="Prometheus /metrics port (0 = any free)")
    parser.add_argument("--no-metrics", action="store_true", help="no metrics endpoint")
    parser.add_argument("--max-waiting", type=int, default=64,
                        help="queued sequences before RESOURCE_EXHAUSTED")
    parser.add_argument("--retry-after-ms", type=int, default=500,
                        help="retry hint sent with RESOURCE_EXHAUSTED")
    parser.add_argument("--shutdown-grace", type=float, default=30.0,
                        help="seconds open streams get to finish on SIGTERM")
    parser.add_argument("--warmup", action="store_true",
                        help="compile every step shape before serving (slow on CPU)")
    add_engine_flags(parser)
    add_distributed_flags(parser)
    add_compilation_cache_flag(parser)
    parser.set_defaults(handler=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    import logging

    from jaxinfer.engine.llm_engine import LLMEngine
    from serve.config import ServerConfig
    from serve.server import run

    log = logging.getLogger("serve")  # server events on stderr, not via the root logger
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    config = ServerConfig(
        host=args.host, port=args.port, metrics_port=None if args.no_metrics else args.metrics_port,
        max_waiting=args.max_waiting, retry_after_ms=args.retry_after_ms,
        shutdown_grace=args.shutdown_grace,
    )
    process = _join_job(args)
    enable_compilation_cache(args)
    loaded = load_from_args(args)
    engine_config = engine_config_from_args(args)
    if process is not None and not process.is_leader:
        from jaxinfer.engine.follower import run_follower

        return run_follower(loaded, engine_config, process, args.worker_timeout)
    broadcast = _step_broadcast(process, args.worker_timeout)
    try:
        engine = LLMEngine(loaded, engine_config, step_broadcast=broadcast)
        if args.warmup:
            print(f"[warmup: {engine.warmup()} compiled step shapes]", file=sys.stderr)
        return run(engine, config)
    finally:
        if broadcast is not None:
            broadcast.close()


def _join_job(args: argparse.Namespace) -> Process | None:
    """This process's place in a multi-host job, joined before any device is touched;
    None when the flags ask for none."""
    from jaxinfer.parallel.multihost import initialize

    distributed = distributed_config_from_args(args)
    return initialize(distributed) if distributed.enabled else None


def _step_broadcast(process: Process | None, worker_timeout: float) -> StepBroadcast | None:
    """On process 0 of several, the channel its followers connect to."""
    from jaxinfer.parallel.multihost import StepBroadcast

    if process is None or process.count == 1:
        return None
    return StepBroadcast(process.broadcast_address, process.count - 1, worker_timeout)


def _add_client(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", nargs="?", default=None, help="the prompt text")
    parser.add_argument("--server", default=DEFAULT_SERVER, help="host:port of jaxinfer serve")
    parser.add_argument("--token-ids", default=None,
                        help="comma-separated prompt token ids instead of text")
    parser.add_argument("--chat", action="store_true", help="send the prompt as a user message")
    parser.add_argument("--system", default=None, help="a system message (with --chat)")
    parser.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    parser.add_argument("--json", action="store_true", help="print one JSON object at the end")
    add_sampling_flags(parser)
    parser.set_defaults(handler=run_client)


def run_client(args: argparse.Namespace) -> int:
    from serve.client import run_client as run

    return run(args)


def _add_bench_serve(parser: argparse.ArgumentParser) -> None:
    add_workload_flags(parser, "mixed")
    parser.add_argument("--server", default=None,
                        help="host:port of jaxinfer serve (default: start one in-process)")
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="Poisson arrivals per second (default inf: all at once)")
    parser.add_argument("--max-concurrency", type=int, default=None,
                        help="requests in flight at most")
    parser.add_argument("--ttft-slo", type=float, default=None, help="TTFT target, ms")
    parser.add_argument("--tpot-slo", type=float, default=None, help="TPOT target, ms")
    parser.add_argument("--timeout", type=float, default=None, help="per-request deadline, s")


def _run_bench_serve(args: argparse.Namespace) -> Report:
    from serve.bench import run_serve_mode

    return run_serve_mode(args)


BENCH_SERVE = BenchMode("serve", "TTFT/TPOT/ITL and goodput of jaxinfer serve over gRPC",
                        _add_bench_serve, _run_bench_serve)
SERVE = Command("serve", "serve a model over gRPC", _add_serve)
CLIENT = Command("client", "stream a completion from jaxinfer serve", _add_client)
COMMANDS = (cli.GENERATE, cli.CONVERT, SERVE, CLIENT, cli.PERPLEXITY,
            bench_command((*BENCH_MODES, BENCH_SERVE)))


if __name__ == "__main__":
    sys.exit(main())
