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

KV layout: one pool per layer of `num_blocks` blocks of `block_size` tokens,
sized from a memory budget. The caller (the host loop and its block
allocator) owns the block tables; the runner turns them into the slot mapping
(where each new token's K/V is written) and the padded block-table array the
attention reads through. Slots only index the per-sequence penalty state.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxinfer.errors import ConfigError
from jaxinfer.model.config import ModelConfig
from jaxinfer.model.params import Params
from jaxinfer.model.transformer import KVCache, forward, init_kv_cache, lm_head
from jaxinfer.ops.attention import (
    ATTENTION_IMPLS,
    AttentionFn,
    AttentionMetadata,
    get_attention_fn,
)
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


@dataclass(frozen=True)
class CacheConfig:
    """How much KV cache to hold and how it is cut into blocks."""

    max_model_len: int = 2048
    max_num_seqs: int = 8
    block_size: int = 16
    attention_impl: str = "xla"
    kv_cache_memory: int | None = None  # bytes; None: see `kv_cache_budget`
    kv_cache_fraction: float = 0.9  # of free accelerator memory, when it is known

    def __post_init__(self) -> None:
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ConfigError(f"kv_cache_memory must be >= 1 byte, got {self.kv_cache_memory}")
        if not 0 < self.kv_cache_fraction <= 1:
            raise ConfigError(
                f"kv_cache_fraction must be in (0, 1], got {self.kv_cache_fraction}"
            )
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.max_model_len < 2:
            raise ConfigError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ConfigError(
                f"attention_impl must be one of {', '.join(ATTENTION_IMPLS)}, "
                f"got {self.attention_impl!r}"
            )

    @property
    def max_blocks_per_seq(self) -> int:
        return math.ceil(self.max_model_len / self.block_size)


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


class StepOutput(struct.PyTreeNode):
    sample: SampleOutput
    prompt_logprobs: jax.Array  # [B, T] f32 log p(token t+1 | ..t); [B, 0] when not asked


def next_power_of_two(n: int, minimum: int) -> int:
    return max(minimum, 1 << max(0, n - 1).bit_length())


class ModelRunner:
    """Holds device state and runs bucketed, jit-compiled prefill and decode steps."""

    def __init__(self, config: ModelConfig, params: Params, cache: CacheConfig) -> None:
        if cache.max_model_len > config.max_position:
            raise ConfigError(
                f"max_model_len ({cache.max_model_len}) exceeds the model's context "
                f"length ({config.max_position})"
            )
        self.config = config
        self.cache = cache
        self.params = jax.tree.map(jnp.asarray, params)
        self.dtype = self.params["embed"].dtype
        self.bytes_per_token = config.kv_bytes_per_token(jnp.dtype(self.dtype).itemsize)
        self.num_blocks = num_kv_blocks(cache, self.bytes_per_token)
        self.kv: KVCache = init_kv_cache(config, self.num_blocks * cache.block_size, self.dtype)
        slots = cache.max_num_seqs + 1
        self.penalties = PenaltyState(
            prompt_mask=jnp.zeros((slots, config.vocab_size), jnp.bool_),
            output_counts=jnp.zeros((slots, config.vocab_size), jnp.int32),
        )
        step = partial(_step, config=config, block_size=cache.block_size,
                       attention_fn=get_attention_fn(cache.attention_impl))
        self._step = jax.jit(
            step, static_argnames=("num_top_logprobs", "prompt_logprobs", "is_prefill"),
            donate_argnames=("kv", "penalties"),
        )

    @property
    def kv_bytes(self) -> int:
        return 2 * self.kv.k.size * self.kv.k.dtype.itemsize

    @property
    def compile_count(self) -> int:
        """Distinct compiled variants of the step function so far."""
        return self._step._cache_size()

    def prefill(
        self,
        slot: int,
        token_ids: Sequence[int],
        block_table: Sequence[int],
        params: SamplingParams,
        seed: int,
        start: int = 0,
    ) -> dict[str, np.ndarray]:
        """Run prompt tokens at positions start.. for `slot` and sample the next token.

        `start` > 0 continues after a prefix whose K/V are already in the
        sequence's blocks (a later prompt chunk, or a prefix-cache hit).
        """
        length = len(token_ids)
        bucket = min(next_power_of_two(length, MIN_PREFILL_BUCKET), self._max_tokens_bucket())
        tokens = np.zeros((1, bucket), np.int32)
        tokens[0, :length] = token_ids
        batch = self._batch(tokens, [slot], [start], [length], [block_table])
        sampling = make_sampling_arrays([params], [seed], [0], 1)
        return self._run(batch, sampling, [params], is_prefill=True)

    def decode(
        self,
        slots: Sequence[int],
        tokens: Sequence[int],
        positions: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        params: Sequence[SamplingParams],
        seeds: Sequence[int],
        steps: Sequence[int],
    ) -> dict[str, np.ndarray]:
        """One new token for each listed slot; `positions` are those of `tokens`."""
        size = next_power_of_two(len(slots), 1)
        padded = np.zeros((size, 1), np.int32)
        padded[: len(tokens), 0] = tokens
        batch = self._batch(padded, slots, positions, [1] * len(slots), block_tables)
        sampling = make_sampling_arrays(params, seeds, steps, size)
        return self._run(batch, sampling, params, is_prefill=False)

    def _max_tokens_bucket(self) -> int:
        return self.cache.max_blocks_per_seq * self.cache.block_size

    def _run(
        self, batch: StepBatch, sampling: SamplingArrays, params: Sequence[SamplingParams],
        *, is_prefill: bool,
    ) -> dict[str, np.ndarray]:
        num_top = max((p.logprobs or 0) for p in params)
        want_prompt = is_prefill and any(p.prompt_logprobs is not None for p in params)
        output, self.kv, self.penalties = self._step(
            self.params, self.kv, self.penalties, batch, sampling,
            num_top_logprobs=_bucket_logprobs(num_top), prompt_logprobs=want_prompt,
            is_prefill=is_prefill,
        )
        host = jax.device_get(output)  # the step's single device -> host transfer
        return {
            "tokens": host.sample.tokens,
            "logprobs": host.sample.logprobs,
            "top_ids": host.sample.top_ids,
            "top_logprobs": host.sample.top_logprobs,
            "prompt_logprobs": host.prompt_logprobs,
        }

    def _batch(
        self,
        tokens: np.ndarray,  # [B, T]
        slots: Sequence[int],
        starts: Sequence[int],  # position of each row's first token
        lengths: Sequence[int],  # real tokens per row
        block_tables: Sequence[Sequence[int]],
    ) -> StepBatch:
        b, t = tokens.shape
        bs = self.cache.block_size
        positions = np.zeros((b, t), np.int32)
        slot_mapping = np.full((b, t), self.kv.num_rows, np.int32)  # out of range: dropped
        valid = np.zeros((b, t), np.bool_)
        context = np.zeros((b,), np.int32)
        row_slots = np.full((b,), self.cache.max_num_seqs, np.int32)  # scratch row
        rows = zip(slots, starts, lengths, block_tables, strict=True)
        for row, (slot, start, length, table) in enumerate(rows):
            pos = np.arange(start, start + length, dtype=np.int32)
            blocks = np.asarray(table, np.int32)[pos // bs]
            positions[row, :length] = pos
            slot_mapping[row, :length] = blocks * bs + pos % bs
            valid[row, :length] = True
            context[row] = start + length
            row_slots[row] = slot
        width = self._context_blocks(int(context.max()))
        table_array = np.zeros((b, width), np.int32)  # padding entries read block 0, masked
        for row, table in enumerate(block_tables):
            used = min(len(table), width)
            table_array[row, :used] = table[:used]
        meta = AttentionMetadata(positions, slot_mapping, table_array, context)
        last_index = np.zeros((b,), np.int32)
        last_index[: len(lengths)] = np.asarray(lengths, np.int32) - 1
        fresh = np.zeros((b,), np.bool_)
        fresh[: len(starts)] = np.asarray(starts) == 0
        return StepBatch(tokens, meta, last_index, row_slots, valid, fresh)

    def _context_blocks(self, max_context: int) -> int:
        """Block-table width: a power-of-two bucket of the longest context."""
        needed = math.ceil(max_context / self.cache.block_size)
        return min(next_power_of_two(needed, MIN_CONTEXT_BLOCKS), self.cache.max_blocks_per_seq)


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
    new_counts = update_output_counts(counts, sampled.tokens, jnp.ones_like(batch.slots, bool))
    penalties = penalties.replace(
        output_counts=penalties.output_counts.at[batch.slots].set(new_counts)
    )
    scores = _prompt_logprobs(params, config, hidden, batch.tokens) if prompt_logprobs else (
        jnp.zeros((batch.tokens.shape[0], 0), jnp.float32)
    )
    return StepOutput(sample=sampled, prompt_logprobs=scores), kv, penalties


def _reset_penalties(penalties: PenaltyState, batch: StepBatch) -> PenaltyState:
    """Record a prefill's prompt tokens; rows starting a sequence are cleared first."""
    vocab = penalties.prompt_mask.shape[1]
    fresh = batch.fresh[:, None]  # [B, 1]
    mask = jnp.where(fresh, False, penalties.prompt_mask[batch.slots])  # [B, V]
    counts = jnp.where(fresh, 0, penalties.output_counts[batch.slots])
    rows = jnp.broadcast_to(jnp.arange(batch.tokens.shape[0])[:, None], batch.tokens.shape)
    cols = jnp.where(batch.valid, batch.tokens, vocab)  # padding -> out of range, dropped
    mask = mask.at[rows, cols].set(True, mode="drop")
    return PenaltyState(
        prompt_mask=penalties.prompt_mask.at[batch.slots].set(mask),
        output_counts=penalties.output_counts.at[batch.slots].set(counts),
    )


def _prompt_logprobs(
    params: Params, config: ModelConfig, hidden: jax.Array, tokens: jax.Array
) -> jax.Array:
    """log p(tokens[t + 1] | tokens[..t]) for every t -> [B, T] (last column is 0).

    Runs the LM head over chunks of positions so the [T, V] logits never exist at once.
    """
    b, t, d = hidden.shape
    chunk = min(PROMPT_LOGPROB_CHUNK, t)
    targets = jnp.concatenate([tokens[:, 1:], jnp.zeros((b, 1), tokens.dtype)], axis=1)
    pad = (-t) % chunk
    h = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))).reshape(b, -1, chunk, d)
    y = jnp.pad(targets, ((0, 0), (0, pad))).reshape(b, -1, chunk)

    def score(args: tuple[jax.Array, jax.Array]) -> jax.Array:
        h_chunk, y_chunk = args  # [B, chunk, d], [B, chunk]
        logits = lm_head(params, config, h_chunk)
        logp = jax.nn.log_softmax(logits, axis=-1)
        return jnp.take_along_axis(logp, y_chunk[..., None], axis=-1)[..., 0]

    scores = jax.lax.map(score, (jnp.moveaxis(h, 1, 0), jnp.moveaxis(y, 1, 0)))
    scores = jnp.moveaxis(scores, 0, 1).reshape(b, -1)[:, :t]
    return scores.at[:, -1].set(0.0)
