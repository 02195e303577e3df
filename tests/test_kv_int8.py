"""int8 KV cache: writing, the reference and both Pallas kernels, the engine, sizing.

The int8 rule itself (round trip, zero vectors) is tested in test_int8.py.

Pools here come from tests/paged_inputs.py, as in test_paged_decode.py and
test_flash_prefill.py: a shuffled, non-contiguous block table and a second layer of noise.
The kernels (interpret mode) must match the reference on int8 pools within
float rounding (same math: the scales are folded into the scores and into p).
The int8 reference must equal the float reference run on the dequantized pool,
and stay within a bound derived from the quantization step of the float one.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paged_inputs import LAYER, PagedInputs, make_paged_inputs

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
from pallas_kernels.flash_prefill import flash_prefill_attention
from pallas_kernels.paged_decode import paged_decode_attention
from pallas_kernels.reference import paged_attention_reference
from serve.cli import build_parser

TINY = Path(__file__).parent / "data" / "tiny"
KERNEL_TOL = 1e-5  # f32: kernels and reference do the same math on int8 pools
STATIC = ("block_size", "scale", "softcap")

_reference = jax.jit(paged_attention_reference, static_argnames=STATIC)
_decode = jax.jit(functools.partial(paged_decode_attention, interpret=True),
                  static_argnames=(*STATIC, "num_splits"))
_prefill = jax.jit(functools.partial(flash_prefill_attention, interpret=True),
                   static_argnames=STATIC)


# ----------------------------------------------------------------- writing


def test_write_kv_int8_scatters_values_and_scales_and_drops_padding() -> None:
    pool = jnp.zeros((2, 8, 1, 4), jnp.int8)
    scales = jnp.zeros((2, 8, 1), jnp.float32)
    new = jnp.arange(1.0, 9.0).reshape(1, 2, 1, 4)  # [B, T, KV, hd]
    pool, scales = write_kv_int8(pool, scales, jnp.int32(1), new, jnp.array([[5, 99]]))
    values, scale = quantize_int8(new[0, 0])
    np.testing.assert_array_equal(pool[1, 5], values)
    np.testing.assert_array_equal(scales[1, 5], scale)
    assert int(jnp.count_nonzero(pool)) == 4 and int(jnp.count_nonzero(scales)) == 1


# ----------------------------------------------------------------- attention


def attend(fn, case: PagedInputs, window: int, softcap: float | None = None,
           **pools) -> np.ndarray:
    pools = pools or {"k_pool": case.k_pool, "v_pool": case.v_pool}
    out = fn(case.q, pools.pop("k_pool"), pools.pop("v_pool"), jnp.int32(LAYER), *case.paging,
             block_size=case.block_size, scale=case.scale, window=jnp.int32(window),
             softcap=softcap, **pools)
    return np.asarray(out, np.float64)


def real(out: np.ndarray, case: PagedInputs) -> np.ndarray:
    """The real query slots of every row, concatenated -> [N, H, hd]."""
    return np.concatenate([out[row, :n] for row, n in enumerate(case.q_lens)])


def quantization_bound(case: PagedInputs) -> float:
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
    case = make_paged_inputs([37, 64, 5], [16, 16, 5], kv_heads=2, max_blocks=4)
    pools = case.int8()
    got = real(attend(_reference, case, window, **pools), case)
    dequantized = replace(
        case, k_pool=dequantize_int8(pools["k_pool"], pools["k_scale"]),
        v_pool=dequantize_int8(pools["v_pool"], pools["v_scale"]),
    )
    np.testing.assert_allclose(got, real(attend(_reference, dequantized, window), case),
                               atol=KERNEL_TOL, rtol=0)
    error = np.abs(got - real(attend(_reference, case, window), case)).max()
    assert error <= quantization_bound(case), (error, quantization_bound(case))
    assert error < 0.05  # what the bound allows is far from what happens: ~0.01 here


@pytest.mark.parametrize(
    ("ctx", "window", "num_splits", "softcap"),
    [([37, 16, 64, 1], NO_WINDOW, 1, None), ([40, 17, 64, 0], 8, 2, None),
     ([33, 5, 64, 48], NO_WINDOW, 4, 5.0)],
    ids=["global", "window-split2", "softcap-split4-padding"],
)
def test_paged_decode_kernel_reads_int8_pools(ctx, window, num_splits, softcap) -> None:
    case = make_paged_inputs(ctx, kv_heads=2, max_blocks=4)  # decode: one query per row
    got = attend(_decode, case, window, softcap, num_splits=num_splits, **case.int8())
    want = attend(_reference, case, window, softcap, **case.int8())
    live = np.asarray(ctx) > 0
    np.testing.assert_allclose(got[live], want[live], atol=KERNEL_TOL, rtol=0)
    assert not got[~live].any()  # padding rows: zeros, never NaN


@pytest.mark.parametrize(
    ("ctx", "q_lens", "window", "softcap"),
    [([48, 21], [48, 5], NO_WINDOW, None), ([64, 45], [16, 45], 10, None),
     ([40, 64], [40, 30], 33, 5.0)],
    ids=["prompt-and-chunk", "window", "softcap"],
)
def test_flash_prefill_kernel_reads_int8_pools(ctx, q_lens, window, softcap) -> None:
    case = make_paged_inputs(ctx, q_lens, seq=48, head_dim=128, max_blocks=4)
    got = real(attend(_prefill, case, window, softcap, **case.int8()), case)
    want = real(attend(_reference, case, window, softcap, **case.int8()), case)
    np.testing.assert_allclose(got, want, atol=KERNEL_TOL, rtol=0)


def test_nan_scales_in_unread_rows_are_ignored() -> None:
    """NaN scales (and extreme int8 values) in blocks outside the window, rows past the
    context and unused blocks: both kernels and the reference still give the clean result."""
    case = make_paged_inputs([40, 17], max_blocks=4)
    window = 8
    clean = case.int8()
    tables = np.asarray(case.block_tables)
    block = case.block_size
    read = {tables[b, p // block] * block + p % block
            for b, c in enumerate(np.asarray(case.context_lens))
            for p in range(max(0, c - window), c)}
    unread = np.array([r for r in range(case.k_pool.shape[1]) if r not in read])
    poisoned = {name: np.array(array) for name, array in clean.items()}
    for name in ("k_scale", "v_scale"):
        poisoned[name][LAYER, unread] = np.nan
    for name in ("k_pool", "v_pool"):
        poisoned[name][LAYER, unread] = 127
    poisoned = {name: jnp.asarray(array) for name, array in poisoned.items()}
    want = attend(_reference, case, window, **clean)
    for fn in (_reference, _decode, _prefill):
        got = attend(fn, case, window, **poisoned)
        assert np.isfinite(got).all(), fn
        np.testing.assert_allclose(got, want, atol=KERNEL_TOL, rtol=0)


def test_kernels_reject_scales_without_int8_pools() -> None:
    case = make_paged_inputs([5], kv_heads=2, max_blocks=4)
    pools = case.int8()
    with pytest.raises(ValueError, match="k_scale"):
        attend(paged_attention_reference, case, NO_WINDOW, k_pool=pools["k_pool"],
               v_pool=pools["v_pool"])
    with pytest.raises(ValueError, match="k_scale"):
        attend(paged_decode_attention, case, NO_WINDOW, k_scale=pools["k_scale"],
               v_scale=pools["v_scale"], k_pool=case.k_pool, v_pool=case.v_pool)


@pytest.mark.parametrize("kernel", [paged_decode_attention, flash_prefill_attention])
def test_int8_kernels_lower_through_pallas_triton(kernel) -> None:
    """The int8 path stays inside Pallas' Triton lowering (no GPU needed)."""
    s = jax.ShapeDtypeStruct
    t = 1 if kernel is paged_decode_attention else 40
    pool, scales = (2, 256, 1, 256), (2, 256, 1)
    paging = (s((2, t), jnp.int32), s((2, 6), jnp.int32), s((2,), jnp.int32))
    fn = jax.jit(functools.partial(kernel, block_size=16, scale=0.1, softcap=30.0))
    traced = fn.trace(s((2, t, 4, 256), jnp.bfloat16), s(pool, jnp.int8), s(pool, jnp.int8),
                      s((), jnp.int32), *paging, window=s((), jnp.int32),
                      k_scale=s(scales, jnp.float32), v_scale=s(scales, jnp.float32))
    assert "triton" in traced.lower(lowering_platforms=("cuda",)).as_text()


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
