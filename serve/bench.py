"""`jaxinfer bench serve`: drive a running `jaxinfer serve` over gRPC.

Requests leave at Poisson arrival times (`request_rate` per second; None
sends them all at once), optionally at most `max_concurrency` in flight; each
runs on its own thread over one shared channel and streams its tokens back.
The client clock gives TTFT (send to first token), ITL (gaps between token
messages), TPOT (mean gap after the first token) and end-to-end latency,
exactly as a user sees them, gRPC included.

Without `--server`, the benchmark starts an in-process server on a free
loopback port (`serve.server.ServerThread`) around an engine of its own.
The mode lives here, with the server it drives, and shares the report,
workload and llama.cpp pieces of the other modes (`jaxinfer.bench`).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import math
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

from jaxinfer.args import engine_config_from_args, load_from_args
from jaxinfer.bench.modes import comparison_peer, report_base, workload_facts, workload_from_args
from jaxinfer.bench.report import PEER
from jaxinfer.bench.stats import RequestRecord, run_summary
from jaxinfer.bench.workloads import BenchRequest, TokenSource, perturbed, token_source
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.llm_engine import LLMEngine
from jaxinfer.errors import ConfigError
from jaxinfer.weights import LoadedModel
from serve.client import InferenceClient
from serve.config import ServerConfig
from serve.server import ServerThread


def arrival_offsets(count: int, request_rate: float | None, seed: int = 0) -> list[float]:
    """Send times in seconds from the start: a Poisson process of `request_rate` per
    second (the first at 0), or all at 0 when the rate is None or infinite."""
    if request_rate is not None and not request_rate > 0:
        raise ConfigError(f"--request-rate must be > 0 (or inf), got {request_rate}")
    if request_rate is None or math.isinf(request_rate):
        return [0.0] * count
    gaps = np.random.default_rng(seed).exponential(1.0 / request_rate, size=count)
    return [0.0, *np.cumsum(gaps[:-1]).tolist()][:count]


@dataclass(frozen=True)
class ServerFacts:
    """What the benchmark needs to know about the server's model."""

    name: str
    max_model_len: int
    vocab_size: int
    has_tokenizer: bool


def server_facts(client: Any) -> ServerFacts:
    info = client.model_info()
    return ServerFacts(info.name, info.context_length, info.vocab_size, info.has_tokenizer)


def remote_token_source(client: Any, facts: ServerFacts) -> TokenSource:
    """Prompt ids from the server's own tokenizer (Tokenize RPC), else random ids."""
    if not facts.has_tokenizer:
        return token_source(None, facts.vocab_size)
    prefix = client.tokenize("", add_special_tokens=True)  # BOS, if the model wants one
    return token_source(lambda text: client.tokenize(text, add_special_tokens=False),
                        facts.vocab_size, prefix)


def stream_one(client: Any, request: BenchRequest, timeout: float | None) -> RequestRecord:
    """Send one request and time its token messages on the client clock."""
    start = time.perf_counter()
    stamps: list[float] = []
    tokens = 0
    try:
        for message in client.generate(token_ids=list(request.prompt_ids),
                                       max_tokens=request.output_len, temperature=0.0,
                                       ignore_eos=True, timeout=timeout):
            if message.token_ids:
                stamps.append(time.perf_counter())
                tokens += len(message.token_ids)
    except grpc.RpcError as exc:
        return RequestRecord(len(request.prompt_ids), tokens, None, None,
                             error=f"{exc.code().name}: {exc.details()}")
    if not stamps:
        return RequestRecord(len(request.prompt_ids), 0, None, None, error="no tokens")
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    return RequestRecord(len(request.prompt_ids), tokens, stamps[0] - start,
                         stamps[-1] - start, gaps)


def run_serving(client: Any, requests: Sequence[BenchRequest], *,
                request_rate: float | None, max_concurrency: int | None, seed: int = 0,
                timeout: float | None = None) -> tuple[list[RequestRecord], float]:
    """Every request at its arrival time; (records in request order, wall seconds)."""
    if max_concurrency is not None and max_concurrency < 1:
        raise ConfigError(f"--max-concurrency must be >= 1, got {max_concurrency}")
    offsets = arrival_offsets(len(requests), request_rate, seed)
    gate = threading.Semaphore(max_concurrency or len(requests))

    def gated(request: BenchRequest) -> RequestRecord:
        with gate:
            return stream_one(client, request, timeout)

    with ThreadPoolExecutor(max_workers=max(1, len(requests))) as pool:
        start = time.perf_counter()
        futures = []
        for offset, request in zip(offsets, requests, strict=True):
            time.sleep(max(0.0, start + offset - time.perf_counter()))
            futures.append(pool.submit(gated, request))
        records = [f.result() for f in futures]
    return records, time.perf_counter() - start


@contextlib.contextmanager
def local_server(model: LoadedModel, config: EngineConfig) -> Iterator[str]:
    """An in-process `jaxinfer serve` on a free loopback port; yields its address."""
    engine = LLMEngine(model, config)
    server = ServerThread(engine, ServerConfig(port=0, metrics_port=None, max_waiting=1 << 20))
    server.start()
    try:
        yield server.address
    finally:
        server.stop(grace=0.0)


@contextlib.contextmanager
def connect(target: str, timeout: float | None = None) -> Iterator[Any]:
    """An InferenceClient on `target`, checked with ModelInfo (a clear error if down)."""
    client = InferenceClient(target, timeout=timeout)
    try:
        try:
            client.model_info()
        except grpc.RpcError as exc:
            raise ConfigError(f"cannot reach jaxinfer serve at {target} (--server): "
                              f"{exc.code().name}") from None
        yield client
    finally:
        client.close()


def run_serve_mode(args: argparse.Namespace) -> dict[str, Any]:
    """`jaxinfer bench serve`: against `--server`, or an in-process server of its own."""
    with comparison_peer(args) as peer:
        if args.server:
            with connect(args.server, args.timeout) as client:
                return _serve_report(args, client, peer, load_s=None)
        model = load_from_args(args)
        with local_server(model, engine_config_from_args(args)) as address, \
                connect(address, args.timeout) as client:
            return _serve_report(args, client, peer, load_s=model.load_seconds)


def _serve_report(args: argparse.Namespace, client: Any, peer: Any,
                  load_s: float | None) -> dict[str, Any]:
    info = client.model_info()
    facts = server_facts(client)
    report = report_base(args, facts.name, {"max_model_len": facts.max_model_len,
                                            "max_num_seqs": info.max_num_seqs,
                                            "server": args.server or "in-process"})
    workload = workload_from_args(args, remote_token_source(client, facts), facts.max_model_len)
    report["workload"] = workload_facts(workload)
    concurrency = args.max_concurrency or info.max_num_seqs  # llama.cpp's n_seq_max
    slos = {"ttft_slo": _seconds(args.ttft_slo), "tpot_slo": _seconds(args.tpot_slo)}
    settings = {"request_rate": args.request_rate, "seed": args.seed}
    report["slo"] = slos
    if args.warmup:
        run_serving(client, perturbed(workload, facts.vocab_size).requests,
                    max_concurrency=args.max_concurrency, timeout=args.timeout, **settings)
    records, seconds = run_serving(client, workload.requests,
                                   max_concurrency=args.max_concurrency,
                                   timeout=args.timeout, **settings)
    tag = {"concurrency": args.max_concurrency or len(workload.requests), **settings}
    report["jaxinfer"] = {"runs": [{**tag, **run_summary(records, seconds, **slos)}]}
    if load_s is not None:
        report["jaxinfer"]["load_s"] = load_s
    if peer is not None:
        arrivals = arrival_offsets(len(workload.requests), args.request_rate, args.seed)
        theirs, their_seconds = peer.generate(workload.requests, concurrency, arrivals)
        report[PEER] = {"runs": [{**tag, **run_summary(theirs, their_seconds, **slos)}],
                        "load_s": peer.load_seconds}
    return report


def _seconds(ms: float | None) -> float | None:
    return None if ms is None else ms / 1000
