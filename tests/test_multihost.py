"""Multi-host serving: the step broadcast on loopback, and `jaxinfer serve` as two real
processes on JAX's distributed runtime (one CPU device each, gloo between them)."""

from __future__ import annotations

import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
import pytest

from jaxinfer.errors import ConfigError
from jaxinfer.parallel.multihost import (
    DistributedConfig,
    LeaderLostError,
    Message,
    StepBroadcast,
    StepFollower,
    WorkerLostError,
    decode,
    encode,
)
from serve.client import InferenceClient

ROOT = Path(__file__).parent.parent
TINY = ROOT / "tests" / "data" / "tiny" / "llama"
READY = re.compile(r"listening on ([\d.]+:\d+)")
TIMEOUT = 2.0  # worker timeout of the loopback tests, seconds
BOUND = 15.0  # a lost process must show within this many seconds (worker timeout 5 s)


def _free_port_pair() -> int:
    """A port P with P and P + 1 free (the coordinator and the step broadcast)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise AssertionError("no free pair of ports")


def _wait_for(condition: Callable[[], bool], limit: float) -> float:
    """Seconds until `condition()` held (fails past `limit`)."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < limit, f"not within {limit} s"
        time.sleep(0.05)
    return time.monotonic() - start


# --------------------------------------------------------------------------- the channel


def test_frames_carry_arrays_and_statics_exactly() -> None:
    arrays = [np.arange(6, dtype=np.int32).reshape(2, 3), np.array([True, False]),
              np.zeros((0,), np.float32), np.array([[1, 2]], np.uint32)]
    frame = encode(Message("step", {"num_top_logprobs": 5, "prompt_logprobs": True}, arrays))
    got = decode(frame[8:])
    assert got.kind == "step" and got.statics == {"num_top_logprobs": 5, "prompt_logprobs": True}
    for want, have in zip(arrays, got.arrays, strict=True):
        assert have.dtype == want.dtype and np.array_equal(have, want)
    with pytest.raises(ValueError, match="holds"):
        decode(frame[8:] + b"\0")


def _pair(followers: int = 1) -> tuple[StepBroadcast, list[StepFollower]]:
    leader = StepBroadcast(("127.0.0.1", 0), followers, TIMEOUT, connect_timeout=10)
    return leader, [StepFollower(("127.0.0.1", leader.port), i + 1, TIMEOUT, connect_timeout=10)
                    for i in range(followers)]


def test_followers_get_every_call_in_order_then_stop() -> None:
    leader, followers = _pair(2)
    received: list[list[Message]] = [[], []]

    def follow(i: int) -> None:
        received[i].extend(followers[i].messages())
        followers[i].close()  # hang up, as a follower does after leaving JAX's runtime

    threads = [threading.Thread(target=follow, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for n in range(5):
        leader.send(Message("record", arrays=[np.full((n + 1,), n, np.int32)]))
    time.sleep(3 * TIMEOUT)  # heartbeats keep both alive past the timeout
    assert leader.lost is None
    leader.close()
    for thread in threads:
        thread.join(10)
    for messages in received:
        assert [(m.kind, m.arrays[0].tolist()) for m in messages] == [
            ("record", [n] * (n + 1)) for n in range(5)]


def test_a_closed_follower_is_lost_at_once_and_sends_fail() -> None:
    leader, (follower,) = _pair()
    leader.send(Message("record"))
    lost: list[WorkerLostError] = []
    leader.on_lost(lost.append)
    follower.close()
    _wait_for(lambda: bool(lost), 5.0)
    assert "process 1 closed its connection" in str(lost[0])  # not by the timeout
    with pytest.raises(WorkerLostError, match="process 1"):
        leader.send(Message("record"))
    late: list[WorkerLostError] = []
    leader.on_lost(late.append)  # registered after the loss: told at once
    assert len(late) == 1 and len(lost) == 1
    leader.close()


def test_a_silent_follower_is_lost_after_the_worker_timeout() -> None:
    leader = StepBroadcast(("127.0.0.1", 0), 1, TIMEOUT, connect_timeout=10)
    lost: list[WorkerLostError] = []
    leader.on_lost(lost.append)
    with socket.create_connection(("127.0.0.1", leader.port)) as silent:  # hello, then nothing
        silent.sendall(encode(Message("hello", {"protocol": 1, "process_id": 1})))
        waited = _wait_for(lambda: bool(lost), 4 * TIMEOUT)
    assert waited > TIMEOUT * 0.9 and "sent no heartbeat" in str(lost[0])
    leader.close()


def test_a_follower_sees_its_leader_go() -> None:
    leader, (follower,) = _pair()
    leader.send(Message("record"))
    leader._server.close()
    for peer in leader._peers.values():  # the leader's process died: its sockets close
        peer.sock.close()
    with pytest.raises(LeaderLostError):
        list(follower.messages())
    assert follower.leader_lost.is_set()


def test_a_stranger_is_refused_and_followers_still_connect() -> None:
    leader = StepBroadcast(("127.0.0.1", 0), 1, TIMEOUT, connect_timeout=10)
    with socket.create_connection(("127.0.0.1", leader.port)) as stranger:
        stranger.sendall(encode(Message("hello", {"protocol": 1, "process_id": 7})))
        assert stranger.recv(1) == b""  # refused: process 7 of a 2-process job
    follower = StepFollower(("127.0.0.1", leader.port), 1, TIMEOUT, connect_timeout=10)
    leader.send(Message("record"))
    assert next(follower.messages()).kind == "record"
    follower.close()
    leader.close()


def test_a_follower_that_never_comes_is_an_error_not_a_hang() -> None:
    leader = StepBroadcast(("127.0.0.1", 0), 1, TIMEOUT, connect_timeout=0.5)
    with pytest.raises(WorkerLostError, match=r"processes \[1\] did not connect"):
        leader.send(Message("record"))
    leader.close()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"num_processes": 0}, "num_processes must be >= 1"),
    ({"num_processes": 2, "process_id": 2}, r"process_id must be in \[0, num_processes\)"),
    ({"coordinator_address": "nohost"}, "must be HOST:PORT"),
    ({"worker_timeout": 0}, "worker_timeout must be > 0"),
])
def test_distributed_settings_are_checked(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        DistributedConfig(**kwargs)


# --------------------------------------------------------------------------- two processes


class _Serve:
    """`jaxinfer serve --process-id I` of a two-process job, its stderr in a queue."""

    def __init__(self, index: int, port: int, flags: list[str]) -> None:
        command = [sys.executable, "-m", "serve.cli", "serve", "--port", "0", "--no-metrics",
                   "--coordinator-address", f"127.0.0.1:{port}", "--num-processes", "2",
                   "--process-id", str(index), "--worker-timeout", "5", *flags]
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        env.pop("XLA_FLAGS", None)  # one CPU device per process
        self.proc = subprocess.Popen(command, cwd=ROOT, env=env, stderr=subprocess.PIPE,
                                     text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=lambda: [self.lines.put(line) for line in self.proc.stderr],
                         daemon=True).start()

    def wait_for_line(self, pattern: re.Pattern | str, limit: float) -> re.Match:
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=1)
            except queue.Empty:
                assert self.proc.poll() is None, "".join(self.log)[-3000:]
                continue
            self.log.append(line)
            if match := re.search(pattern, line):
                return match
        raise AssertionError(f"no {pattern!r} within {limit} s: {''.join(self.log)[-3000:]}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


def _start_job(flags: list[str]) -> tuple[_Serve, _Serve, str]:
    port = _free_port_pair()
    leader, follower = _Serve(0, port, flags), _Serve(1, port, flags)
    address = leader.wait_for_line(READY, 600).group(1)
    follower.wait_for_line("process 1 of 2 following", 60)
    return leader, follower, address


def test_two_processes_split_data_parallel_ranks_and_stop_together() -> None:
    """Tiny Llama, one data-parallel rank per process: a rank's rows come from the other
    host's device. SIGTERM on process 0 stops process 1 too."""
    from jaxinfer import LLM, SamplingParams

    flags = ["--model", str(TINY), "--data-parallel-size", "2", "--max-model-len", "128",
             "--block-size", "16", "--max-num-seqs", "2"]
    prompts = [[1, 5, 9, 13], [1, 7, 7, 2, 30], [1, 40], [1, 3, 3, 3, 3, 3, 3]]
    params = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    want = LLM(str(TINY), max_model_len=128, block_size=16).generate(
        prompt_token_ids=prompts, sampling_params=SamplingParams(**params))
    leader, follower, address = _start_job(flags)
    try:
        with InferenceClient(address, timeout=300) as client:
            results: list = [None] * len(prompts)
            threads = [threading.Thread(target=lambda i=i: results.__setitem__(
                i, client.complete(token_ids=prompts[i], **params))) for i in range(len(prompts))]
            for thread in threads:  # at once, so both ranks get sequences
                thread.start()
            for thread in threads:
                thread.join(300)
            assert [r.token_ids for r in results] == [w.token_ids for w in want]
        leader.proc.send_signal(signal.SIGTERM)
        assert leader.proc.wait(120) == 0
        follower.wait_for_line(r"process 1 stopped after \d+ calls", 60)
        assert follower.proc.wait(60) == 0
    finally:
        leader.kill()
        follower.kill()


@pytest.mark.real_model
def test_gemma3_split_over_two_processes_matches_hf_and_survives_a_lost_worker(
        reference: dict) -> None:
    """Real Gemma 3 270M, TP=2 with one shard per process: greedy equal to the HF
    references; then process 1 is killed mid-stream and process 0 reports it."""
    leader, follower, address = _start_job(
        ["--tensor-parallel-size", "2", "--max-model-len", "256", "--max-num-seqs", "4"])
    try:
        with InferenceClient(address, timeout=300) as client:
            cases = [c for c in reference["cases"].values() if len(c["prompt_ids"]) <= 32]
            for case in cases:
                got = client.complete(token_ids=case["prompt_ids"], temperature=0.0,
                                      ignore_eos=True, max_tokens=reference["new_tokens"])
                assert got.token_ids == case["greedy_ids"], case["prompt"]

            stream = client.generate(token_ids=cases[0]["prompt_ids"], max_tokens=200,
                                     temperature=0.0, ignore_eos=True)
            next(stream)  # mid-stream
            follower.proc.kill()
            killed = time.monotonic()
            with pytest.raises(grpc.RpcError) as info:
                for _ in stream:
                    pass
            assert time.monotonic() - killed < BOUND
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "process 1" in info.value.details()
            _wait_for(lambda: client.health() == "NOT_SERVING", BOUND)
            with pytest.raises(grpc.RpcError) as refused:
                client.complete(token_ids=[2, 818], max_tokens=2)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        leader.proc.send_signal(signal.SIGTERM)
        assert leader.proc.wait(120) == 0
    finally:
        leader.kill()
        follower.kill()
