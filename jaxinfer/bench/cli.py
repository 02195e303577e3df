"""`jaxinfer bench`: the flags every mode shares, the latency and offline modes,
and the run of any mode.

`bench serve` drives a gRPC server, so it lives with the server
(`serve/bench.py`) and joins the command through `bench_command` in
`serve/cli.py`. Each mode builds one report (see `report.py`), prints it as tables, and
optionally writes it as JSON (`--output`) and plots it (`--plot`). With
`--compare llama-cpp` the same token ids also run through llama.cpp on the
same GGUF, and every figure gets a jaxinfer / llama.cpp ratio.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from jaxinfer.args import (
    AddArguments,
    Command,
    add_compilation_cache_flag,
    add_engine_flags,
    add_model_flags,
    enable_compilation_cache,
)
from jaxinfer.bench.workloads import WORKLOADS
from jaxinfer.errors import ConfigError

Report = dict[str, Any]


@dataclass(frozen=True)
class BenchMode:
    """A `jaxinfer bench` mode: its flags (beside the model, engine and report flags
    every mode takes) and `run`, which returns the report (see `report.py`)."""

    name: str
    help: str
    add_flags: AddArguments
    run: Callable[[argparse.Namespace], Report]


def bench_command(modes: Sequence[BenchMode]) -> Command:
    """`jaxinfer bench` with these modes."""
    names = ", ".join(mode.name for mode in modes)
    return Command("bench", f"benchmarks: {names}", partial(add_bench_modes, modes=modes))


def add_bench_modes(parser: argparse.ArgumentParser, modes: Sequence[BenchMode]) -> None:
    """One subcommand per mode, each with the model and engine flags of `generate`."""
    subparsers = parser.add_subparsers(dest="mode", required=True)
    for mode in modes:
        sub = subparsers.add_parser(mode.name, help=mode.help)
        add_model_flags(sub)
        _add_common(sub)
        mode.add_flags(sub)
        add_engine_flags(sub)
        add_compilation_cache_flag(sub)
        sub.set_defaults(handler=partial(run_bench, mode.run))


def _add_common(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("report")
    group.add_argument("--seed", type=int, default=0, help="workload seed")
    group.add_argument("--output", type=Path, default=None, help="write the report as JSON")
    group.add_argument("--plot", type=Path, default=None,
                       help="draw latency CDFs (and throughput vs concurrency) to a PNG")
    group.add_argument("--compare", default=None,
                       help="llama-cpp: run the same token ids through llama.cpp too")
    group.add_argument("--gguf", type=Path, default=None,
                       help="GGUF for llama.cpp (default: --model's GGUF)")
    group.add_argument("--no-roofline", dest="roofline", action="store_false",
                       help="skip the peaks microbenchmark and the step cost analysis")


def add_workload_flags(parser: argparse.ArgumentParser, default: str) -> None:
    group = parser.add_argument_group("workload")
    group.add_argument("--workload", default=default,
                       help=f"{' | '.join(WORKLOADS)} (default {default})")
    group.add_argument("--num-prompts", type=int, default=32)
    group.add_argument("--input-len", type=int, default=None,
                       help="prompt tokens (fixed), or question/document length override")
    group.add_argument("--output-len", type=int, default=None,
                       help="new tokens per request, overriding the workload's")
    group.add_argument("--no-warmup", dest="warmup", action="store_false",
                       help="time the first run too (compilation included)")


def _add_latency(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt-lens", default="128,512,2048,8192",
                        help="prefill prompt lengths (clipped to max_model_len)")
    parser.add_argument("--context-lens", default="128,2048,8192",
                        help="decode context lengths (clipped to max_model_len)")
    parser.add_argument("--decode-tokens", type=int, default=16,
                        help="tokens decoded per context point")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per point")


def _add_offline(parser: argparse.ArgumentParser) -> None:
    add_workload_flags(parser, "mixed")
    parser.add_argument("--concurrency", default=None,
                        help="max_num_seqs values, e.g. 1,8,32,64 (default: the engine's)")


def run_bench(run: Callable[[argparse.Namespace], Report], args: argparse.Namespace) -> int:
    """Check the flags, run the mode, print the report, write JSON and plot."""
    from jaxinfer.bench.report import add_ratios, print_report, write_json

    check_flags(args)
    enable_compilation_cache(args)
    report = run(args)
    add_ratios(report)
    print_report(report, sys.stdout)
    if args.output is not None:
        write_json(report, args.output)
        print(f"wrote {args.output}", file=sys.stderr)
    if args.plot is not None:
        from jaxinfer.bench.plot import plot_report

        plot_report(report, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def check_flags(args: argparse.Namespace) -> None:
    """Every bad flag value is a ConfigError naming the flag, before anything loads."""
    if args.compare not in (None, "llama-cpp"):
        raise ConfigError(f"--compare must be llama-cpp, got {args.compare!r}")
    if args.compare:
        from jaxinfer.bench.llama_cpp_peer import import_llama_cpp

        import_llama_cpp()
    if args.plot is not None:
        from jaxinfer.bench.plot import _pyplot

        _pyplot()
    if getattr(args, "workload", WORKLOADS[0]) not in WORKLOADS:
        raise ConfigError(f"unknown workload {args.workload!r}; workloads: "
                          f"{', '.join(WORKLOADS)}")
    _positive(args, "num_prompts", "repeats", "input_len", "output_len", "max_concurrency")
    _positive(args, "request_rate", "ttft_slo", "tpot_slo", "timeout")
    if getattr(args, "decode_tokens", 2) < 2:
        raise ConfigError(f"--decode-tokens must be >= 2, got {args.decode_tokens}")


def _positive(args: argparse.Namespace, *names: str) -> None:
    for name in names:
        value: Any = getattr(args, name, None)
        if value is not None and not value > 0:
            flag = "--" + name.replace("_", "-")
            raise ConfigError(f"{flag} must be > 0, got {value}")


def _run_latency(args: argparse.Namespace) -> Report:
    from jaxinfer.bench.modes import run_latency_mode

    return run_latency_mode(args)


def _run_offline(args: argparse.Namespace) -> Report:
    from jaxinfer.bench.modes import run_offline_mode

    return run_offline_mode(args)


BENCH_MODES = (
    BenchMode("latency", "batch-1 prefill and decode times", _add_latency, _run_latency),
    BenchMode("offline", "throughput of LLM.generate against concurrency", _add_offline,
              _run_offline),
)
