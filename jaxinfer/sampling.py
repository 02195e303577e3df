"""Sampling: per-request settings on the host, one jitted sampler on the device.

A request carries a frozen `SamplingParams`. Each step the runner packs the
settings of every running sequence into a `SamplingArrays` of [B] arrays, so a
new temperature, top-k or seed is new *data* and never a recompilation.

`sample` turns logits [B, V] into tokens [B] in the vLLM order:

    penalties -> greedy rows: argmax -> temperature -> min_p -> top_k -> top_p -> Gumbel-max

Two batch-wide `lax.cond`s keep the common cases cheap at V = 262,144: when
every row is greedy the random path never runs, and the top-k / top-p filters
run only when some sampled row asks for them. The filters need no sort: the
cut-off logit is found by a 32-step bisection over the float bit patterns
(count or probability mass above a candidate threshold), which is exact and
an order of magnitude cheaper than sorting the vocabulary on CPU. Tokens tied
with the cut-off are kept together.

Randomness is per row: the key of a row is `fold_in(key_from_seed, step)`, so
a seeded request draws the same tokens alone or in any batch, in any slot.
Reported log-probs come from the raw model distribution (log_softmax of the
input logits), as vLLM reports them by default.

Stop strings are host work: `find_stop_string` searches the detokenized text
from just before the newest delta, so a stop string split across deltas is
still found.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxinfer.errors import ConfigError
from jaxinfer.parallel.mesh import shard_map_over_model

MAX_LOGPROBS = 20
MAX_STOP = 16
MAX_SEED = 2**63  # exclusive
SAMPLING_EPS = 1e-5  # temperatures below this are greedy (as in vLLM)
_BISECT_STEPS = 32  # one per bit of a float32

Array = jax.Array | np.ndarray


# --------------------------------------------------------------------------- host: params


def _is_int(value: object) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, int | float | np.integer | np.floating) and not isinstance(value, bool)


def _require(ok: bool, name: str, allowed: str, value: object) -> None:
    if not ok:
        raise ConfigError(f"SamplingParams.{name} must be {allowed}, got {value!r}")


def _as_tuple(value: object, name: str) -> tuple:
    if isinstance(value, str):
        return (value,)
    _require(isinstance(value, list | tuple), name, "a list or tuple", value)
    return tuple(value)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request (vLLM-like). `stop` and `stop_token_ids` accept
    lists (stored as tuples); `stop` also accepts a single string."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 or -1 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top log-probs per sampled token; 0 = the sampled one only
    prompt_logprobs: int | None = None
    n: int = 1
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", _as_tuple(self.stop, "stop"))
        object.__setattr__(self, "stop_token_ids", _as_tuple(self.stop_token_ids, "stop_token_ids"))
        self._validate_counts()
        self._validate_distribution()
        self._validate_penalties()
        self._validate_stops()
        self._validate_flags()

    @property
    def uses_penalties(self) -> bool:
        """True when a repetition, presence or frequency penalty is on."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @property
    def greedy(self) -> bool:
        """True when the request takes the argmax (temperature below SAMPLING_EPS)."""
        return self.temperature < SAMPLING_EPS

    def _validate_counts(self) -> None:
        _require(_is_int(self.max_tokens) and self.max_tokens >= 1,
                 "max_tokens", "an integer >= 1", self.max_tokens)
        _require(_is_int(self.n) and self.n >= 1, "n", "an integer >= 1", self.n)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            ok = value is None or (_is_int(value) and 0 <= value <= MAX_LOGPROBS)
            _require(ok, name, f"None or an integer in [0, {MAX_LOGPROBS}]", value)
        ok = self.seed is None or (_is_int(self.seed) and 0 <= self.seed < MAX_SEED)
        _require(ok, "seed", "None or an integer in [0, 2**63)", self.seed)

    def _validate_distribution(self) -> None:
        t = self.temperature
        _require(_is_real(t) and math.isfinite(t) and t >= 0,
                 "temperature", "a finite number >= 0 (0 = greedy)", t)
        _require(_is_int(self.top_k) and self.top_k >= -1,
                 "top_k", "-1 or 0 (off) or an integer >= 1", self.top_k)
        _require(_is_real(self.top_p) and 0 < self.top_p <= 1, "top_p", "in (0, 1]", self.top_p)
        _require(_is_real(self.min_p) and 0 <= self.min_p <= 1, "min_p", "in [0, 1]", self.min_p)

    def _validate_penalties(self) -> None:
        r = self.repetition_penalty
        _require(_is_real(r) and math.isfinite(r) and r > 0,
                 "repetition_penalty", "a finite number > 0 (1 = off)", r)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require(_is_real(value) and -2 <= value <= 2, name, "in [-2, 2]", value)

    def _validate_stops(self) -> None:
        _require(len(self.stop) <= MAX_STOP, "stop", f"at most {MAX_STOP} strings", self.stop)
        for s in self.stop:
            _require(isinstance(s, str) and s != "", "stop", "non-empty strings", self.stop)
        for t in self.stop_token_ids:
            _require(_is_int(t) and t >= 0,
                     "stop_token_ids", "non-negative integers", self.stop_token_ids)

    def _validate_flags(self) -> None:
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            value = getattr(self, name)
            _require(isinstance(value, bool), name, "True or False", value)


# --------------------------------------------------------------------------- host -> device


class SamplingArrays(NamedTuple):
    """Per-row sampling settings; values are data, so they never recompile."""

    temperature: Array  # [B] f32, < SAMPLING_EPS = greedy
    top_k: Array  # [B] i32, 0 = off
    top_p: Array  # [B] f32, 1 = off
    min_p: Array  # [B] f32, 0 = off
    repetition_penalty: Array  # [B] f32, 1 = off
    presence_penalty: Array  # [B] f32
    frequency_penalty: Array  # [B] f32
    key: Array  # [B, 2] u32, raw threefry key data from the seed
    step: Array  # [B] i32, tokens this sequence has sampled so far


class SampleOutput(NamedTuple):
    tokens: jax.Array  # [B] i32
    logprobs: jax.Array  # [B] f32, of the sampled token under the raw distribution
    top_ids: jax.Array  # [B, k] i32, sorted by log-prob, descending
    top_logprobs: jax.Array  # [B, k] f32


def seed_to_key_data(seed: int) -> np.ndarray:
    """Threefry key data of `seed`, equal to `jax.random.key_data(jax.random.key(seed))`."""
    if not (_is_int(seed) and 0 <= seed < 2**64):
        raise ConfigError(f"seed must be an integer in [0, 2**64), got {seed!r}")
    return np.array([(seed >> 32) & 0xFFFFFFFF, seed & 0xFFFFFFFF], np.uint32)  # [2]


def _check_batch(params: Sequence[SamplingParams], seeds: Sequence[int],
                 steps: Sequence[int], batch_size: int) -> None:
    if len(seeds) != len(params) or len(steps) != len(params):
        raise ConfigError(f"seeds and steps need one entry per params ({len(params)}), "
                          f"got {len(seeds)} seeds and {len(steps)} steps")
    if not (_is_int(batch_size) and batch_size >= max(1, len(params))):
        raise ConfigError(f"batch_size must be an integer >= max(1, len(params)) = "
                          f"{max(1, len(params))}, got {batch_size!r}")
    if any(not _is_int(s) or s < 0 for s in steps):
        raise ConfigError(f"steps must be integers >= 0, got {list(steps)}")


def _row_settings(p: SamplingParams) -> tuple[float, ...]:
    if p.greedy:  # neutral filters: greedy rows never need the filter path
        return (0.0, 0, 1.0, 0.0, p.repetition_penalty, p.presence_penalty, p.frequency_penalty)
    return (p.temperature, max(p.top_k, 0), p.top_p, p.min_p,
            p.repetition_penalty, p.presence_penalty, p.frequency_penalty)


def make_sampling_arrays(params: Sequence[SamplingParams], seeds: Sequence[int],
                         steps: Sequence[int], batch_size: int) -> SamplingArrays:
    """Pack one row per sequence; rows past len(params) are greedy and neutral."""
    _check_batch(params, seeds, steps, batch_size)
    rows = np.array([(0.0, 0, 1.0, 0.0, 1.0, 0.0, 0.0)] * batch_size, np.float64)  # [B, 7]
    key = np.zeros((batch_size, 2), np.uint32)  # [B, 2]
    step = np.zeros((batch_size,), np.int32)  # [B]
    for i, (p, seed, s) in enumerate(zip(params, seeds, steps, strict=True)):
        rows[i] = _row_settings(p)
        key[i] = seed_to_key_data(seed)
        step[i] = s
    f32 = rows.astype(np.float32)
    return SamplingArrays(
        temperature=f32[:, 0], top_k=rows[:, 1].astype(np.int32), top_p=f32[:, 2],
        min_p=f32[:, 3], repetition_penalty=f32[:, 4], presence_penalty=f32[:, 5],
        frequency_penalty=f32[:, 6], key=key, step=step,
    )


# --------------------------------------------------------------------------- device


def apply_penalties(logits: jax.Array, arrays: SamplingArrays, prompt_mask: jax.Array,
                    output_counts: jax.Array) -> jax.Array:
    """vLLM penalties. logits [B, V] f32, prompt_mask [B, V] bool, output_counts [B, V] i32.

    Repetition: over tokens in the prompt or the output, positive logits are
    divided by the penalty and negative ones multiplied. Frequency subtracts
    f * count, presence subtracts p once per token already output.
    """
    rep = arrays.repetition_penalty[:, None]  # [B, 1]
    counts = output_counts.astype(logits.dtype)  # [B, V]
    seen = prompt_mask | (output_counts > 0)  # [B, V]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - arrays.frequency_penalty[:, None] * counts
    return logits - arrays.presence_penalty[:, None] * (counts > 0)


def _ordered_keys(x: jax.Array) -> jax.Array:
    """[B, V] f32 -> [B, V] u32 whose unsigned order is the float order."""
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _largest_true(
    pred: Callable[[jax.Array], jax.Array], lo: jax.Array, hi: jax.Array
) -> jax.Array:
    """Per row, the largest u32 t in [lo, hi] with pred(t) ([B] -> [B] bool, monotone
    decreasing, assumed true at lo). lo, hi [B] u32."""

    def step(_, bounds: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        lo, hi = bounds
        done = lo >= hi  # [B]; once done, mid == lo and nothing may move
        mid = lo + (hi - lo) - (hi - lo) // 2  # ceil midpoint, > lo unless done
        ok = pred(mid) & ~done
        return jnp.where(ok, mid, lo), jnp.where(ok | done, hi, mid - 1)

    return lax.fori_loop(0, _BISECT_STEPS, step, (lo, hi))[0]


def _top_k_mask(x: jax.Array, top_k: jax.Array, active: jax.Array) -> jax.Array:
    """x [B, V] f32; keep the top_k [B] largest (ties kept) where active [B]."""
    keys = _ordered_keys(x)  # [B, V]

    def enough(t: jax.Array) -> jax.Array:
        return jnp.sum(keys >= t[:, None], axis=-1) >= top_k

    cut = _largest_true(enough, keys.min(axis=-1), keys.max(axis=-1))  # [B]
    return jnp.where(active[:, None] & (keys < cut[:, None]), -jnp.inf, x)


def _top_p_mask(x: jax.Array, top_p: jax.Array, active: jax.Array) -> jax.Array:
    """x [B, V] f32; keep the smallest top set with mass >= top_p [B] where active [B]."""
    keys = _ordered_keys(x)  # [B, V]
    probs = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))  # [B, V], unnormalized
    target = top_p * jnp.sum(probs, axis=-1)  # [B]

    def enough(t: jax.Array) -> jax.Array:
        return jnp.sum(jnp.where(keys >= t[:, None], probs, 0.0), axis=-1) >= target

    cut = _largest_true(enough, keys.min(axis=-1), keys.max(axis=-1))  # [B]
    return jnp.where(active[:, None] & (keys < cut[:, None]), -jnp.inf, x)


def _min_p_mask(x: jax.Array, min_p: jax.Array) -> jax.Array:
    """x [B, V] f32; drop tokens with prob < min_p [B] * max prob."""
    floor = jnp.max(x, axis=-1, keepdims=True) + jnp.log(min_p)[:, None]  # [B, 1]
    return jnp.where(x < floor, -jnp.inf, x)


def _filter(x: jax.Array, arrays: SamplingArrays, sampled: jax.Array) -> jax.Array:
    """Temperature-scaled x [B, V] -> x with filtered tokens at -inf; sampled [B] bool."""
    vocab = x.shape[-1]
    x = _min_p_mask(x, arrays.min_p)
    use_k = sampled & (arrays.top_k > 0) & (arrays.top_k < vocab)  # [B]
    x = lax.cond(jnp.any(use_k), _top_k_mask, lambda x, *_: x, x, arrays.top_k, use_k)
    use_p = sampled & (arrays.top_p < 1.0)  # [B]
    return lax.cond(jnp.any(use_p), _top_p_mask, lambda x, *_: x, x, arrays.top_p, use_p)


def _argmax(x: jax.Array) -> jax.Array:
    """x [B, V] -> [B] i32, the first index of the row max. A max and a masked min
    vectorize on CPU where XLA's variadic argmax reduce does not (2-3x faster)."""
    top = jnp.max(x, axis=-1, keepdims=True)  # [B, 1]
    index = lax.broadcasted_iota(jnp.int32, x.shape, 1)  # [B, V]
    first = jnp.min(jnp.where(x == top, index, x.shape[-1]), axis=-1)  # [B]
    return jnp.minimum(first, x.shape[-1] - 1)  # a NaN row gives V - 1, never out of range


def _row_gumbel(key_data: jax.Array, step: jax.Array, vocab: int) -> jax.Array:
    """[2] u32 key data, [] i32 step -> [V] f32 Gumbel noise from fold_in(key, step)."""
    key = jax.random.fold_in(jax.random.wrap_key_data(key_data, impl="threefry2x32"), step)
    return jax.random.gumbel(key, (vocab,), jnp.float32)


def _random_tokens(penalized: jax.Array, arrays: SamplingArrays, greedy_rows: jax.Array,
                   greedy_tokens: jax.Array) -> jax.Array:
    """penalized [B, V] -> [B] i32; greedy rows keep greedy_tokens [B]."""
    temperature = jnp.where(greedy_rows, 1.0, arrays.temperature)  # [B]
    x = _filter(penalized / temperature[:, None], arrays, ~greedy_rows)  # [B, V]
    gumbel = partial(_row_gumbel, vocab=x.shape[-1])
    noise = jax.vmap(gumbel)(arrays.key, arrays.step)  # [B, V]
    sampled = _argmax(x + noise)  # [B]
    return jnp.where(greedy_rows, greedy_tokens, sampled)


def _raw_logprobs(logits: jax.Array, tokens: jax.Array, k: int,
                  vocab_mesh: Mesh | None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Log-probs under log_softmax(logits [B, V]): sampled [B], top ids and values [B, k]."""
    lse = jax.nn.logsumexp(logits, axis=-1)  # [B]
    chosen = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0] - lse  # [B]
    if k == 0:
        batch = logits.shape[0]
        return chosen, jnp.zeros((batch, 0), jnp.int32), jnp.zeros((batch, 0), jnp.float32)
    top_values, top_ids = _top_k(logits, k, vocab_mesh)  # [B, k], descending
    return chosen, top_ids.astype(jnp.int32), top_values - lse[:, None]


def _top_k(x: jax.Array, k: int, vocab_mesh: Mesh | None) -> tuple[jax.Array, jax.Array]:
    """lax.top_k of x [B, V]; with the vocabulary split over `vocab_mesh`'s 'model' axis,
    each shard takes its own top k first (shard_map), then the k winners of those
    shards x k: no shard gathers the others' logits."""
    if vocab_mesh is None:
        return lax.top_k(x, k)
    width = x.shape[-1] // vocab_mesh.shape["model"]

    def local_top_k(x_local: jax.Array) -> tuple[jax.Array, jax.Array]:  # [B, width]
        values, ids = lax.top_k(x_local, k)
        return values, ids + lax.axis_index("model") * width

    split = P(None, "model")
    values, ids = shard_map_over_model(local_top_k, vocab_mesh, split,
                                       (split, split))(x)  # [B, shards * k]
    top_values, where = lax.top_k(values, k)  # [B, k]
    return top_values, jnp.take_along_axis(ids, where, axis=-1)


def sample(logits: jax.Array, arrays: SamplingArrays, prompt_mask: jax.Array,
           output_counts: jax.Array, num_top_logprobs: int,
           vocab_mesh: Mesh | None = None) -> SampleOutput:
    """Sample one token per row. logits [B, V] f32, prompt_mask [B, V] bool,
    output_counts [B, V] i32; num_top_logprobs is static (0 gives [B, 0] tops).
    `vocab_mesh`: the logits are split by vocabulary over its 'model' axis (V a
    multiple of it); every step here is then a per-shard reduction, never a gather.

    Jit with `jax.jit(sample, static_argnames="num_top_logprobs")`.
    """
    logits = logits.astype(jnp.float32)
    penalized = apply_penalties(logits, arrays, prompt_mask, output_counts)  # [B, V]
    greedy_rows = arrays.temperature < SAMPLING_EPS  # [B]
    greedy_tokens = _argmax(penalized)  # [B]
    tokens = lax.cond(jnp.all(greedy_rows), lambda *a: a[-1], _random_tokens,
                      penalized, arrays, greedy_rows, greedy_tokens)
    chosen, top_ids, top_logprobs = _raw_logprobs(logits, tokens, num_top_logprobs,
                                                  vocab_mesh)
    return SampleOutput(tokens, chosen, top_ids, top_logprobs)


def update_output_counts(output_counts: jax.Array, tokens: jax.Array,
                         active: jax.Array) -> jax.Array:
    """output_counts [B, V] i32 plus one at tokens [B] for rows where active [B] bool."""
    rows = jnp.arange(output_counts.shape[0])
    return output_counts.at[rows, tokens].add(active.astype(output_counts.dtype))


# --------------------------------------------------------------------------- host: stops


def find_stop_string(text: str, stops: Sequence[str], search_from: int) -> tuple[int, str] | None:
    """Earliest (position, stop) in text at or after search_from - max(len(stop)) + 1.

    Pass search_from = the length of the text before the newest delta: a stop
    string that began in an earlier delta but ends in this one is still found,
    and matches already checked are not reported twice. Ties go to the first
    stop in `stops`.
    """
    if not stops:
        return None
    start = max(0, search_from - max(len(s) for s in stops) + 1)
    best: tuple[int, str] | None = None
    for stop in stops:
        pos = text.find(stop, start)
        if pos >= 0 and (best is None or pos < best[0]):
            best = (pos, stop)
    return best
