"""Running workloads through jaxinfer's offline API (`LLM.generate`), timed.

Latency (batch 1) and offline throughput both go through `LLM.generate`, so
they include everything a user pays: scheduling, padding, the device step,
sampling and the host loop. Warm-up runs use prompts of the same shapes but
other ids (`workloads.perturbed`), so they compile the step shapes without
filling the prefix cache the timed run will read.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Sequence

from jaxinfer.bench.stats import RequestRecord
from jaxinfer.bench.workloads import BenchRequest
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.metrics import EngineStats
from jaxinfer.llm import LLM
from jaxinfer.outputs import RequestOutput
from jaxinfer.sampling import SamplingParams
from jaxinfer.weights import LoadedModel


def exact_params(output_len: int) -> SamplingParams:
    """Greedy, exactly `output_len` new tokens (EOS ignored)."""
    return SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)


def record_of(output: RequestOutput) -> RequestRecord:
    """A RequestRecord from the engine's own timestamps (arrival = add_request)."""
    m = output.metrics
    assert m is not None
    last = m.token_times[-1] - m.arrival_time if m.token_times else None
    return RequestRecord(m.prompt_tokens, len(output.token_ids), m.ttft, last, m.itls)


def generate(llm: LLM, requests: Sequence[BenchRequest]) -> tuple[list[RequestRecord], float]:
    """Run every request through `llm.generate` at once; (records, wall seconds)."""
    start = time.perf_counter()
    outputs = llm.generate(prompt_token_ids=[list(r.prompt_ids) for r in requests],
                           sampling_params=[exact_params(r.output_len) for r in requests],
                           use_tqdm=False)
    seconds = time.perf_counter() - start
    return [record_of(o) for o in outputs], seconds


class EngineBench:
    """One loaded model; an `LLM` per concurrency (`max_num_seqs`), built when asked.

    Only one LLM (one KV pool) lives at a time, so a pool sized from free
    accelerator memory is released before the next is made; compiled steps
    are shared by every LLM in the process.
    """

    def __init__(self, model: LoadedModel, config: EngineConfig) -> None:
        self.model = model
        self.config = config
        self._llm: LLM | None = None
        self.last_steps: dict[str, float] = {}

    def llm(self, max_num_seqs: int | None = None) -> LLM:
        seqs = max_num_seqs or self.config.max_num_seqs
        if self._llm is None or self._llm.engine.config.max_num_seqs != seqs:
            self._llm = None
            gc.collect()
            self._llm = LLM(loaded=self.model, engine_config=self.config.replace(
                max_num_seqs=seqs))
        return self._llm

    def generate(self, requests: Sequence[BenchRequest],
                 max_seqs: int) -> tuple[list[RequestRecord], float]:
        """Run the requests; `last_steps` then holds that run's step figures."""
        llm = self.llm(max_seqs)
        before = step_totals(llm.engine.stats)
        result = generate(llm, requests)
        after = step_totals(llm.engine.stats)
        self.last_steps = step_figures(*(a - b for a, b in zip(after, before, strict=True)))
        return result


def step_totals(stats: EngineStats) -> tuple[int, int, int, int]:
    return stats.steps, stats.device_calls, stats.step_tokens, stats.computed_tokens


def step_figures(steps: int, calls: int, useful: int, computed: int) -> dict[str, float]:
    """How a run used the device: jitted calls per engine step, and padding waste
    (tokens computed, padding included, per token a sequence needed)."""
    return {"steps": steps, "device_calls_per_step": calls / steps if steps else math.nan,
            "padding_waste": computed / useful if useful else math.nan}
