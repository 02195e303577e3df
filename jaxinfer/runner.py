"""The model runner: device state and the jit-compiled step function.

The runner owns the params, the KV pool and the per-sequence penalty state
(prompt-token masks and output-token counts), all on device. Each engine step
is one device call over a flat, ragged batch:

    step(params, kv, penalties, batch, sampling) -> (StepOutput, kv, penalties)

`batch.tokens [T]` holds every scheduled sequence's query tokens back to back
(a decode's last sampled token, a prompt chunk, ...), with per-sequence query
starts, context lengths and block tables (`AttentionMetadata`), padded only at
the end. The step samples one token per sequence from its last query position
and returns the sampled tokens and their log-probs (and, when asked, prompt
log-probs at every position) in one small pytree, fetched to the host in a
single transfer. The KV pool and the penalty state are donated, so they are
updated in place.

Shapes are bucketed so that a few compilations serve every mix: S sequences
(a power of two), T tokens (S when every query is one token, as in a step of
decodes only; else a power of two of at least MIN_TOKEN_BUCKET) and W
block-table entries (a power of two of the longest context's blocks). Sampling
settings are arrays, never static, so no request recompiles.

Dispatch is asynchronous: `step` returns a `PendingStep` at once, so the engine
can prepare the next call while the device runs, and reads the results later.

KV layout: one pool per layer of `num_blocks` blocks of `block_size` tokens,
sized from a memory budget; `kv_cache_dtype="int8"` stores int8 K/V plus one
f32 scale per token and KV head, so the same budget holds more blocks. The
caller (the host loop and its block allocator) owns the block tables; the
runner turns them into the KV write rows (where each new token's K/V is
written) and the padded block-table array the attention reads through.
Slots only index the per-sequence penalty state.

Several hosts (jaxinfer/parallel/multihost.py): every process holds a runner
built the same way. The leader's runner sends each device call's host inputs
to the others (`broadcast`) before making it; a follower's runner makes the
same calls from `follow`, so every process runs the same program in the same
order. The step's outputs are then replicated, readable on the leader.
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
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

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
from jaxinfer.parallel.attention import shard_by_heads
from jaxinfer.parallel.data import per_rank
from jaxinfer.parallel.mesh import make_mesh, model_shards
from jaxinfer.parallel.multihost import (
    Message,
    StepBroadcast,
    StepFollower,
    agree_on_minimum,
)
from jaxinfer.parallel.shardings import (
    check_tensor_parallel,
    kv_pool_sharding,
    place_params,
    sharded_config,
    vocab_state_sharding,
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

MIN_TOKEN_BUCKET = 16  # T of a step holding a query longer than one token
MIN_CONTEXT_BLOCKS = 8
PROMPT_LOGPROB_CHUNK = 128


def kv_cache_budget(cache: CacheConfig, bytes_per_token: int) -> int:
    """Bytes of KV pool per device (`bytes_per_token`: per device too):
    `kv_cache_memory`, else a fraction of free device memory where the device
    reports it (GPU/TPU), else (CPU) room for `max_num_seqs` sequences of
    `max_model_len` tokens."""
    if cache.kv_cache_memory is not None:
        return cache.kv_cache_memory
    stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        return int(free * cache.kv_cache_fraction)
    return cache.max_num_seqs * cache.max_blocks_per_seq * cache.block_size * bytes_per_token


def num_kv_blocks(cache: CacheConfig, bytes_per_token: int) -> int:
    """Blocks that fit the budget (on every host: the fewest any process has room for);
    a clear error when one full sequence does not fit."""
    budget = agree_on_minimum(kv_cache_budget(cache, bytes_per_token))
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
    """One step's flat inputs: T tokens of S sequences, padded at the end."""

    tokens: jax.Array  # [T] int32, every sequence's query tokens back to back
    meta: AttentionMetadata
    targets: jax.Array  # [T] int32, next token at each position (prompt log-probs)
    token_seq: jax.Array  # [T] int32, the sequence of each token (0 for padding)
    record: jax.Array  # [T] bool, the token enters its sequence's penalty statistics
    is_output: jax.Array  # [T] bool, token is an earlier output (resumed sequence)
    last_index: jax.Array  # [S] int32, index in tokens of each sequence's last query token
    slots: jax.Array  # [S] int32, penalty-state row (scratch row for padding)
    fresh: jax.Array  # [S] bool, the step starts the sequence's penalty statistics
    emit: jax.Array  # [S] bool, the sampled token will be used


class StepOutput(struct.PyTreeNode):
    sample: SampleOutput
    prompt_logprobs: jax.Array  # [T] f32 log p(token t+1 | ..t); [0] when not asked


@dataclass(frozen=True)
class StepResult:
    """A step's output on the host, one row per sequence (padding rows included)."""

    tokens: np.ndarray  # [S] int32 sampled token ids
    logprobs: np.ndarray  # [S] f32 log-prob of each sampled token (raw distribution)
    top_ids: np.ndarray  # [S, K] int32 most likely ids, K = the bucketed top count (0, 5, 20)
    top_logprobs: np.ndarray  # [S, K] f32
    prompt_logprobs: np.ndarray  # [T] f32 log p(token t+1 | ..t); [0] when not asked
    query_start: np.ndarray  # [S + 1] int32, where each sequence's tokens start

    def prompt_scores(self, row: int) -> np.ndarray:
        """log p(next token) at each query position of sequence `row` (prompt log-probs)."""
        return self.prompt_logprobs[self.query_start[row]: self.query_start[row + 1]]


class PendingStep:
    """A dispatched step: the device computes while the host prepares the next call.

    Its small output (sampled tokens, log-probs) starts copying to the host at
    once; `results()` waits for it: the step's single device -> host transfer.
    `computed_tokens` is the padded token count (T per rank), the tokens the
    device computes, padding included.
    """

    def __init__(self, output: StepOutput, query_starts: list[np.ndarray],
                 computed_tokens: int) -> None:
        self._output = output
        self._query_starts = query_starts  # per rank
        self.computed_tokens = computed_tokens
        for leaf in jax.tree.leaves(output):
            leaf.copy_to_host_async()

    def results(self) -> list[StepResult]:
        """One result per data-parallel rank."""
        host = jax.device_get(self._output)
        ranks = len(self._query_starts)
        return [_rank_result(host, rank if ranks > 1 else None, starts)
                for rank, starts in enumerate(self._query_starts)]


def _rank_result(host: StepOutput, rank: int | None, query_start: np.ndarray) -> StepResult:
    """Rank `rank`'s rows of a step's host output (None: the output has no rank axis)."""
    if rank is not None:
        host = jax.tree.map(lambda x: x[rank], host)
    return StepResult(
        tokens=host.sample.tokens, logprobs=host.sample.logprobs,
        top_ids=host.sample.top_ids, top_logprobs=host.sample.top_logprobs,
        prompt_logprobs=host.prompt_logprobs, query_start=query_start,
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
    record: bool = False  # add the tokens to the penalty statistics (prompt chunks)
    fresh: bool = False  # start the statistics anew first (the first chunk from position 0)


@dataclass(frozen=True)
class StepShape:
    """A step's bucketed sizes: the compiled program it runs."""

    tokens: int  # T
    seqs: int  # S
    width: int  # W, block-table entries per sequence


def next_power_of_two(n: int, minimum: int) -> int:
    return max(minimum, 1 << max(0, n - 1).bit_length())


class ModelRunner:
    """Holds device state and runs the bucketed, jit-compiled flat step."""

    def __init__(self, config: ModelConfig, params: Params, cache: CacheConfig,
                 broadcast: StepBroadcast | None = None) -> None:
        """`cache`: the view of an EngineConfig resolved for this model (`resolve`).
        `broadcast`: on the leader of several processes, where each call is sent first.

        With tensor_parallel_size > 1 the params, the KV pool and the penalty state
        are split over a mesh (jaxinfer/parallel); `self.config` is then the config
        the split model runs (KV heads repeated up to the shard count when fewer).
        With data_parallel_size > 1 each rank has its own `num_blocks` blocks and
        penalty rows, and `step` takes one list of queries per rank.
        """
        self.cache = cache
        self.broadcast = broadcast
        self.mesh = make_mesh(cache.tensor_parallel_size, cache.data_parallel_size)
        shards = model_shards(self.mesh)
        check_tensor_parallel(config, shards)
        self.config = sharded_config(config, shards)
        # First, so a platform without the chosen kernels fails before any allocation.
        self.attention_fn = mesh_attention_fn(cache.attention_impl, self.mesh)
        self._step = _jitted_step(self.config, cache.block_size, cache.attention_impl, self.mesh)
        self.params = place_params(params, config, self.mesh)
        self.dtype = compute_dtype(self.params)
        # per device: each holds 1 / shards of the KV heads
        self.bytes_per_token = kv_bytes_per_token(
            self.config, self.dtype, cache.kv_cache_dtype) // shards
        self.num_blocks = num_kv_blocks(cache, self.bytes_per_token)
        self.kv: KVCache = self._init_kv()
        self.penalties = self._init_penalties()
        self._record = _jitted_record()

    def _init_kv(self) -> KVCache:
        """The zeroed pools, made on their devices already split: by rank (each rank's
        `num_blocks` blocks, numbered from 0 within it) and by KV head."""
        rows = self.cache.data_parallel_size * self.num_blocks * self.cache.block_size
        make = partial(init_kv_cache, self.config, rows, self.dtype, self.cache.kv_cache_dtype)
        shardings = jax.tree.map(lambda leaf: kv_pool_sharding(self.mesh, leaf.ndim),
                                 jax.eval_shape(make))
        return jax.jit(make, out_shardings=shardings)()

    def _init_penalties(self) -> PenaltyState:
        """Zeroed per-slot statistics [ranks * (max_num_seqs + 1), V], split by rank
        and vocabulary."""
        shape = (self.cache.data_parallel_size * (self.cache.max_num_seqs + 1),
                 self.config.vocab_size)
        sharding = vocab_state_sharding(self.mesh, self.config.vocab_size)
        make = jax.jit(lambda: PenaltyState(prompt_mask=jnp.zeros(shape, jnp.bool_),
                                            output_counts=jnp.zeros(shape, jnp.int32)),
                       out_shardings=PenaltyState(prompt_mask=sharding, output_counts=sharding))
        return make()

    @property
    def kv_bytes(self) -> int:
        """Bytes of KV pool each device holds (the whole pool on one device)."""
        return sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(self.kv))

    @property
    def num_devices(self) -> int:
        return self.mesh.size

    @property
    def compile_count(self) -> int:
        """Distinct compiled variants of the step function so far."""
        return self._step._cache_size()

    def step(self, queries: Sequence[Sequence[SequenceQuery]]) -> PendingStep:
        """Run every query of an engine step in one device call, one list of queries per
        data-parallel rank (a rank may have none); sample one token per query from its
        last position (used where the query `emit`s).

        A query may start after a prefix whose K/V are already in its blocks (an
        earlier chunk, or a prefix-cache hit).
        """
        ranks = self.cache.data_parallel_size
        if len(queries) != ranks or not any(queries):
            raise ValueError(f"a step needs {ranks} lists of queries, not all empty")
        shape = self._common_shape(queries)
        built = [self._batch(rank_queries, shape) for rank_queries in queries]
        samplings = [make_sampling_arrays(
            [q.params for q in rank_queries], [q.seed for q in rank_queries],
            [q.step for q in rank_queries], shape.seqs) for rank_queries in queries]
        every = [q.params for rank_queries in queries for q in rank_queries]
        num_top = max((p.logprobs or 0) for p in every)
        want_prompt = any(p.prompt_logprobs is not None for p in every)
        output = self._run_step(_by_rank([b for b, _ in built], ranks), _by_rank(samplings, ranks),
                                num_top_logprobs=_bucket_logprobs(num_top),
                                prompt_logprobs=want_prompt)
        return PendingStep(output, [starts for _, starts in built],
                           computed_tokens=shape.tokens * ranks)

    def _common_shape(self, queries: Sequence[Sequence[SequenceQuery]]) -> StepShape:
        """The smallest bucket that holds every rank's step."""
        shapes = [self.step_shape([len(q.token_ids) for q in rank_queries],
                                  max(q.start + len(q.token_ids) for q in rank_queries))
                  for rank_queries in queries if rank_queries]
        return StepShape(max(s.tokens for s in shapes), max(s.seqs for s in shapes),
                         max(s.width for s in shapes))

    def step_shape(self, query_lens: Sequence[int], max_context: int) -> StepShape:
        """The bucketed shape of a step of sequences with `query_lens` query tokens."""
        seqs = next_power_of_two(len(query_lens), 1)
        total = sum(query_lens)
        tokens = seqs if total == len(query_lens) else next_power_of_two(total, MIN_TOKEN_BUCKET)
        return StepShape(tokens, seqs, self.context_width(max_context))

    def context_width(self, max_context: int) -> int:
        """Block-table width: a power-of-two bucket of the longest context."""
        needed = math.ceil(max_context / self.cache.block_size)
        return min(next_power_of_two(needed, MIN_CONTEXT_BLOCKS), self.cache.max_blocks_per_seq)

    def record_history(self, rank: int, slot: int, token_ids: Sequence[int],
                       prompt_len: int) -> None:
        """Start rank `rank`'s `slot`'s penalty statistics from tokens whose K/V are
        already cached (a prefix-cache hit): the step that follows starts after them."""
        size = next_power_of_two(len(token_ids), MIN_TOKEN_BUCKET)
        tokens = np.full((size,), self.config.vocab_size, np.int32)  # padding: dropped
        tokens[: len(token_ids)] = token_ids
        is_output = np.arange(size) >= prompt_len
        row = rank * (self.cache.max_num_seqs + 1) + slot  # each rank has its rows
        self._run_record(np.int32(row), tokens, is_output)

    def warmup(self, max_batched_tokens: int) -> None:
        """Compile every step shape a scheduler within `max_batched_tokens` tokens can
        produce, with plain sampling (no log-probs)."""
        for shape in self.step_shapes(max_batched_tokens):
            self._warm(shape)

    def step_shapes(self, max_batched_tokens: int) -> list[StepShape]:
        """Every (T, S, W) bucket: steps of one-token queries (T = S), then the others.

        A step of T > MIN_TOKEN_BUCKET tokens holds more than T / 2 real ones, so
        with S sequences its longest query (and context) has at least that / S.
        """
        seq_buckets = _powers_of_two(next_power_of_two(self.cache.max_num_seqs, 1))
        shapes = [StepShape(s, s, w) for s in seq_buckets for w in self._widths(1)]
        top = next_power_of_two(max_batched_tokens, MIN_TOKEN_BUCKET)
        for tokens in _powers_of_two(top, MIN_TOKEN_BUCKET):
            least = tokens // 2 + 1 if tokens > MIN_TOKEN_BUCKET else 2
            shapes += [StepShape(tokens, s, w) for s in seq_buckets if s <= tokens
                       for w in self._widths(math.ceil(least / s))]
        return shapes

    def _widths(self, min_context: int) -> list[int]:
        """Block-table widths of a step whose longest context is at least `min_context`."""
        cap = self.cache.max_blocks_per_seq
        widths = [w for w in _powers_of_two(next_power_of_two(cap, 1), MIN_CONTEXT_BLOCKS)
                  if w < cap]
        least = self.context_width(min_context)
        return [w for w in [*widths, cap] if w >= least]

    def _warm(self, shape: StepShape) -> None:
        """Compile one shape with an all-padding call, plain sampling."""
        ranks = self.cache.data_parallel_size
        batch, _ = self._batch([], shape)
        sampling = make_sampling_arrays([], [], [], shape.seqs)
        self._run_step(_by_rank([batch] * ranks, ranks), _by_rank([sampling] * ranks, ranks),
                       num_top_logprobs=0, prompt_logprobs=False)

    # ------------------------------------------------------------ device calls

    def _run_step(self, batch: StepBatch, sampling: SamplingArrays, *, num_top_logprobs: int,
                  prompt_logprobs: bool) -> StepOutput:
        """The jitted step over host inputs (sent to the followers first)."""
        statics = {"num_top_logprobs": num_top_logprobs, "prompt_logprobs": prompt_logprobs}
        if self.broadcast is not None:  # several hosts: the followers make this call too
            self.broadcast.send(Message("step", statics, jax.tree.leaves((batch, sampling))))
        output, self.kv, self.penalties = self._step(
            self.params, self.kv, self.penalties, batch, sampling, **statics)
        return output

    def _run_record(self, row: np.ndarray, tokens: np.ndarray, is_output: np.ndarray) -> None:
        if self.broadcast is not None:
            self.broadcast.send(Message("record", arrays=(row, tokens, is_output)))
        self.penalties = self._record(self.penalties, row, tokens, is_output)

    def follow(self, follower: StepFollower) -> int:
        """On a follower process: make every call the leader sends, until it says stop;
        returns the number of calls made."""
        step_tree = jax.tree.structure(self._step_inputs_template())
        calls = 0
        for message in follower.messages():
            if message.kind == "step":
                batch, sampling = jax.tree.unflatten(step_tree, message.arrays)
                self._run_step(batch, sampling, **message.statics)
            elif message.kind == "record":
                self._run_record(*message.arrays)
            else:
                raise ValueError(f"unknown call from the leader: {message.kind!r}")
            calls += 1
        return calls

    def _step_inputs_template(self) -> tuple[StepBatch, SamplingArrays]:
        """A (batch, sampling) pair: the structure every step's inputs share."""
        ranks = self.cache.data_parallel_size
        batch, _ = self._batch([], StepShape(1, 1, 1))
        sampling = make_sampling_arrays([], [], [], 1)
        return _by_rank([batch] * ranks, ranks), _by_rank([sampling] * ranks, ranks)

    def _batch(
        self, queries: Sequence[SequenceQuery], shape: StepShape
    ) -> tuple[StepBatch, np.ndarray]:
        """Lay the queries back to back in `shape`; padding tokens drop their K/V and
        padding sequences point at the scratch slot. Also returns query_start [S + 1]."""
        t, s = shape.tokens, shape.seqs
        arrays = {
            "tokens": np.zeros((t,), np.int32),
            "targets": np.zeros((t,), np.int32),
            "positions": np.zeros((t,), np.int32),
            "kv_rows": np.full((t,), self.kv.num_rows, np.int32),  # out of range: dropped
            "token_seq": np.zeros((t,), np.int32),
            "record": np.zeros((t,), np.bool_),
            "is_output": np.zeros((t,), np.bool_),
            "query_start": np.zeros((s + 1,), np.int32),
            "context": np.zeros((s,), np.int32),
            "tables": np.zeros((s, shape.width), np.int32),  # padding entries: block 0, masked
            "slots": np.full((s,), self.cache.max_num_seqs, np.int32),  # scratch row
            "last_index": np.zeros((s,), np.int32),
            "fresh": np.zeros((s,), np.bool_),
            "emit": np.zeros((s,), np.bool_),
        }
        offset = 0
        for i, query in enumerate(queries):
            offset = _fill_sequence(arrays, i, offset, query, self.cache.block_size)
        arrays["query_start"][len(queries) + 1:] = offset
        meta = AttentionMetadata(
            positions=arrays["positions"], kv_rows=arrays["kv_rows"],
            query_start=arrays["query_start"], context_lens=arrays["context"],
            block_tables=arrays["tables"], num_seqs=np.array([len(queries)], np.int32))
        batch = StepBatch(
            tokens=arrays["tokens"], meta=meta, targets=arrays["targets"],
            token_seq=arrays["token_seq"], record=arrays["record"],
            is_output=arrays["is_output"], last_index=arrays["last_index"],
            slots=arrays["slots"], fresh=arrays["fresh"], emit=arrays["emit"])
        return batch, arrays["query_start"]


def mesh_attention_fn(attention_impl: str, mesh: Mesh) -> AttentionFn:
    """The attention implementation, run per head shard when the model is split."""
    attention_fn = get_attention_fn(attention_impl)
    return attention_fn if model_shards(mesh) == 1 else shard_by_heads(attention_fn, mesh)


@functools.cache
def _jitted_step(config: ModelConfig, block_size: int, attention_impl: str, mesh: Mesh) -> Any:
    """One jitted step per (model config, block size, kernel, mesh): runners share
    compilations."""
    shards = model_shards(mesh)
    step = partial(_step, config=config, block_size=block_size,
                   attention_fn=mesh_attention_fn(attention_impl, mesh),
                   vocab_mesh=mesh if shards > 1 and config.vocab_size % shards == 0 else None)
    if mesh.shape["data"] > 1:
        step = per_rank(step, mesh)
    if jax.process_count() > 1:
        step = _replicated_output(step, mesh)
    return jax.jit(
        step, static_argnames=("num_top_logprobs", "prompt_logprobs"),
        donate_argnames=("kv", "penalties"),
    )


def _replicated_output(step: Any, mesh: Mesh) -> Any:
    """`step` with its (small) output on every device, so that process 0 can read rows
    that other processes' devices computed."""
    everywhere = NamedSharding(mesh, P())

    def stepped(*args: Any, **kwargs: Any) -> Any:
        output, kv, penalties = step(*args, **kwargs)
        return jax.lax.with_sharding_constraint(output, everywhere), kv, penalties

    return stepped


def _by_rank(per_rank_inputs: list[Any], ranks: int) -> Any:
    """One rank's inputs as they are; several stacked on a leading rank axis."""
    if ranks == 1:
        return per_rank_inputs[0]
    return jax.tree.map(lambda *xs: np.stack(xs), *per_rank_inputs)


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


def _fill_sequence(
    arrays: dict[str, np.ndarray], i: int, offset: int, query: SequenceQuery, block_size: int
) -> int:
    """Write sequence i's query tokens from token `offset`; returns the next offset."""
    n = len(query.token_ids)
    end = offset + n
    pos = np.arange(query.start, query.start + n, dtype=np.int32)
    table = np.asarray(query.block_table, np.int32)
    arrays["tokens"][offset:end] = query.token_ids
    arrays["targets"][offset: offset + len(query.targets)] = query.targets
    arrays["positions"][offset:end] = pos
    arrays["kv_rows"][offset:end] = table[pos // block_size] * block_size + pos % block_size
    arrays["token_seq"][offset:end] = i
    arrays["record"][offset:end] = query.record
    arrays["is_output"][offset:end] = pos >= query.prompt_len
    arrays["query_start"][i: i + 2] = offset, end
    arrays["context"][i] = query.start + n
    used = min(len(table), arrays["tables"].shape[1])
    arrays["tables"][i, :used] = table[:used]
    arrays["slots"][i] = query.slot
    arrays["last_index"][i] = end - 1
    arrays["fresh"][i] = query.fresh
    arrays["emit"][i] = query.emit
    return end


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
    vocab_mesh: Mesh | None,
    num_top_logprobs: int,
    prompt_logprobs: bool,
) -> tuple[StepOutput, KVCache, PenaltyState]:
    """Forward, sample and update the penalty state, all in one compiled program."""
    hidden, kv = forward(params, config, batch.tokens, kv, batch.meta, block_size=block_size,
                         attention_fn=attention_fn)  # [T, d_model]
    logits = lm_head(params, config, hidden[batch.last_index])  # [S, V]
    prompt_mask, counts = _sequence_statistics(penalties, batch)  # [S, V]
    sampled = sample(logits, sampling, prompt_mask, counts, num_top_logprobs, vocab_mesh)
    counts = update_output_counts(counts, sampled.tokens, batch.emit)
    penalties = PenaltyState(
        prompt_mask=penalties.prompt_mask.at[batch.slots].set(prompt_mask),
        output_counts=penalties.output_counts.at[batch.slots].set(counts),
    )
    scores = _prompt_logprobs(params, config, hidden, batch.targets) if prompt_logprobs else (
        jnp.zeros((0,), jnp.float32)
    )
    return StepOutput(sample=sampled, prompt_logprobs=scores), kv, penalties


def _sequence_statistics(
    penalties: PenaltyState, batch: StepBatch
) -> tuple[jax.Array, jax.Array]:
    """Each sequence's prompt mask and output counts [S, V] with this step's recorded
    tokens added: prompt tokens to the mask, earlier outputs (a resumed sequence) to
    the counts. Sequences starting fresh are cleared first."""
    vocab = penalties.prompt_mask.shape[1]
    fresh = batch.fresh[:, None]  # [S, 1]
    mask = jnp.where(fresh, False, penalties.prompt_mask[batch.slots])  # [S, V]
    counts = jnp.where(fresh, 0, penalties.output_counts[batch.slots])
    prompt_cols = jnp.where(batch.record & ~batch.is_output, batch.tokens, vocab)  # else dropped
    output_cols = jnp.where(batch.record & batch.is_output, batch.tokens, vocab)
    mask = mask.at[batch.token_seq, prompt_cols].set(True, mode="drop")
    counts = counts.at[batch.token_seq, output_cols].add(1, mode="drop")
    return mask, counts


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
    """log p(targets[t] | tokens[..t]) for every token t -> [T].

    Runs the LM head over chunks of tokens so the [T, V] logits never exist at once.
    """
    t, d = hidden.shape
    chunk = min(PROMPT_LOGPROB_CHUNK, t)
    pad = (-t) % chunk
    h = jnp.pad(hidden, ((0, pad), (0, 0))).reshape(-1, chunk, d)
    y = jnp.pad(targets, (0, pad)).reshape(-1, chunk)

    def score(args: tuple[jax.Array, jax.Array]) -> jax.Array:
        h_chunk, y_chunk = args  # [chunk, d], [chunk]
        logp = jax.nn.log_softmax(lm_head(params, config, h_chunk), axis=-1)
        return jnp.take_along_axis(logp, y_chunk[:, None], axis=-1)[:, 0]

    return jax.lax.map(score, (h, y)).reshape(-1)[:t]
