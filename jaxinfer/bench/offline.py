"""`jaxinfer bench offline`: a whole workload at once, at several concurrencies.

For each concurrency (the engine's `max_num_seqs`, or llama.cpp's
`n_seq_max`), the workload runs once with other ids of the same lengths to
compile every step shape it reaches (a partial warm-up leaves compilations of
seconds inside the timed run), then again, timed: requests/s, input and
output tokens/s, and the TTFT/TPOT/ITL the requests saw.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from jaxinfer.bench.stats import RequestRecord, run_summary
from jaxinfer.bench.workloads import BenchRequest, Workload, perturbed
from jaxinfer.errors import ConfigError

GenerateFn = Callable[[Sequence[BenchRequest], int], tuple[list[RequestRecord], float]]


def parse_int_list(text: str, flag: str) -> list[int]:
    """'1,8,32' -> [1, 8, 32]; every value >= 1, else a ConfigError naming `flag`."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ConfigError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ConfigError(f"{flag} needs integers >= 1, got {text!r}")
    return values


def offline_point(generate: GenerateFn, workload: Workload, concurrency: int,
                  vocab_size: int, warmup: bool = True) -> dict[str, object]:
    """Warm up on a look-alike of the workload, then time the workload."""
    if warmup:
        generate(perturbed(workload, vocab_size).requests, concurrency)
    records, seconds = generate(workload.requests, concurrency)
    return {"concurrency": concurrency, **run_summary(records, seconds)}


def run_offline(generate: GenerateFn, workload: Workload, concurrencies: Sequence[int],
                vocab_size: int, warmup: bool = True) -> list[dict[str, object]]:
    return [offline_point(generate, workload, c, vocab_size, warmup) for c in concurrencies]
