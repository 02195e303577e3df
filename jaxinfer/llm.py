"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`.

The host loop is deliberately simple until the scheduler arrives: sequences
wait in FCFS order until a batch slot and enough KV blocks are free. Admission
reserves blocks for the prompt plus `max_tokens` (capped by `max_model_len`),
so a running sequence never runs out; a prefill of the whole prompt follows,
and then all running sequences decode together, one token per step, each with
its own sampling settings. A finished sequence frees its slot and blocks at
once, so the next waiting prompt starts on the following step.
"""

from __future__ import annotations

import secrets
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from jaxinfer.engine.block_manager import BlockAllocator
from jaxinfer.errors import ConfigError, RequestError
from jaxinfer.model.config import ModelConfig
from jaxinfer.runner import CacheConfig, ModelRunner
from jaxinfer.sampling import SamplingParams, find_stop_string
from jaxinfer.tokenizer import IncrementalDetokenizer, Tokenizer
from jaxinfer.weights import DEFAULT_MODEL, LoadedModel, load_model

Logprobs = dict[int, float]


@dataclass
class CompletionOutput:
    """One sample of a request."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length"
    logprobs: list[Logprobs] | None = None  # per new token: {token id: log-prob}


@dataclass
class RequestOutput:
    """A prompt and its `n` samples; `.text` etc. read the first sample."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[Logprobs | None] | None = None

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


@dataclass
class _Sequence:
    """Host-side state of one sample while it runs."""

    output: CompletionOutput
    request: RequestOutput
    params: SamplingParams
    seed: int
    stop_ids: frozenset[int]
    detokenizer: IncrementalDetokenizer | None
    slot: int = -1
    blocks: list[int] = field(default_factory=list)
    stop_scan_from: int = 0
    raw_text: str = ""
    stopped_by_string: bool = False

    @property
    def prompt_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output.token_ids)


TokenCallback = Callable[[RequestOutput, CompletionOutput, str], None]


class LLM:
    """Load a model once, then generate for any number of prompts."""

    def __init__(
        self,
        model: str | Path = DEFAULT_MODEL,
        *,
        dtype: str = "float32",
        load_format: str = "auto",
        max_model_len: int | None = None,
        max_num_seqs: int = 8,
        block_size: int = 16,
        attention_impl: str = "xla",
        kv_cache_memory: int | None = None,
        loaded: LoadedModel | None = None,
    ) -> None:
        self.model = loaded or load_model(model, dtype=dtype, load_format=load_format)
        config = self.model.config
        cache = CacheConfig(
            max_model_len=max_model_len or min(config.max_position, 2048),
            max_num_seqs=max_num_seqs,
            block_size=block_size,
            attention_impl=attention_impl,
            kv_cache_memory=kv_cache_memory,
        )
        self.runner = ModelRunner(config, self.model.params, cache)
        self.blocks = BlockAllocator(self.runner.num_blocks, block_size)
        self._next_request = 0

    @property
    def tokenizer(self) -> Tokenizer:
        if self.model.tokenizer is None:
            raise ConfigError("this model was loaded without a tokenizer; pass token ids")
        return self.model.tokenizer

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    @property
    def max_model_len(self) -> int:
        return self.runner.cache.max_model_len

    def generate(
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        on_token: TokenCallback | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text, or token ids); outputs keep the input order."""
        requests = self._requests(prompts, prompt_token_ids)
        params = _per_request(sampling_params, len(requests))
        sequences = [
            seq for request, p in zip(requests, params, strict=True)
            for seq in self._sequences(request, p)
        ]
        self._run(sequences, on_token)
        return requests

    def chat(
        self, messages: Sequence[dict[str, str]], sampling_params: SamplingParams | None = None,
    ) -> RequestOutput:
        """Apply the model's chat template to one conversation and generate the reply."""
        prompt = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True)
        return self.generate(prompt, sampling_params)[0]

    def _requests(
        self, prompts: str | Sequence[str] | None, token_ids: Sequence[Sequence[int]] | None
    ) -> list[RequestOutput]:
        if (prompts is None) == (token_ids is None):
            raise RequestError("pass exactly one of prompts or prompt_token_ids")
        if isinstance(prompts, str):
            prompts = [prompts]
        texts: list[str | None] = list(prompts) if prompts is not None else [None] * len(token_ids)
        id_lists = (
            [self._encode(text) for text in prompts] if prompts is not None
            else [list(map(int, ids)) for ids in token_ids]
        )
        requests = []
        for text, ids in zip(texts, id_lists, strict=True):
            self._check_prompt(ids)
            requests.append(RequestOutput(str(self._next_request), text, ids, []))
            self._next_request += 1
        return requests

    def _encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise RequestError(f"prompts must be strings, got {type(text).__name__}")
        return self.tokenizer.encode(text)

    def _check_prompt(self, ids: list[int]) -> None:
        vocab = self.config.vocab_size
        if not ids:
            raise RequestError("prompt is empty: give at least one token")
        if len(ids) >= self.max_model_len:
            raise RequestError(
                f"prompt has {len(ids)} tokens but max_model_len is {self.max_model_len}: "
                "shorten the prompt or raise max_model_len"
            )
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise RequestError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")

    def _sequences(self, request: RequestOutput, params: SamplingParams) -> list[_Sequence]:
        base_seed = params.seed if params.seed is not None else secrets.randbits(63)
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= set(self._eos_ids())
        sequences = []
        for index in range(params.n):
            logprobs: list[Logprobs] | None = [] if params.logprobs is not None else None
            output = CompletionOutput(index, "", [], None, logprobs)
            request.outputs.append(output)
            detok = None
            if self.model.tokenizer is not None:
                detok = IncrementalDetokenizer(
                    self.model.tokenizer, request.prompt_token_ids, params.skip_special_tokens
                )
            seed = (base_seed + index) % (1 << 63)
            sequences.append(_Sequence(output, request, params, seed, frozenset(stop_ids), detok))
        return sequences

    def _eos_ids(self) -> tuple[int, ...]:
        ids = set(self.config.eos_token_ids)
        if self.model.tokenizer is not None:
            ids |= set(self.model.tokenizer.stop_token_ids)
        return tuple(sorted(ids))

    def kv_cache_info(self) -> dict[str, int]:
        """The KV pool's size, as reported at start-up."""
        return {
            "num_blocks": self.runner.num_blocks,
            "block_size": self.blocks.block_size,
            "max_cached_tokens": self.runner.num_blocks * self.blocks.block_size,
            "bytes_per_token": self.runner.bytes_per_token,
            "bytes": self.runner.kv_bytes,
        }

    def _run(self, sequences: list[_Sequence], on_token: TokenCallback | None) -> None:
        waiting = deque(sequences)
        running: list[_Sequence] = []
        free_slots = list(range(self.runner.cache.max_num_seqs))[::-1]
        while waiting or running:
            while waiting and free_slots and self._reserve(waiting[0]):
                seq = waiting.popleft()
                seq.slot = free_slots.pop()
                self._prefill(seq, on_token)
                running.append(seq)
            if running:
                self._decode([s for s in running if not s.output.finish_reason], on_token)
            for seq in [s for s in running if s.output.finish_reason]:
                running.remove(seq)
                free_slots.append(seq.slot)
                self.blocks.free(seq.blocks)

    def _reserve(self, seq: _Sequence) -> bool:
        """Allocate blocks for the prompt and every token it may generate, if free."""
        tokens = min(len(seq.prompt_ids) + seq.params.max_tokens, self.max_model_len)
        count = self.blocks.blocks_for(tokens)
        if not self.blocks.can_allocate(count):
            return False
        seq.blocks = self.blocks.allocate(count)
        return True

    def _prefill(self, seq: _Sequence, on_token: TokenCallback | None) -> None:
        result = self.runner.prefill(
            seq.slot, seq.prompt_ids, seq.blocks, seq.params, seq.seed
        )
        if seq.params.prompt_logprobs is not None and seq.output.index == 0:
            scores = result["prompt_logprobs"][0]
            seq.request.prompt_logprobs = _prompt_logprobs(seq.prompt_ids, scores)
        self._append(seq, result, 0, on_token)

    def _decode(self, running: list[_Sequence], on_token: TokenCallback | None) -> None:
        if not running:
            return
        result = self.runner.decode(
            slots=[s.slot for s in running],
            tokens=[s.output.token_ids[-1] for s in running],
            positions=[s.num_tokens - 1 for s in running],
            block_tables=[s.blocks for s in running],
            params=[s.params for s in running],
            seeds=[s.seed for s in running],
            steps=[len(s.output.token_ids) for s in running],
        )
        for row, seq in enumerate(running):
            self._append(seq, result, row, on_token)

    def _append(
        self, seq: _Sequence, result: dict[str, np.ndarray], row: int,
        on_token: TokenCallback | None,
    ) -> None:
        token = int(result["tokens"][row])
        out = seq.output
        out.token_ids.append(token)
        if out.logprobs is not None:
            out.logprobs.append(_token_logprobs(result, row, token, seq.params.logprobs or 0))
        emitted = len(out.text)
        if token not in seq.stop_ids:
            self._detokenize(seq, token)
        out.finish_reason = self._finish_reason(seq, token)
        if out.finish_reason and not seq.stopped_by_string:
            self._flush(seq)
        if on_token is not None:
            on_token(seq.request, out, out.text[emitted:])

    def _detokenize(self, seq: _Sequence, token: int) -> None:
        if seq.detokenizer is not None:
            seq.raw_text += seq.detokenizer.push(token)
            seq.output.text = seq.raw_text

    def _flush(self, seq: _Sequence) -> None:
        """Emit bytes the detokenizer held back for an unfinished character."""
        if seq.detokenizer is not None:
            seq.raw_text += seq.detokenizer.flush()
            seq.output.text = seq.raw_text

    def _finish_reason(self, seq: _Sequence, token: int) -> str | None:
        out, params = seq.output, seq.params
        if token in seq.stop_ids:
            return "stop"
        if params.stop and self._truncate_at_stop(seq):
            return "stop"
        if len(out.token_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _truncate_at_stop(self, seq: _Sequence) -> bool:
        found = find_stop_string(seq.raw_text, seq.params.stop, seq.stop_scan_from)
        seq.stop_scan_from = len(seq.raw_text)
        if found is None:
            return False
        position, stop = found
        end = position + len(stop) if seq.params.include_stop_str_in_output else position
        seq.output.text = seq.raw_text[:end]
        seq.stopped_by_string = True
        return True


def _per_request(
    params: SamplingParams | Sequence[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ConfigError(f"got {len(params)} SamplingParams for {count} prompts")
    return params


def _token_logprobs(result: dict[str, np.ndarray], row: int, token: int, top: int) -> Logprobs:
    entry = {token: float(result["logprobs"][row])}
    for token_id, value in zip(result["top_ids"][row][:top], result["top_logprobs"][row][:top],
                               strict=True):
        entry.setdefault(int(token_id), float(value))
    return entry


def _prompt_logprobs(ids: list[int], scores: np.ndarray) -> list[Logprobs | None]:
    """Per prompt token: None for the first, then {token: log p(token | prefix)}."""
    return [None] + [{ids[t + 1]: float(scores[t])} for t in range(len(ids) - 1)]
