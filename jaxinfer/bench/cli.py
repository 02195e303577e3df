"""`jaxinfer bench latency | offline | serve`: flags and the run of each mode.

Each mode builds one report (see `report.py`), prints it as tables, and
optionally writes it as JSON (`--output`) and plots it (`--plot`). With
`--compare llama-cpp` the same token ids also run through llama.cpp on the
same GGUF, and every figure gets a jaxinfer / llama.cpp ratio.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jaxinfer.errors import ConfigError

AddFlags = Callable[[argparse.ArgumentParser], None]


def add_bench_commands(parser: argparse.ArgumentParser, model_flags: AddFlags,
                       engine_flags: AddFlags) -> None:
    """The three `bench` modes, each with the model and engine flags of `generate`."""
    modes = parser.add_subparsers(dest="mode", required=True)
    for mode, text in (("latency", "batch-1 prefill and decode times"),
                       ("offline", "throughput of LLM.generate against concurrency"),
                       ("serve", "TTFT/TPOT/ITL and goodput of jaxinfer serve over gRPC")):
        sub = modes.add_parser(mode, help=text)
        model_flags(sub)
        _add_common(sub)
        {"latency": _add_latency, "offline": _add_offline, "serve": _add_serve}[mode](sub)
        engine_flags(sub)
        sub.set_defaults(handler=run_bench)


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


def _add_workload(parser: argparse.ArgumentParser, default: str) -> None:
    group = parser.add_argument_group("workload")
    group.add_argument("--workload", default=default,
                       help="long-prompt-short-answer | short-prompt-long-answer | "
                       f"shared-prefix | mixed | fixed (default {default})")
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
    _add_workload(parser, "mixed")
    parser.add_argument("--concurrency", default=None,
                        help="max_num_seqs values, e.g. 1,8,32,64 (default: the engine's)")


def _add_serve(parser: argparse.ArgumentParser) -> None:
    _add_workload(parser, "mixed")
    parser.add_argument("--server", default=None,
                        help="host:port of jaxinfer serve (default: start one in-process)")
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="Poisson arrivals per second (default inf: all at once)")
    parser.add_argument("--max-concurrency", type=int, default=None,
                        help="requests in flight at most")
    parser.add_argument("--ttft-slo", type=float, default=None, help="TTFT target, ms")
    parser.add_argument("--tpot-slo", type=float, default=None, help="TPOT target, ms")
    parser.add_argument("--timeout", type=float, default=None, help="per-request deadline, s")


def run_bench(args: argparse.Namespace) -> int:
    """Check the flags, run the mode, print the report, write JSON and plot."""
    from jaxinfer.bench import modes
    from jaxinfer.bench.report import add_ratios, print_report, write_json

    check_flags(args)
    report = modes.MODES[args.mode](args)
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
    from jaxinfer.bench.workloads import WORKLOADS

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
