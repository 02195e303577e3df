"""The model runner: device state and the jit-compiled step functions.

The runner owns the params, the KV pool and the per-sequence penalty state
(prompt-token masks and output-token counts), all on device. Each sequence
lives in a *slot*; the runner turns host-side requests (token ids, positions,
sampling settings) into padded arrays of a few bucketed shapes and calls:

    prefill(params, kv, penalties, batch, sampling) -> (StepOutput, kv, penalties)
    decode(params, kv, penalties, batch, sampling)  -> (StepOutput, kv, penalties)

Both sample on device and return the sampled tokens and their log-probs in one
small pytree, fetched to the host in a single transfer. The KV pool and the
penalty state are donated, so they are updated in place.

Dispatch is asynchronous: `prefill` and `decode` return a `PendingStep` at
once, so the engine prepares and dispatches a step's next call while the
device runs the previous one, and reads the results afterwards.

KV layout: one pool per layer of `num_blocks` blocks of `block_size` tokens,
sized from a memory budget; `kv_cache_dtype="int8"` stores int8 K/V plus one
f32 scale per token and KV head, so the same budget holds more blocks. The
caller (the host loop and its block allocator) owns the block tables; the
runner turns them into the KV write rows (where each new token's K/V is
written) and the padded block-table array the attention reads through.
Slots only index the per-sequence penalty state.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxinfer.engine.config import CacheConfig
from jaxinfer.errors import ConfigError
from jaxinfer.model.config import ModelConfig
from jaxinfer.model.params import Params, compute_dtype
from jaxinfer.model.transformer import (
    KVCache,
    forward,
    init_kv_cache,
    kv_bytes_per_token,
    lm_head,
)
from jaxinfer.ops.attention import (
    AttentionFn,
    get_attention_fn,
)
from jaxinfer.ops.types import AttentionMetadata
from jaxinfer.sampling import (
    MAX_LOGPROBS,
    SampleOutput,
    SamplingArrays,
    SamplingParams,
    make_sampling_arrays,
    sample,
    update_output_counts,
)

MIN_PREFILL_BUCKET = 16
MIN_CONTEXT_BLOCKS = 8
PROMPT_LOGPROB_CHUNK = 128


def kv_cache_budget(cache: CacheConfig, bytes_per_token: int) -> int:
    """Bytes for the KV pool: `kv_cache_memory`, else a fraction of free device
    memory where the device reports it (GPU/TPU), else (CPU) room for
    `max_num_seqs` sequences of `max_model_len` tokens."""
    if cache.kv_cache_memory is not None:
        return cache.kv_cache_memory
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        return int(free * cache.kv_cache_fraction)
    return cache.max_num_seqs * cache.max_blocks_per_seq * cache.block_size * bytes_per_token


def num_kv_blocks(cache: CacheConfig, bytes_per_token: int) -> int:
    """Blocks that fit the budget; a clear error when one full sequence does not fit."""
    budget = kv_cache_budget(cache, bytes_per_token)
    blocks = budget // (bytes_per_token * cache.block_size)
    if blocks < cache.max_blocks_per_seq:
        raise ConfigError(
            f"a KV cache of {budget:,} bytes holds {blocks * cache.block_size:,} tokens "
            f"({bytes_per_token:,} bytes each), fewer than one max_model_len sequence "
            f"({cache.max_model_len:,}): raise kv_cache_memory or lower max_model_len"
        )
    return blocks


@struct.dataclass
class PenaltyState:
    """Per-slot token statistics for repetition/presence/frequency penalties.

    Row `max_num_seqs` is a scratch row that padding entries of a batch point at.
    """

    prompt_mask: jax.Array  # [slots + 1, V] bool
    output_counts: jax.Array  # [slots + 1, V] int32


@struct.dataclass
class StepBatch:
    """One step's padded inputs (prefill: T = bucket length; decode: T = 1)."""

    tokens: jax.Array  # [B, T] int32
    meta: AttentionMetadata
    last_index: jax.Array  # [B] int32, index in T of each row's last real token
    slots: jax.Array  # [B] int32, penalty-state row (scratch row for padding)
    valid: jax.Array  # [B, T] bool, real (non-padding) tokens
    fresh: jax.Array  # [B] bool, the row starts its sequence (position 0)
    is_output: jax.Array  # [B, T] bool, token is an earlier output (resumed sequence)
    emit: jax.Array  # [B] bool, the sampled token will be used
    targets: jax.Array  # [B, T] int32, next token at each position (prompt log-probs)


class StepOutput(struct.PyTreeNode):
    sample: SampleOutput
    prompt_logprobs: jax.Array  # [B, T] f32 log p(token t+1 | ..t); [B, 0] when not asked


@dataclass(frozen=True)
class StepResult:
    """A step's output on the host, one row per batch row (padding rows included)."""

    tokens: np.ndarray  # [B] int32 sampled token ids
    logprobs: np.ndarray  # [B] f32 log-prob of each sampled token (raw distribution)
    top_ids: np.ndarray  # [B, K] int32 most likely ids, K = the bucketed top count (0, 5, 20)
    top_logprobs: np.ndarray  # [B, K] f32
    prompt_logprobs: np.ndarray  # [B, T] f32 log p(token t+1 | ..t); [B, 0] when not asked


class PendingStep:
    """A dispatched step: the device computes while the host prepares the next call.

    Its small output (sampled tokens, log-probs) starts copying to the host at
    once; `result()` waits for it: the step's single device -> host transfer.
    `computed_tokens` is the padded batch's size (rows x length), the tokens the
    device computes, padding included.
    """

    def __init__(self, output: StepOutput, computed_tokens: int) -> None:
        self._output = output
        self.computed_tokens = computed_tokens
        for leaf in jax.tree.leaves(output):
            leaf.copy_to_host_async()

    def result(self) -> StepResult:
        host = jax.device_get(self._output)
        return StepResult(
            tokens=host.sample.tokens, logprobs=host.sample.logprobs,
            top_ids=host.sample.top_ids, top_logprobs=host.sample.top_logprobs,
            prompt_logprobs=host.prompt_logprobs,
        )


@dataclass
class SequenceQuery:
    """One sequence's query tokens in a step (a prompt chunk or its last sampled token),
    and what to do with them, as the host describes it."""

    slot: int  # penalty-state row of the sequence
    token_ids: Sequence[int]  # tokens to run (a prompt chunk, or the last sampled token)
    start: int  # position of token_ids[0]
    block_table: Sequence[int]
    params: SamplingParams
    seed: int
    step: int  # tokens the sequence has sampled so far (advances the seeded key)
    prompt_len: int  # positions below it are prompt tokens, the rest earlier outputs
    emit: bool = True  # the sampled token is used (False for a non-final prompt chunk)
    targets: Sequence[int] = ()  # next-token ids per position, for prompt log-probs


def next_power_of_two(n: int, minimum: int) -> int:
    return max(minimum, 1 << max(0, n - 1).bit_length())


class ModelRunner:
    """Holds device state and runs bucketed, jit-compiled prefill and decode steps."""

    def __init__(self, config: ModelConfig, params: Params, cache: CacheConfig) -> None:
        """`cache`: the view of an EngineConfig resolved for this model (`resolve`)."""
        self.config = config
        self.cache = cache
        # First, so a platform without the chosen kernels fails before any allocation.
        self._step = _jitted_step(config, cache.block_size, cache.attention_impl)
        self.params = jax.tree.map(jnp.asarray, params)
        self.dtype = compute_dtype(self.params)
        self.bytes_per_token = kv_bytes_per_token(config, self.dtype, cache.kv_cache_dtype)
        self.num_blocks = num_kv_blocks(cache, self.bytes_per_token)
        self.kv: KVCache = init_kv_cache(config, self.num_blocks * cache.block_size, self.dtype,
                                         cache.kv_cache_dtype)
        slots = cache.max_num_seqs + 1
        self.penalties = PenaltyState(
            prompt_mask=jnp.zeros((slots, config.vocab_size), jnp.bool_),
            output_counts=jnp.zeros((slots, config.vocab_size), jnp.int32),
        )
        self._record = _jitted_record()

    @property
    def kv_bytes(self) -> int:
        return self.kv.nbytes

    @property
    def compile_count(self) -> int:
        """Distinct compiled variants of the step function so far."""
        return self._step._cache_size()

    def prefill(self, queries: Sequence[SequenceQuery]) -> PendingStep:
        """Run prompt chunks, one sequence per batch row; sample where a query `emit`s.

        A chunk may start after a prefix whose K/V are already in its blocks (an
        earlier chunk, or a prefix-cache hit). Rows share one call, padded to
        the longest chunk; attention reads a power-of-two bucket of the longest
        context (like decode), so shapes are (rows, chunk, context) buckets.
        """
        bucket = self.prefill_bucket(max(len(q.token_ids) for q in queries))
        return self._dispatch(queries, bucket, is_prefill=True)

    def prefill_bucket(self, length: int) -> int:
        """The padded length of a call whose longest chunk has `length` tokens."""
        return min(next_power_of_two(length, MIN_PREFILL_BUCKET), self._max_tokens_bucket())

    def record_history(self, slot: int, token_ids: Sequence[int], prompt_len: int) -> None:
        """Start `slot`'s penalty statistics from tokens whose K/V are already cached
        (a prefix-cache hit): the prefill that follows starts after them."""
        size = next_power_of_two(len(token_ids), MIN_PREFILL_BUCKET)
        tokens = np.full((size,), self.config.vocab_size, np.int32)  # padding: dropped
        tokens[: len(token_ids)] = token_ids
        is_output = np.arange(size) >= prompt_len
        self.penalties = self._record(self.penalties, np.int32(slot), tokens, is_output)

    def decode(self, queries: Sequence[SequenceQuery]) -> PendingStep:
        """One new token for each sequence (its token_ids is the last sampled token)."""
        return self._dispatch(queries, 1, is_prefill=False)

    def _max_tokens_bucket(self) -> int:
        return self.cache.max_blocks_per_seq * self.cache.block_size

    def warmup(self, max_batched_tokens: int) -> None:
        """Compile every (rows, length, context) bucket a scheduler within
        `max_batched_tokens` can produce, with plain sampling (no log-probs)."""
        for rows, length in self.prefill_shapes(max_batched_tokens):
            for width in self.prefill_widths(length):
                self._warm(rows, length, width, is_prefill=True)
        for rows in _powers_of_two(next_power_of_two(self.cache.max_num_seqs, 1)):
            for width in self.decode_widths():
                self._warm(rows, 1, width, is_prefill=False)

    def prefill_shapes(self, max_batched_tokens: int) -> list[tuple[int, int]]:
        """(rows, length) buckets: a group of length-bucket T holds chunks longer than T/2."""
        cap = self._max_tokens_bucket()
        longest = min(max_batched_tokens, cap)
        lengths = sorted({min(p, cap) for p in _powers_of_two(
            next_power_of_two(longest, MIN_PREFILL_BUCKET), MIN_PREFILL_BUCKET)})
        shapes = []
        for length in lengths:
            shortest = 1 if length == MIN_PREFILL_BUCKET else next_power_of_two(
                length, 1) // 2 + 1
            most = min(self.cache.max_num_seqs, max(1, max_batched_tokens // shortest))
            shapes += [(rows, length) for rows in _powers_of_two(next_power_of_two(most, 1))]
        return shapes

    def prefill_widths(self, length: int) -> list[int]:
        """Block-table widths of a `length`-token chunk: its context is at least as long."""
        least = self.context_width(length)
        return [w for w in self.decode_widths() if w >= least]

    def decode_widths(self) -> list[int]:
        cap = self.cache.max_blocks_per_seq
        widths = [w for w in _powers_of_two(cap, MIN_CONTEXT_BLOCKS) if w < cap]
        return [*widths, cap]

    def _warm(self, rows: int, length: int, width: int, *, is_prefill: bool) -> None:
        """Compile one shape with an all-padding call, plain sampling."""
        batch = self._batch([], rows, length, is_prefill, width=width)
        sampling = make_sampling_arrays([], [], [], rows)
        _, self.kv, self.penalties = self._step(
            self.params, self.kv, self.penalties, batch, sampling,
            num_top_logprobs=0, prompt_logprobs=False, is_prefill=is_prefill,
        )

    def _dispatch(
        self, queries: Sequence[SequenceQuery], length: int, *, is_prefill: bool
    ) -> PendingStep:
        batch = self._batch(queries, next_power_of_two(len(queries), 1), length, is_prefill)
        params = [q.params for q in queries]
        sampling = make_sampling_arrays(params, [q.seed for q in queries],
                                        [q.step for q in queries],
                                        batch.tokens.shape[0])
        num_top = max((p.logprobs or 0) for p in params)
        want_prompt = is_prefill and any(p.prompt_logprobs is not None for p in params)
        output, self.kv, self.penalties = self._step(
            self.params, self.kv, self.penalties, batch, sampling,
            num_top_logprobs=_bucket_logprobs(num_top), prompt_logprobs=want_prompt,
            is_prefill=is_prefill,
        )
        return PendingStep(output, computed_tokens=batch.tokens.size)

    def _batch(
        self, queries: Sequence[SequenceQuery], b: int, t: int, is_prefill: bool,
        width: int | None = None,
    ) -> StepBatch:
        """Pad rows to [b, t]; padding rows point at the scratch slot and drop their K/V."""
        bs = self.cache.block_size
        arrays = {
            "tokens": np.zeros((b, t), np.int32),
            "targets": np.zeros((b, t), np.int32),
            "positions": np.zeros((b, t), np.int32),
            "kv_rows": np.full((b, t), self.kv.num_rows, np.int32),  # out of range
            "valid": np.zeros((b, t), np.bool_),
            "is_output": np.zeros((b, t), np.bool_),
            "context": np.zeros((b,), np.int32),
            "slots": np.full((b,), self.cache.max_num_seqs, np.int32),  # scratch row
            "last_index": np.zeros((b,), np.int32),
            "fresh": np.zeros((b,), np.bool_),
            "emit": np.zeros((b,), np.bool_),
        }
        for i, query in enumerate(queries):
            _fill_row(arrays, i, query, bs)
        if width is None:  # attention reads only a bucket of the longest context
            width = self.context_width(int(arrays["context"].max()))
        tables = np.zeros((b, width), np.int32)  # padding entries read block 0, masked
        for i, query in enumerate(queries):
            used = min(len(query.block_table), width)
            tables[i, :used] = query.block_table[:used]
        meta = AttentionMetadata(arrays["positions"], arrays["kv_rows"], tables,
                                 arrays["context"])
        return StepBatch(
            tokens=arrays["tokens"], meta=meta, last_index=arrays["last_index"],
            slots=arrays["slots"], valid=arrays["valid"], fresh=arrays["fresh"],
            is_output=arrays["is_output"], emit=arrays["emit"], targets=arrays["targets"],
        )

    def context_width(self, max_context: int) -> int:
        """Block-table width: a power-of-two bucket of the longest context."""
        needed = math.ceil(max_context / self.cache.block_size)
        return min(next_power_of_two(needed, MIN_CONTEXT_BLOCKS), self.cache.max_blocks_per_seq)


@functools.cache
def _jitted_step(config: ModelConfig, block_size: int, attention_impl: str) -> Any:
    """One jitted step per (model config, block size, kernel): runners share compilations."""
    step = partial(_step, config=config, block_size=block_size,
                   attention_fn=get_attention_fn(attention_impl))
    return jax.jit(
        step, static_argnames=("num_top_logprobs", "prompt_logprobs", "is_prefill"),
        donate_argnames=("kv", "penalties"),
    )


@functools.cache
def _jitted_record() -> Any:
    return jax.jit(_record_history, donate_argnames=("penalties",))


def _powers_of_two(top: int, start: int = 1) -> list[int]:
    """start, 2*start, ... up to and including top (top a power of two >= start)."""
    out = []
    value = start
    while value <= top:
        out.append(value)
        value *= 2
    return out


def _fill_row(
    arrays: dict[str, np.ndarray], i: int, query: SequenceQuery, block_size: int
) -> None:
    n = len(query.token_ids)
    pos = np.arange(query.start, query.start + n, dtype=np.int32)
    blocks = np.asarray(query.block_table, np.int32)[pos // block_size]
    arrays["tokens"][i, :n] = query.token_ids
    arrays["targets"][i, : len(query.targets)] = query.targets
    arrays["positions"][i, :n] = pos
    arrays["kv_rows"][i, :n] = blocks * block_size + pos % block_size
    arrays["valid"][i, :n] = True
    arrays["is_output"][i, :n] = pos >= query.prompt_len
    arrays["context"][i] = query.start + n
    arrays["slots"][i] = query.slot
    arrays["last_index"][i] = n - 1
    arrays["fresh"][i] = query.start == 0
    arrays["emit"][i] = query.emit


def _bucket_logprobs(k: int) -> int:
    """Round the requested top-logprob count up to 0, 5 or 20 to bound compilations."""
    if k == 0:
        return 0
    return 5 if k <= 5 else MAX_LOGPROBS


def _step(
    params: Params,
    kv: KVCache,
    penalties: PenaltyState,
    batch: StepBatch,
    sampling: SamplingArrays,
    *,
    config: ModelConfig,
    block_size: int,
    attention_fn: AttentionFn,
    num_top_logprobs: int,
    prompt_logprobs: bool,
    is_prefill: bool,
) -> tuple[StepOutput, KVCache, PenaltyState]:
    """Forward, sample and update the penalty state, all in one compiled program."""
    hidden, kv = forward(params, config, batch.tokens, kv, batch.meta, block_size=block_size,
                         attention_fn=attention_fn)
    last = jnp.take_along_axis(hidden, batch.last_index[:, None, None], axis=1)[:, 0]
    logits = lm_head(params, config, last)  # [B, V]
    if is_prefill:
        penalties = _reset_penalties(penalties, batch)
    prompt_mask = penalties.prompt_mask[batch.slots]  # [B, V]
    counts = penalties.output_counts[batch.slots]
    sampled = sample(logits, sampling, prompt_mask, counts, num_top_logprobs)
    new_counts = update_output_counts(counts, sampled.tokens, batch.emit)
    penalties = penalties.replace(
        output_counts=penalties.output_counts.at[batch.slots].set(new_counts)
    )
    scores = _prompt_logprobs(params, config, hidden, batch.targets) if prompt_logprobs else (
        jnp.zeros((batch.tokens.shape[0], 0), jnp.float32)
    )
    return StepOutput(sample=sampled, prompt_logprobs=scores), kv, penalties


def _reset_penalties(penalties: PenaltyState, batch: StepBatch) -> PenaltyState:
    """Record a prefill's tokens: prompt tokens in the mask, earlier outputs (a resumed
    sequence) in the counts. Rows starting a sequence are cleared first."""
    vocab = penalties.prompt_mask.shape[1]
    fresh = batch.fresh[:, None]  # [B, 1]
    mask = jnp.where(fresh, False, penalties.prompt_mask[batch.slots])  # [B, V]
    counts = jnp.where(fresh, 0, penalties.output_counts[batch.slots])
    rows = jnp.broadcast_to(jnp.arange(batch.tokens.shape[0])[:, None], batch.tokens.shape)
    prompt_cols = jnp.where(batch.valid & ~batch.is_output, batch.tokens, vocab)  # else dropped
    output_cols = jnp.where(batch.valid & batch.is_output, batch.tokens, vocab)
    mask = mask.at[rows, prompt_cols].set(True, mode="drop")
    counts = counts.at[rows, output_cols].add(1, mode="drop")
    return PenaltyState(
        prompt_mask=penalties.prompt_mask.at[batch.slots].set(mask),
        output_counts=penalties.output_counts.at[batch.slots].set(counts),
    )


def _record_history(
    penalties: PenaltyState, slot: jax.Array, tokens: jax.Array, is_output: jax.Array
) -> PenaltyState:
    """Reset a slot's row, then mark tokens [H] (out of range = padding) as prompt or output."""
    vocab = penalties.prompt_mask.shape[1]
    prompt_cols = jnp.where(is_output, vocab, tokens)
    output_cols = jnp.where(is_output, tokens, vocab)
    mask = jnp.zeros((vocab,), jnp.bool_).at[prompt_cols].set(True, mode="drop")
    counts = jnp.zeros((vocab,), jnp.int32).at[output_cols].add(1, mode="drop")
    return PenaltyState(
        prompt_mask=penalties.prompt_mask.at[slot].set(mask),
        output_counts=penalties.output_counts.at[slot].set(counts),
    )


def _prompt_logprobs(
    params: Params, config: ModelConfig, hidden: jax.Array, targets: jax.Array
) -> jax.Array:
    """log p(targets[t] | tokens[..t]) for every position t -> [B, T].

    Runs the LM head over chunks of positions so the [T, V] logits never exist at once.
    """
    b, t, d = hidden.shape
    chunk = min(PROMPT_LOGPROB_CHUNK, t)
    pad = (-t) % chunk
    h = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))).reshape(b, -1, chunk, d)
    y = jnp.pad(targets, ((0, 0), (0, pad))).reshape(b, -1, chunk)

    def score(args: tuple[jax.Array, jax.Array]) -> jax.Array:
        h_chunk, y_chunk = args  # [B, chunk, d], [B, chunk]
        logits = lm_head(params, config, h_chunk)
        logp = jax.nn.log_softmax(logits, axis=-1)
        return jnp.take_along_axis(logp, y_chunk[..., None], axis=-1)[..., 0]

    scores = jax.lax.map(score, (jnp.moveaxis(h, 1, 0), jnp.moveaxis(y, 1, 0)))
    return jnp.moveaxis(scores, 0, 1).reshape(b, -1)[:, :t]
