"""Which kernel each `attention_impl` reaches, and the engine through each.

Through the engine, every step is one flat ragged call: decodes beside prompt
chunks (after cached prefixes, mid-block), sliding windows, GQA, int8 KV. The
kernels under their interpreters must give the greedy tokens the XLA reference
gives. `pallas` resolves by platform, and on CPU is a start-up error that names
the interpreted choices.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from jaxinfer import LLM, ConfigError, SamplingParams
from jaxinfer.ops.attention import get_attention_fn, gpu_attention, tpu_attention
from jaxinfer.weights import load_model

TINY = Path(__file__).parent / "data" / "tiny"
PROMPTS = [[5, 17, 99, 3, 42, 7], [11, 12, 13], [100, 1, 60, 60, 60, 60, 60, 2, 9, 8, 7, 6]]
SHARED_PREFIX = [*PROMPTS[2][:8], 30, 31, 32, 33, 34]  # a cache hit of two 4-token blocks


@pytest.fixture(scope="module")
def tiny_gemma3():
    return load_model(TINY / "gemma3")


def greedy_tokens(model, impl: str, kv_cache_dtype: str) -> list[list[int]]:
    """Tiny Gemma 3 (a 4-token sliding window on local layers, GQA: 4 heads on 2 KV
    heads); 8-token steps put decodes beside chunks of the longer prompts, and the
    last prompt starts after a cached prefix of the third."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    llm = LLM(loaded=model, max_model_len=64, max_num_seqs=3, block_size=4,
              max_num_batched_tokens=8, attention_impl=impl, kv_cache_dtype=kv_cache_dtype)
    outputs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)
    outputs += llm.generate(prompt_token_ids=[SHARED_PREFIX], sampling_params=params)
    assert llm.blocks.hit_rate > 0
    return [o.token_ids for o in outputs]


@pytest.mark.parametrize(("impl", "kv_cache_dtype"), [
    ("pallas-tpu-interpret", "auto"), ("pallas-tpu-interpret", "int8"),
    ("pallas-interpret", "auto"),
])
def test_kernels_through_the_engine_generate_what_xla_does(
    tiny_gemma3, impl: str, kv_cache_dtype: str
) -> None:
    assert greedy_tokens(tiny_gemma3, impl, kv_cache_dtype) == greedy_tokens(
        tiny_gemma3, "xla", kv_cache_dtype)


def test_pallas_on_cpu_is_a_start_up_error_naming_the_interpreters() -> None:
    model = load_model(TINY / "llama")
    with pytest.raises(ConfigError, match=r"default JAX backend is 'cpu'.*'pallas-interpret'.*"
                                          r"'pallas-tpu-interpret'"):
        LLM(loaded=model, max_model_len=32, attention_impl="pallas")


def test_pallas_resolves_to_the_kernels_of_the_platform() -> None:
    tpu, gpu = get_attention_fn("pallas", "tpu"), get_attention_fn("pallas", "gpu")
    assert tpu.func is tpu_attention and tpu.keywords == {"interpret": False}
    assert gpu.func is gpu_attention and gpu.keywords == {"interpret": False}
    for impl, fn in (("pallas-tpu-interpret", tpu_attention), ("pallas-interpret", gpu_attention)):
        interpreted = get_attention_fn(impl)
        assert interpreted.func is fn and interpreted.keywords == {"interpret": True}
