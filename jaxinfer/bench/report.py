"""The benchmark report: one JSON-able dict per run, printed as plain tables.

Layout of a report (every mode):

    {"mode", "model", "engine", "workload" (offline/serve), "machine" (peaks),
     "load_s", "jaxinfer": {...}, "llama_cpp": {...} (with --compare),
     "roofline": [...], "ratios": [...]}

`jaxinfer` and `llama_cpp` have the same shape, so `figures()` reads either
and `stats.compare` turns the pairs into ratios (jaxinfer / llama.cpp).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from jaxinfer.bench.stats import Figures, compare

PEER = "llama_cpp"


def figures(mode: str, side: dict[str, Any]) -> Figures:
    """Every comparable figure of one side of a report: name -> (value, higher is better)."""
    out: Figures = {}
    if "load_s" in side:
        out["load s"] = (side["load_s"], False)
    if mode == "latency":
        for p in side.get("prefill", []):
            out[f"prefill {p['prompt_len']} tok: s"] = (p["seconds"], False)
            out[f"prefill {p['prompt_len']} tok: tok/s"] = (p["tokens_per_s"], True)
        for d in side.get("decode", []):
            out[f"decode @{d['context_len']}: s/token"] = (d["seconds_per_token"], False)
            out[f"decode @{d['context_len']}: tok/s"] = (d["tokens_per_s"], True)
        return out
    for run in side.get("runs", []):
        out |= _run_figures(f"c={run['concurrency']}", run)
    return out


def _run_figures(tag: str, run: dict[str, Any]) -> Figures:
    out: Figures = {}
    for key, label in (("requests_per_s", "req/s"), ("input_tokens_per_s", "input tok/s"),
                       ("output_tokens_per_s", "output tok/s"),
                       ("goodput_requests_per_s", "goodput req/s")):
        out[f"{tag} {label}"] = (run[key], True)
    for metric in ("ttft", "tpot", "itl"):
        for q in ("p50", "p99"):
            out[f"{tag} {metric} {q} s"] = (run[metric][q], False)
    return out


def add_ratios(report: dict[str, Any]) -> None:
    """report["ratios"]: jaxinfer / llama.cpp for every figure both report."""
    if PEER not in report:
        return
    ours, theirs = figures(report["mode"], report["jaxinfer"]), figures(report["mode"],
                                                                          report[PEER])
    report["ratios"] = [r.as_dict() for r in compare(ours, theirs)]


# --------------------------------------------------------------------------- tables


def _cell(value: Any) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:,.3f}" if abs(value) < 100 else f"{value:,.1f}"
    return str(value)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A left-aligned text table."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(lines)


def _ms(value: float) -> float:
    return value * 1000


def latency_tables(side: dict[str, Any]) -> list[str]:
    prefill = format_table(
        ["prompt tokens", "prefill ms", "tok/s", "first run ms", "compile s"],
        [[p["prompt_len"], _ms(p["seconds"]), p["tokens_per_s"], _ms(p["first_run_s"]),
          p["compile_s"]] for p in side["prefill"]])
    decode = format_table(
        ["context", "ms/token", "tok/s", "first run ms/token", "compile s"],
        [[d["context_len"], _ms(d["seconds_per_token"]), d["tokens_per_s"],
          _ms(d["first_run_s_per_token"]), d["compile_s"]] for d in side["decode"]])
    return [prefill, decode]


def runs_table(runs: Sequence[dict[str, Any]]) -> str:
    """One row per run; jaxinfer's runs add device calls per step and padding waste."""
    headers = ["concurrency", "req/s", "input tok/s", "output tok/s", "goodput req/s",
               "TTFT p50/p90/p99 ms", "TPOT p50/p90/p99 ms", "ITL p50/p90/p99 ms", "failed"]
    rows = [[r["concurrency"], r["requests_per_s"], r["input_tokens_per_s"],
             r["output_tokens_per_s"], r["goodput_requests_per_s"],
             *(_triple(r[m]) for m in ("ttft", "tpot", "itl")), r["failed"]] for r in runs]
    if runs and all("padding_waste" in r for r in runs):
        headers += ["calls/step", "computed/useful tokens"]
        for row, run in zip(rows, runs, strict=True):
            row += [run["device_calls_per_step"], run["padding_waste"]]
    return format_table(headers, rows)


def _triple(summary: dict[str, float]) -> str:
    return " / ".join(_cell(_ms(summary[q])) for q in ("p50", "p90", "p99"))


def roofline_table(lines: Sequence[dict[str, Any]]) -> str:
    return format_table(
        ["step", "GFLOP", "MB", "FLOP/byte", "ms", "GB/s", "GFLOP/s", "% peak BW",
         "% peak FLOP/s"],
        [[r["step"], r["flops"] / 1e9, r["bytes"] / 1e6, r["intensity"], _ms(r["seconds"]),
          r["gbps"], r["gflops"], 100 * r["bandwidth_fraction"], 100 * r["compute_fraction"]]
         for r in lines])


def ratios_table(ratios: Sequence[dict[str, Any]]) -> str:
    rows = []
    for r in ratios:
        verdict = {True: "jaxinfer", False: "llama.cpp", None: "tie"}[r["jaxinfer_wins"]]
        rows.append([r["figure"], r["jaxinfer"], r["llama_cpp"], r["ratio"],
                     f"{r['better']} is better", verdict])
    return format_table(["figure", "jaxinfer", "llama.cpp", "jaxinfer/llama.cpp",
                         "direction", "wins"], rows)


def print_report(report: dict[str, Any], out: TextIO) -> None:
    """Every table of `report`, titled."""
    machine = report.get("machine")
    print(f"# jaxinfer bench {report['mode']}: {report['model']}", file=out)
    if machine:
        print(f"machine: {machine['backend']} ({machine['device']}), peak memory "
              f"{machine['memory_gbps']:,.1f} GB/s, peak compute "
              f"{machine['compute_gflops']:,.1f} GFLOP/s ({machine['matmul_dtype']} matmul)",
              file=out)
    for side, title in (("jaxinfer", "jaxinfer"), (PEER, "llama.cpp")):
        if side not in report:
            continue
        print(f"\n## {title} (load {report[side].get('load_s', math.nan):.2f}s)", file=out)
        tables = (latency_tables(report[side]) if report["mode"] == "latency"
                  else [runs_table(report[side]["runs"])])
        for table in tables:
            print(table + "\n", file=out)
    for key, title, render in (("roofline", "roofline", roofline_table),
                               ("ratios", "jaxinfer / llama.cpp", ratios_table)):
        if report.get(key):
            print(f"## {title}\n{render(report[key])}\n", file=out)


def write_json(report: dict[str, Any], path: Path) -> None:
    """The report as JSON (NaN written as null)."""
    path.write_text(json.dumps(_clean(report), indent=1) + "\n")


def _clean(value: Any) -> Any:
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value
