"""Graceful shutdown: `jaxinfer serve` as a real process under SIGTERM, and the
abort of streams still open when the grace period ends."""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc

from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.llm_engine import LLMEngine
from jaxinfer.weights import load_model
from serve.client import InferenceClient, collect
from serve.config import ServerConfig
from serve.server import ServerThread

ROOT = Path(__file__).parent.parent
TINY = ROOT / "tests" / "data" / "tiny" / "llama"
LONG = {"max_tokens": 120, "temperature": 0.0, "ignore_eos": True}
ENDLESS = {"max_tokens": 4000, "temperature": 0.0, "ignore_eos": True}
READY = re.compile(r"listening on ([\d.]+:\d+), metrics on http://[\d.]+:(\d+)/metrics")


def _start_server() -> tuple[subprocess.Popen, threading.Thread, queue.Queue, str, int]:
    """`jaxinfer serve` on the tiny model, one sequence at a time; (process, stderr
    reader, stderr lines, address, metrics port) once it is listening."""
    command = [sys.executable, "-m", "serve.cli", "serve", "--model", str(TINY),
               "--port", "0", "--metrics-port", "0", "--max-model-len", "128",
               "--block-size", "16", "--max-num-seqs", "1", "--shutdown-grace", "60"]
    proc = subprocess.Popen(command, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr],
                              daemon=True)
    reader.start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            match = READY.search(lines.get(timeout=1))
        except queue.Empty:
            assert proc.poll() is None, f"serve exited with {proc.returncode}"
            continue
        if match:
            return proc, reader, lines, match.group(1), int(match.group(2))
    proc.kill()
    raise AssertionError("serve did not start within 120 s")


def _gauge(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def _wait_for(condition: Callable[[], bool], limit: float = 10.0) -> None:
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_sigterm_finishes_in_flight_streams_then_exits_0() -> None:
    proc, reader, lines, address, metrics_port = _start_server()
    try:
        client = InferenceClient(address, timeout=120)
        calls = [client.generate(token_ids=[5, 6, 7], **LONG)]
        first = next(calls[0])  # after prefill; two more wait behind it (max_num_seqs 1)
        calls += [client.generate(token_ids=[5 + i, 6, 7], **LONG) for i in (1, 2)]
        _wait_for(lambda: _gauge(metrics_port, "jaxinfer_grpc_open_streams") == 3)
        proc.send_signal(signal.SIGTERM)
        assert client.health() == "NOT_SERVING"
        try:
            list(client.generate(token_ids=[1, 2], max_tokens=2))
            raise AssertionError("a new request was accepted while draining")
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc.details()
        results = [collect([first, *calls[0]])] + [collect(call) for call in calls[1:]]
        for result in results:
            assert result.samples[0].finish_reason == "length"
            assert len(result.samples[0].token_ids) == LONG["max_tokens"]
        assert proc.wait(timeout=60) == 0
        reader.join(timeout=10)
        log = "".join(lines.queue)
        assert "shutting down: 3 open streams" in log and "Traceback" not in log
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


def long_context_tiny(folder: Path) -> Path:
    """The tiny Llama with a 4,096-position context (RoPE takes any position)."""
    shutil.copytree(TINY, folder)
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = 4096
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_streams_open_past_the_grace_period_end_with_abort(tmp_path: Path) -> None:
    # A stream far longer than the shutdown takes: the tiny model decodes a token in
    # well under a millisecond, so 120 tokens could end before the abort lands.
    model = load_model(long_context_tiny(tmp_path / "tiny"))
    engine = LLMEngine(model, EngineConfig(max_model_len=4096, max_num_seqs=8, block_size=16))
    running = ServerThread(engine, ServerConfig(port=0, metrics_port=None)).start()
    with InferenceClient(running.address, timeout=60) as client:
        call = client.generate(token_ids=[9, 8, 7], **ENDLESS)
        first = next(call)
        stopper = threading.Thread(target=running.stop, kwargs={"grace": 0.0})
        stopper.start()
        result = collect([first, *call])
        stopper.join(timeout=30)
    (sample,) = result.samples
    assert sample.finish_reason == "abort" and 0 < len(sample.token_ids) < ENDLESS["max_tokens"]
    assert sample.usage.completion_tokens == len(sample.token_ids)
    assert engine.blocks.num_used == 0
