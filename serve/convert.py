"""Between the wire and the engine: requests in, stream deltas out.

Every check that needs the model (prompt length against the context, token
ids against the vocabulary) runs here before a request is queued, so a bad
request fails with INVALID_ARGUMENT naming the field and never reaches the
device loop. Sampling settings are validated by `jaxinfer.SamplingParams`.
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxinfer.engine.llm_engine import LLMEngine
from jaxinfer.errors import ConfigError, JaxinferError, RequestError
from jaxinfer.outputs import Logprobs, StreamDelta, Usage
from jaxinfer.sampling import SamplingParams
from jaxinfer.tokenizer import Tokenizer
from serve.proto.jaxinfer.v1 import inference_pb2 as pb

FINISH_REASONS = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
}
MAX_REQUEST_ID = 256  # characters


class NoTokenizerError(JaxinferError):
    """Text in or out was asked of a model loaded without a tokenizer."""


# --------------------------------------------------------------------------- requests


def sampling_params(message: pb.SamplingParams) -> SamplingParams:
    """SamplingParams from the set fields of `message`; unset fields keep their default."""
    settings: dict[str, object] = {}
    for descriptor, value in message.ListFields():
        settings[descriptor.name] = tuple(value) if descriptor.is_repeated else value
    return SamplingParams(**settings)


def prompt_input(request: pb.GenerateRequest, tokenizer: Tokenizer | None) -> tuple[
    str | None, list[int]
]:
    """(prompt text or None, prompt token ids) from exactly one of the three inputs."""
    given = [name for name, present in (
        ("prompt", request.HasField("prompt")), ("token_ids", bool(request.token_ids)),
        ("messages", bool(request.messages)),
    ) if present]
    if len(given) > 1:
        raise RequestError(
            f"give only one of prompt, token_ids or messages; got {' and '.join(given)}"
        )
    if not given:
        raise RequestError("prompt is empty: set prompt (text), token_ids or messages")
    if request.token_ids:
        return None, list(request.token_ids)
    text = chat_text(request.messages, tokenizer) if request.messages else request.prompt
    if not text:
        raise RequestError("prompt is empty: give at least one character of text")
    return text, require_tokenizer(tokenizer, "a text prompt (send token_ids)").encode(text)


def chat_text(messages: Sequence[pb.ChatMessage], tokenizer: Tokenizer | None) -> str:
    """The prompt text of a conversation under the model's chat template."""
    conversation = [{"role": m.role, "content": m.content} for m in messages]
    tokenizer = require_tokenizer(tokenizer, "chat messages (send token_ids)")
    return tokenizer.apply_chat_template(conversation)


def require_tokenizer(tokenizer: Tokenizer | None, what: str) -> Tokenizer:
    """`tokenizer`, or NoTokenizerError saying that the model cannot take `what`."""
    if tokenizer is None:
        raise NoTokenizerError(f"this model was loaded without a tokenizer, so it cannot take "
                               f"{what}")
    return tokenizer


def check_fits(engine: LLMEngine, ids: list[int], params: SamplingParams) -> None:
    """Prompt, token ids and max_tokens against the vocabulary and the context."""
    engine.check_request(ids, params)
    room = engine.max_model_len - len(ids)
    if params.max_tokens > room:
        raise ConfigError(
            f"SamplingParams.max_tokens must be in [1, {room}] for this prompt ({len(ids)} "
            f"tokens, max_model_len {engine.max_model_len}), got {params.max_tokens}"
        )


def check_request_id(request_id: str) -> str:
    if len(request_id) > MAX_REQUEST_ID:
        raise RequestError(f"request_id must be at most {MAX_REQUEST_ID} characters, "
                           f"got {len(request_id)}")
    return request_id


def token_ids(ids: Sequence[int], vocab_size: int, field: str = "token_ids") -> list[int]:
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise RequestError(f"{field} has {bad[0]}, outside the vocabulary [0, {vocab_size})")
    return list(ids)


# --------------------------------------------------------------------------- responses


def response(delta: StreamDelta, num_logprobs: int = 0) -> pb.GenerateResponse:
    """One stream message; the last one of a sample carries finish_reason and usage.
    `num_logprobs` is the request's `logprobs` (top candidates per token)."""
    out = pb.GenerateResponse(
        request_id=delta.request_id, index=delta.index, text=delta.text,
        token_ids=delta.token_ids, finish_reason=FINISH_REASONS[delta.finish_reason],
    )
    if delta.logprobs:
        out.logprobs.extend(token_logprobs(entry, tok, num_logprobs)
                            for entry, tok in zip(delta.logprobs, delta.token_ids, strict=True))
    if delta.prompt_logprobs:
        out.prompt_logprobs.extend(_prompt_scores(delta.prompt_logprobs))
    if delta.usage is not None:
        out.usage.CopyFrom(usage(delta.usage))
    return out


def token_logprobs(entry: Logprobs, token: int, k: int) -> pb.TokenLogprobs:
    """The sampled token's log-prob and the top `k` candidates, most likely first.
    (The engine's entry holds the sampled token and the top k.)"""
    ranked = sorted(entry.items(), key=lambda item: -item[1])
    top = [pb.TokenLogprob(token_id=t, logprob=lp) for t, lp in ranked[:k]]
    return pb.TokenLogprobs(token_id=token, logprob=entry[token], top=top)


def _prompt_scores(entries: Sequence[Logprobs | None]) -> list[float]:
    return [next(iter(e.values())) for e in entries[1:] if e is not None]


def usage(counts: Usage) -> pb.Usage:
    return pb.Usage(
        prompt_tokens=counts.prompt_tokens, completion_tokens=counts.completion_tokens,
        cached_tokens=counts.cached_tokens, ttft_seconds=counts.ttft or 0.0,
    )
