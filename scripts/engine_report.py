"""Measure the engine's three serving figures on the real Gemma 3 270M (CPU).

    python scripts/engine_report.py [--quick]

1. Chunked prefill: while 8 streams decode, a ~4k-token prompt arrives; the
   longest inter-token gap of the 8 streams, with chunking on and off.
2. Prefix cache: TTFT of a request with a ~2k-token system prompt, cold and
   then warm (same system prompt, different question), and the hit rate.
3. Offline throughput: 64 prompts x 128 new tokens through the engine, against
   the one-at-a-time loop (max_num_seqs=1) timed on a subset in the same run.
Each measurement runs twice and reports the second run, so compilation (shared
by all engines in the process) is not timed. Results are printed as JSON.
Timings are wall-clock on a shared machine: compare the figures of one run
with each other, not across runs.
"""

from __future__ import annotations

import argparse
import json
import time

from jaxinfer import LLM, SamplingParams
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.llm_engine import LLMEngine
from jaxinfer.weights import load_model

GREEDY_IGNORE_EOS = dict(temperature=0.0, ignore_eos=True)


def long_text(tokens: int, tokenizer) -> list[int]:
    words = ("The archive holds letters, maps and ledgers from the river trade; "
             "each entry notes a date, a cargo and a name. ")
    ids = tokenizer.encode(words * (tokens // 20 + 1))
    return ids[:tokens]


def chunked_prefill_gap(model, chunk_budget: int | None, prompt_tokens: int) -> dict:
    """Longest gap between tokens of 8 decoding streams when a long prompt arrives."""
    budget = chunk_budget or 8192
    engine = LLMEngine(model, EngineConfig(
        max_model_len=prompt_tokens + 512, max_num_seqs=9, max_num_batched_tokens=budget,
        enable_chunked_prefill=chunk_budget is not None, enable_prefix_caching=False))
    params = SamplingParams(max_tokens=64, **GREEDY_IGNORE_EOS)
    streams = [engine.add_request(prompt_token_ids=[2, 100 + i, 200 + i], params=params)
               for i in range(8)]
    for _ in range(6):  # streams are decoding; compile the decode shapes
        engine.step()
    long_prompt = long_text(prompt_tokens, model.tokenizer)
    engine.add_request(prompt_token_ids=long_prompt,
                       params=SamplingParams(max_tokens=4, **GREEDY_IGNORE_EOS))
    arrival = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    gaps = [gap for s in streams for t, gap in zip(s.metrics.token_times[1:], s.metrics.itls,
                                                   strict=True) if t > arrival]
    return {"chunk_budget": chunk_budget, "longest_gap_s": max(gaps),
            "median_gap_s": sorted(gaps)[len(gaps) // 2]}


def prefix_cache_ttft(model, system_tokens: int) -> dict:
    llm = LLM(loaded=model, max_model_len=system_tokens + 256, max_num_seqs=2)
    system = long_text(system_tokens, model.tokenizer)
    params = SamplingParams(max_tokens=1, **GREEDY_IGNORE_EOS)
    other = [2, *([5, 6, 7, 8] * (system_tokens // 4))][:system_tokens]
    for prompt in ([*other, 9, 9], [*other, 9, 9, 9]):  # compile the cold and the hit shapes
        llm.generate(prompt_token_ids=[prompt], sampling_params=params)
    cold = llm.generate(prompt_token_ids=[[*system, 111, 112]], sampling_params=params)[0]
    warm = llm.generate(prompt_token_ids=[[*system, 113, 114, 115]], sampling_params=params)[0]
    return {"system_tokens": system_tokens, "cold_ttft_s": cold.metrics.ttft,
            "warm_ttft_s": warm.metrics.ttft, "speedup": cold.metrics.ttft / warm.metrics.ttft,
            "warm_cached_tokens": warm.metrics.cached_tokens,
            "hit_rate": llm.engine.blocks.hit_rate}


def throughput(model, num_prompts: int, new_tokens: int, serial_subset: int) -> dict:
    prompts = [[2, *range(1000 + 13 * i, 1000 + 13 * i + 20 + i % 17)] for i in range(num_prompts)]
    params = SamplingParams(max_tokens=new_tokens, **GREEDY_IGNORE_EOS)
    result = {}
    for name, seqs, subset in (("engine", num_prompts, prompts),
                               ("one_at_a_time", 1, prompts[:serial_subset])):
        llm = LLM(loaded=model, max_model_len=512, max_num_seqs=seqs)
        start = time.perf_counter()
        outputs = llm.generate(prompt_token_ids=subset, sampling_params=params, use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = sum(len(o.token_ids) for o in outputs)
        result[name] = {"prompts": len(subset), "tokens": tokens, "seconds": seconds,
                        "tokens_per_s": tokens / seconds, "compiles": llm.runner.compile_count}
    result["ratio"] = result["engine"]["tokens_per_s"] / result["one_at_a_time"]["tokens_per_s"]
    return result


def twice(measure, *args):
    """Run once to compile every shape, then again to time it."""
    measure(*args)
    return measure(*args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    args = parser.parse_args()
    model = load_model("gemma3-270m")
    long_prompt, system, prompts, new, subset = (
        (1024, 512, 16, 32, 2) if args.quick else (4096, 2048, 64, 128, 4))
    report = {
        "chunked_prefill": [twice(chunked_prefill_gap, model, 512, long_prompt),
                            twice(chunked_prefill_gap, model, None, long_prompt)],
        "prefix_cache": prefix_cache_ttft(model, system),
        "throughput": twice(throughput, model, prompts, new, subset),
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
