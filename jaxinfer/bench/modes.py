"""The latency and offline bench modes, end to end: load, run ours, run llama.cpp,
add rooflines; and the report pieces every mode shares (`serve/bench.py` too).

Each `run_<mode>(args)` returns the report dict (see `report.py`); the
engine comes from the same flags as `jaxinfer generate`/`serve`.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from jaxinfer.args import engine_config_from_args, load_from_args
from jaxinfer.bench.engine_runs import EngineBench
from jaxinfer.bench.latency import run_latency
from jaxinfer.bench.offline import parse_int_list, run_offline
from jaxinfer.bench.report import PEER
from jaxinfer.bench.stats import RequestRecord, median
from jaxinfer.bench.workloads import (
    BenchRequest,
    TokenSource,
    Workload,
    make_workload,
    token_source,
)
from jaxinfer.weights import LoadedModel


def local_token_source(model: LoadedModel) -> TokenSource:
    """Real-text ids from the model's tokenizer (BOS first if it wants one), else random."""
    tok = model.tokenizer
    if tok is None:
        return token_source(None, model.config.vocab_size)
    prefix = [tok.bos_id] if tok.add_bos and tok.bos_id is not None else []
    return token_source(lambda text: tok.encode(text, add_bos=False), model.config.vocab_size,
                        prefix)


@contextlib.contextmanager
def comparison_peer(args: argparse.Namespace) -> Iterator[Any]:
    """llama.cpp on the GGUF when --compare llama-cpp, else None."""
    if not args.compare:
        yield None
        return
    from jaxinfer.bench.llama_cpp_peer import default_gguf, open_peer

    with open_peer(args.gguf or default_gguf(args.model)) as peer:
        yield peer


def report_base(args: argparse.Namespace, model_name: str,
                engine: dict[str, Any]) -> dict[str, Any]:
    return {"mode": args.mode, "model": model_name, "engine": engine, "seed": args.seed}


def _engine_facts(bench: EngineBench) -> dict[str, Any]:
    llm = bench.llm()
    return {"max_model_len": llm.max_model_len, "block_size": llm.engine.config.block_size,
            "max_num_batched_tokens": llm.engine.config.max_num_batched_tokens,
            "attention_impl": llm.engine.config.attention_impl,
            "dtype": str(llm.runner.dtype), "backend": _backend()}


def _backend() -> str:
    import jax

    return jax.default_backend()


def _peaks(args: argparse.Namespace, bench: EngineBench) -> dict[str, Any] | None:
    if not args.roofline:
        return None
    from jaxinfer.bench.roofline import measure_peaks

    return measure_peaks(bench.llm().runner.dtype)


# --------------------------------------------------------------------------- latency


def run_latency_mode(args: argparse.Namespace) -> dict[str, Any]:
    with comparison_peer(args) as peer:
        model = load_from_args(args)
        bench = EngineBench(model, engine_config_from_args(args, max_num_seqs=1))
        report = report_base(args, model.config.name, _engine_facts(bench))
        peaks = _peaks(args, bench)
        settings = {
            "prompt_lens": parse_int_list(args.prompt_lens, "--prompt-lens"),
            "context_lens": parse_int_list(args.context_lens, "--context-lens"),
            "max_model_len": bench.llm().max_model_len, "new_tokens": args.decode_tokens,
            "repeats": args.repeats, "seed": args.seed,
        }
        source = local_token_source(model)
        report["jaxinfer"] = {**run_latency(bench.generate, source, **settings),
                              "load_s": model.load_seconds}
        if peaks is not None:
            report["machine"] = peaks
            report["roofline"] = latency_roofline(bench, report["jaxinfer"], peaks)
        if peer is not None:
            report[PEER] = {**run_latency(peer.generate, source, **settings),
                            "load_s": peer.load_seconds}
    return report


def latency_roofline(bench: EngineBench, ours: dict[str, Any],
                     peaks: dict[str, Any]) -> list[dict[str, Any]]:
    from jaxinfer.bench.roofline import decode_shape, prefill_shape, roofline_line, step_cost

    llm = bench.llm()
    budget = llm.engine.config.max_num_batched_tokens
    lines = []
    for p in ours["prefill"]:
        shape, calls = prefill_shape(llm.runner, p["prompt_len"], budget)
        name = f"prefill {p['prompt_len']} (T={shape.tokens} x{calls})"
        lines.append(roofline_line(name, step_cost(llm.runner, shape), calls,
                                   p["seconds"], peaks))
    for d in ours["decode"]:
        shape = decode_shape(llm.runner, 1, d["context_len"] + d["new_tokens"])
        name = f"decode @{d['context_len']} (b=1, {shape.width} blocks)"
        lines.append(roofline_line(name, step_cost(llm.runner, shape), 1,
                                   d["seconds_per_token"], peaks))
    return lines


# --------------------------------------------------------------------------- offline


def workload_from_args(args: argparse.Namespace, source: TokenSource,
                       max_model_len: int) -> Workload:
    return make_workload(args.workload, source, num_prompts=args.num_prompts,
                         max_model_len=max_model_len, seed=args.seed,
                         input_len=args.input_len, output_len=args.output_len)


def workload_facts(workload: Workload) -> dict[str, Any]:
    prompts = [len(r.prompt_ids) for r in workload.requests]
    outputs = [r.output_len for r in workload.requests]
    return {"name": workload.name, "seed": workload.seed, "num_prompts": len(prompts),
            "input_tokens": sum(prompts), "output_tokens": sum(outputs),
            "prompt_len_median": median(prompts), "prompt_len_max": max(prompts),
            "output_len_median": median(outputs), "output_len_max": max(outputs)}


def run_offline_mode(args: argparse.Namespace) -> dict[str, Any]:
    with comparison_peer(args) as peer:
        model = load_from_args(args)
        config = engine_config_from_args(args)
        concurrencies = (parse_int_list(args.concurrency, "--concurrency")
                         if args.concurrency else [config.max_num_seqs])
        bench = EngineBench(model, config.replace(max_num_seqs=concurrencies[0]))
        report = report_base(args, model.config.name, _engine_facts(bench))
        peaks = _peaks(args, bench)
        workload = workload_from_args(args, local_token_source(model), bench.llm().max_model_len)
        report["workload"] = workload_facts(workload)
        vocab = model.config.vocab_size
        report["jaxinfer"] = {"runs": _offline_with_steps(bench, workload, concurrencies,
                                                          vocab, args.warmup),
                              "load_s": model.load_seconds}
        if peaks is not None:
            report["machine"] = peaks
            report["roofline"] = offline_roofline(bench, workload, report["jaxinfer"]["runs"],
                                                  peaks)
        if peer is not None:
            report[PEER] = {"runs": run_offline(peer.generate, workload, concurrencies, vocab,
                                                args.warmup), "load_s": peer.load_seconds}
    return report


def _offline_with_steps(bench: EngineBench, workload: Workload, concurrencies: list[int],
                        vocab: int, warmup: bool) -> list[dict[str, Any]]:
    """Offline runs, each with the step figures of its timed (last) generate call."""
    steps: dict[int, dict[str, float]] = {}

    def generate(requests: Sequence[BenchRequest],
                 max_seqs: int) -> tuple[list[RequestRecord], float]:
        result = bench.generate(requests, max_seqs)
        steps[max_seqs] = bench.last_steps
        return result

    runs = run_offline(generate, workload, concurrencies, vocab, warmup)
    return [run | steps[run["concurrency"]] for run in runs]


def offline_roofline(bench: EngineBench, workload: Workload, runs: list[dict[str, Any]],
                     peaks: dict[str, Any]) -> list[dict[str, Any]]:
    """A decode line per concurrency, timed by the run's median ITL (one step of about
    `concurrency` sequences at the workload's median total length)."""
    from jaxinfer.bench.roofline import decode_shape, roofline_line, step_cost

    runner = bench.llm().runner
    context = int(median([r.total_len for r in workload.requests]))
    lines = []
    for run in runs:
        batch = min(run["concurrency"], len(workload.requests))
        shape = decode_shape(runner, batch, context)
        name = f"decode b={shape.seqs} @{context} (median ITL, c={run['concurrency']})"
        lines.append(roofline_line(name, step_cost(runner, shape), 1,
                                   run["itl"]["p50"], peaks))
    return lines
