"""Multi-host serving: JAX's distributed runtime plus a step broadcast from process 0.

Multi-controller JAX runs one Python process per host; every process must make
the same jitted calls, in the same order, with the same host inputs, while the
devices exchange activations over ICI, NCCL or gloo. Process 0 (the leader)
runs the scheduler and the front end. Before each device call its runner sends
the call's host inputs (a few small integer arrays) to every other process (the
followers) over a TCP connection; a follower's runner makes the same call with
them and keeps its shards of the KV cache in step. Outputs are replicated, so
the leader reads the sampled tokens from its own devices.

Failure: a follower sends a heartbeat every `worker_timeout / 4` seconds from a
thread of its own (it keeps beating while its device call waits on the
others). The leader counts a follower lost when its connection closes (the
process died, its host went down) or no heartbeat came for `worker_timeout`
seconds (the process hangs or its network is gone), and calls its `on_lost`
callbacks once: the engine fails every open request and health turns
NOT_SERVING. JAX's own runtime would abort the leader when a follower dies;
`initialize` turns on `jax_enable_recoverability` so that the leader lives on to
report it. A follower whose leader is gone stops (`LeaderLostError`).

Wire format, one frame per message: an 8-byte length, then a 4-byte header
length, a JSON header (kind, static arguments, each array's dtype and shape)
and the arrays' raw bytes. Nothing is unpickled.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jaxinfer.errors import ConfigError, JaxinferError

logger = logging.getLogger(__name__)

PROTOCOL = 1
HEARTBEAT = "heartbeat"
STOP = "stop"
DEFAULT_WORKER_TIMEOUT = 10.0  # seconds without a heartbeat before a follower counts as lost
CONNECT_TIMEOUT = 300.0  # seconds the leader waits for every follower to connect
_LENGTH = struct.Struct("!Q")
_HEADER = struct.Struct("!I")


class WorkerLostError(JaxinferError):
    """A follower process died or stopped answering: the mesh cannot run a step."""


class LeaderLostError(JaxinferError):
    """The leader (process 0) closed its connection: a follower has nothing to run."""


@dataclass(frozen=True)
class DistributedConfig:
    """How this process joins a multi-host job (all None and auto False: it does not).

    Any of the three settings left None is auto-detected by
    `jax.distributed.initialize` (Cloud TPU, SLURM, ...); `auto=True` with none
    set detects all three.
    """

    coordinator_address: str | None = None  # HOST:PORT of process 0
    num_processes: int | None = None
    process_id: int | None = None
    auto: bool = False
    worker_timeout: float = DEFAULT_WORKER_TIMEOUT

    def __post_init__(self) -> None:
        if self.num_processes is not None and self.num_processes < 1:
            raise ConfigError(f"num_processes must be >= 1, got {self.num_processes}")
        if self.process_id is not None and not (
                0 <= self.process_id < (self.num_processes or self.process_id + 1)):
            raise ConfigError(f"process_id must be in [0, num_processes), got {self.process_id}")
        if self.worker_timeout <= 0:
            raise ConfigError(f"worker_timeout must be > 0 seconds, got {self.worker_timeout}")
        if self.coordinator_address is not None:
            _split_address(self.coordinator_address)

    @property
    def enabled(self) -> bool:
        return self.auto or any(v is not None for v in (
            self.coordinator_address, self.num_processes, self.process_id))


@dataclass(frozen=True)
class Process:
    """This process's place in an initialized multi-host job."""

    index: int
    count: int
    coordinator_address: str

    @property
    def is_leader(self) -> bool:
        return self.index == 0

    @property
    def broadcast_address(self) -> tuple[str, int]:
        """Where the leader listens for followers: the coordinator's host, port + 1
        (process 0 runs JAX's coordinator, so the host is the leader's)."""
        host, port = _split_address(self.coordinator_address)
        return host, port + 1


def initialize(config: DistributedConfig) -> Process:
    """Join the job (`jax.distributed.initialize`); call before anything touches a device."""
    import jax
    from jax._src import distributed

    # Keep the leader alive when a follower dies, so it can report the loss.
    jax.config.update("jax_enable_recoverability", True)
    jax.distributed.initialize(
        coordinator_address=config.coordinator_address, num_processes=config.num_processes,
        process_id=config.process_id,
        heartbeat_timeout_seconds=max(1, int(config.worker_timeout)))
    address = distributed.global_state.coordinator_address
    return Process(jax.process_index(), jax.process_count(), address)


def leave() -> None:
    """Disconnect from JAX's runtime (a follower, before it hangs up on the leader)."""
    import jax

    jax.distributed.shutdown()


def agree_on_minimum(value: int) -> int:
    """The smallest `value` over all processes (every process must call it)."""
    import jax
    from jax.experimental import multihost_utils

    if jax.process_count() == 1:
        return value
    return int(np.min(multihost_utils.process_allgather(np.asarray(value, np.int64))))


@dataclass(frozen=True)
class Message:
    """One mirrored device call: what to run, its static arguments and host arrays."""

    kind: str
    statics: dict[str, Any] = field(default_factory=dict)
    arrays: Sequence[np.ndarray] = ()


# --------------------------------------------------------------------------- leader


class StepBroadcast:
    """The leader's side: listens for `followers` processes, sends them every call,
    watches their heartbeats."""

    def __init__(self, address: tuple[str, int], followers: int,
                 worker_timeout: float = DEFAULT_WORKER_TIMEOUT,
                 connect_timeout: float = CONNECT_TIMEOUT) -> None:
        self.worker_timeout = worker_timeout
        self.lost: str | None = None
        self._callbacks: list[Callable[[WorkerLostError], None]] = []
        self._lock = threading.Lock()
        self._peers: dict[int, _Peer] = {}
        self._expected = followers
        self._closing = False
        self._connected = threading.Event()
        self._deadline = time.monotonic() + connect_timeout
        try:
            self._server = socket.create_server(("", address[1]))
        except OSError as exc:
            raise ConfigError(f"cannot listen for followers on port {address[1]} "
                              f"(coordinator port + 1): {exc}") from exc
        self.port = self._server.getsockname()[1]
        threading.Thread(target=self._accept, name="jaxinfer-broadcast-accept",
                         daemon=True).start()
        threading.Thread(target=self._watch, name="jaxinfer-broadcast-watch",
                         daemon=True).start()

    def on_lost(self, callback: Callable[[WorkerLostError], None]) -> None:
        """Call `callback` once when a follower is lost (at once if one already is)."""
        with self._lock:
            self._callbacks.append(callback)
            lost = self.lost
        if lost is not None:
            callback(WorkerLostError(lost))

    def send(self, message: Message) -> None:
        """Frame `message` to every follower; WorkerLostError if one is gone."""
        self._wait_connected()
        frame = encode(message)
        for process, peer in sorted(self._peers.items()):
            try:
                peer.sock.sendall(frame)
            except OSError as exc:
                self._lose(f"process {process} cannot be reached: {exc}")
        if self.lost is not None:
            raise WorkerLostError(self.lost)

    def close(self, timeout: float = 30.0) -> None:
        """Tell the followers to stop and wait (up to `timeout` s) until they have left
        JAX's runtime and hung up (its service lives in this process), then close."""
        if self.lost is None and len(self._peers) == self._expected:
            self._closing = True
            with contextlib.suppress(WorkerLostError):
                self.send(Message(STOP))
            deadline = time.monotonic() + timeout
            for peer in self._peers.values():
                peer.reader.join(max(0.0, deadline - time.monotonic()))
        self.lost = self.lost or "the leader closed the step broadcast"
        for peer in self._peers.values():
            _shut(peer.sock)
            peer.sock.close()
        self._server.close()

    def _wait_connected(self) -> None:
        if not self._connected.wait(max(0.0, self._deadline - time.monotonic())):
            missing = sorted(set(range(1, self._expected + 1)) - set(self._peers))
            raise WorkerLostError(f"processes {missing} did not connect to the leader on "
                                  f"port {self.port} in time")
        if self.lost is not None:
            raise WorkerLostError(self.lost)

    def _accept(self) -> None:
        while len(self._peers) < self._expected:
            try:
                sock, _ = self._server.accept()
            except OSError:  # closed
                return
            try:
                process = _handshake_leader(sock, self._expected + 1, set(self._peers))
            except (OSError, ValueError, EOFError) as exc:
                logger.warning("refused a connection to the step broadcast: %s", exc)
                sock.close()
                continue
            sock.settimeout(None)  # silence is the watchdog's to judge
            reader = threading.Thread(target=self._read, args=(process,), daemon=True,
                                      name=f"jaxinfer-broadcast-{process}")
            self._peers[process] = _Peer(sock, time.monotonic(), reader)
            reader.start()
        self._connected.set()

    def _read(self, process: int) -> None:
        """Heartbeats from one follower; a closed connection loses it."""
        peer = self._peers[process]
        while self.lost is None:
            try:
                read_message(peer.sock)
            except (OSError, ValueError, EOFError) as exc:
                if self._closing:  # it left as asked
                    return
                self._lose(f"process {process} closed its connection ({exc or 'EOF'}): it "
                           "exited or its host went down")
                return
            peer.last_seen = time.monotonic()

    def _watch(self) -> None:
        while self.lost is None and not self._closing:
            time.sleep(self.worker_timeout / 8)
            now = time.monotonic()
            for process, peer in list(self._peers.items()):
                if now - peer.last_seen > self.worker_timeout:
                    self._lose(f"process {process} sent no heartbeat for "
                               f"{now - peer.last_seen:.1f} s (worker timeout "
                               f"{self.worker_timeout:g} s)")

    def _lose(self, reason: str) -> None:
        with self._lock:
            if self.lost is not None:
                return
            self.lost = reason
            callbacks = list(self._callbacks)
        logger.error("multi-host step broadcast: %s", reason)
        for peer in self._peers.values():  # unblocks a send stuck on a silent peer
            _shut(peer.sock)
        for callback in callbacks:
            callback(WorkerLostError(reason))


@dataclass
class _Peer:
    sock: socket.socket
    last_seen: float
    reader: threading.Thread  # reads its heartbeats


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):  # already closed
        sock.shutdown(socket.SHUT_RDWR)


def _handshake_leader(sock: socket.socket, num_processes: int, taken: set[int]) -> int:
    """Read a follower's hello, answer it; returns its process index."""
    sock.settimeout(10.0)
    hello = read_message(sock)
    process = int(hello.statics.get("process_id", -1))
    if hello.kind != "hello" or hello.statics.get("protocol") != PROTOCOL:
        raise ValueError(f"not a jaxinfer follower hello: {hello.kind} {hello.statics}")
    if not 1 <= process < num_processes:
        raise ValueError(f"follower process_id {process} not in [1, {num_processes})")
    if process in taken:
        raise ValueError(f"process {process} is connected already")
    sock.sendall(encode(Message("welcome")))
    return process


# --------------------------------------------------------------------------- follower


class StepFollower:
    """A follower's side: connects to the leader, beats, yields the calls to mirror."""

    def __init__(self, address: tuple[str, int], process_id: int,
                 worker_timeout: float = DEFAULT_WORKER_TIMEOUT,
                 connect_timeout: float = CONNECT_TIMEOUT) -> None:
        self.leader_lost = threading.Event()
        self._sock = _connect(address, connect_timeout)
        self._sock.sendall(encode(Message("hello", {"protocol": PROTOCOL,
                                                    "process_id": process_id})))
        if read_message(self._sock).kind != "welcome":
            raise LeaderLostError(f"the leader at {address[0]}:{address[1]} refused process "
                                  f"{process_id}")
        self._sock.settimeout(None)
        self._interval = worker_timeout / 4
        threading.Thread(target=self._beat, name="jaxinfer-heartbeat", daemon=True).start()

    def messages(self) -> Iterator[Message]:
        """Every mirrored call until the leader says stop; LeaderLostError if it vanishes."""
        while True:
            try:
                message = read_message(self._sock)
            except (OSError, EOFError, ValueError) as exc:
                self.leader_lost.set()
                raise LeaderLostError(f"the leader closed the step broadcast: {exc}") from exc
            if message.kind == STOP:
                return
            yield message

    def close(self) -> None:
        self._sock.close()

    def _beat(self) -> None:
        frame = encode(Message(HEARTBEAT))
        while not self.leader_lost.is_set():
            try:
                self._sock.sendall(frame)  # the only sender after the handshake
            except OSError:
                self.leader_lost.set()
                return
            time.sleep(self._interval)


def _connect(address: tuple[str, int], timeout: float) -> socket.socket:
    """Connect to the leader, retrying while it starts."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            sock = socket.create_connection(address, timeout=10.0)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock
        except OSError as exc:
            if time.monotonic() > deadline:
                raise LeaderLostError(f"cannot reach the leader at {address[0]}:{address[1]} "
                                      f"after {timeout:g} s: {exc}") from exc
            time.sleep(0.5)


# --------------------------------------------------------------------------- wire format


def encode(message: Message) -> bytes:
    arrays = [np.ascontiguousarray(a) for a in message.arrays]
    header = json.dumps({
        "kind": message.kind, "statics": message.statics,
        "arrays": [[a.dtype.str, list(a.shape)] for a in arrays],
    }).encode()
    body = b"".join([_HEADER.pack(len(header)), header, *(a.tobytes() for a in arrays)])
    return _LENGTH.pack(len(body)) + body


def read_message(sock: socket.socket) -> Message:
    (size,) = _LENGTH.unpack(_read_exactly(sock, _LENGTH.size))
    return decode(_read_exactly(sock, size))


def decode(body: bytes) -> Message:
    (header_len,) = _HEADER.unpack_from(body)
    header = json.loads(body[_HEADER.size: _HEADER.size + header_len])
    offset = _HEADER.size + header_len
    arrays = []
    for dtype_str, shape in header["arrays"]:
        dtype = np.dtype(dtype_str)
        count = int(np.prod(shape))
        arrays.append(np.frombuffer(body, dtype, count, offset).reshape(shape))
        offset += count * dtype.itemsize
    if offset != len(body):
        raise ValueError(f"a frame of {len(body)} bytes holds {offset}")
    return Message(header["kind"], header["statics"], arrays)


def _read_exactly(sock: socket.socket, size: int) -> bytes:
    chunks = bytearray()
    while len(chunks) < size:
        chunk = sock.recv(min(size - len(chunks), 1 << 20))
        if not chunk:
            raise EOFError("connection closed")
        chunks += chunk
    return bytes(chunks)


def _split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"coordinator address must be HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)
