"""Prefill + incremental decode equal a full recompute, on tiny models of each family.

The Gemma 3 fixture has a 4-token sliding window, so 20 generated tokens
cross it many times; the Llama one has GQA and Llama-3 RoPE scaling.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import full_logits

from jaxinfer import LLM, ConfigError, SamplingParams
from jaxinfer.weights import load_model

TINY = Path(__file__).parent / "data" / "tiny"
PROMPTS = [[5, 17, 99, 3, 42, 7], [11, 12, 13], [100, 1, 60, 60, 60, 60, 60, 2, 9]]
PADDED = 32


def greedy_by_recompute(model, prompt: list[int], steps: int) -> list[int]:
    """Greedy tokens, each from a fresh forward over the whole sequence (no KV cache).

    Sequences are right-padded to one length so the forward compiles once;
    causal attention keeps the padding out of every real position.
    """
    run = jax.jit(full_logits, static_argnums=1)
    ids = list(prompt)
    for _ in range(steps):
        tokens = np.zeros((1, PADDED), np.int32)
        tokens[0, : len(ids)] = ids
        logits = run(model.params, model.config, tokens)
        ids.append(int(np.argmax(np.asarray(logits[0, len(ids) - 1]))))
    return ids[len(prompt):]


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "mistral", "gemma3"])
def test_decode_matches_full_recompute(name: str) -> None:
    model = load_model(TINY / name)
    llm = LLM(loaded=model, max_model_len=64, max_num_seqs=2, block_size=4)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    outputs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        assert output.token_ids == greedy_by_recompute(model, prompt, 20)


def test_bfloat16_weights_and_cache_follow_float32() -> None:
    f32 = load_model(TINY / "gemma3")
    bf16 = load_model(TINY / "gemma3", dtype="bfloat16")
    assert bf16.params["embed"].dtype == jnp.bfloat16
    tokens = np.load(TINY / "gemma3" / "expected.npz")["tokens"]
    a = np.asarray(full_logits(f32.params, f32.config, tokens))
    b = np.asarray(full_logits(bf16.params, bf16.config, tokens))
    assert np.abs(a - b).max() / (a.max() - a.min()) < 2e-2
    llm = LLM(loaded=bf16, max_model_len=32, max_num_seqs=1)
    out = llm.generate(prompt_token_ids=[PROMPTS[0]],
                       sampling_params=SamplingParams(max_tokens=5, temperature=0))[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_length_limit_of_the_context() -> None:
    model = load_model(TINY / "qwen2")
    llm = LLM(loaded=model, max_model_len=12, max_num_seqs=1, block_size=4)
    out = llm.generate(prompt_token_ids=[PROMPTS[0]],
                       sampling_params=SamplingParams(max_tokens=50, temperature=0,
                                                      ignore_eos=True))[0]
    assert out.finish_reason == "length"
    assert len(out.prompt_token_ids) + len(out.token_ids) == 12


def test_a_pool_too_small_for_one_sequence_names_the_setting() -> None:
    model = load_model(TINY / "qwen2")
    per_token = model.config.kv_bytes_per_token(4)
    with pytest.raises(ConfigError, match="raise kv_cache_memory or lower max_model_len"):
        LLM(loaded=model, max_model_len=64, block_size=4, kv_cache_memory=per_token * 60)


def test_a_small_pool_queues_requests_and_keeps_outputs() -> None:
    """Room for one sequence at a time: the others wait, and nothing changes."""
    model = load_model(TINY / "llama")
    per_token = model.config.kv_bytes_per_token(4)
    roomy = LLM(loaded=model, max_model_len=64, max_num_seqs=4, block_size=4)
    tight = LLM(loaded=model, max_model_len=64, max_num_seqs=4, block_size=4,
                kv_cache_memory=per_token * 64)
    assert tight.kv_cache_info()["max_cached_tokens"] == 64
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    expected = roomy.generate(prompt_token_ids=PROMPTS, sampling_params=params)
    got = tight.generate(prompt_token_ids=PROMPTS, sampling_params=params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert tight.blocks.num_free == tight.blocks.num_blocks
