"""Engine metrics: a snapshot object, and the same figures as Prometheus collectors.

`EngineStats` accumulates per-step and per-request figures in plain Python.
`PrometheusMetrics` exposes them on a registry of its own (one per engine, so
several engines in a process never clash): gauges are read from the engine at
scrape time, histograms are fed as requests finish.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from jaxinfer.outputs import RequestOutput

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (1, 8, 32, 128, 512, 1024, 2048, 4096, 8192, 16384, 32768)


@dataclass
class EngineStats:
    """Totals since start: steps, tokens, preemptions, finished requests by reason.

    `step_tokens` counts the tokens steps ran for sequences (prompt chunks and
    decodes); `computed_tokens` the tokens the device computed, padding to the
    step shapes included; `device_calls` the jitted calls the steps made.
    """

    steps: int = 0
    step_tokens: int = 0
    computed_tokens: int = 0
    device_calls: int = 0
    step_seconds: float = 0.0
    max_step_seconds: float = 0.0
    preemptions: int = 0
    finished: Counter = field(default_factory=Counter)
    listeners: list[Callable[[RequestOutput], None]] = field(default_factory=list)

    def record_step(self, num_tokens: int, num_preempted: int, seconds: float,
                    device_calls: int, computed_tokens: int) -> None:
        self.steps += 1
        self.step_tokens += num_tokens
        self.device_calls += device_calls
        self.computed_tokens += computed_tokens
        self.step_seconds += seconds
        self.max_step_seconds = max(self.max_step_seconds, seconds)
        self.preemptions += num_preempted

    def record_request(self, output: RequestOutput) -> None:
        self.finished[output.finish_reason or "unknown"] += 1
        for listener in self.listeners:
            listener(output)


class PrometheusMetrics:
    """Prometheus view of one engine; serve `registry` over HTTP to scrape it."""

    def __init__(self, snapshot: Callable[[], dict[str, float]], stats: EngineStats) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_GaugeCollector(snapshot, stats))
        self._histograms = {
            name: Histogram(f"jaxinfer_request_{name}", help_text, registry=self.registry,
                            buckets=buckets)
            for name, help_text, buckets in (
                ("queue_seconds", "Time from arrival to first scheduling", LATENCY_BUCKETS),
                ("ttft_seconds", "Time to first token", LATENCY_BUCKETS),
                ("tpot_seconds", "Mean time per output token after the first",
                 LATENCY_BUCKETS),
                ("itl_seconds", "Inter-token latency", LATENCY_BUCKETS),
                ("prompt_tokens", "Prompt tokens per request", TOKEN_BUCKETS),
                ("completion_tokens", "Generated tokens per request", TOKEN_BUCKETS),
                ("cached_tokens", "Prompt tokens served from the prefix cache",
                 TOKEN_BUCKETS),
            )
        }
        stats.listeners.append(self.observe)

    def observe(self, output: RequestOutput) -> None:
        m = output.metrics
        if m is None:
            return
        values = {"queue_seconds": m.queue_time, "ttft_seconds": m.ttft,
                  "tpot_seconds": m.tpot, "prompt_tokens": m.prompt_tokens,
                  "completion_tokens": m.completion_tokens, "cached_tokens": m.cached_tokens}
        for name, value in values.items():
            if value is not None:
                self._histograms[name].observe(value)
        for gap in m.itls:
            self._histograms["itl_seconds"].observe(gap)


class _GaugeCollector(Collector):
    def __init__(self, snapshot: Callable[[], dict[str, float]], stats: EngineStats) -> None:
        self._snapshot = snapshot
        self._stats = stats

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        for name, value in self._snapshot().items():
            yield GaugeMetricFamily(f"jaxinfer_{name}", f"engine gauge: {name}", value=value)
        finished = CounterMetricFamily("jaxinfer_requests_finished", "Finished requests",
                                       labels=["finish_reason"])
        for reason, count in sorted(self._stats.finished.items()):
            finished.add_metric([reason], count)
        yield finished
