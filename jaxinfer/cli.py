"""The engine's commands: generate | convert | perplexity | bench latency | bench offline.

The `jaxinfer` console command is `serve.cli`, which adds the commands that
start or talk to a server (serve, client, bench serve) to these: `serve` sits
above `jaxinfer`, so nothing here may import it. `python -m jaxinfer.cli`
runs the engine's commands alone; `main(argv, commands)` runs any list.

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

from jaxinfer.args import (
    Command,
    add_compilation_cache_flag,
    add_engine_flags,
    add_model_flags,
    add_quantization_flags,
    enable_compilation_cache,
    engine_config_from_args,
    load_from_args,
)
from jaxinfer.bench.cli import BENCH_MODES, bench_command
from jaxinfer.choices import DTYPE_NAMES
from jaxinfer.errors import ConfigError, JaxinferError

EXIT_USAGE = 2


def main(argv: Sequence[str] | None = None, commands: Sequence[Command] | None = None) -> int:
    """Parse `argv` against `commands` (default: this module's) and run the handler."""
    parser = build_parser(COMMANDS if commands is None else commands)
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except JaxinferError as exc:
        print(f"jaxinfer: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


def build_parser(commands: Sequence[Command] | None = None) -> argparse.ArgumentParser:
    commands = COMMANDS if commands is None else commands
    names = " | ".join(command.name for command in commands)
    parser = argparse.ArgumentParser(prog="jaxinfer",
                                     description=f"The `jaxinfer` command: {names}.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for command in commands:
        command.add_arguments(subparsers.add_parser(command.name, help=command.help))
    return parser


def _add_generate(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the prompt text")
    add_model_flags(parser)
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
    add_engine_flags(parser)
    add_compilation_cache_flag(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quiet", action="store_true", help="no timing line on stderr")
    parser.set_defaults(handler=run_generate)


def _add_convert(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="preset name, GGUF file or HF folder")
    parser.add_argument("out", nargs="?", default=None,
                        help="output folder (default: checkpoints/<name>)")
    parser.add_argument("--dtype", default="float32", choices=DTYPE_NAMES)
    add_quantization_flags(parser)
    parser.set_defaults(handler=run_convert)


def run_generate(args: argparse.Namespace) -> int:
    from jaxinfer.llm import LLM
    from jaxinfer.sampling import SamplingParams

    enable_compilation_cache(args)
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
          f"{info['bytes_per_token']:,} bytes/token, {info['bytes'] / 2**20:,.0f} MiB"
          f"{_per_device(info)}]", file=sys.stderr)


def _per_device(info: dict[str, int | str]) -> str:
    devices = int(info["devices"])
    return f" per device on {devices} devices" if devices > 1 else ""


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


def _add_perplexity(parser: argparse.ArgumentParser) -> None:
    add_model_flags(parser)
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
    add_engine_flags(parser)
    add_compilation_cache_flag(parser)
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the report here")
    parser.set_defaults(handler=run_perplexity)


def run_perplexity(args: argparse.Namespace) -> int:
    from jaxinfer import evaluate
    from jaxinfer.bench.report import write_json

    enable_compilation_cache(args)
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


def _folder_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-._" else "-" for c in name.lower()).strip("-")


GENERATE = Command("generate", "generate text from a prompt", _add_generate)
CONVERT = Command("convert", "convert weights to a jaxinfer checkpoint", _add_convert)
PERPLEXITY = Command("perplexity", "perplexity on fixed English texts", _add_perplexity)
COMMANDS = (GENERATE, CONVERT, PERPLEXITY, bench_command(BENCH_MODES))


if __name__ == "__main__":
    sys.exit(main())
