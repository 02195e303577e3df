"""A roofline line per step function: FLOPs and bytes against the machine's peaks.

The machine's peaks are measured, not looked up: a large array reduction and
copy for memory bandwidth (GB/s), a large matmul in the model's dtype for
compute (GFLOP/s). A step's FLOPs and bytes come from XLA's cost analysis
(`jit(...).lower(...).compile().cost_analysis()`) of a step built here from the
model's public pieces (forward, LM head, sampling), for the padded shapes the
runner really dispatches (its token, sequence and block-table buckets);
with a measured step time they give the achieved GB/s and
GFLOP/s and their fractions of the peaks. Decode at small batch should sit
near the bandwidth roof, long prefills near the compute roof.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.model.config import ModelConfig
from jaxinfer.model.params import Params
from jaxinfer.model.transformer import KVCache, forward, init_kv_cache, lm_head
from jaxinfer.ops.attention import AttentionFn
from jaxinfer.ops.types import AttentionMetadata
from jaxinfer.runner import ModelRunner, StepShape
from jaxinfer.sampling import SampleOutput, SamplingArrays, make_sampling_arrays, sample

BANDWIDTH_ELEMENTS = 1 << 26  # 256 MiB of f32: far past any cache
MATMUL_SIZE = {"cpu": 2048}  # other backends: 8192
REPEATS = 5


def _best_seconds(fn: Callable[[], Any], repeats: int = REPEATS) -> float:
    jax.block_until_ready(fn())  # compile and warm
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - start)
    return best


def measure_peaks(dtype: Any = jnp.float32) -> dict[str, Any]:
    """Memory GB/s (best of a sum and a copy) and matmul GFLOP/s in `dtype`."""
    backend = jax.default_backend()
    x = jnp.ones((BANDWIDTH_ELEMENTS,), jnp.float32)
    nbytes = x.size * x.dtype.itemsize
    read = nbytes / _best_seconds(lambda: jnp.sum(x))
    copy = 2 * nbytes / _best_seconds(lambda: x * 2.0)
    n = MATMUL_SIZE.get(backend, 8192)
    a = jnp.ones((n, n), dtype)
    matmul = jax.jit(lambda p, q: p @ q)
    flops = 2 * n**3 / _best_seconds(lambda: matmul(a, a))
    return {"backend": backend, "device": str(jax.devices()[0].device_kind),
            "memory_gbps": max(read, copy) / 1e9, "compute_gflops": flops / 1e9,
            "matmul_dtype": str(jnp.dtype(dtype)), "matmul_n": n}


def prefill_shape(runner: ModelRunner, prompt_len: int, budget: int) -> tuple[StepShape, int]:
    """The step shape of one `prompt_len` prompt chunked by `budget` tokens (its last
    chunk's context), and the number of steps it takes."""
    chunk = min(prompt_len, budget)
    return runner.step_shape([chunk], prompt_len), math.ceil(prompt_len / chunk)


def decode_shape(runner: ModelRunner, batch: int, context: int) -> StepShape:
    """The step shape of `batch` decoding sequences whose longest context is `context`."""
    return runner.step_shape([1] * batch, context)


def step_cost(runner: ModelRunner, shape: StepShape) -> dict[str, float]:
    """FLOPs and bytes accessed of one step call of `shape`, by XLA's cost analysis."""
    cost = step_lowering(runner, shape).compile().cost_analysis()
    if isinstance(cost, list):  # older JAX: one dict per program
        cost = cost[0] if cost else {}
    cost = cost or {}
    return {"flops": float(cost.get("flops", math.nan)),
            "bytes": float(cost.get("bytes accessed", math.nan))}


def step_lowering(
    runner: ModelRunner, shape: StepShape, *, unroll_layers: bool = True
) -> jax.stages.Lowered:
    """The runner's step of `shape` (forward, LM head at each sequence's last token,
    plain sampling), lowered over abstract inputs.

    The layer scan is unrolled: the analysis counts a loop body once whatever its
    trip count. The KV pool holds just the blocks the call reads: the analysis
    charges an in-place K/V write with the whole pool, which the real update never
    touches.
    """
    t, s, width = shape.tokens, shape.seqs, shape.width
    cache, config = runner.cache, runner.config
    kv = jax.eval_shape(partial(init_kv_cache, config, s * width * cache.block_size,
                                runner.dtype, cache.kv_cache_dtype))
    meta = AttentionMetadata(positions=_int32(t), kv_rows=_int32(t), query_start=_int32(s + 1),
                             context_lens=_int32(s), block_tables=_int32(s, width),
                             num_seqs=_int32(1))
    step = jax.jit(partial(_sampled_step, config=config, block_size=cache.block_size,
                           attention_fn=runner.attention_fn,
                           unroll_layers=unroll_layers))
    penalties = (jax.ShapeDtypeStruct((s, config.vocab_size), np.bool_),
                 jax.ShapeDtypeStruct((s, config.vocab_size), np.int32))
    return step.lower(runner.params, kv, _int32(t), meta, _int32(s),
                      make_sampling_arrays([], [], [], s), *penalties)


def _int32(*shape: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, np.int32)


def _sampled_step(
    params: Params,
    kv: KVCache,
    tokens: jax.Array,  # [T] int32
    meta: AttentionMetadata,
    last_index: jax.Array,  # [S] int32, each sequence's last query token
    sampling: SamplingArrays,
    prompt_mask: jax.Array,  # [S, V] bool
    output_counts: jax.Array,  # [S, V] int32
    *,
    config: ModelConfig,
    block_size: int,
    attention_fn: AttentionFn,
    unroll_layers: bool,
) -> tuple[SampleOutput, KVCache]:
    hidden, kv = forward(params, config, tokens, kv, meta, block_size=block_size,
                         attention_fn=attention_fn, unroll_layers=unroll_layers)  # [T, d]
    logits = lm_head(params, config, hidden[last_index])  # [S, V]
    return sample(logits, sampling, prompt_mask, output_counts, 0), kv


def roofline_line(step: str, cost: dict[str, float], calls: int, seconds: float,
                  peaks: dict[str, Any]) -> dict[str, Any]:
    """Achieved GB/s and GFLOP/s of `calls` step calls taking `seconds` in all, and
    their fractions of the measured peaks."""
    flops, nbytes = cost["flops"] * calls, cost["bytes"] * calls
    gbps = nbytes / seconds / 1e9 if seconds > 0 else math.nan
    gflops = flops / seconds / 1e9 if seconds > 0 else math.nan
    return {"step": step, "flops": flops, "bytes": nbytes, "seconds": seconds,
            "intensity": flops / nbytes if nbytes else math.nan,
            "gbps": gbps, "gflops": gflops,
            "bandwidth_fraction": gbps / peaks["memory_gbps"],
            "compute_fraction": gflops / peaks["compute_gflops"]}
