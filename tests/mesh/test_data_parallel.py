"""Data parallelism on 8 CPU devices: replicas (each possibly split by tensor
parallelism) serve their own sequences from their own KV pools in one step, and
generate exactly what one device does."""

from __future__ import annotations

from pathlib import Path

import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.weights import load_model

TINY = Path(__file__).parents[1] / "data" / "tiny"
PROMPTS = [[5, 17, 99, 3, 42, 7], [11, 12, 13], [100, 1, 60, 60, 60, 60, 60, 2, 9, 8, 7, 6],
           [5, 17, 99, 3, 42, 7, 8, 9, 10], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50],
           [7] * 20]
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def engine(model, **settings) -> LLM:
    base = dict(max_model_len=64, max_num_seqs=2, block_size=4, max_num_batched_tokens=16)
    return LLM(loaded=model, **(base | settings))


def generate(llm: LLM, params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)]


@pytest.fixture(scope="module")
def llama():
    return load_model(TINY / "llama")


@pytest.fixture(scope="module")
def llama_single(llama) -> list[list[int]]:
    return generate(engine(llama))


@pytest.mark.parametrize(("dp", "tp"), [(2, 1), (4, 1), (2, 2), (2, 4)])
def test_replicas_generate_what_one_device_does(llama, llama_single, dp: int, tp: int) -> None:
    llm = engine(llama, data_parallel_size=dp, tensor_parallel_size=tp)
    assert generate(llm) == llama_single
    assert llm.engine.stats.device_calls == llm.engine.stats.steps  # one call for all ranks
    assert all(blocks.num_used == 0 for blocks in llm.blocks.ranks)


def test_each_rank_holds_its_own_pool_and_takes_a_share(llama) -> None:
    llm = engine(llama, data_parallel_size=2, tensor_parallel_size=2)
    runner = llm.runner
    rows = runner.kv.k.shape[1]
    assert rows == 2 * runner.num_blocks * 4
    assert runner.kv.k.addressable_shards[0].data.shape[1:3] == (rows // 2, 1)  # rank, head
    for i, prompt in enumerate(PROMPTS[:4]):
        llm.engine.add_request(f"r{i}", prompt_token_ids=prompt, params=GREEDY)
    assert [len(s.waiting) for s in llm.engine.schedulers] == [2, 2]
    while llm.engine.has_unfinished():
        llm.engine.step()
    lengths = [len(p) for p in PROMPTS[:4]]  # each rank's block manager saw its two prompts
    assert [r.queried_tokens for r in llm.blocks.ranks] == [lengths[0] + lengths[2],
                                                            lengths[1] + lengths[3]]


def test_sampling_penalties_and_prefix_hits_per_rank(llama) -> None:
    params = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=5,
                            repetition_penalty=1.3, logprobs=2)
    want = generate(engine(llama), params)
    llm = engine(llama, data_parallel_size=2)
    assert generate(llm, params) == want
    assert generate(llm, params) == want  # again: prefix-cache hits start penalty history
    assert llm.blocks.hit_rate > 0


@pytest.mark.parametrize(("dp", "tp"), [(2, 1), (2, 2)])
def test_real_gemma3_replicas_match_hf(gemma, reference: dict, dp: int, tp: int) -> None:
    cases = [c for c in reference["cases"].values() if len(c["prompt_ids"]) <= 32]
    llm = LLM(loaded=gemma, max_model_len=128, max_num_seqs=4, data_parallel_size=dp,
              tensor_parallel_size=tp)
    params = SamplingParams(max_tokens=reference["new_tokens"], temperature=0, ignore_eos=True)
    outputs = llm.generate(prompt_token_ids=[c["prompt_ids"] for c in cases],
                           sampling_params=params)
    for case, output in zip(cases, outputs, strict=True):
        assert output.token_ids == case["greedy_ids"], (dp, tp, case["prompt"][:40])
