"""What generation returns: per-request outputs, streamed deltas and request metrics."""

from __future__ import annotations

from dataclasses import dataclass, field

Logprobs = dict[int, float]  # token id -> log-prob


@dataclass
class CompletionOutput:
    """One sample of a request."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort"
    logprobs: list[Logprobs] | None = None  # per new token: {token id: log-prob}


@dataclass
class RequestMetrics:
    """Timestamps (time.perf_counter seconds) and token counts of one request."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished_time: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        """Time to first token, from arrival."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def itls(self) -> list[float]:
        """Inter-token latencies of the first sample."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        gaps = self.itls
        return sum(gaps) / len(gaps) if gaps else None


@dataclass
class RequestOutput:
    """A prompt and its `n` samples; `.text` etc. read the first sample."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[Logprobs | None] | None = None
    metrics: RequestMetrics | None = None

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[Logprobs] | None:
        return self.outputs[0].logprobs


@dataclass(frozen=True)
class Usage:
    """Token counts of one sample, taken when its stream ends."""

    prompt_tokens: int
    completion_tokens: int  # this sample's
    cached_tokens: int  # prompt tokens served from the prefix cache
    ttft: float | None  # seconds from arrival to the request's first token


@dataclass(frozen=True)
class StreamDelta:
    """What one engine step added to one sample of one request: a value, copied out of
    the engine's state when made, so it never changes after it is handed over."""

    request_id: str
    index: int  # sample index
    text: str  # text delta
    token_ids: tuple[int, ...]  # new token ids
    logprobs: tuple[Logprobs, ...] | None
    finish_reason: str | None  # set on the sample's last delta
    request_finished: bool = False  # every sample of the request has ended with this delta
    usage: Usage | None = None  # on the sample's last delta
    prompt_logprobs: tuple[Logprobs | None, ...] | None = None  # on sample 0's first token
