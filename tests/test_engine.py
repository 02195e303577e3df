"""The engine on tiny models: chunking, prefix caching, preemption, abort, seeds,
compilations, the asyncio face and the Prometheus metrics."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import jax
import pytest
from prometheus_client import generate_latest

from jaxinfer import LLM, SamplingParams
from jaxinfer.engine.async_engine import AsyncLLMEngine
from jaxinfer.engine.config import EngineConfig, load_engine_preset
from jaxinfer.engine.llm_engine import LLMEngine
from jaxinfer.engine.metrics import PrometheusMetrics
from jaxinfer.errors import ConfigError
from jaxinfer.weights import load_model

TINY = Path(__file__).parent / "data" / "tiny"
SHARED = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79, 50, 28]
PROMPTS = [SHARED + [i, i + 1, i + 2][: 1 + i % 3] for i in range(6)] + [list(range(40, 70))]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llama():
    return load_model(TINY / "llama")


def engine_llm(model, **settings) -> LLM:
    base = dict(max_model_len=64, max_num_seqs=4, block_size=4)
    return LLM(loaded=model, **(base | settings))


@pytest.fixture(scope="module")
def baseline(llama) -> list[list[int]]:
    """Each prompt alone, no prefix cache, no chunking."""
    llm = engine_llm(llama, max_num_seqs=1, enable_prefix_caching=False,
                     enable_chunked_prefill=False)
    return [llm.generate(prompt_token_ids=[p], sampling_params=GREEDY)[0].token_ids
            for p in PROMPTS]


def run(llm: LLM, params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)]


@pytest.mark.parametrize(
    "settings",
    [
        {"enable_prefix_caching": False},
        {"enable_prefix_caching": True},
        {"max_num_batched_tokens": 8},  # chunked prefill
        {"kv_cache_memory": 64},  # bytes-per-token x 64 tokens, set below: preemption
    ],
    ids=["batched", "prefix-cache", "chunked", "tiny-pool"],
)
def test_batch_invariance(llama, baseline, settings: dict) -> None:
    if "kv_cache_memory" in settings:
        settings = {"kv_cache_memory": llama.config.kv_bytes_per_token(4) * 64}
    llm = engine_llm(llama, **settings)
    assert run(llm) == baseline
    stats = llm.engine.snapshot()
    if "kv_cache_memory" in settings:
        assert stats["preemptions"] > 0
    if settings.get("enable_prefix_caching"):
        # the first four share a step; the next two reuse the 16-token shared prefix
        assert llm.engine.blocks.hit_tokens == 32 and stats["prefix_cache_hit_rate"] > 0.2


def test_prefix_cache_reports_cached_tokens(llama) -> None:
    llm = engine_llm(llama)
    _, second = llm.generate(prompt_token_ids=PROMPTS[:2], sampling_params=GREEDY)
    again = llm.generate(prompt_token_ids=[PROMPTS[1]], sampling_params=GREEDY)[0]
    assert again.metrics.cached_tokens == 16  # four full 4-token blocks of the prompt
    assert again.token_ids == second.token_ids


def test_seeded_sampling_with_penalties_survives_preemption(llama) -> None:
    params = [SamplingParams(max_tokens=30, temperature=1.0, seed=i, repetition_penalty=1.3,
                             frequency_penalty=0.5, ignore_eos=True) for i in range(len(PROMPTS))]
    roomy = engine_llm(llama).generate(prompt_token_ids=PROMPTS, sampling_params=params)
    tight = engine_llm(llama, kv_cache_memory=llama.config.kv_bytes_per_token(4) * 64)
    squeezed = tight.generate(prompt_token_ids=PROMPTS, sampling_params=params)
    assert tight.engine.snapshot()["preemptions"] > 0
    assert [o.token_ids for o in squeezed] == [o.token_ids for o in roomy]


def test_same_seed_same_tokens_in_any_crowd(llama) -> None:
    seeded = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=42, ignore_eos=True)
    llm = engine_llm(llama)
    alone = llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=seeded)[0].token_ids
    others = [SamplingParams(max_tokens=8 + i, temperature=1.2, seed=i) for i in range(5)]
    crowd = llm.generate(prompt_token_ids=PROMPTS[:6], sampling_params=[seeded, *others])
    assert crowd[0].token_ids == alone


def test_parallel_samples_share_the_prompt(llama) -> None:
    llm = engine_llm(llama)
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=5, n=3, ignore_eos=True)
    out = llm.generate(prompt_token_ids=[PROMPTS[-1]], sampling_params=params)[0]
    assert len(out.outputs) == 3 and len({tuple(o.token_ids) for o in out.outputs}) == 3
    assert llm.engine.blocks.hit_tokens >= 2 * 28  # siblings reuse 7 full prompt blocks


def test_abort_frees_blocks_and_spares_the_others(llama, baseline) -> None:
    engine = LLMEngine(llama, EngineConfig(max_model_len=64, max_num_seqs=4, block_size=4))
    victim = engine.add_request("victim", prompt_token_ids=PROMPTS[0], params=GREEDY)
    keeper = engine.add_request("keeper", prompt_token_ids=PROMPTS[1], params=GREEDY)
    for _ in range(3):
        engine.step()
    engine.abort("victim")
    deltas = engine.step()
    assert victim.finish_reason == "abort" and any(d.request_id == "victim" for d in deltas)
    assert not victim.outputs[0].token_ids[4:]  # nothing after the abort
    while engine.has_unfinished():
        engine.step()
    assert keeper.token_ids == baseline[1]
    assert engine.blocks.num_used == 0


def test_deltas_are_values_and_outputs_do_not_share_engine_state(llama, baseline) -> None:
    engine = LLMEngine(llama, EngineConfig(max_model_len=64, max_num_seqs=4, block_size=4))
    output = engine.add_request("r", prompt_token_ids=PROMPTS[0], params=GREEDY)
    deltas = engine.step()
    output.outputs[0].token_ids.clear()  # the caller's list: the sequence must not notice
    while engine.has_unfinished():
        deltas += engine.step()
    assert [t for d in deltas for t in d.token_ids] == baseline[0]
    assert all(isinstance(d.token_ids, tuple) for d in deltas)
    with pytest.raises(dataclasses.FrozenInstanceError):
        deltas[0].text = "changed"  # type: ignore[misc]
    assert [d.request_finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    assert all(d.usage is None for d in deltas[:-1])
    usage = deltas[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(PROMPTS[0]), len(baseline[0]))


def test_no_compilation_after_warmup(llama) -> None:
    llm = engine_llm(llama, max_num_batched_tokens=32)
    compiled = llm.engine.warmup()
    settings = [SamplingParams(max_tokens=5 + i, temperature=t, top_k=k, top_p=p, seed=i,
                               presence_penalty=0.3 * i)
                for i, (t, k, p) in enumerate([(0, 0, 1), (0.7, 5, 0.9), (1.3, 0, 0.5)])]
    for count in (1, 2, 3):
        prompts = [list(range(1, 2 + 17 * (i + 1))) for i in range(count)]
        llm.generate(prompt_token_ids=prompts, sampling_params=settings[:count])
    assert llm.runner.compile_count == compiled


def test_engine_presets() -> None:
    assert load_engine_preset("cpu-offline").max_num_seqs == 64
    with pytest.raises(ConfigError, match="cpu-offline"):
        load_engine_preset("nope")
    with pytest.raises(ConfigError, match="max_num_seqs"):
        EngineConfig(max_num_seqs=0)


def test_async_streams_cancel_and_metrics(llama, baseline) -> None:
    engine = LLMEngine(llama, EngineConfig(max_model_len=64, max_num_seqs=4, block_size=4))
    metrics = PrometheusMetrics(engine.snapshot, engine.stats)
    front = AsyncLLMEngine(engine)

    async def collect(index: int) -> list[int]:
        tokens = []
        async for delta in front.generate(prompt_token_ids=PROMPTS[index], params=GREEDY):
            tokens += delta.token_ids
        return tokens

    async def cancelled() -> int:
        seen = 0
        async for delta in front.generate(prompt_token_ids=PROMPTS[2], params=GREEDY):
            seen += len(delta.token_ids)
            if seen == 3:
                break  # leaving the stream aborts the request
        return seen

    async def main() -> tuple:
        return await asyncio.gather(collect(0), collect(1), cancelled())

    try:
        first, second, seen = asyncio.run(main())
        assert (first, second, seen) == (baseline[0], baseline[1], 3)
        for _ in range(100):  # the abort lands at the next step
            if engine.blocks.num_used == 0 and not engine.has_unfinished():
                break
            asyncio.run(asyncio.sleep(0.02))
        assert engine.blocks.num_used == 0 and front.num_open_streams == 0
        text = generate_latest(metrics.registry).decode()
        assert "jaxinfer_kv_blocks_used 0.0" in text
        assert 'jaxinfer_requests_finished_total{finish_reason="abort"} 1.0' in text
        assert 'jaxinfer_requests_finished_total{finish_reason="length"} 2.0' in text
        assert "jaxinfer_request_ttft_seconds_count 3.0" in text  # the aborted one too
    finally:
        front.shutdown()


@pytest.fixture
def device_executions(monkeypatch) -> list[int]:
    """A one-item list counting every compiled-program execution from now on.

    JAX runs a warm jitted call through a C++ fast path that Python never sees;
    turning that path off (and dropping the caches that hold it) sends every
    execution through `ExecuteReplicated.__call__`, which is counted. Both are
    JAX internals (jax 0.10): if they move, this fixture fails loudly.
    """
    from jax._src import pjit
    from jax._src.interpreters import pxla

    count = [0]
    execute = pxla.ExecuteReplicated.__call__

    def counted(self, *args, **kwargs):
        count[0] += 1
        return execute(self, *args, **kwargs)

    monkeypatch.setattr(pjit, "_get_fastpath_data", lambda *args, **kwargs: None)
    monkeypatch.setattr(pxla.ExecuteReplicated, "__call__", counted)
    jax.clear_caches()
    yield count
    jax.clear_caches()  # drop programs compiled without their fast path


def test_one_device_execution_per_step(llama, device_executions: list[int]) -> None:
    """Decodes beside prompt chunks (chunked, after cached prefixes): every step with
    work is exactly one device execution, whatever its mix."""
    llm = engine_llm(llama, max_num_batched_tokens=8)
    engine = llm.engine
    for i, prompt in enumerate([*PROMPTS[:3], PROMPTS[6], PROMPTS[0] + [7, 7, 7]]):
        engine.add_request(f"r{i}", prompt_token_ids=prompt, params=GREEDY)
    mixes = set()
    while engine.has_unfinished():
        running = engine.schedulers[0].running
        decodes = any(not s.in_prefill for s in running)
        mixes.add((decodes, any(s.in_prefill for s in running)))
        before = device_executions[0]
        engine.step()
        calls = device_executions[0] - before
        assert calls == 1, f"{calls} device executions in one step"
    assert (True, True) in mixes  # some step ran decodes and prompt chunks together
    assert engine.blocks.hit_rate > 0
    stats = engine.stats
    assert stats.device_calls == stats.steps
