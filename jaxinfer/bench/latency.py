"""`jaxinfer bench latency`: batch-1 prefill and decode times.

For each prompt length, the time from adding a request to its first token
(prefill plus one sample); for each context length, the time per decoded
token after a prompt of that length. Each point runs once to compile (its
excess over the steady time is reported as compile time), then `repeats`
times with fresh prompts (no prefix-cache hits); the median is reported.
The same runs go through llama.cpp when it is compared: any `generate`
function taking (requests, max_seqs) fits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from jaxinfer.bench.stats import RequestRecord, median
from jaxinfer.bench.workloads import BenchRequest, TokenSource
from jaxinfer.errors import ConfigError

GenerateFn = Callable[[Sequence[BenchRequest], int], tuple[list[RequestRecord], float]]
DEFAULT_PROMPT_LENS = (128, 512, 2048, 8192)
DEFAULT_CONTEXT_LENS = (128, 2048, 8192)


def clip_lengths(lengths: Sequence[int], limit: int) -> list[int]:
    """Lengths above `limit` become `limit`; sorted, without duplicates."""
    if any(n < 1 for n in lengths):
        raise ConfigError(f"lengths must be >= 1, got {list(lengths)}")
    if limit < 1:
        raise ConfigError(f"max_model_len leaves no room for these lengths (limit {limit})")
    return sorted({min(n, limit) for n in lengths})


def prefill_point(generate: GenerateFn, source: TokenSource, rng: np.random.Generator,
                  length: int, repeats: int) -> dict[str, float]:
    """Median TTFT of a `length`-token prompt, batch 1; the first run compiles."""
    runs = [_one(generate, BenchRequest(tuple(source.prompt(rng, length)), 1)).ttft or 0.0
            for _ in range(repeats + 1)]
    steady = median(runs[1:])
    return {"prompt_len": length, "seconds": steady, "tokens_per_s": length / steady,
            "first_run_s": runs[0], "compile_s": max(0.0, runs[0] - steady), "runs": runs[1:]}


def decode_point(generate: GenerateFn, source: TokenSource, rng: np.random.Generator,
                 context: int, new_tokens: int, repeats: int) -> dict[str, float]:
    """Median time per decoded token after a `context`-token prompt, batch 1."""
    per_token = []
    for _ in range(repeats + 1):
        record = _one(generate, BenchRequest(tuple(source.prompt(rng, context)), new_tokens))
        per_token.append((median(record.itls), sum(record.itls)))
    steady = median([p for p, _ in per_token[1:]])
    first_total, steady_total = per_token[0][1], median([t for _, t in per_token[1:]])
    return {"context_len": context, "new_tokens": new_tokens, "seconds_per_token": steady,
            "tokens_per_s": 1 / steady, "first_run_s_per_token": per_token[0][0],
            "compile_s": max(0.0, first_total - steady_total),
            "runs": [p for p, _ in per_token[1:]]}


def run_latency(generate: GenerateFn, source: TokenSource, *, prompt_lens: Sequence[int],
                context_lens: Sequence[int], max_model_len: int, new_tokens: int = 16,
                repeats: int = 3, seed: int = 0) -> dict[str, list[dict[str, float]]]:
    """Every prefill and decode point, with lengths clipped to the context."""
    if repeats < 1 or new_tokens < 2:
        raise ConfigError(f"need repeats >= 1 and decode tokens >= 2, got {repeats}, "
                          f"{new_tokens}")
    rng = np.random.default_rng(seed)
    prompts = clip_lengths(prompt_lens, max_model_len - 1)
    contexts = clip_lengths(context_lens, max_model_len - new_tokens)
    return {
        "prefill": [prefill_point(generate, source, rng, n, repeats) for n in prompts],
        "decode": [decode_point(generate, source, rng, n, new_tokens, repeats)
                   for n in contexts],
    }


def _one(generate: GenerateFn, request: BenchRequest) -> RequestRecord:
    records, _ = generate([request], 1)
    return records[0]
