"""The Inference RPCs over an AsyncLLMEngine.

Each RPC body raises plain exceptions; one wrapper per call kind turns them
into gRPC statuses and counts every outcome:

    RequestError, ConfigError, a malformed request   -> INVALID_ARGUMENT
    a text prompt on a model without a tokenizer     -> FAILED_PRECONDITION
    the waiting queue at its bound                   -> RESOURCE_EXHAUSTED + retry hint
    the server draining for shutdown                 -> UNAVAILABLE
    a lost process of a multi-host mesh              -> UNAVAILABLE
    the engine loop dead, anything unexpected        -> INTERNAL

A Generate stream iterates the engine's deltas inside `aclosing`, so when the
client cancels, disconnects or passes its deadline, grpc cancels the handler,
the engine's generator closes, and the request is aborted at the next step.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import grpc

from jaxinfer.engine.async_engine import AsyncLLMEngine, EngineDeadError
from jaxinfer.errors import ConfigError, RequestError
from jaxinfer.outputs import StreamDelta
from serve import convert
from serve.config import ServerConfig
from serve.metrics import ServerMetrics
from serve.proto.jaxinfer.v1 import inference_pb2 as pb
from serve.wire import MalformedRequest

logger = logging.getLogger(__name__)
Context = grpc.aio.ServicerContext


@dataclass
class RpcFailure(Exception):
    code: grpc.StatusCode
    message: str
    trailers: tuple[tuple[str, str], ...] = ()

    async def abort(self, context: Context) -> None:
        """End the RPC with this status (grpc raises AbortError out of here)."""
        await context.abort(self.code, self.message, trailing_metadata=self.trailers)


class InferenceServicer:
    def __init__(self, front: AsyncLLMEngine, config: ServerConfig, metrics: ServerMetrics,
                 info: pb.ModelInfoResponse) -> None:
        self.front = front
        self.engine = front.engine
        self.config = config
        self.metrics = metrics
        self.info = info
        self.draining = False
        self.active: set[str] = set()  # ids of the Generate streams open now

    # ----------------------------------------------------------------- RPCs

    async def Generate(self, request: Any, context: Context) -> AsyncIterator[pb.GenerateResponse]:
        code = grpc.StatusCode.OK
        try:
            async for message in self._generate(_checked(request), context):
                yield message
        except (asyncio.CancelledError, GeneratorExit):  # GeneratorExit: closed at a yield
            code = _cancel_code(context)
            raise
        except Exception as exc:
            failure = _failure(exc)
            code = failure.code
            await failure.abort(context)
        finally:
            self.metrics.count("Generate", code)

    async def Tokenize(self, request: Any, context: Context) -> pb.TokenizeResponse:
        return await self._unary("Tokenize", self._tokenize, request, context)

    async def Detokenize(self, request: Any, context: Context) -> pb.DetokenizeResponse:
        return await self._unary("Detokenize", self._detokenize, request, context)

    async def ModelInfo(self, request: Any, context: Context) -> pb.ModelInfoResponse:
        return await self._unary("ModelInfo", lambda _: self.info, request, context)

    # ----------------------------------------------------------------- shutdown

    async def drain(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for the open streams to end; True if they did."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.active and loop.time() < deadline:
            await asyncio.sleep(0.05)
        return not self.active

    def abort_all(self) -> None:
        """End every open stream now: each sample's last message says ABORT."""
        for request_id in list(self.active):
            self.front.abort(request_id)

    # ----------------------------------------------------------------- bodies

    async def _generate(
        self, request: pb.GenerateRequest, context: Context
    ) -> AsyncIterator[pb.GenerateResponse]:
        if self.draining:
            raise RpcFailure(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        prompt, ids = convert.prompt_input(request, self.engine.tokenizer)
        params = convert.sampling_params(request.params)
        convert.check_fits(self.engine, ids, params)
        request_id = self._new_request_id(request.request_id)
        self._admit()  # no await between here and add_request: admission is atomic
        stream = self.front.generate(prompt, params, prompt_token_ids=ids, request_id=request_id)
        self.active.add(request_id)
        try:
            async with aclosing(stream) as deltas:
                async for message in _messages(deltas, params.logprobs or 0):
                    yield message
        finally:
            self.active.discard(request_id)

    def _new_request_id(self, given: str) -> str:
        if not given:
            return uuid.uuid4().hex
        convert.check_request_id(given)
        if given in self.active:
            raise RpcFailure(grpc.StatusCode.ALREADY_EXISTS,
                             f"request_id {given!r} is in use by an open stream")
        return given

    def _admit(self) -> None:
        waiting = self.engine.snapshot()["waiting"]
        if waiting >= self.config.max_waiting:
            hint = self.config.retry_after_ms
            raise RpcFailure(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the waiting queue is full ({int(waiting)} sequences, max_waiting "
                f"{self.config.max_waiting}): retry after {hint} ms",
                (("retry-after-ms", str(hint)),),
            )

    def _tokenize(self, request: pb.TokenizeRequest) -> pb.TokenizeResponse:
        tokenizer = convert.require_tokenizer(self.engine.tokenizer, "Tokenize requests")
        if request.HasField("text") == bool(request.messages):
            raise RequestError("give exactly one of text or messages")
        text = convert.chat_text(request.messages, tokenizer) if request.messages else (
            request.text)
        add_bos = not request.HasField("add_special_tokens") or request.add_special_tokens
        return pb.TokenizeResponse(token_ids=tokenizer.encode(text, add_bos=add_bos))

    def _detokenize(self, request: pb.DetokenizeRequest) -> pb.DetokenizeResponse:
        tokenizer = convert.require_tokenizer(self.engine.tokenizer, "Detokenize requests")
        ids = convert.token_ids(request.token_ids, self.engine.model.config.vocab_size)
        return pb.DetokenizeResponse(text=tokenizer.decode(ids, request.skip_special_tokens))

    async def _unary(self, method: str, body: Callable[[Any], Any], request: Any,
                     context: Context) -> Any:
        code = grpc.StatusCode.OK
        try:
            return body(_checked(request))
        except asyncio.CancelledError:
            code = _cancel_code(context)
            raise
        except Exception as exc:
            failure = _failure(exc)
            code = failure.code
            await failure.abort(context)
        finally:
            self.metrics.count(method, code)


async def _messages(
    deltas: AsyncIterator[StreamDelta], num_logprobs: int
) -> AsyncIterator[pb.GenerateResponse]:
    """One stream message per delta; every sample's last delta carries its usage."""
    async for delta in deltas:
        yield convert.response(delta, num_logprobs)


def _checked(request: Any) -> Any:
    if isinstance(request, MalformedRequest):
        raise RequestError(request.message)
    return request


def _failure(exc: Exception) -> RpcFailure:
    if isinstance(exc, RpcFailure):
        return exc
    if isinstance(exc, convert.NoTokenizerError):
        return RpcFailure(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
    if isinstance(exc, EngineDeadError):
        code = grpc.StatusCode.UNAVAILABLE if exc.worker_lost else grpc.StatusCode.INTERNAL
        return RpcFailure(code, str(exc))
    if isinstance(exc, RequestError | ConfigError):
        return RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    logger.exception("unexpected error in an RPC")
    return RpcFailure(grpc.StatusCode.INTERNAL, f"internal error: {exc!r}")


def _cancel_code(context: Context) -> grpc.StatusCode:
    remaining = context.time_remaining()
    if remaining is not None and remaining <= 0:
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return grpc.StatusCode.CANCELLED
