"""`jaxinfer bench`: the report's arithmetic, workloads, and real runs on a tiny model.

Nothing here asserts on speed: timings only have to be positive and consistent
with the counts they were derived from.
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest

from jaxinfer.bench import report as report_mod
from jaxinfer.bench.latency import clip_lengths, run_latency
from jaxinfer.bench.stats import (
    RequestRecord,
    compare,
    meets_slo,
    percentile,
    summarize,
    throughput,
)
from jaxinfer.bench.workloads import (
    WORKLOADS,
    TokenSource,
    make_workload,
    perturbed,
    token_source,
)
from jaxinfer.errors import ConfigError
from jaxinfer.runner import MIN_TOKEN_BUCKET
from serve.bench import arrival_offsets
from serve.cli import main

TINY = Path(__file__).parent / "data" / "tiny" / "llama"
RANDOM = token_source(None, vocab_size=256)
TEXT = TokenSource(tuple(range(10, 5010)), (1,), 6000)  # a stand-in corpus with a BOS


# ------------------------------------------------------------------ arithmetic


def test_percentiles_match_numpy_linear_interpolation() -> None:
    values = [0.3, 0.1, 0.7, 0.2, 0.9, 0.4, 1.5]
    for q in (0, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q))
    summary = summarize(values)
    assert summary["count"] == 7 and summary["mean"] == pytest.approx(np.mean(values))
    assert math.isnan(summarize([])["p50"])


def test_tpot_goodput_and_tokens_per_second() -> None:
    records = [
        RequestRecord(10, 5, ttft=0.1, latency=0.5, itls=[0.1] * 4),  # tpot 0.1: good
        RequestRecord(20, 5, ttft=0.1, latency=1.3, itls=[0.3] * 4),  # tpot 0.3: too slow
        RequestRecord(30, 1, ttft=0.9, latency=0.9),  # ttft over the target
        RequestRecord(40, 1, ttft=0.2, latency=0.2),  # no tpot: passes that test
        RequestRecord(50, 0, None, None, error="UNAVAILABLE: down"),  # counts nowhere
    ]
    assert records[1].tpot == pytest.approx(0.3)
    assert [meets_slo(r, 0.5, 0.2) for r in records] == [True, False, False, True, False]
    result = throughput(records, 2.0, ttft_slo=0.5, tpot_slo=0.2)
    assert result["completed"] == 4 and result["failed"] == 1
    assert result["input_tokens"] == 100 and result["output_tokens"] == 12
    assert result["output_tokens_per_s"] == 12 / 2.0
    assert result["input_tokens_per_s"] == 100 / 2.0
    assert result["requests_per_s"] == 2.0
    assert result["good_requests"] == 2 and result["goodput_requests_per_s"] == 1.0
    assert throughput(records, 2.0)["goodput_requests_per_s"] == 2.0  # no targets


def test_ratios_against_a_fake_llama_cpp_result() -> None:
    def run(c: int, tok_s: float, ttft: float) -> dict:
        latencies = {m: {"p50": ttft, "p99": 2 * ttft} for m in ("ttft", "tpot", "itl")}
        return {"concurrency": c, "requests_per_s": 1.0, "input_tokens_per_s": 10.0,
                "output_tokens_per_s": tok_s, "goodput_requests_per_s": 1.0, **latencies}

    report = {"mode": "offline", "model": "m",
              "jaxinfer": {"runs": [run(8, 300.0, 0.2)], "load_s": 1.0},
              "llama_cpp": {"runs": [run(8, 150.0, 0.1)], "load_s": 2.0}}
    report_mod.add_ratios(report)
    ratios = {r["figure"]: r for r in report["ratios"]}
    tok = ratios["c=8 output tok/s"]
    assert tok["ratio"] == 2.0 and tok["better"] == "higher" and tok["jaxinfer_wins"] is True
    ttft = ratios["c=8 ttft p50 s"]
    assert ttft["ratio"] == 2.0 and ttft["better"] == "lower" and ttft["jaxinfer_wins"] is False
    assert ratios["load s"]["ratio"] == 0.5 and ratios["load s"]["jaxinfer_wins"] is True
    assert ratios["c=8 req/s"]["jaxinfer_wins"] is None  # a tie
    assert compare({"a": (1.0, True)}, {"b": (1.0, True)}) == []  # only shared figures


def test_latency_points_take_the_median_after_the_compile_run() -> None:
    calls = []

    def fake(requests, max_seqs):
        assert max_seqs == 1
        calls.append(requests[0])
        first = len(calls) == 1 or len(calls) == 5  # the compile run of each point
        ttft = 5.0 if first else 0.1 * len(calls)
        itls = [1.0 if first else 0.01] * (requests[0].output_len - 1)
        return [RequestRecord(len(requests[0].prompt_ids), requests[0].output_len, ttft,
                              ttft + sum(itls), itls)], 1.0

    result = run_latency(fake, RANDOM, prompt_lens=[16, 999], context_lens=[999],
                         max_model_len=64, new_tokens=4, repeats=3)
    assert [p["prompt_len"] for p in result["prefill"]] == [16, 63]  # clipped
    first = result["prefill"][0]
    assert first["seconds"] == pytest.approx(0.3)  # median of 0.2, 0.3, 0.4
    assert first["compile_s"] == pytest.approx(4.7)
    assert first["tokens_per_s"] == pytest.approx(16 / 0.3)
    decode = result["decode"][0]
    assert decode["context_len"] == 60 and decode["seconds_per_token"] == pytest.approx(0.01)
    assert [len(r.prompt_ids) for r in calls] == [16] * 4 + [63] * 4 + [60] * 4
    assert clip_lengths([8, 128, 9000], 100) == [8, 100]


# ------------------------------------------------------------------ workloads


@pytest.mark.parametrize("name", WORKLOADS)
def test_workloads_are_seeded_and_fit_the_context(name: str) -> None:
    a = make_workload(name, TEXT, num_prompts=20, max_model_len=512, seed=3)
    assert a == make_workload(name, TEXT, num_prompts=20, max_model_len=512, seed=3)
    assert a != make_workload(name, TEXT, num_prompts=20, max_model_len=512, seed=4)
    assert len(a.requests) == 20
    for r in a.requests:
        assert r.prompt_ids[0] == 1 and r.output_len >= 1 and r.total_len <= 512
        assert all(0 <= i < 6000 for i in r.prompt_ids)


def test_workload_length_shapes() -> None:
    big = 16384
    long = make_workload("long-prompt-short-answer", TEXT, num_prompts=30, max_model_len=big)
    assert all(4096 <= len(r.prompt_ids) <= 8192 + 48 and r.output_len == 20
               for r in long.requests)
    short = make_workload("short-prompt-long-answer", TEXT, num_prompts=30, max_model_len=big)
    assert all(16 <= len(r.prompt_ids) <= 24 and r.output_len == 1000 for r in short.requests)
    small = make_workload("long-prompt-short-answer", TEXT, num_prompts=30, max_model_len=1024)
    assert all(len(r.prompt_ids) <= 1004 for r in small.requests)  # scaled down
    shared = make_workload("shared-prefix", TEXT, num_prompts=10, max_model_len=big)
    prefix = shared.requests[0].prompt_ids[:2048]
    assert all(r.prompt_ids[:2048] == prefix for r in shared.requests)
    assert len({r.prompt_ids for r in shared.requests}) == 10
    mixed = make_workload("mixed", TEXT, num_prompts=400, max_model_len=big)
    lengths = [len(r.prompt_ids) for r in mixed.requests]
    assert max(lengths) > 4 * percentile(lengths, 50)  # heavy tail
    fixed = make_workload("fixed", RANDOM, num_prompts=3, max_model_len=64, input_len=10,
                          output_len=5)
    assert [(len(r.prompt_ids), r.output_len) for r in fixed.requests] == [(10, 5)] * 3


def test_random_ids_without_a_tokenizer_and_the_warmup_look_alike() -> None:
    work = make_workload("mixed", RANDOM, num_prompts=10, max_model_len=128, seed=1)
    assert all(4 <= i < 256 for r in work.requests for i in r.prompt_ids)
    warm = perturbed(work, 256)
    for a, b in zip(work.requests, warm.requests, strict=True):
        assert len(a.prompt_ids) == len(b.prompt_ids) and a.output_len == b.output_len
        assert a.prompt_ids != b.prompt_ids or len(a.prompt_ids) == 0


def test_real_text_corpus_comes_from_the_tokenizer() -> None:
    source = token_source(lambda text: [ord(c) % 200 for c in text[:3000]], 256, [1])
    assert len(source.corpus) >= 8192 and source.prefix == (1,)
    ids = source.prompt(np.random.default_rng(0), 50)
    assert len(ids) == 50 and ids[0] == 1


def test_bad_workload_settings_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="unknown workload 'chat'"):
        make_workload("chat", RANDOM, num_prompts=1, max_model_len=64)
    with pytest.raises(ConfigError, match="num_prompts"):
        make_workload("mixed", RANDOM, num_prompts=0, max_model_len=64)


def test_poisson_arrivals() -> None:
    offsets = arrival_offsets(4000, 20.0, seed=0)
    assert offsets == arrival_offsets(4000, 20.0, seed=0) and offsets[0] == 0.0
    assert all(b >= a for a, b in itertools.pairwise(offsets))
    assert offsets[-1] / 3999 == pytest.approx(1 / 20.0, rel=0.1)
    assert arrival_offsets(3, math.inf) == [0.0, 0.0, 0.0]
    with pytest.raises(ConfigError, match="request-rate"):
        arrival_offsets(3, 0.0)


# ------------------------------------------------------------------ the command


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["offline", "--workload", "chat"], "unknown workload 'chat'"),
        (["serve", "--request-rate", "0"], "--request-rate must be > 0"),
        (["offline", "--concurrency", "1,x"], "--concurrency must be comma-separated"),
        (["offline", "--compare", "vllm"], "--compare must be llama-cpp"),
        (["latency", "--decode-tokens", "1"], "--decode-tokens must be >= 2"),
    ],
)
def test_bad_flags_are_one_line(args: list[str], message: str, capsys) -> None:
    base = ["bench", args[0], "--model", str(TINY), "--no-roofline", *args[1:]]
    assert main(base) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1


def test_missing_llama_cpp_names_the_fix(monkeypatch, capsys) -> None:
    import builtins

    real_import = builtins.__import__

    def no_llama(name, *args, **kwargs):
        if name == "llama_cpp":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_llama)
    assert main(["bench", "latency", "--model", str(TINY), "--compare", "llama-cpp"]) == 2
    assert "pip install 'jaxinfer[llama-cpp]'" in capsys.readouterr().err


# One KV pool shape (and max_num_seqs 4) in both runs, so they share compiled steps.
ENGINE = ["--max-model-len", "32", "--block-size", "16", "--kv-cache-memory", "131072"]


def test_offline_cli_writes_the_report(tmp_path: Path, capsys) -> None:
    out = tmp_path / "offline.json"
    code = main(["bench", "offline", "--model", str(TINY), "--workload", "fixed",
                 "--input-len", "8", "--output-len", "4", "--num-prompts", "4",
                 "--concurrency", "1,4", "--output", str(out), *ENGINE])
    assert code == 0
    printed = capsys.readouterr().out
    assert "output tok/s" in printed and "peak memory" in printed and "roofline" in printed
    report = json.loads(out.read_text())
    assert report["mode"] == "offline" and report["workload"]["output_tokens"] == 16
    assert [r["concurrency"] for r in report["jaxinfer"]["runs"]] == [1, 4]
    for run in report["jaxinfer"]["runs"]:
        assert run["completed"] == 4 and run["failed"] == 0
        assert run["input_tokens"] == 32 and run["output_tokens"] == 16
        assert run["output_tokens_per_s"] == pytest.approx(16 / run["seconds"])
        assert run["ttft"]["count"] == 4 and run["itl"]["count"] == 12
    # one sequence at a time: a prompt step padded to the smallest token bucket, then
    # one single-token step per further token, one call per step
    alone = report["jaxinfer"]["runs"][0]
    assert alone["steps"] == 4 * 4 and alone["device_calls_per_step"] == 1
    assert alone["padding_waste"] == pytest.approx((MIN_TOKEN_BUCKET + 3) / (8 + 3))
    assert "computed/useful tokens" in printed
    assert report["machine"]["memory_gbps"] > 0 and report["machine"]["compute_gflops"] > 0
    lines = report["roofline"]
    assert len(lines) == 2 and all(line["flops"] > 0 and line["bytes"] > 0 for line in lines)
    assert lines[0]["gbps"] == pytest.approx(lines[0]["bytes"] / lines[0]["seconds"] / 1e9)


def test_serve_cli_in_process_over_grpc(tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    code = main(["bench", "serve", "--model", str(TINY), "--workload", "fixed",
                 "--num-prompts", "5", "--input-len", "8", "--output-len", "4",
                 "--request-rate", "50", "--ttft-slo", "600000", "--tpot-slo", "600000",
                 "--no-roofline",
                 "--output", str(out), "--max-num-seqs", "4", *ENGINE])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["engine"]["server"] == "in-process" and report["engine"]["max_num_seqs"] == 4
    run = report["jaxinfer"]["runs"][0]
    assert run["completed"] == 5 and run["failed"] == 0 and run["output_tokens"] == 20
    assert run["input_tokens"] == report["workload"]["input_tokens"]
    assert run["good_requests"] == 5  # generous targets: every request meets them
    assert run["goodput_requests_per_s"] == pytest.approx(run["requests_per_s"])
    assert run["ttft"]["count"] == 5 and run["tpot"]["count"] == 5
    assert len(run["samples"]["itl"]) == 15  # 3 gaps per 4-token stream
    assert run["ttft"]["p50"] <= run["ttft"]["p90"] <= run["ttft"]["p99"]


def test_plot_draws_a_png(tmp_path: Path) -> None:
    from jaxinfer.bench.plot import plot_report

    run = {"concurrency": 1, "output_tokens_per_s": 5.0,
           "samples": {"ttft": [0.1, 0.2], "tpot": [0.01], "itl": [0.01, 0.02]}}
    plot_report({"mode": "offline", "model": "m", "jaxinfer": {"runs": [run]}},
                tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"



def test_step_cost_counts_every_layer_not_one_loop_body() -> None:
    """XLA's cost analysis counts a loop body once; the roofline lowers the step with
    its layer scan unrolled, so a 2-layer model costs about twice one layer."""
    from jaxinfer import LLM
    from jaxinfer.bench.roofline import decode_shape, step_cost, step_lowering

    runner = LLM(TINY, max_model_len=32, block_size=16, kv_cache_memory=131072).runner
    shape = decode_shape(runner, 1, 16)
    looped = step_lowering(runner, shape, unroll_layers=False).compile().cost_analysis()
    looped = looped[0] if isinstance(looped, list) else looped
    assert step_cost(runner, shape)["flops"] > 1.5 * looped["flops"]
