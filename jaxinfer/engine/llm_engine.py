"""The engine: scheduler + model runner + detokenizer, one `step()` at a time.

Each step:
1. applies aborts requested since the last step (from any thread);
2. asks the scheduler for a plan (decodes, prompt chunks, preemptions);
3. runs the decodes and prompt chunks together in one device call over a
   flat batch of their tokens, which samples on device;
4. feeds the sampled tokens back: K/V bookkeeping, prefix-cache commits,
   incremental detokenization, stop checks, metrics;
5. returns the step's deltas, which the offline API collects and the async
   engine streams.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from jaxinfer.engine.block_manager import BlockManager, BlockPools
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.metrics import EngineStats
from jaxinfer.engine.scheduler import PrefillChunk, Scheduler, SequenceState
from jaxinfer.errors import RequestError
from jaxinfer.outputs import (
    CompletionOutput,
    Logprobs,
    RequestMetrics,
    RequestOutput,
    StreamDelta,
    Usage,
)
from jaxinfer.parallel.multihost import StepBroadcast
from jaxinfer.runner import ModelRunner, SequenceQuery, StepResult
from jaxinfer.sampling import SamplingParams, find_stop_string
from jaxinfer.tokenizer import IncrementalDetokenizer, Tokenizer
from jaxinfer.weights import LoadedModel


@dataclass(eq=False)
class _Sample:
    """Host-side state of one sample: its scheduler sequence and its output."""

    seq: SequenceState
    output: CompletionOutput
    request: _Request
    seed: int
    detokenizer: IncrementalDetokenizer | None
    rank: int  # the data-parallel rank whose scheduler and KV pool hold the sequence
    raw_text: str = ""
    stop_scan_from: int = 0
    stopped_by_string: bool = False


@dataclass(eq=False)
class _Request:
    output: RequestOutput
    params: SamplingParams
    stop_ids: frozenset[int]
    samples: list[_Sample] = field(default_factory=list)

    @property
    def metrics(self) -> RequestMetrics:
        assert self.output.metrics is not None
        return self.output.metrics


class LLMEngine:
    """Continuous batching over one model: add requests, call `step()` until done."""

    def __init__(self, model: LoadedModel, config: EngineConfig | None = None, *,
                 step_broadcast: StepBroadcast | None = None) -> None:
        """`step_broadcast`: on process 0 of a multi-host job, the followers' channel."""
        self.model = model
        self.config = config = (config or EngineConfig()).resolve(model.config.max_position)
        self.runner = ModelRunner(model.config, model.params, config.cache_config(),
                                  step_broadcast)
        self.blocks = BlockPools([
            BlockManager(self.runner.num_blocks, config.block_size,
                         enable_prefix_caching=config.enable_prefix_caching)
            for _ in range(config.data_parallel_size)])
        # one scheduler per data-parallel rank, over that rank's blocks
        self.schedulers = [Scheduler(config.scheduler_config(), blocks)
                           for blocks in self.blocks.ranks]
        self.stats = EngineStats()
        self._requests: dict[str, _Request] = {}
        self._samples: dict[int, _Sample] = {}  # by scheduler seq_id
        self._pending_aborts: list[str] = []
        self._lock = threading.Lock()
        self._next_id = 0

    # ----------------------------------------------------------------- public API

    @property
    def max_model_len(self) -> int:
        return self.runner.cache.max_model_len

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.model.tokenizer

    def add_request(
        self,
        request_id: str | None = None,
        prompt: str | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        params: SamplingParams | None = None,
    ) -> RequestOutput:
        """Validate and queue a request; bad input raises RequestError and queues nothing."""
        params = params or SamplingParams()
        ids = self._prompt_ids(prompt, prompt_token_ids)
        self.check_request(ids, params)
        request_id = request_id if request_id is not None else self._new_id()
        with self._lock:
            if request_id in self._requests:
                raise RequestError(f"request_id {request_id!r} is already in use")
            request = self._new_request(request_id, prompt, ids, params, self._pick_rank())
            self._requests[request_id] = request
            for sample in request.samples:
                self._samples[sample.seq.seq_id] = sample
                self.schedulers[sample.rank].add(sample.seq)
        return request.output

    def abort(self, request_id: str) -> None:
        """Cancel a request at the next step (thread-safe); its blocks are freed then."""
        with self._lock:
            self._pending_aborts.append(request_id)

    def has_unfinished(self) -> bool:
        with self._lock:
            return any(s.has_unfinished() for s in self.schedulers) or bool(
                self._pending_aborts)

    def step(self) -> list[StreamDelta]:
        """Run one scheduling iteration and return what it produced."""
        with self._lock:
            deltas = self._apply_aborts()
            plans = [scheduler.schedule() for scheduler in self.schedulers]  # one per rank
        start = time.perf_counter()
        for plan in plans:
            self._mark_scheduled(plan.prefills, start)
        calls, computed = 0, 0
        if not all(plan.empty for plan in plans):
            calls = sum(self._record_prefix_histories(plan.prefills) for plan in plans)
            pending = self.runner.step([
                [self._decode_query(seq) for seq in plan.decodes]
                + [self._prefill_query(chunk) for chunk in plan.prefills] for plan in plans])
            for plan, result in zip(plans, pending.results(), strict=True):
                deltas += self._accept_decodes(plan.decodes, result)
                deltas += self._accept_prefills(plan.prefills, result,
                                                first_row=len(plan.decodes))
            calls, computed = calls + 1, pending.computed_tokens
        self.stats.record_step(
            num_tokens=sum(plan.num_tokens for plan in plans),
            num_preempted=sum(len(plan.preempted) for plan in plans),
            seconds=time.perf_counter() - start, device_calls=calls, computed_tokens=computed,
        )
        return deltas

    def get_request(self, request_id: str) -> RequestOutput:
        return self._requests[request_id].output

    def release(self, request_id: str) -> None:
        """Forget a finished request (the offline API and server call this)."""
        with self._lock:
            request = self._requests.pop(request_id)
            for sample in request.samples:
                self._samples.pop(sample.seq.seq_id, None)

    def warmup(self) -> int:
        """Compile every step shape the engine can use; returns the compile count."""
        self.runner.warmup(self.schedulers[0].config.max_num_batched_tokens)
        return self.runner.compile_count

    # ----------------------------------------------------------------- requests

    def _new_id(self) -> str:
        self._next_id += 1
        return f"req-{self._next_id}"

    def _prompt_ids(self, prompt: str | None, token_ids: Sequence[int] | None) -> list[int]:
        """The ids to run: token_ids when given (prompt is then only recorded)."""
        if prompt is None and token_ids is None:
            raise RequestError("pass a prompt or prompt_token_ids")
        if token_ids is not None:
            return [int(i) for i in token_ids]
        if not isinstance(prompt, str):
            raise RequestError(f"prompt must be a string, got {type(prompt).__name__}")
        if self.model.tokenizer is None:
            raise RequestError("this model was loaded without a tokenizer; pass token ids")
        return self.model.tokenizer.encode(prompt)

    def check_request(self, ids: list[int], params: SamplingParams) -> None:
        """Raise RequestError if the request cannot be served as given."""
        vocab = self.model.config.vocab_size
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
        bad_stops = [i for i in params.stop_token_ids if not 0 <= i < vocab]
        if bad_stops:
            raise RequestError(
                f"stop_token_ids has {bad_stops[0]}, outside the vocabulary [0, {vocab})"
            )

    def _new_request(
        self, request_id: str, prompt: str | None, ids: list[int], params: SamplingParams,
        rank: int,
    ) -> _Request:
        """The request's samples, all on data-parallel rank `rank` (they share prompt blocks)."""
        metrics = RequestMetrics(arrival_time=time.perf_counter(), prompt_tokens=len(ids))
        output = RequestOutput(request_id, prompt, ids, [], metrics=metrics)
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= set(self._eos_ids())
        request = _Request(output, params, frozenset(stop_ids))
        base_seed = params.seed if params.seed is not None else secrets.randbits(63)
        first: SequenceState | None = None
        for index in range(params.n):
            seq = SequenceState(request_id, ids, params.max_tokens, sample_index=index,
                           wait_for=first, use_prefix_cache=params.prompt_logprobs is None)
            first = first or seq
            logprobs: list[Logprobs] | None = [] if params.logprobs is not None else None
            completion = CompletionOutput(index, "", [], None, logprobs)
            output.outputs.append(completion)
            request.samples.append(_Sample(
                seq, completion, request, (base_seed + index) % (1 << 63),
                self._detokenizer(ids, params), rank,
            ))
        return request

    def _pick_rank(self) -> int:
        """The data-parallel rank a new request joins: the one with the fewest unfinished
        sequences, then the most free KV blocks."""
        def load(rank: int) -> tuple[int, int]:
            scheduler = self.schedulers[rank]
            return (len(scheduler.waiting) + len(scheduler.running),
                    -scheduler.blocks.num_free)

        return min(range(len(self.schedulers)), key=load)

    def _detokenizer(
        self, ids: list[int], params: SamplingParams
    ) -> IncrementalDetokenizer | None:
        if self.model.tokenizer is None:
            return None
        return IncrementalDetokenizer(self.model.tokenizer, ids, params.skip_special_tokens)

    def _eos_ids(self) -> tuple[int, ...]:
        ids = set(self.model.config.eos_token_ids)
        if self.model.tokenizer is not None:
            ids |= set(self.model.tokenizer.stop_token_ids)
        return tuple(sorted(ids))

    def _apply_aborts(self) -> list[StreamDelta]:
        deltas = []
        for request_id in self._pending_aborts:
            request = self._requests.get(request_id)
            if request is None:
                continue
            live = [s for s in request.samples if s.output.finish_reason is None]
            for sample in live:
                sample.output.finish_reason = "abort"
                self.schedulers[sample.rank].finish(sample.seq)
                deltas.append(self._delta(sample, [], "", None))
            if live:
                self._finish_metrics(request)
        self._pending_aborts.clear()
        return deltas

    # ----------------------------------------------------------------- device steps

    def _mark_scheduled(self, chunks: list[PrefillChunk], now: float) -> None:
        for chunk in chunks:
            metrics = self._samples[chunk.seq.seq_id].request.metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
                metrics.cached_tokens = chunk.seq.num_cached

    def _record_prefix_histories(self, chunks: list[PrefillChunk]) -> int:
        """Start the penalty statistics of prefix-cache hits that use penalties from
        their cached tokens (elsewhere they are never read); returns the device calls."""
        calls = 0
        for chunk in chunks:
            if self._history_recorded(chunk):
                seq = chunk.seq
                self.runner.record_history(self._samples[seq.seq_id].rank, seq.slot,
                                           seq.tokens(0, chunk.start), len(seq.prompt_ids))
                calls += 1
        return calls

    def _history_recorded(self, chunk: PrefillChunk) -> bool:
        params = self._samples[chunk.seq.seq_id].request.params
        return chunk.first and chunk.start > 0 and params.uses_penalties

    def _accept_prefills(
        self, chunks: list[PrefillChunk], result: StepResult, first_row: int
    ) -> list[StreamDelta]:
        deltas = []
        for row, chunk in enumerate(chunks, start=first_row):
            sample = self._samples[chunk.seq.seq_id]
            self._record_prompt_logprobs(sample, chunk, result.prompt_scores(row))
            self.schedulers[sample.rank].on_computed(chunk.seq, chunk.num_tokens)
            if chunk.completes:
                deltas += self._accept(sample, result, row)
        return deltas

    def _accept_decodes(
        self, seqs: list[SequenceState], result: StepResult
    ) -> list[StreamDelta]:
        deltas = []
        for i, seq in enumerate(seqs):
            sample = self._samples[seq.seq_id]
            self.schedulers[sample.rank].on_computed(seq, 1)
            deltas += self._accept(sample, result, i)
        return deltas

    def _prefill_query(self, chunk: PrefillChunk) -> SequenceQuery:
        seq, sample = chunk.seq, self._samples[chunk.seq.seq_id]
        stop = chunk.start + chunk.num_tokens
        wants_scores = sample.request.params.prompt_logprobs is not None
        return SequenceQuery(
            slot=seq.slot, token_ids=seq.tokens(chunk.start, stop), start=chunk.start,
            block_table=seq.block_table, params=sample.request.params, seed=sample.seed,
            step=len(seq.output_ids), prompt_len=len(seq.prompt_ids), emit=chunk.completes,
            targets=seq.tokens(chunk.start + 1, stop + 1) if wants_scores else (),
            record=True, fresh=chunk.first and not self._history_recorded(chunk),
        )

    def _decode_query(self, seq: SequenceState) -> SequenceQuery:
        sample = self._samples[seq.seq_id]
        return SequenceQuery(
            slot=seq.slot, token_ids=[seq.output_ids[-1]], start=seq.num_tokens - 1,
            block_table=seq.block_table, params=sample.request.params, seed=sample.seed,
            step=len(seq.output_ids), prompt_len=len(seq.prompt_ids),
        )

    def _record_prompt_logprobs(
        self, sample: _Sample, chunk: PrefillChunk, scores: np.ndarray
    ) -> None:
        """scores [chunk tokens]: log p(next token) at each of the chunk's positions."""
        request = sample.request
        if request.params.prompt_logprobs is None or sample.seq.sample_index or (
            sample.seq.preemptions
        ):
            return
        prompt = request.output.prompt_token_ids
        entries = request.output.prompt_logprobs
        if entries is None:
            entries = request.output.prompt_logprobs = [None]
        for t in range(chunk.num_tokens):
            target = chunk.start + t + 1
            if target < len(prompt):
                entries.append({prompt[target]: float(scores[t])})

    # ----------------------------------------------------------------- outputs

    def _accept(
        self, sample: _Sample, result: StepResult, row: int
    ) -> list[StreamDelta]:
        """Append a sampled token: detokenize, check stops, record metrics."""
        token = int(result.tokens[row])
        request, out = sample.request, sample.output
        sample.seq.output_ids.append(token)
        out.token_ids.append(token)
        now = time.perf_counter()
        metrics = request.metrics
        if sample.seq.sample_index == 0:
            metrics.first_token_time = metrics.first_token_time or now
            metrics.token_times.append(now)
        metrics.completion_tokens += 1
        logprobs = None
        if out.logprobs is not None:
            logprobs = [_token_logprobs(result, row, token, request.params.logprobs or 0)]
            out.logprobs.extend(logprobs)
        emitted = len(out.text)
        if token not in request.stop_ids:
            self._detokenize(sample, token)
        out.finish_reason = self._finish_reason(sample, token)
        if out.finish_reason:
            self._retire(sample)
        return [self._delta(sample, [token], out.text[emitted:], logprobs)]

    def _delta(
        self, sample: _Sample, tokens: list[int], text: str, logprobs: list[Logprobs] | None
    ) -> StreamDelta:
        """A value copy of what the step added: later steps never change it."""
        out, request = sample.output, sample.request.output
        first_token = sample.seq.sample_index == 0 and len(out.token_ids) == 1 and tokens
        prompt_logprobs = request.prompt_logprobs if first_token else None
        return StreamDelta(
            request.request_id, out.index, text, tuple(tokens),
            None if logprobs is None else tuple(logprobs), out.finish_reason,
            request_finished=request.finished,
            usage=_usage(sample) if out.finish_reason is not None else None,
            prompt_logprobs=None if prompt_logprobs is None else tuple(prompt_logprobs),
        )

    def _retire(self, sample: _Sample) -> None:
        if not sample.stopped_by_string and sample.detokenizer is not None:
            sample.raw_text += sample.detokenizer.flush()
            sample.output.text = sample.raw_text
        self.schedulers[sample.rank].finish(sample.seq)
        if sample.request.output.finished:
            self._finish_metrics(sample.request)

    def _finish_metrics(self, request: _Request) -> None:
        request.metrics.finished_time = time.perf_counter()
        self.stats.record_request(request.output)

    def _detokenize(self, sample: _Sample, token: int) -> None:
        if sample.detokenizer is not None:
            sample.raw_text += sample.detokenizer.push(token)
            sample.output.text = sample.raw_text

    def _finish_reason(self, sample: _Sample, token: int) -> str | None:
        params = sample.request.params
        if token in sample.request.stop_ids:
            return "stop"
        if params.stop and self._truncate_at_stop(sample):
            return "stop"
        seq = sample.seq
        if len(seq.output_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _truncate_at_stop(self, sample: _Sample) -> bool:
        stops = sample.request.params.stop
        found = find_stop_string(sample.raw_text, stops, sample.stop_scan_from)
        sample.stop_scan_from = len(sample.raw_text)
        if found is None:
            return False
        position, stop = found
        keep = sample.request.params.include_stop_str_in_output
        sample.output.text = sample.raw_text[: position + len(stop) if keep else position]
        sample.stopped_by_string = True
        return True

    # ----------------------------------------------------------------- metrics

    def snapshot(self) -> dict[str, float]:
        """Engine gauges now: queues, KV blocks, prefix cache, preemptions, compiles."""
        with self._lock:
            return {
                "waiting": sum(len(s.waiting) for s in self.schedulers),
                "running": sum(len(s.running) for s in self.schedulers),
                "kv_blocks_used": self.blocks.num_used,
                "kv_blocks_free": self.blocks.num_free,
                "kv_blocks_total": self.blocks.num_blocks,
                "prefix_cache_hit_rate": self.blocks.hit_rate,
                "preemptions": sum(s.num_preemptions for s in self.schedulers),
                "compiles": self.runner.compile_count,
                "steps": self.stats.steps,
            }


def _usage(sample: _Sample) -> Usage:
    metrics = sample.request.metrics
    return Usage(prompt_tokens=metrics.prompt_tokens,
                 completion_tokens=len(sample.seq.output_ids),
                 cached_tokens=metrics.cached_tokens, ttft=metrics.ttft)


def _token_logprobs(result: StepResult, row: int, token: int, top: int) -> Logprobs:
    entry = {token: float(result.logprobs[row])}
    top_ids, top_values = result.top_ids[row][:top], result.top_logprobs[row][:top]
    for token_id, value in zip(top_ids, top_values, strict=True):
        entry.setdefault(int(token_id), float(value))
    return entry
