"""The offline API on the real model: sampling settings, stops, log-probs, bad input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import full_logits

from jaxinfer import LLM, ConfigError, RequestError, SamplingParams

PROMPT = "The history of the printing press begins in"


def test_same_seed_same_text_and_different_seeds_differ(gemma_llm: LLM) -> None:
    def run(seed: int) -> list[int]:
        params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, seed=seed)
        return gemma_llm.generate(PROMPT, params)[0].token_ids

    first, again, other = run(7), run(7), run(8)
    assert first == again
    assert first != other


def test_seeded_sample_is_the_same_alone_and_beside_others(gemma_llm: LLM) -> None:
    seeded = SamplingParams(max_tokens=10, temperature=0.8, top_k=40, seed=3)
    alone = gemma_llm.generate(PROMPT, seeded)[0].token_ids
    crowd = gemma_llm.generate(
        [PROMPT, "Hello there", "1, 2, 3,"],
        [seeded, SamplingParams(max_tokens=10, temperature=1.0, seed=9),
         SamplingParams(max_tokens=4, temperature=0.0)],
    )
    assert crowd[0].token_ids == alone
    assert len(crowd[2].token_ids) == 4


def test_max_tokens_and_stop_string(gemma_llm: LLM, reference: dict) -> None:
    greedy_text = reference["cases"]["english"]["greedy_text"]
    stop = "printing press was"  # appears in the greedy continuation
    assert stop in greedy_text
    out = gemma_llm.generate(PROMPT, SamplingParams(max_tokens=48, temperature=0, stop=stop))[0]
    assert out.finish_reason == "stop"
    assert out.text == greedy_text[: greedy_text.index(stop)]
    short = gemma_llm.generate(PROMPT, SamplingParams(max_tokens=3, temperature=0))[0]
    assert short.finish_reason == "length" and len(short.token_ids) == 3


def test_stop_token_ids_end_generation(gemma_llm: LLM, reference: dict) -> None:
    greedy = reference["cases"]["english"]["greedy_ids"]
    params = SamplingParams(max_tokens=48, temperature=0, stop_token_ids=[greedy[5]])
    out = gemma_llm.generate(PROMPT, params)[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == greedy[: greedy.index(greedy[5]) + 1]


def test_logprobs_agree_with_full_forward(gemma_llm: LLM, gemma) -> None:
    params = SamplingParams(max_tokens=4, temperature=0, logprobs=3, prompt_logprobs=0)
    out = gemma_llm.generate(PROMPT, params)[0]
    ids = out.prompt_token_ids + out.token_ids
    logits = full_logits(jax.tree.map(jnp.asarray, gemma.params), gemma.config,
                         jnp.array([ids]))[0]
    logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    n = len(out.prompt_token_ids)
    for step, entry in enumerate(out.logprobs):
        token = out.token_ids[step]
        assert len(entry) == 3 and max(entry, key=entry.get) == token  # greedy = top-1
        for token_id, value in entry.items():
            assert value == pytest.approx(logp[n - 1 + step, token_id], abs=1e-4)
    assert out.prompt_logprobs[0] is None
    for t in range(1, n):
        (token_id, value), = out.prompt_logprobs[t].items()
        assert token_id == ids[t]
        assert value == pytest.approx(logp[t - 1, ids[t]], abs=1e-4)


def test_penalties_change_greedy_output(gemma_llm: LLM, reference: dict) -> None:
    greedy = reference["cases"]["code"]["greedy_ids"]  # repeats `elif n ==` a lot
    params = SamplingParams(max_tokens=48, temperature=0, repetition_penalty=1.5,
                            ignore_eos=True)
    out = gemma_llm.generate(prompt_token_ids=[reference["cases"]["code"]["prompt_ids"]],
                             sampling_params=params)[0]
    assert out.token_ids != greedy
    assert len(set(out.token_ids)) > len(set(greedy))


def test_chat_template_prompt(gemma_llm: LLM, reference: dict) -> None:
    case = reference["cases"]["chat"]
    text = gemma_llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a haiku about autumn leaves."}])
    assert gemma_llm.tokenizer.encode(text) == case["prompt_ids"]


def test_no_recompilation_for_new_lengths_and_settings(gemma_llm: LLM) -> None:
    gemma_llm.generate("Warm up the buckets", SamplingParams(max_tokens=3, temperature=0))
    before = gemma_llm.runner.compile_count
    gemma_llm.generate("A different prompt length here!", SamplingParams(
        max_tokens=3, temperature=0.7, top_k=5, top_p=0.8, min_p=0.05, seed=1,
        presence_penalty=0.5, frequency_penalty=0.2, repetition_penalty=1.1))
    gemma_llm.generate("Short", SamplingParams(max_tokens=3, temperature=1.3, seed=2))
    assert gemma_llm.runner.compile_count == before


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"top_p": 0.0}, "top_p"), ({"temperature": -1.0}, "temperature"),
     ({"max_tokens": 0}, "max_tokens"), ({"n": 0}, "n")],
)
def test_impossible_sampling_settings_are_named(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        SamplingParams(**kwargs)


def test_bad_prompts_are_rejected_without_harm(gemma_llm: LLM) -> None:
    with pytest.raises(RequestError, match="max_model_len"):
        gemma_llm.generate(prompt_token_ids=[[2] * 5000])
    with pytest.raises(RequestError, match="empty"):
        gemma_llm.generate(prompt_token_ids=[[]])
    with pytest.raises(RequestError, match="vocabulary"):
        gemma_llm.generate(prompt_token_ids=[[2, 300000]])
    out = gemma_llm.generate(PROMPT, SamplingParams(max_tokens=2, temperature=0))[0]
    assert len(out.token_ids) == 2  # the engine still serves after the rejections
