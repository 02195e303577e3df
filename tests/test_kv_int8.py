"""int8 KV cache: writing, the reference on int8 pools, the engine, sizing.

The int8 rule itself (round trip, zero vectors) is tested in test_int8.py; the
ragged kernels on int8 pools (and NaN scales in unread rows) in
test_ragged_attention.py. Pools here come from tests/ragged_inputs.py: a
shuffled, non-contiguous block table and a second layer of noise. The int8
reference must equal the float reference run on the dequantized pool, and stay
within a bound derived from the quantization step of the float one.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ragged_inputs import LAYER, Case, make_case

from jaxinfer import LLM, ConfigError, SamplingParams
from jaxinfer.args import engine_config_from_args
from jaxinfer.engine.config import EngineConfig, load_engine_preset
from jaxinfer.model.config import ModelConfig
from jaxinfer.model.transformer import init_kv_cache, kv_bytes_per_token
from jaxinfer.ops.attention import write_kv_int8
from jaxinfer.ops.int8 import dequantize_int8, quantize_int8
from jaxinfer.ops.types import NO_WINDOW
from jaxinfer.runner import ModelRunner
from jaxinfer.weights import load_model
from jaxinfer.weights.dummy import dummy_params
from pallas_kernels.ragged_reference import ragged_paged_attention_reference
from serve.cli import build_parser

TINY = Path(__file__).parent / "data" / "tiny"
KERNEL_TOL = 1e-5  # f32: kernels and reference do the same math on int8 pools
STATIC = ("block_size", "scale", "softcap")

_reference = jax.jit(ragged_paged_attention_reference, static_argnames=STATIC)


# ----------------------------------------------------------------- writing


def test_write_kv_int8_scatters_values_and_scales_and_drops_padding() -> None:
    pool = jnp.zeros((2, 8, 1, 4), jnp.int8)
    scales = jnp.zeros((2, 8, 1), jnp.float32)
    new = jnp.arange(1.0, 9.0).reshape(2, 1, 4)  # [T, KV, hd]
    pool, scales = write_kv_int8(pool, scales, jnp.int32(1), new, jnp.array([5, 99]))
    values, scale = quantize_int8(new[0])
    np.testing.assert_array_equal(pool[1, 5], values)
    np.testing.assert_array_equal(scales[1, 5], scale)
    assert int(jnp.count_nonzero(pool)) == 4 and int(jnp.count_nonzero(scales)) == 1


# ----------------------------------------------------------------- attention


def attend(case: Case, window: int, **pools: jax.Array | None) -> np.ndarray:
    """The XLA reference on `case` (or on `pools` in its place) -> [T, H, hd] float64."""
    pools = {"k_pool": case.k_pool, "v_pool": case.v_pool, **case.scales(), **pools}
    out = _reference(case.q, pools.pop("k_pool"), pools.pop("v_pool"), jnp.int32(LAYER),
                     *case.metadata, block_size=case.block_size, scale=case.scale,
                     window=jnp.int32(window), softcap=None, **pools)
    return np.asarray(out, np.float64)


def quantization_bound(case: Case) -> float:
    """Worst-case |int8 - float| attention output, from the quantization step.

    K error per element <= s_k / 2 moves every score by at most
    d = scale * max ||q||_1 * max s_k / 2; softmax then moves p by at most
    (e^{2d} - 1) in l1, which moves the output by that times max |v|. V error
    adds at most max s_v / 2 (p sums to 1).
    """
    s_k = float(jnp.abs(case.k_pool[LAYER]).max()) / 127
    s_v = float(jnp.abs(case.v_pool[LAYER]).max()) / 127
    d = case.scale * float(jnp.abs(case.q).sum(-1).max()) * s_k / 2
    return float(np.expm1(2 * d)) * float(jnp.abs(case.v_pool[LAYER]).max()) + s_v / 2


@pytest.mark.parametrize("window", [NO_WINDOW, 20])
def test_reference_int8_pool_is_the_float_reference_on_dequantized_values(window: int) -> None:
    """int8 attention == float attention over the dequantized pool, and within the
    quantization bound of float attention over the unquantized one. (The kernels
    against the reference on int8 pools: test_ragged_attention.py.)"""
    seqs = [(16, 37), (1, 64), (5, 5)]  # a chunk after a prefix, a decode, a whole prompt
    exact, quantized = make_case(seqs, kv_heads=2), make_case(seqs, kv_heads=2, int8=True)
    got = attend(quantized, window)
    dequantized = attend(quantized, window, k_scale=None, v_scale=None,
                         k_pool=dequantize_int8(quantized.k_pool, quantized.k_scale),
                         v_pool=dequantize_int8(quantized.v_pool, quantized.v_scale))
    np.testing.assert_allclose(got, dequantized, atol=KERNEL_TOL, rtol=0)
    error = np.abs(got - attend(exact, window)).max()
    assert error <= quantization_bound(exact), (error, quantization_bound(exact))
    assert error < 0.05  # what the bound allows is far from what happens: ~0.01 here


# ----------------------------------------------------------------- engine


PROMPTS = [[5, 17, 99, 3, 42, 7], [11, 12, 13], [100, 1, 60, 60, 60, 60, 60, 2, 9]]


@pytest.fixture(scope="module")
def llama() -> object:
    return load_model(TINY / "llama")


def test_engine_with_int8_cache_follows_the_float_cache(llama) -> None:
    """Greedy tokens, prompt log-probs (prefill attends through the cache it just
    wrote) and sampled-token log-probs (decode) of an int8 cache against a float one.

    Bound: every log-prob within 0.15 nats (a probability ratio within e^0.15,
    16%), 0.05 on average. An int8 element is off by at most 1/254 of its
    vector's max, about twice a bfloat16 cache's relative error; measured on
    this model: max 0.073, mean 0.02 nats, and all 60 greedy tokens agree.
    """
    settings = {"max_model_len": 32, "max_num_seqs": 4, "block_size": 4}
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=0,
                            prompt_logprobs=0)
    runs = {}
    for dtype in ("auto", "int8"):
        llm = LLM(loaded=llama, kv_cache_dtype=dtype, **settings)
        runs[dtype] = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)
    assert llm.runner.kv.k.dtype == jnp.int8 and llm.kv_cache_info()["dtype"] == "int8"
    want, got = ([o.token_ids for o in runs[d]] for d in ("auto", "int8"))
    same = sum(a == b for w, g in zip(want, got, strict=True) for a, b in zip(w, g, strict=True))
    assert same / sum(map(len, want)) >= 0.9, (want, got)
    first_diff = [next((i for i, (a, b) in enumerate(zip(w, g, strict=True)) if a != b), len(w))
                  for w, g in zip(want, got, strict=True)]
    a, b = (_scores(runs[d], first_diff) for d in ("auto", "int8"))
    assert np.abs(a - b).max() <= 0.15 and np.abs(a - b).mean() <= 0.05, np.abs(a - b).max()


def _scores(outputs, agreed: list[int]) -> np.ndarray:
    """Prompt log-probs, then the sampled-token log-probs up to the first disagreement."""
    prompt = [v for o in outputs for entry in o.prompt_logprobs[1:] for v in entry.values()]
    sampled = [v for o, n in zip(outputs, agreed, strict=True)
               for entry in o.outputs[0].logprobs[:n] for v in entry.values()]
    return np.array(prompt + sampled)


# ----------------------------------------------------------------- sizing and settings


def test_bytes_per_token_and_blocks_for_a_fixed_budget() -> None:
    """head_dim 256: int8 takes 2 L KV (256 + 4) bytes a token, f32 2 L KV 1024,
    so a fixed kv_cache_memory holds 1024 / 260 = 3.94x the blocks."""
    config = ModelConfig(architecture="llama", vocab_size=32, d_model=32, num_layers=2,
                         num_heads=2, num_kv_heads=1, head_dim=256, ffn_dim=32, max_position=64)
    assert kv_bytes_per_token(config, jnp.float32, "auto") == 2 * 2 * 1 * 256 * 4
    assert kv_bytes_per_token(config, jnp.bfloat16, "auto") == 2 * 2 * 1 * 256 * 2
    assert kv_bytes_per_token(config, jnp.float32, "int8") == 2 * 2 * 1 * (256 + 4)
    assert init_kv_cache(config, 16, jnp.float32, "int8").nbytes == 16 * 2 * 2 * (256 + 4)
    params = dummy_params(config)
    budget = 2**20
    runners = {dtype: ModelRunner(config, params, EngineConfig(
        max_model_len=64, kv_cache_memory=budget, kv_cache_dtype=dtype).cache_config())
        for dtype in ("auto", "int8")}
    auto, int8 = runners["auto"], runners["int8"]
    assert auto.num_blocks == budget // (4096 * 16) and int8.num_blocks == budget // (1040 * 16)
    assert int8.num_blocks / auto.num_blocks == pytest.approx(1024 / 260, rel=0.02)
    assert int8.kv_bytes <= budget and int8.kv_bytes == int8.num_blocks * 16 * 1040


def test_kv_cache_dtype_setting_is_validated_everywhere(llama) -> None:
    assert EngineConfig().kv_cache_dtype == "auto"
    assert load_engine_preset("cpu-offline").kv_cache_dtype == "auto"
    for make in (lambda: EngineConfig(kv_cache_dtype="fp8"),
                 lambda: EngineConfig().replace(kv_cache_dtype="fp8"),
                 lambda: LLM(loaded=llama, max_model_len=32, kv_cache_dtype="fp8")):
        with pytest.raises(ConfigError, match="kv_cache_dtype must be one of auto, int8"):
            make()


@pytest.mark.parametrize("command", [["generate", "hi"], ["serve"]])
def test_cli_kv_cache_dtype_flag(command: list[str], capsys) -> None:
    parser = build_parser()
    args = parser.parse_args([*command, "--kv-cache-dtype", "int8"])
    assert engine_config_from_args(args).kv_cache_dtype == "int8"
    preset = parser.parse_args([*command, "--engine-preset", "cpu-offline",
                                "--kv-cache-dtype", "int8"])
    assert engine_config_from_args(preset).kv_cache_dtype == "int8"
    assert engine_config_from_args(parser.parse_args(command)).kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args([*command, "--kv-cache-dtype", "fp8"])
    assert "--kv-cache-dtype: invalid choice: 'fp8'" in capsys.readouterr().err
