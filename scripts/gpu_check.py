"""One short GPU check of the Pallas kernels, for a machine with an NVIDIA GPU.

    python scripts/gpu_check.py --out results.json

1. Compiles the flash-prefill and paged-decode kernels for real (interpret=False)
   and compares them with the jnp reference on random paged inputs (built by
   tests/paged_inputs.py, as in the kernel tests).
2. Times decode attention at batch 64, context 4,096 (Gemma 3 270M shapes and a
   Llama-like GQA shape) against the XLA reference, and reports the achieved
   HBM bandwidth: K/V bytes read / time.
3. Runs `LLM.generate` with dummy Gemma 3 270M weights under both
   attention implementations and reports decode tokens/s for each.
Everything is written to one JSON file (and printed).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.ops.types import NO_WINDOW
from pallas_kernels.flash_prefill import flash_prefill_attention
from pallas_kernels.paged_decode import paged_decode_attention
from pallas_kernels.reference import paged_attention_reference

# The kernel tests' input builder: the GPU checks the same layouts the CPU tests do.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from paged_inputs import LAYER, PagedInputs, make_paged_inputs


def paged_inputs(batch: int, q_len: int, context: int, heads: int, kv_heads: int,
                 head_dim: int, dtype: jnp.dtype) -> PagedInputs:
    """`batch` rows of `context` tokens each, running their last `q_len`."""
    return make_paged_inputs([context] * batch, [q_len] * batch, kv_heads=kv_heads,
                             group=heads // kv_heads, head_dim=head_dim, dtype=dtype)


def timed(fn: Callable[[], jax.Array], repeats: int = 20) -> float:
    """Median seconds of `fn` after one warm-up call."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def check_kernels() -> list[dict]:
    results = []
    cases = [  # (kernel, q_len, context, heads, kv_heads, head_dim, window, dtype)
        (flash_prefill_attention, 128, 300, 4, 1, 256, NO_WINDOW, jnp.float32),
        (flash_prefill_attention, 64, 200, 8, 2, 128, 48, jnp.bfloat16),
        (paged_decode_attention, 1, 1000, 4, 1, 256, NO_WINDOW, jnp.float32),
        (paged_decode_attention, 1, 777, 8, 1, 64, 100, jnp.bfloat16),
    ]
    for kernel, q_len, context, heads, kv_heads, hd, window, dtype in cases:
        p = paged_inputs(4, q_len, context, heads, kv_heads, hd, dtype)
        args = (p.q, p.k_pool, p.v_pool, LAYER, *p.paging)
        kwargs = dict(block_size=p.block_size, scale=p.scale, window=window)
        got = jax.jit(lambda *a, kernel=kernel, kw=kwargs: kernel(*a, **kw))(*args)
        want = paged_attention_reference(*args, **kwargs)
        error = float(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32)).max())
        results.append({"kernel": kernel.__name__, "q_len": q_len, "context": context,
                        "heads": heads, "kv_heads": kv_heads, "head_dim": hd,
                        "window": int(window), "dtype": jnp.dtype(dtype).name,
                        "max_abs_error": error,
                        "ok": error < (1e-4 if dtype == jnp.float32 else 2e-2)})
    return results


def time_decode(heads: int, kv_heads: int, head_dim: int, dtype: jnp.dtype) -> dict:
    batch, context = 64, 4096
    p = paged_inputs(batch, 1, context, heads, kv_heads, head_dim, dtype)
    kwargs = dict(block_size=p.block_size, scale=p.scale, window=NO_WINDOW)
    pallas = jax.jit(lambda *a: paged_decode_attention(*a, **kwargs))
    xla = jax.jit(lambda *a: paged_attention_reference(*a, **kwargs))
    kv_bytes = 2 * batch * context * kv_heads * head_dim * jnp.dtype(dtype).itemsize
    result = {"batch": batch, "context": context, "heads": heads, "kv_heads": kv_heads,
              "head_dim": head_dim, "dtype": jnp.dtype(dtype).name, "kv_bytes": kv_bytes}
    for name, fn in (("pallas", pallas), ("xla", xla)):
        seconds = timed(lambda fn=fn: fn(p.q, p.k_pool, p.v_pool, LAYER, *p.paging))
        result[f"{name}_ms"] = seconds * 1e3
        result[f"{name}_GBps"] = kv_bytes / seconds / 1e9
    return result


def bench_dummy_model() -> dict:
    from jaxinfer import LLM, SamplingParams
    from jaxinfer.weights import load_model

    model = load_model("gemma3-270m", load_format="dummy", dtype="bfloat16")
    prompts = [[2, *range(100, 300 + 7 * i)] for i in range(32)]
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    result = {}
    for impl in ("xla", "pallas"):
        llm = LLM(loaded=model, max_model_len=1024, max_num_seqs=32, attention_impl=impl)
        llm.generate(prompt_token_ids=prompts[:2], sampling_params=params)  # compile
        start = time.perf_counter()
        outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        seconds = time.perf_counter() - start
        result[f"{impl}_output_tok_s"] = sum(len(o.token_ids) for o in outputs) / seconds
        result[f"{impl}_compiles"] = llm.runner.compile_count
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu_check.json"))
    args = parser.parse_args()
    report = {"devices": [str(d) for d in jax.devices()], "jax": jax.__version__}
    steps = (("kernels", check_kernels),
             ("decode_gemma3", lambda: time_decode(4, 1, 256, jnp.bfloat16)),
             ("decode_gqa8", lambda: time_decode(32, 8, 128, jnp.bfloat16)),
             ("dummy_model", bench_dummy_model))
    for name, step in steps:
        try:
            report[name] = step()
        except Exception as exc:  # keep going: one failed step must not hide the others
            report[name] = {"error": f"{type(exc).__name__}: {exc}"}
        print(name, json.dumps(report[name], indent=1), flush=True)
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
