"""The asyncio face of the engine: `async for delta in engine.generate(...)`.

One background thread owns the device loop: it calls `LLMEngine.step()` while
there is work and sleeps on an event otherwise. Each step's deltas are handed
to the waiting coroutines through `loop.call_soon_threadsafe` onto unbounded
per-request queues, so the device loop never waits on a slow consumer.
Cancelling a consumer (client gone, deadline passed) aborts its request; the
engine frees its blocks at the next step. An exception inside a step is
delivered to every open stream and stops the loop; it never kills the process.
On a multi-host mesh, a lost follower process fails the engine the same way
from the broadcast's watchdog thread, even while the loop thread waits on the
devices (its step can never finish).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from jaxinfer.engine.llm_engine import LLMEngine
from jaxinfer.errors import JaxinferError
from jaxinfer.outputs import StreamDelta
from jaxinfer.parallel.multihost import WorkerLostError
from jaxinfer.sampling import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(JaxinferError):
    """The engine loop stopped after an unexpected error; no request can run."""

    @property
    def worker_lost(self) -> bool:
        """The cause is a lost process of a multi-host mesh (not a bug here)."""
        return isinstance(self.__cause__, WorkerLostError)


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncLLMEngine:
    """Runs an LLMEngine in a background thread and streams outputs to coroutines."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="jaxinfer-engine", daemon=True)
        self._thread.start()
        if engine.runner.broadcast is not None:
            engine.runner.broadcast.on_lost(self.fail)

    async def generate(
        self,
        prompt: str | None = None,
        params: SamplingParams | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[StreamDelta]:
        """Stream one request's deltas; leaving the loop early aborts the request."""
        self._check_alive()
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue())
        with self._lock:
            output = self.engine.add_request(request_id, prompt, prompt_token_ids, params)
            request_id = output.request_id
            self._streams[request_id] = stream
        self._wake.set()
        samples = params.n if params is not None else 1
        done = 0
        try:
            while done < samples:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise _dead(item) from item
                done += item.finish_reason is not None
                yield item
        finally:
            self._close(request_id, done >= samples)

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self._wake.set()

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Stop the loop thread after the current step."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)

    @property
    def num_open_streams(self) -> int:
        with self._lock:
            return len(self._streams)

    def _close(self, request_id: str, finished: bool) -> None:
        with self._lock:
            self._streams.pop(request_id, None)
        if not finished:
            self.abort(request_id)
        self._release_when_done(request_id)

    def _release_when_done(self, request_id: str) -> None:
        """Forget the request now if it is finished; else the loop does after the abort."""
        try:
            if self.engine.get_request(request_id).finished:
                self.engine.release(request_id)
        except KeyError:
            pass

    def fail(self, exc: BaseException) -> None:
        """Fail every open stream and every later request with `exc` (once)."""
        with self._lock:
            if self.error is not None:
                return
            self.error = exc
        self._broadcast(exc)

    def _check_alive(self) -> None:
        if self.error is not None:
            raise _dead(self.error) from self.error
        if self._stopping:
            raise EngineDeadError("the engine is shutting down")

    def _loop(self) -> None:
        while not self._stopping:
            if not self.engine.has_unfinished():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                deltas = self.engine.step()
            except Exception as exc:  # deliver to every stream, then stop: never crash
                if self.error is None:
                    logger.exception("engine step failed")
                self.fail(exc)
                return
            if self.error is not None:  # failed from outside while the step ran
                return
            self._dispatch(deltas)

    def _dispatch(self, deltas: list[StreamDelta]) -> None:
        for delta in deltas:
            with self._lock:
                stream = self._streams.get(delta.request_id)
            if stream is None:  # the consumer left; release once the request is over
                if delta.request_finished:
                    self._release_when_done(delta.request_id)
                continue
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, delta)

    def _broadcast(self, exc: BaseException) -> None:
        with self._lock:
            streams = list(self._streams.values())
        for stream in streams:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, exc)


def _dead(cause: BaseException) -> EngineDeadError:
    if isinstance(cause, WorkerLostError):
        return EngineDeadError(f"a process of the multi-host mesh was lost: {cause}")
    return EngineDeadError(f"the engine loop failed: {cause!r}")
