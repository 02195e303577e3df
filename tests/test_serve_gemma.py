"""The server on the real Gemma 3 270M: text prompts, chat messages, Tokenize and
Detokenize, malformed UTF-8, ModelInfo. One test: the model loads once (~6 s)."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.llm_engine import LLMEngine
from jaxinfer.weights import LoadedModel
from serve.client import InferenceClient, generate_request
from serve.config import ServerConfig
from serve.proto.jaxinfer.v1 import inference_pb2 as pb
from serve.server import ServerThread

ENGINE = EngineConfig(max_model_len=256, max_num_seqs=2, block_size=16)
GREEDY = {"max_tokens": 8, "temperature": 0.0}
CHAT = [{"role": "user", "content": "Name a river."}]


def _invalid(call: Callable[[], object]) -> str:
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    return info.value.details()


def _raw(client: InferenceClient, method: str, data: bytes, reply: type) -> object:
    call = client.channel.unary_stream if method == "Generate" else client.channel.unary_unary
    result = call(f"/jaxinfer.v1.Inference/{method}", response_deserializer=reply.FromString)(
        data, timeout=60)
    return list(result) if method == "Generate" else result


def test_text_chat_tokenize_and_utf8_on_gemma(gemma: LoadedModel) -> None:
    offline = LLM(loaded=gemma, engine_config=ENGINE)  # same shapes: compiled once
    want_text = offline.generate("The capital of France is", SamplingParams(**GREEDY))[0]
    want_chat = offline.chat(CHAT, SamplingParams(**GREEDY))
    with ServerThread(LLMEngine(gemma, ENGINE), ServerConfig(port=0, metrics_port=None)) as s, \
            InferenceClient(s.address, timeout=120) as client:
        messages = list(client.generate("The capital of France is", **GREEDY))
        assert "".join(m.text for m in messages) == want_text.text
        assert [t for m in messages for t in m.token_ids] == want_text.token_ids
        chat = client.complete(messages=CHAT, **GREEDY)
        assert chat.text == want_chat.text and chat.token_ids == want_chat.token_ids

        tokenizer = gemma.tokenizer
        assert client.tokenize("Xin chào") == tokenizer.encode("Xin chào")
        assert client.tokenize("Hi", add_special_tokens=False) == tokenizer.encode(
            "Hi", add_bos=False)
        assert client.tokenize(messages=CHAT) == want_chat.prompt_token_ids
        assert client.detokenize(tokenizer.encode("Xin chào"), skip_special_tokens=True) == (
            "Xin chào")

        info = client.model_info()
        assert (info.name, info.architecture, info.quantization) == (
            "gemma3-270m", "gemma3", "none (from Q4_K_M)")
        assert info.has_tokenizer and info.vocab_size == 262144 and info.context_length == 256

        assert "prompt is empty" in _invalid(lambda: list(client.generate("")))
        assert "role 'robot'" in _invalid(lambda: list(client.generate(
            messages=[{"role": "robot", "content": "hi"}])))
        assert "messages[0].content is not valid UTF-8" in _invalid(lambda: _raw(
            client, "Generate", generate_request(messages=[{"role": "user", "content": "@@@@"}])
            .SerializeToString().replace(b"@@@@", b"@\xfe@@"), pb.GenerateResponse))
        assert "prompt is not valid UTF-8" in _invalid(lambda: _raw(
            client, "Generate", generate_request("@@ caf\u00e9").SerializeToString().replace(
                "\u00e9".encode(), b"\xe9"), pb.GenerateResponse))
        assert "text is not valid UTF-8" in _invalid(lambda: _raw(
            client, "Tokenize", pb.TokenizeRequest(text="@@@@").SerializeToString().replace(
                b"@@@@", b"\x80@@@"), pb.TokenizeResponse))
        assert "token_ids has 262144" in _invalid(lambda: client.detokenize([5, 262144]))
        assert client.health() == "SERVING"  # and it still serves
        assert client.complete("The capital of France is", **GREEDY).text == want_text.text
