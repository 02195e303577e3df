"""`--plot out.png`: latency CDFs and throughput against concurrency (matplotlib)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jaxinfer.errors import ConfigError

SIDES = (("jaxinfer", "jaxinfer"), ("llama_cpp", "llama.cpp"))
METRICS = ("ttft", "tpot", "itl")


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'jaxinfer[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_report(report: dict[str, Any], path: Path) -> None:
    """One figure: a CDF per latency metric (every run of every side), and for offline
    and serve runs, output tokens/s against concurrency."""
    plt = _pyplot()
    runs = report["mode"] != "latency"
    fig, axes = plt.subplots(1, len(METRICS) + runs, figsize=(5 * (len(METRICS) + runs), 4))
    for ax, metric in zip(axes, METRICS, strict=False):
        _cdf(ax, report, metric)
    if runs:
        _throughput(axes[-1], report)
    fig.suptitle(f"jaxinfer bench {report['mode']}: {report['model']}")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _cdf(ax: Any, report: dict[str, Any], metric: str) -> None:
    for side, label in SIDES:
        for name, values in _series(report, side, metric):
            ordered = sorted(values)
            if ordered:
                ax.step([v * 1000 for v in ordered],
                        [(i + 1) / len(ordered) for i in range(len(ordered))],
                        where="post", label=f"{label} {name}")
    ax.set_xlabel(f"{metric.upper()} (ms)")
    ax.set_ylabel("fraction of requests" if metric != "itl" else "fraction of tokens")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")


def _series(report: dict[str, Any], side: str, metric: str) -> list[tuple[str, list[float]]]:
    """(label, values) of one metric: per run (offline/serve), or per length (latency)."""
    data = report.get(side)
    if not data:
        return []
    if report["mode"] != "latency":
        return [(f"c={r['concurrency']}", r["samples"][metric]) for r in data["runs"]]
    if metric == "ttft":
        return [(f"{p['prompt_len']} tok", p["runs"]) for p in data["prefill"]]
    if metric == "itl":
        return [(f"@{d['context_len']}", d["runs"]) for d in data["decode"]]
    return []


def _throughput(ax: Any, report: dict[str, Any]) -> None:
    for side, label in SIDES:
        runs = report.get(side, {}).get("runs", [])
        if runs:
            ax.plot([r["concurrency"] for r in runs], [r["output_tokens_per_s"] for r in runs],
                    marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency")
    ax.set_ylabel("output tokens/s")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
