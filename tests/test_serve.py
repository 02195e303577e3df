"""The gRPC server on loopback with the tiny Llama (token-id prompts, vocab 256):
concurrent streams equal LLM.generate, cancellation and deadlines free blocks,
every bad input is INVALID_ARGUMENT, a burst past the queue bound, discovery,
the CLI client. Run with -rP (or -s) to see the per-stream TTFT table."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from jaxinfer import LLM, SamplingParams
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.llm_engine import LLMEngine
from jaxinfer.weights import LoadedModel, load_model
from serve.cli import main
from serve.client import InferenceClient, collect, generate_request
from serve.config import ServerConfig
from serve.proto.jaxinfer.v1 import inference_pb2 as pb
from serve.proto.jaxinfer.v1 import inference_pb2_grpc as pb_grpc
from serve.server import ServerThread

TINY = Path(__file__).parent / "data" / "tiny" / "llama"
ENGINE = EngineConfig(max_model_len=128, max_num_seqs=8, block_size=16)
PROMPTS = [[(7 * i + 3 * j) % 250 + 4 for j in range(3 + i % 14)] for i in range(32)]
GREEDY = {"max_tokens": 24, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model(TINY)


@pytest.fixture(scope="module")
def offline(tiny: LoadedModel) -> LLM:
    """The offline API on the same settings; compiled steps are shared per process."""
    llm = LLM(loaded=tiny, engine_config=ENGINE)
    for rows in (1, 2, 4, 8):  # compile every step shape these tests reach, up front:
        llm.generate(prompt_token_ids=PROMPTS[:rows], use_tqdm=False,  # prefill and decode
                     sampling_params=SamplingParams(max_tokens=2))  # of 1, 2, 4, 8 rows
    return llm


@pytest.fixture(scope="module")
def server(tiny: LoadedModel, offline: LLM) -> Iterator[ServerThread]:
    config = ServerConfig(port=0, metrics_port=0, max_waiting=64)
    with ServerThread(LLMEngine(tiny, ENGINE), config) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: ServerThread) -> Iterator[InferenceClient]:
    with InferenceClient(server.address, timeout=120) as c:
        yield c


def scrape(server: ServerThread) -> dict[str, float]:
    """The metrics endpoint as {sample line name with labels: value}."""
    url = f"http://127.0.0.1:{server.server.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


def test_concurrent_greedy_streams_equal_offline_generate(offline, server, client) -> None:
    expected = offline.generate(prompt_token_ids=PROMPTS, use_tqdm=False,
                                sampling_params=SamplingParams(**GREEDY))

    def one(ids: list[int]):
        return client.complete(token_ids=ids, **GREEDY)

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(one, PROMPTS))
    print(f"\n{'stream':>6} {'prompt':>6} {'client TTFT':>12} {'engine TTFT':>12}")
    for i, result in enumerate(results):
        usage = result.samples[0].usage
        print(f"{i:>6} {len(PROMPTS[i]):>6} {result.ttft:>11.3f}s {usage.ttft_seconds:>11.3f}s")
    for result, want in zip(results, expected, strict=True):
        (sample,) = result.samples
        assert sample.token_ids == want.token_ids
        assert sample.finish_reason == "length"
        assert sample.usage.completion_tokens == GREEDY["max_tokens"]
        assert sample.usage.prompt_tokens == len(want.prompt_token_ids)
    assert server.server.front.num_open_streams == 0


def test_n_samples_share_one_stream(offline, server, client) -> None:
    sampled = {"max_tokens": 8, "temperature": 1.0, "seed": 3, "n": 3, "ignore_eos": True}
    expected = offline.generate(
        prompt_token_ids=[PROMPTS[5]], sampling_params=SamplingParams(**sampled),
        use_tqdm=False)[0]
    messages = list(client.generate(token_ids=PROMPTS[5], **sampled))
    assert {m.index for m in messages} == {0, 1, 2}
    assert sum(m.finish_reason != pb.FINISH_REASON_UNSPECIFIED for m in messages) == 3
    result = collect(messages)
    assert [s.token_ids for s in result.samples] == [o.token_ids for o in expected.outputs]


def _wait_until_idle(server: ServerThread, before: dict[str, float], limit: float,
                     code: str) -> float:
    """Seconds until the scraped metrics show no used blocks, one more abort, and
    one more Generate that ended with `code`."""
    start = time.perf_counter()
    abort = 'jaxinfer_requests_finished_total{finish_reason="abort"}'
    status = f'jaxinfer_grpc_requests_total{{code="{code}",method="Generate"}}'
    while time.perf_counter() - start < limit:
        now = scrape(server)
        if (now["jaxinfer_kv_blocks_used"] == 0 and now["jaxinfer_grpc_open_streams"] == 0
                and now.get(abort, 0) == before.get(abort, 0) + 1
                and now.get(status, 0) == before.get(status, 0) + 1):
            return time.perf_counter() - start
        time.sleep(0.02)
    raise AssertionError(f"not idle after {limit}s: {scrape(server)}")


def test_cancel_frees_blocks_and_metrics_show_it_within_a_second(server, client) -> None:
    before = scrape(server)
    call = client.generate(token_ids=PROMPTS[0], max_tokens=120, temperature=0,
                           ignore_eos=True)
    for _ in range(3):
        next(call)
    assert scrape(server)["jaxinfer_kv_blocks_used"] > 0
    call.cancel()
    seconds = _wait_until_idle(server, before, 1.0, "CANCELLED")
    print(f"\ncancel -> blocks free, shown by /metrics, in {seconds:.3f}s")


def test_deadline_mid_stream_aborts_the_request(server, client) -> None:
    long = {"token_ids": PROMPTS[1], "max_tokens": 120, "temperature": 0, "ignore_eos": True}
    start = time.perf_counter()
    client.complete(**long)
    full = time.perf_counter() - start  # the deadline below passes well before the end
    before = scrape(server)
    with pytest.raises(grpc.RpcError) as info:
        list(client.generate(**long, timeout=full / 3))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    _wait_until_idle(server, before, 2.0, "DEADLINE_EXCEEDED")


def _raw_generate(server: ServerThread, data: bytes) -> list[pb.GenerateResponse]:
    with grpc.insecure_channel(server.address) as channel:
        call = channel.unary_stream("/jaxinfer.v1.Inference/Generate",
                                    response_deserializer=pb.GenerateResponse.FromString)
        return list(call(data, timeout=30))


BAD_INPUTS = [
    ({}, "prompt is empty"),
    ({"prompt": ""}, "prompt is empty"),
    ({"token_ids": [1] * 128}, "max_model_len is 128"),
    ({"token_ids": [1, 2, 3], "max_tokens": 126}, "max_tokens must be in [1, 125]"),
    ({"token_ids": [1, 256]}, "token id 256 is outside the vocabulary [0, 256)"),
    ({"token_ids": [-1]}, "token id -1 is outside the vocabulary"),
    ({"token_ids": [1], "top_p": 0.0}, "top_p must be in (0, 1]"),
    ({"token_ids": [1], "top_p": 1.5}, "top_p must be in (0, 1]"),
    ({"token_ids": [1], "temperature": -0.5}, "temperature must be a finite number >= 0"),
    ({"token_ids": [1], "n": 0}, "n must be an integer >= 1"),
    ({"token_ids": [1], "stop": [f"s{i}" for i in range(17)]}, "stop must be at most 16"),
    ({"token_ids": [1], "stop_token_ids": [300]}, "stop_token_ids has 300"),
    ({"token_ids": [1], "max_tokens": 0}, "max_tokens must be an integer >= 1"),
    ({"token_ids": [1], "logprobs": 21}, "logprobs must be None or an integer in [0, 20]"),
    ({"token_ids": [1], "seed": -3}, "seed must be None or an integer in [0, 2**63)"),
    ({"prompt": "hi", "token_ids": [1]}, "only one of prompt, token_ids or messages"),
    ({"token_ids": [1], "request_id": "x" * 300}, "request_id must be at most 256"),
]


def test_every_bad_input_is_invalid_argument_and_the_server_keeps_serving(
    server, client
) -> None:
    before = scrape(server)
    for kwargs, message in BAD_INPUTS:
        prompt = kwargs.pop("prompt", None)
        with pytest.raises(grpc.RpcError) as info:
            list(client.generate(prompt, **kwargs))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, kwargs
        assert message in info.value.details(), (kwargs, info.value.details())
    for bad in (
        pb.GenerateRequest(prompt="@@@@").SerializeToString().replace(b"@@@@", b"@\xff@@"),
        generate_request(token_ids=[1], stop=["@@@@"]).SerializeToString().replace(
            b"@@@@", b"\xc3(@@"),
    ):
        with pytest.raises(grpc.RpcError) as info:
            _raw_generate(server, bad)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "is not valid UTF-8" in info.value.details()
    after = scrape(server)
    key = 'jaxinfer_grpc_requests_total{code="INVALID_ARGUMENT",method="Generate"}'
    assert after[key] - before.get(key, 0) == len(BAD_INPUTS) + 2
    assert client.complete(token_ids=PROMPTS[2], **GREEDY).samples[0].finish_reason == "length"
    assert after["jaxinfer_waiting"] == 0 and after["jaxinfer_kv_blocks_used"] == 0


def test_text_rpcs_need_a_tokenizer(client) -> None:
    for call in (lambda: client.tokenize("hi"), lambda: client.detokenize([1, 2]),
                 lambda: list(client.generate("hi"))):
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "without a tokenizer" in info.value.details()


def test_health_reflection_and_model_info(server, client) -> None:
    assert client.health() == "SERVING"
    assert client.health("jaxinfer.v1.Inference") == "SERVING"
    stub = reflection_pb2_grpc.ServerReflectionStub(client.channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    (reply,) = stub.ServerReflectionInfo(iter([request]), timeout=10)
    names = {s.name for s in reply.list_services_response.service}
    assert {"jaxinfer.v1.Inference", "grpc.health.v1.Health"} <= names
    info = client.model_info()
    assert (info.architecture, info.vocab_size, info.context_length) == ("llama", 256, 128)
    assert (info.kv_block_size, info.max_num_seqs, info.has_tokenizer) == (16, 8, False)
    assert info.kv_num_blocks == server.server.engine.runner.num_blocks
    assert (info.quantization, info.load_format, info.dtype) == ("none", "hf", "float32")


def test_cli_client_streams_from_the_server(server, capsys) -> None:
    args = ["client", "--server", server.address, "--token-ids", "5,6,7", "--max-tokens", "6",
            "--temperature", "0", "--ignore-eos", "--json"]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert len(result["samples"][0]["token_ids"]) == 6
    assert result["samples"][0]["finish_reason"] == "length"
    assert main(["client", "--server", server.address, "--token-ids", "5", "--top-p", "2"]) == 2
    assert "INVALID_ARGUMENT: SamplingParams.top_p" in capsys.readouterr().err


def test_burst_past_the_queue_bound_gets_answers_or_resource_exhausted(tiny) -> None:
    """500 requests at once against max_waiting=8: each gets its full answer or
    RESOURCE_EXHAUSTED with a retry hint, before any token; no hang, no crash."""
    config = ServerConfig(port=0, metrics_port=None, max_waiting=8, retry_after_ms=250)
    params = {"max_tokens": 16, "temperature": 0.0, "ignore_eos": True}
    start = time.perf_counter()
    with ServerThread(LLMEngine(tiny, ENGINE), config) as running, \
            grpc.insecure_channel(running.address) as channel:
        stub = pb_grpc.InferenceStub(channel)
        calls = [stub.Generate(generate_request(token_ids=PROMPTS[i % 32], **params),
                               timeout=120) for i in range(500)]
        done = rejected = 0
        for call in calls:
            try:
                result = collect(call)
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc.details()
                assert "retry after 250 ms" in exc.details()
                assert ("retry-after-ms", "250") in tuple(exc.trailing_metadata())
                rejected += 1
                continue
            assert [s.finish_reason for s in result.samples] == ["length"]
            assert len(result.samples[0].token_ids) == 16
            done += 1
        snapshot = running.server.engine.snapshot()
    elapsed = time.perf_counter() - start
    print(f"\nburst: {done} answered, {rejected} RESOURCE_EXHAUSTED in {elapsed:.1f}s")
    assert done + rejected == 500 and done >= 8 and rejected > 0
    assert snapshot["kv_blocks_used"] == 0 and snapshot["waiting"] == 0
    assert elapsed < 90


def test_engine_failure_turns_health_not_serving(tiny, monkeypatch) -> None:
    engine = LLMEngine(tiny, ENGINE)

    def broken_step() -> list:
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine, "step", broken_step)
    with ServerThread(engine, ServerConfig(port=0, metrics_port=None)) as running, \
            InferenceClient(running.address, timeout=30) as client:
        with pytest.raises(grpc.RpcError) as info:
            list(client.generate(token_ids=[1, 2], max_tokens=2))
        assert info.value.code() == grpc.StatusCode.INTERNAL
        assert "device lost" in info.value.details()
        deadline = time.monotonic() + 5
        while client.health() == "SERVING" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.health() == "NOT_SERVING"
