"""The gRPC contract without a server: generated code is fresh, bad UTF-8 is located,
and proto <-> engine conversion keeps every field."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from jaxinfer.errors import ConfigError
from jaxinfer.outputs import StreamDelta, Usage
from jaxinfer.sampling import SamplingParams
from serve import convert
from serve.gen_proto import GENERATED, PROTO_FILE, PROTO_ROOT, generate
from serve.proto.jaxinfer.v1 import inference_pb2 as pb
from serve.wire import MalformedRequest, find_bad_utf8, tolerant

_VERSIONS = [
    (re.compile(r"_runtime_version\.ValidateProtobufRuntimeVersion\(.*?\)", re.S), "<check>"),
    (re.compile(r"\d+\.\d+\.\d+"), "<version>"),
]


def _normalized(text: str) -> str:
    """Generated code minus the generator's version stamps."""
    for pattern, stand_in in _VERSIONS:
        text = pattern.sub(stand_in, text)
    return text


def test_checked_in_code_matches_the_proto(tmp_path: Path) -> None:
    fresh = generate(tmp_path)
    checked_in = PROTO_ROOT / Path(PROTO_FILE).parent
    for path in fresh:
        old = (checked_in / path.name).read_text()
        assert _normalized(old) == _normalized(path.read_text()), (
            f"{path.name} is stale: run `python -m serve.gen_proto`")
    assert sorted(p.name for p in fresh) == sorted(GENERATED)


def _bad(request: pb.GenerateRequest, marker: str) -> bytes:
    """`request` serialized with the UTF-8 text `marker` replaced by invalid bytes."""
    data = request.SerializeToString()
    assert data.count(marker.encode()) == 1
    return data.replace(marker.encode(), b"@\xff" + b"@" * (len(marker) - 2))


@pytest.mark.parametrize(
    ("request_", "marker", "path"),
    [
        (pb.GenerateRequest(prompt="@@@@"), "@@@@", "prompt"),
        (pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="hi"),
                                      pb.ChatMessage(role="user", content="@@@@")]),
         "@@@@", "messages[1].content"),
        (pb.GenerateRequest(token_ids=[1], params=pb.SamplingParams(stop=["a", "@@@@"])),
         "@@@@", "params.stop[1]"),
    ],
)
def test_bad_utf8_names_the_field(request_: pb.GenerateRequest, marker: str, path: str) -> None:
    data = _bad(request_, marker)
    assert find_bad_utf8(pb.GenerateRequest.DESCRIPTOR, data).startswith(
        f"{path} is not valid UTF-8 (byte 0xff")
    decoded = tolerant(pb.GenerateRequest)(data)
    assert isinstance(decoded, MalformedRequest) and decoded.message.startswith(path)
    assert tolerant(pb.GenerateRequest)(request_.SerializeToString()) == request_


def test_truncated_request_is_malformed_not_a_crash() -> None:
    data = pb.GenerateRequest(prompt="hello").SerializeToString()[:-2]
    decoded = tolerant(pb.GenerateRequest)(data)
    assert isinstance(decoded, MalformedRequest)
    assert "jaxinfer.v1.GenerateRequest" in decoded.message


def test_sampling_params_keep_defaults_and_every_set_field() -> None:
    assert convert.sampling_params(pb.SamplingParams()) == SamplingParams()
    message = pb.SamplingParams(
        max_tokens=7, temperature=0.5, top_k=3, top_p=0.9, min_p=0.1, repetition_penalty=1.2,
        presence_penalty=0.5, frequency_penalty=-0.5, seed=11, stop=["x", "yz"],
        stop_token_ids=[4], ignore_eos=True, logprobs=2, prompt_logprobs=1, n=2,
        skip_special_tokens=False, include_stop_str_in_output=True,
    )
    settings = {f.name for f in pb.SamplingParams.DESCRIPTOR.fields}
    assert settings == set(SamplingParams.__dataclass_fields__)  # nothing left out
    params = convert.sampling_params(message)
    assert params == SamplingParams(
        max_tokens=7, temperature=0.5, top_k=3, top_p=0.9, min_p=0.1, repetition_penalty=1.2,
        presence_penalty=0.5, frequency_penalty=-0.5, seed=11, stop=("x", "yz"),
        stop_token_ids=(4,), ignore_eos=True, logprobs=2, prompt_logprobs=1, n=2,
        skip_special_tokens=False, include_stop_str_in_output=True,
    )
    with pytest.raises(ConfigError, match="top_p"):
        convert.sampling_params(pb.SamplingParams(top_p=0.0))  # set to 0 is not "unset"


def test_response_carries_logprobs_and_usage_on_the_last_message() -> None:
    usage = Usage(prompt_tokens=3, completion_tokens=2, cached_tokens=2, ttft=0.25)
    delta = StreamDelta("r1", 0, "b", (6,), ({6: -1.0, 9: -0.5},), "length",
                        request_finished=True, usage=usage)
    message = convert.response(delta, num_logprobs=1)
    assert list(message.token_ids) == [6] and message.text == "b"
    assert message.finish_reason == pb.FINISH_REASON_LENGTH
    assert message.logprobs[0].token_id == 6 and message.logprobs[0].logprob == -1.0
    assert [(t.token_id, t.logprob) for t in message.logprobs[0].top] == [(9, -0.5)]
    assert (message.usage.prompt_tokens, message.usage.completion_tokens,
            message.usage.cached_tokens, message.usage.ttft_seconds) == (3, 2, 2, 0.25)


def test_a_middle_message_has_no_usage_and_the_first_carries_prompt_logprobs() -> None:
    first = StreamDelta("r1", 0, "a", (5,), None, None,
                        prompt_logprobs=(None, {7: -0.5}, {8: -1.5}))
    message = convert.response(first)
    assert not message.HasField("usage") and list(message.prompt_logprobs) == [-0.5, -1.5]
    later = convert.response(StreamDelta("r1", 0, "b", (6,), None, None))
    assert not later.HasField("usage") and not later.prompt_logprobs
