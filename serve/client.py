"""A small blocking client for the jaxinfer gRPC service, and `jaxinfer client`.

    from serve.client import InferenceClient

    with InferenceClient("127.0.0.1:50051") as client:
        for message in client.generate("The capital of France is", max_tokens=20):
            print(message.text, end="", flush=True)       # message: GenerateResponse
        result = client.complete(token_ids=[1, 2, 3], max_tokens=8, temperature=0)
        print(result.samples[0].token_ids, result.samples[0].finish_reason, result.ttft)

`generate` returns the gRPC call itself: iterate it for messages, or call
`.cancel()` to stop (the server aborts the request and frees its KV blocks).
Sampling settings are keyword arguments named as in `jaxinfer.SamplingParams`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf.descriptor import FieldDescriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serve.proto.jaxinfer.v1 import inference_pb2 as pb
from serve.proto.jaxinfer.v1 import inference_pb2_grpc as pb_grpc

FINISH_NAMES = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length",
                pb.FINISH_REASON_ABORT: "abort"}
DEFAULT_SERVER = "127.0.0.1:50051"
SAMPLING_FIELDS = pb.SamplingParams.DESCRIPTOR.fields  # == jaxinfer.SamplingParams' fields
_FLOAT_TYPES = (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT)


@dataclass
class Sample:
    """One finished (or cut-off) sample, assembled from its stream messages."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    usage: pb.Usage | None = None


@dataclass
class Completion:
    request_id: str
    samples: list[Sample]
    ttft: float | None  # seconds from sending to the first message, seen by the client
    prompt_logprobs: list[float] = field(default_factory=list)

    @property
    def text(self) -> str:
        return self.samples[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.samples[0].token_ids


def generate_request(
    prompt: str | None = None, *, token_ids: Sequence[int] | None = None,
    messages: Sequence[Mapping[str, str]] | None = None, request_id: str = "",
    **sampling: Any,
) -> pb.GenerateRequest:
    """A GenerateRequest; `sampling` holds SamplingParams fields (max_tokens=..., ...)."""
    request = pb.GenerateRequest(request_id=request_id, params=pb.SamplingParams(**sampling))
    if prompt is not None:
        request.prompt = prompt
    request.token_ids.extend(token_ids or ())
    request.messages.extend(pb.ChatMessage(**m) for m in messages or ())
    return request


class InferenceClient:
    def __init__(self, target: str = DEFAULT_SERVER, *, timeout: float | None = None) -> None:
        """`timeout`: the default deadline of every call, in seconds (None = none)."""
        self.channel = grpc.insecure_channel(target)
        self.stub = pb_grpc.InferenceStub(self.channel)
        self.timeout = timeout

    def generate(self, prompt: str | None = None, *, timeout: float | None = None,
                 **kwargs: Any) -> Any:
        """Start a Generate stream (see `generate_request` for the arguments); returns
        the call: an iterator of GenerateResponse with `.cancel()`."""
        return self.stub.Generate(generate_request(prompt, **kwargs),
                                  timeout=timeout or self.timeout)

    def complete(self, prompt: str | None = None, **kwargs: Any) -> Completion:
        """Run one request to the end and assemble its samples."""
        start = time.perf_counter()
        return collect(self.generate(prompt, **kwargs), start)

    def tokenize(self, text: str | None = None, *,
                 messages: Sequence[Mapping[str, str]] | None = None,
                 add_special_tokens: bool = True) -> list[int]:
        request = pb.TokenizeRequest(add_special_tokens=add_special_tokens)
        if text is not None:
            request.text = text
        request.messages.extend(pb.ChatMessage(**m) for m in messages or ())
        return list(self.stub.Tokenize(request, timeout=self.timeout).token_ids)

    def detokenize(self, token_ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        request = pb.DetokenizeRequest(token_ids=list(token_ids),
                                       skip_special_tokens=skip_special_tokens)
        return self.stub.Detokenize(request, timeout=self.timeout).text

    def model_info(self) -> pb.ModelInfoResponse:
        return self.stub.ModelInfo(pb.ModelInfoRequest(), timeout=self.timeout)

    def health(self, service: str = "") -> str:
        """"SERVING", "NOT_SERVING", ... from the standard grpc.health.v1 service."""
        stub = health_pb2_grpc.HealthStub(self.channel)
        reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=self.timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> InferenceClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def collect(messages: Iterable[pb.GenerateResponse], start: float | None = None) -> Completion:
    """Assemble a stream's messages into a Completion (ttft measured from `start`)."""
    samples: dict[int, Sample] = {}
    result = Completion("", [], None)
    for message in messages:
        if result.ttft is None and start is not None:
            result.ttft = time.perf_counter() - start
        result.request_id = message.request_id
        result.prompt_logprobs += message.prompt_logprobs
        _add(samples.setdefault(message.index, Sample(message.index)), message)
    result.samples = [samples[i] for i in sorted(samples)]
    return result


def _add(sample: Sample, message: pb.GenerateResponse) -> None:
    sample.text += message.text
    sample.token_ids += message.token_ids
    for entry in message.logprobs:
        sample.logprobs.append({entry.token_id: entry.logprob}
                               | {t.token_id: t.logprob for t in entry.top})
    if message.finish_reason:
        sample.finish_reason = FINISH_NAMES[message.finish_reason]
        sample.usage = message.usage


# --------------------------------------------------------------------------- the CLI


def run_client(args: argparse.Namespace) -> int:
    """Stream one request to stdout; a one-line summary goes to stderr."""
    try:
        request = _request_from_args(args)
    except ValueError as exc:
        print(f"jaxinfer client: error: {exc}", file=sys.stderr)
        return 2
    with InferenceClient(args.server, timeout=args.timeout) as client:
        start = time.perf_counter()
        try:
            result = collect(_echo(client.stub.Generate(request, timeout=args.timeout),
                                   stream=not args.json), start)
        except grpc.RpcError as exc:
            print(f"jaxinfer client: error: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 2 if exc.code() == grpc.StatusCode.INVALID_ARGUMENT else 1
    _print_result(result, args.json)
    return 0


def add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    """A flag per field of the wire's SamplingParams (the fields of
    `jaxinfer.SamplingParams`); a flag left out leaves the server's default."""
    group = parser.add_argument_group("sampling")
    for field_ in SAMPLING_FIELDS:
        flag = _flag(field_)
        if field_.type == FieldDescriptor.TYPE_BOOL:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None)
        elif field_.type == FieldDescriptor.TYPE_STRING:  # repeated: stop
            group.add_argument(flag, action="append", default=None,
                               help=f"{field_.name} string (repeatable)")
        elif _is_id_list(field_):  # checked after parsing, like --token-ids
            group.add_argument(flag, default=None, help="comma-separated ids")
        else:
            kind = float if field_.type in _FLOAT_TYPES else int
            group.add_argument(flag, type=kind, default=None)


def _flag(field_: FieldDescriptor) -> str:
    return "--" + field_.name.replace("_", "-")


def _is_id_list(field_: FieldDescriptor) -> bool:
    return field_.is_repeated and field_.type != FieldDescriptor.TYPE_STRING


def _sampling_from_args(args: argparse.Namespace) -> dict[str, Any]:
    sampling = {}
    for field_ in SAMPLING_FIELDS:
        value = getattr(args, field_.name)
        if value is not None and _is_id_list(field_):
            value = _ids(value, _flag(field_))
        if value is not None:
            sampling[field_.name] = value
    return sampling


def _request_from_args(args: argparse.Namespace) -> pb.GenerateRequest:
    sampling = _sampling_from_args(args)
    if args.token_ids is not None:
        return generate_request(token_ids=_ids(args.token_ids, "--token-ids"), **sampling)
    if args.prompt is None:
        raise ValueError("give a PROMPT or --token-ids")
    if args.chat:
        system = [{"role": "system", "content": args.system}] if args.system else []
        return generate_request(messages=[*system, {"role": "user", "content": args.prompt}],
                                **sampling)
    return generate_request(args.prompt, **sampling)


def _ids(text: str, flag: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers, got {text!r}") from None


def _echo(messages: Iterable[pb.GenerateResponse], stream: bool) -> Iterable[pb.GenerateResponse]:
    """Pass messages through, printing sample 0's text as it arrives."""
    for message in messages:
        if stream and message.index == 0:
            print(message.text, end="", flush=True)
        yield message


def _print_result(result: Completion, as_json: bool) -> None:
    if as_json:
        print(json.dumps({"request_id": result.request_id, "ttft": result.ttft, "samples": [
            {"index": s.index, "text": s.text, "token_ids": s.token_ids,
             "finish_reason": s.finish_reason} for s in result.samples]}, ensure_ascii=False))
        return
    print()
    for sample in result.samples[1:]:
        print(f"--- sample {sample.index}\n{sample.text}")
    first = result.samples[0] if result.samples else Sample(0)
    usage = first.usage or pb.Usage()
    ttft = f"{result.ttft:.3f}s" if result.ttft is not None else "-"
    print(f"[{first.finish_reason}: {usage.completion_tokens} tokens, prompt "
          f"{usage.prompt_tokens} ({usage.cached_tokens} cached), first token {ttft}]",
          file=sys.stderr)
