"""Which kernels each `attention_impl` reaches, and the batched -> ragged adapter.

`pallas-tpu-interpret` runs the ragged TPU kernel under the TPU interpreter
through `ragged_tpu_attention`, which packs the batched rows flat: it must
match the XLA reference on mixed batches (prompt chunks after a cached prefix,
decodes, padding rows, windows, soft-cap, GQA, int8 KV) and give the same
greedy tokens through the engine. `pallas` resolves by platform, and on CPU
is a start-up error that names the interpreted choices.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paged_inputs import LAYER, make_paged_inputs

from jaxinfer import LLM, ConfigError, SamplingParams
from jaxinfer.ops.attention import get_attention_fn, ragged_tpu_attention, xla_attention
from jaxinfer.ops.types import NO_WINDOW, AttentionMetadata
from jaxinfer.weights import load_model

TINY = Path(__file__).parent / "data" / "tiny"
PROMPTS = [[5, 17, 99, 3, 42, 7], [11, 12, 13], [100, 1, 60, 60, 60, 60, 60, 2, 9, 8, 7, 6]]
STATIC = ("block_size", "scale", "softcap")

_xla = jax.jit(xla_attention, static_argnames=STATIC)
_ragged = jax.jit(functools.partial(ragged_tpu_attention, interpret=True),
                  static_argnames=STATIC)


@pytest.mark.parametrize(
    ("window", "softcap", "int8"),
    [(NO_WINDOW, None, False), (5, 30.0, False), (NO_WINDOW, None, True)],
    ids=["global", "window-softcap", "int8"],
)
def test_adapter_matches_the_reference_on_mixed_rows(window: int, softcap, int8: bool) -> None:
    # rows: a chunk after a 21-token prefix, a whole prompt, padding, a decode, a short chunk
    case = make_paged_inputs([37, 9, 0, 20, 12], [16, 9, 0, 1, 3], kv_heads=2, group=2,
                             head_dim=32, block_size=8)
    meta = AttentionMetadata(positions=case.positions, kv_rows=jnp.zeros_like(case.positions),
                             block_tables=case.block_tables, context_lens=case.context_lens)
    pools = case.int8() if int8 else {"k_pool": case.k_pool, "v_pool": case.v_pool}
    outs = [np.asarray(fn(case.q, pools["k_pool"], pools["v_pool"], jnp.int32(LAYER), meta,
                          block_size=case.block_size, scale=case.scale,
                          window=jnp.int32(window), softcap=softcap,
                          k_scale=pools.get("k_scale"), v_scale=pools.get("v_scale")))
            for fn in (_xla, _ragged)]  # [B, T, H, hd]
    for row, n in enumerate(case.q_lens):
        np.testing.assert_allclose(outs[1][row, :n], outs[0][row, :n], atol=2e-5, rtol=2e-5)
        assert not outs[1][row, n:].any(), f"row {row}: padding tokens must come out as zeros"


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_tpu_interpret_engine_generates_what_xla_does(kv_cache_dtype: str) -> None:
    # Tiny Gemma 3: a 4-token sliding window on local layers, GQA (4 heads on 2 KV heads);
    # 8-token steps cut the longest prompt into chunks after a cached prefix.
    model = load_model(TINY / "gemma3")
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outputs = {}
    for impl in ("xla", "pallas-tpu-interpret"):
        llm = LLM(loaded=model, max_model_len=64, max_num_seqs=2, block_size=4,
                  max_num_batched_tokens=8, attention_impl=impl, kv_cache_dtype=kv_cache_dtype)
        outputs[impl] = [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS,
                                                           sampling_params=params)]
    assert outputs["pallas-tpu-interpret"] == outputs["xla"]


def test_pallas_on_cpu_is_a_start_up_error_naming_the_interpreters() -> None:
    model = load_model(TINY / "llama")
    with pytest.raises(ConfigError, match=r"default JAX backend is 'cpu'.*'pallas-interpret'.*"
                                          r"'pallas-tpu-interpret'"):
        LLM(loaded=model, max_model_len=32, attention_impl="pallas")


def test_pallas_resolves_to_the_kernels_of_the_platform() -> None:
    tpu, gpu = get_attention_fn("pallas", "tpu"), get_attention_fn("pallas", "gpu")
    assert tpu.func is ragged_tpu_attention and tpu.keywords == {"interpret": False}
    assert gpu.func.__name__ == "_pallas_attention" and gpu.keywords == {"interpret": False}
    interpreted = get_attention_fn("pallas-tpu-interpret")
    assert interpreted.func is ragged_tpu_attention and interpreted.keywords == {
        "interpret": True}
