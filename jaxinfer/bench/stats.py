"""The arithmetic of a benchmark report: percentiles, throughput, goodput, ratios.

Everything here is plain Python over lists of seconds and token counts, so the
report's figures can be checked exactly in tests. Latencies are kept in
seconds; the printed tables show milliseconds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation (numpy's default)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def median(values: Sequence[float]) -> float:
    return percentile(values, 50)


def summarize(values: Sequence[float]) -> dict[str, float]:
    """mean, p50, p90, p99 (NaN when there are no values) and the count."""
    summary = {"mean": sum(values) / len(values) if values else math.nan}
    summary |= {f"p{q}": percentile(values, q) for q in PERCENTILES}
    return summary | {"count": len(values)}


@dataclass
class RequestRecord:
    """What one request did, as its client (or the engine) saw it; times in seconds."""

    prompt_tokens: int
    output_tokens: int
    ttft: float | None  # send (arrival) to first token
    latency: float | None  # send to last token
    itls: list[float] = field(default_factory=list)  # gaps between token arrivals
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (vLLM's TPOT)."""
        if self.ttft is None or self.latency is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    @property
    def ok(self) -> bool:
        return self.error is None and self.ttft is not None


def meets_slo(record: RequestRecord, ttft_slo: float | None, tpot_slo: float | None) -> bool:
    """vLLM's goodput test: TTFT and TPOT both within their targets (None = no target);
    a request with one output token has no TPOT and passes that test."""
    if not record.ok:
        return False
    if ttft_slo is not None and record.ttft is not None and record.ttft > ttft_slo:
        return False
    tpot = record.tpot
    return not (tpot_slo is not None and tpot is not None and tpot > tpot_slo)


def throughput(records: Sequence[RequestRecord], seconds: float,
               ttft_slo: float | None = None, tpot_slo: float | None = None) -> dict[str, float]:
    """Requests, input and output tokens per second over `seconds`, and goodput
    (requests per second that met the SLOs). Failed requests count nowhere."""
    done = [r for r in records if r.ok]
    good = sum(meets_slo(r, ttft_slo, tpot_slo) for r in done)
    per_s = (lambda x: x / seconds) if seconds > 0 else (lambda _x: math.nan)
    return {
        "seconds": seconds,
        "completed": len(done),
        "failed": len(records) - len(done),
        "input_tokens": sum(r.prompt_tokens for r in done),
        "output_tokens": sum(r.output_tokens for r in done),
        "requests_per_s": per_s(len(done)),
        "input_tokens_per_s": per_s(sum(r.prompt_tokens for r in done)),
        "output_tokens_per_s": per_s(sum(r.output_tokens for r in done)),
        "good_requests": good,
        "goodput_requests_per_s": per_s(good),
    }


def latency_summaries(records: Sequence[RequestRecord]) -> dict[str, dict[str, float]]:
    """TTFT, TPOT, ITL and end-to-end latency summaries over the completed requests."""
    done = [r for r in records if r.ok]
    return {
        "ttft": summarize([r.ttft for r in done if r.ttft is not None]),
        "tpot": summarize([r.tpot for r in done if r.tpot is not None]),
        "itl": summarize([gap for r in done for gap in r.itls]),
        "e2e": summarize([r.latency for r in done if r.latency is not None]),
    }


def samples(records: Sequence[RequestRecord]) -> dict[str, list[float]]:
    """The raw TTFT, TPOT and ITL values of the completed requests (for CDF plots)."""
    done = [r for r in records if r.ok]
    return {"ttft": [r.ttft for r in done if r.ttft is not None],
            "tpot": [r.tpot for r in done if r.tpot is not None],
            "itl": [gap for r in done for gap in r.itls]}


def run_summary(records: Sequence[RequestRecord], seconds: float, ttft_slo: float | None = None,
                tpot_slo: float | None = None) -> dict[str, object]:
    """Throughput, latency summaries and raw samples of one timed run."""
    return {**throughput(records, seconds, ttft_slo, tpot_slo), **latency_summaries(records),
            "samples": samples(records)}


@dataclass(frozen=True)
class Ratio:
    """ours / theirs for one figure; `higher_is_better` says which way wins."""

    figure: str
    ours: float
    theirs: float
    higher_is_better: bool

    @property
    def ratio(self) -> float:
        if not self.theirs or math.isnan(self.theirs) or math.isnan(self.ours):
            return math.nan
        return self.ours / self.theirs

    @property
    def we_win(self) -> bool | None:
        if math.isnan(self.ratio) or self.ratio == 1:
            return None
        return (self.ratio > 1) == self.higher_is_better

    def as_dict(self) -> dict[str, object]:
        return {"figure": self.figure, "jaxinfer": self.ours, "llama_cpp": self.theirs,
                "ratio": self.ratio, "better": "higher" if self.higher_is_better else "lower",
                "jaxinfer_wins": self.we_win}


Figures = dict[str, tuple[float, bool]]  # name -> (value, higher is better)


def compare(ours: Figures, theirs: Figures) -> list[Ratio]:
    """A Ratio for every figure both sides report, in our order."""
    return [Ratio(name, value, theirs[name][0], higher)
            for name, (value, higher) in ours.items() if name in theirs]
