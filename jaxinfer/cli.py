"""The `jaxinfer` command: generate | convert | serve | client | perplexity | bench.

Errors a user can fix (a missing file, a bad setting, a prompt too long) are
printed as one line naming the problem, with exit status 2, not a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jaxinfer.errors import ConfigError, JaxinferError

EXIT_USAGE = 2
# jaxinfer.weights.quantize.QUANTIZATIONS, kept here so --help imports no JAX
QUANTIZATION_CHOICES = ("none", "int8", "w8a8", "int4", "int4-awq")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except JaxinferError as exc:
        print(f"jaxinfer: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxinfer", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    _add_generate(commands.add_parser("generate", help="generate text from a prompt"))
    _add_convert(commands.add_parser("convert", help="convert weights to a jaxinfer checkpoint"))
    _add_serve(commands.add_parser("serve", help="serve a model over gRPC"))
    _add_client(commands.add_parser("client", help="stream a completion from jaxinfer serve"))
    _add_perplexity(commands.add_parser("perplexity", help="perplexity on fixed English texts"))
    _add_bench(commands.add_parser("bench", help="latency, offline and serving benchmarks"))
    return parser


def _add_model_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="gemma3-270m",
                        help="preset name, GGUF file, HF folder or jaxinfer checkpoint")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    _add_quantization_flag(parser)


def load_from_args(args: argparse.Namespace, source: str | None = None,
                   quantization: str | None = None) -> Any:
    """load_model with the model flags (`source`/`quantization` override them)."""
    from jaxinfer.weights import load_model

    return load_model(source or args.model, dtype=args.dtype,
                      load_format=getattr(args, "load_format", "auto"),
                      quantization=quantization or args.quantization,
                      quant_group_size=args.quant_group_size)


def _add_quantization_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quantization", default="none", choices=QUANTIZATION_CHOICES,
                        help="weight format, converted at load (default: none = float); "
                        "w8a8 also quantizes activations in batched steps")
    parser.add_argument("--quant-group-size", type=int, default=128,
                        help="int4 group size along the input dimension (default 128)")


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """EngineConfig settings; unset flags keep the preset's (or the default) value."""
    group = parser.add_argument_group("engine")
    group.add_argument("--engine-preset", default=None,
                       help="configs/engine/<name>.toml, e.g. cpu-offline, cpu-interactive")
    group.add_argument("--max-model-len", type=int, default=None)
    group.add_argument("--max-num-seqs", type=int, default=None)
    group.add_argument("--max-num-batched-tokens", type=int, default=None)
    group.add_argument("--block-size", type=int, default=None)
    group.add_argument("--kv-cache-memory", type=int, default=None,
                       help="bytes for the KV pool (default: fits the batch on CPU, "
                       "90%% of free memory on accelerators)")
    group.add_argument("--attention-impl", default=None,
                       choices=["xla", "pallas", "pallas-interpret"],
                       help="xla (reference, CPU default) or the Pallas kernels")
    group.add_argument("--kv-cache-dtype", default=None, choices=["auto", "int8"],
                       help="auto: the model dtype; int8: int8 K/V with one f32 scale per "
                       "token and head (about 4x the tokens of a float32 cache)")
    group.add_argument("--no-prefix-caching", dest="enable_prefix_caching",
                       action="store_false", default=None)
    group.add_argument("--no-chunked-prefill", dest="enable_chunked_prefill",
                       action="store_false", default=None)


def engine_config_from_args(args: argparse.Namespace, **defaults: object):
    """EngineConfig from --engine-preset, then `defaults`, then explicit flags."""
    from jaxinfer.engine.config import EngineConfig, load_engine_preset

    base = load_engine_preset(args.engine_preset) if args.engine_preset else EngineConfig()
    if not args.engine_preset:
        base = base.replace(**defaults)
    names = ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size",
             "kv_cache_memory", "kv_cache_dtype", "attention_impl", "enable_prefix_caching",
             "enable_chunked_prefill")
    return base.replace(**{name: getattr(args, name) for name in names})


def _add_generate(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the prompt text")
    _add_model_flags(parser)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--logprobs", type=int, default=None, help="top log-probs per token")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    _add_engine_flags(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quiet", action="store_true", help="no timing line on stderr")
    parser.set_defaults(handler=run_generate)


def _add_convert(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="preset name, GGUF file or HF folder")
    parser.add_argument("out", nargs="?", default=None,
                        help="output folder (default: checkpoints/<name>)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    _add_quantization_flag(parser)
    parser.set_defaults(handler=run_convert)


def run_generate(args: argparse.Namespace) -> int:
    from jaxinfer.llm import LLM
    from jaxinfer.sampling import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
        seed=args.seed, stop=tuple(args.stop), logprobs=args.logprobs,
    )
    llm = LLM(loaded=load_from_args(args),
              engine_config=engine_config_from_args(args, max_num_seqs=1))
    if not args.quiet:
        _print_cache(llm.kv_cache_info())
    prompt = args.prompt
    if args.chat:
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    stamps: list[float] = []

    def on_token(_request: object, _output: object, delta: str) -> None:
        stamps.append(time.perf_counter())
        if not args.json:
            print(delta, end="", flush=True)

    start = time.perf_counter()
    output = llm.generate(prompt, params, on_token=on_token)[0]
    if args.json:
        print(json.dumps(_as_json(output), ensure_ascii=False))
    else:
        print()
    if not args.quiet:
        _print_timing(llm.model.load_seconds, start, stamps)
    return 0


def _print_cache(info: dict[str, int | str]) -> None:
    print(f"[KV cache: {info['num_blocks']:,} blocks x {info['block_size']} tokens = "
          f"{info['max_cached_tokens']:,} tokens, {info['dtype']}, "
          f"{info['bytes_per_token']:,} bytes/token, {info['bytes'] / 2**20:,.0f} MiB]",
          file=sys.stderr)


def _as_json(output: object) -> dict[str, object]:
    return {
        "prompt": output.prompt,
        "prompt_token_ids": output.prompt_token_ids,
        "token_ids": output.token_ids,
        "text": output.text,
        "finish_reason": output.finish_reason,
        "logprobs": output.logprobs and [
            {str(k): v for k, v in entry.items()} for entry in output.logprobs
        ],
    }


def _print_timing(load_seconds: float, start: float, stamps: list[float]) -> None:
    """One stderr line: load time, time to first token (incl. compile), decode rate."""
    if not stamps:
        return
    ttft = stamps[0] - start
    line = f"[load {load_seconds:.1f}s, first token {ttft:.2f}s"
    if len(stamps) > 2:  # the first decode step compiles; rate over the rest
        rate = (len(stamps) - 2) / (stamps[-1] - stamps[1])
        line += f", decode {rate:.1f} tok/s over {len(stamps) - 2} tokens"
    print(line + "]", file=sys.stderr)


def run_convert(args: argparse.Namespace) -> int:
    from jaxinfer.weights.orbax_ckpt import save_checkpoint

    loaded = load_from_args(args, source=args.src)
    out = Path(args.out) if args.out else Path("checkpoints") / _folder_name(loaded.config.name)
    start = time.perf_counter()
    save_checkpoint(out, loaded.config, loaded.params, loaded.quantization)
    if loaded.tokenizer is not None:
        loaded.tokenizer.save(out)
    print(f"loaded {loaded.source} ({loaded.kind}) in {loaded.load_seconds:.1f}s; "
          f"wrote {out} in {time.perf_counter() - start:.1f}s")
    return 0


def _add_serve(parser: argparse.ArgumentParser) -> None:
    _add_model_flags(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=50051, help="gRPC port (0 = any free)")
    parser.add_argument("--metrics-port", type=int, default=9090,
                        help="Prometheus /metrics port (0 = any free)")
    parser.add_argument("--no-metrics", action="store_true", help="no metrics endpoint")
    parser.add_argument("--max-waiting", type=int, default=64,
                        help="queued sequences before RESOURCE_EXHAUSTED")
    parser.add_argument("--retry-after-ms", type=int, default=500,
                        help="retry hint sent with RESOURCE_EXHAUSTED")
    parser.add_argument("--shutdown-grace", type=float, default=30.0,
                        help="seconds open streams get to finish on SIGTERM")
    parser.add_argument("--warmup", action="store_true",
                        help="compile every step shape before serving (slow on CPU)")
    _add_engine_flags(parser)
    parser.set_defaults(handler=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    import logging

    from jaxinfer.engine.llm_engine import LLMEngine
    from serve.config import ServerConfig
    from serve.server import run

    log = logging.getLogger("serve")  # server events on stderr, not via the root logger
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    config = ServerConfig(
        host=args.host, port=args.port, metrics_port=None if args.no_metrics else args.metrics_port,
        max_waiting=args.max_waiting, retry_after_ms=args.retry_after_ms,
        shutdown_grace=args.shutdown_grace,
    )
    loaded = load_from_args(args)
    engine = LLMEngine(loaded, engine_config_from_args(args))
    if args.warmup:
        print(f"[warmup: {engine.warmup()} compiled step shapes]", file=sys.stderr)
    return run(engine, config)


def _add_client(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", nargs="?", default=None, help="the prompt text")
    parser.add_argument("--server", default="127.0.0.1:50051", help="host:port of jaxinfer serve")
    parser.add_argument("--token-ids", default=None,
                        help="comma-separated prompt token ids instead of text")
    parser.add_argument("--chat", action="store_true", help="send the prompt as a user message")
    parser.add_argument("--system", default=None, help="a system message (with --chat)")
    parser.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    parser.add_argument("--json", action="store_true", help="print one JSON object at the end")
    group = parser.add_argument_group("sampling")
    for flag, kind in (("max-tokens", int), ("temperature", float), ("top-k", int),
                       ("top-p", float), ("min-p", float), ("repetition-penalty", float),
                       ("presence-penalty", float), ("frequency-penalty", float),
                       ("seed", int), ("n", int), ("logprobs", int)):
        group.add_argument(f"--{flag}", type=kind, default=None)
    group.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    group.add_argument("--stop-token-ids", default=None, help="comma-separated ids")
    group.add_argument("--ignore-eos", action="store_true", default=None)
    parser.set_defaults(handler=run_client)


def run_client(args: argparse.Namespace) -> int:
    from serve.client import run_client as run

    return run(args)


def _add_perplexity(parser: argparse.ArgumentParser) -> None:
    _add_model_flags(parser)
    parser.add_argument("--texts", nargs="+", default=None, metavar="PACKAGE",
                        help="installed packages whose README to score (default: jax "
                        "sentencepiece tokenizers rich msgpack)")
    parser.add_argument("--num-tokens", type=int, default=1024, help="tokens taken from each text")
    parser.add_argument("--max-len", type=int, default=1024, help="window length in tokens")
    parser.add_argument("--stride", type=int, default=None,
                        help="tokens scored per window after the first (default: max-len / 2)")
    parser.add_argument("--all-settings", action="store_true",
                        help="baseline, int8 KV cache, int8, w8a8, int4 and int4-awq in turn")
    parser.add_argument("--compare", choices=["llama-cpp"], default=None,
                        help="also score the same token ids with llama.cpp (GGUF models)")
    _add_engine_flags(parser)
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the report here")
    parser.set_defaults(handler=run_perplexity)


def run_perplexity(args: argparse.Namespace) -> int:
    from jaxinfer import evaluate
    from jaxinfer.bench.report import write_json

    engine = engine_config_from_args(args, max_model_len=args.max_len + 1, max_num_seqs=4)
    if args.all_settings and (args.quantization != "none" or args.kv_cache_dtype is not None):
        raise ConfigError("--all-settings runs every weight and KV cache type; "
                          "drop --quantization and --kv-cache-dtype")
    settings = (list(evaluate.ALL_SETTINGS) if args.all_settings
                else [evaluate.setting_for(args.quantization, engine.kv_cache_dtype)])

    def load(quantization: str) -> object:
        return load_from_args(args, quantization=quantization)

    rows, task = evaluate.score_settings(
        settings, load, engine, texts=args.texts or evaluate.DEFAULT_TEXTS,
        num_tokens=args.num_tokens, max_len=args.max_len, stride=args.stride)
    status = 0
    if args.compare == "llama-cpp":
        try:
            rows.append(evaluate.score_llama_cpp(task, args.model))
        except JaxinferError as exc:  # keep the jaxinfer rows already scored
            print(f"jaxinfer: error: {exc}", file=sys.stderr)
            status = 1
    print(evaluate.format_table(rows, task))
    if args.json:
        write_json(evaluate.report_json(rows, task), Path(args.json))
    return status


def _add_bench(parser: argparse.ArgumentParser) -> None:
    from jaxinfer.bench.cli import add_bench_commands

    add_bench_commands(parser, _add_model_flags, _add_engine_flags)


def _folder_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-._" else "-" for c in name.lower()).strip("-")


if __name__ == "__main__":
    sys.exit(main())
