"""One short check of the Pallas kernels on the accelerator at hand (GPU or TPU).

    python scripts/gpu_check.py --out results.json
    python scripts/gpu_check.py --interpret   # CPU smoke run: both kernels, interpreters

On an NVIDIA GPU:
1. Compiles the ragged Triton kernel for real (interpret=False) and compares
   it with the jnp reference and a float64 oracle on random inputs, built by
   tests/ragged_inputs.py as in the tests.
2. Times a decode-heavy and a prefill-heavy ragged batch and pure decode at
   batch 64, context 4,096 (Gemma 3 270M's heads), kernel against the XLA
   reference, with the achieved bandwidth: K/V bytes read / time.
3. Runs `LLM.generate` with dummy Gemma 3 270M weights under both
   attention implementations (each step one flat ragged call) and reports
   decode tokens/s for each.
4. With more than one device: dummy Llama 3.2 1B weights on one device and
   split over all of them (tensor parallel): tokens/s each, greedy agreement.
On a TPU: steps 1 and 2 for the ragged Mosaic kernel, and 4.
With --interpret (any machine): steps 1 and 2 for both ragged kernels under
their interpreters, on batches a tenth the size; the timings then mean nothing.
Everything is written to one JSON file (and printed).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.ops.types import NO_WINDOW
from pallas_kernels.ragged_gpu import ragged_paged_attention_gpu
from pallas_kernels.ragged_reference import ragged_paged_attention_reference
from pallas_kernels.ragged_tpu import ragged_paged_attention_tpu

# The kernel tests' input builder: the checks use the same layouts the CPU tests do.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from ragged_inputs import LAYER, Case, dense_attention, make_case

RAGGED_KERNELS = {"gpu": ragged_paged_attention_gpu, "tpu": ragged_paged_attention_tpu}
RAGGED_CASES = [  # (sequences as (query length, context), builder options, window, softcap)
    ([(1, 37), (300, 300), (1, 130), (1, 1)], {"head_dim": 128}, NO_WINDOW, None),
    ([(20, 45), (5, 21), (1, 17), (16, 16)],
     {"kv_heads": 2, "group": 8, "dtype": jnp.bfloat16}, 16, None),
    ([(1, 700), (64, 200), (1, 33)], {"head_dim": 256, "int8": True}, 512, 30.0),
    ([(1, 90), (40, 40)], {"kv_heads": 2, "group": 1, "dtype": jnp.bfloat16}, NO_WINDOW, None),
]
RAGGED_BATCHES = {  # (count, query length, context) groups of Gemma 3 270M-shaped sequences
    "decode_heavy": [(64, 1, 2048), (1, 256, 2048)],
    "prefill_heavy": [(4, 1024, 1024), (8, 1, 1024)],
    "decode_b64_4k": [(64, 1, 4096)],
}


def timed(fn: Callable[[], jax.Array], repeats: int = 20) -> float:
    """Median seconds of `fn` after one warm-up call."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def ragged_call(fn: Callable, case: Case, window: int,
                softcap: float | None) -> Callable[[], jax.Array]:
    """`fn` on the case, jitted once: call it to run it again."""
    attend = jax.jit(lambda q, k, v, metadata, scales, w: fn(
        q, k, v, jnp.int32(LAYER), *metadata, block_size=case.block_size, scale=case.scale,
        window=w, softcap=softcap, **scales))
    args = (case.q, case.k_pool, case.v_pool, case.metadata, case.scales(), jnp.int32(window))
    return lambda: attend(*args)


def check_ragged(kernel: Callable) -> list[dict]:
    """The compiled ragged kernel against the XLA reference and the float64 oracle."""
    results = []
    for seqs, options, window, softcap in RAGGED_CASES:
        case = make_case(seqs, **options)
        oracle = dense_attention(case, window, softcap)
        outputs = {name: np.asarray(ragged_call(fn, case, window, softcap)().astype(jnp.float32),
                                    np.float64)
                   for name, fn in (("kernel", kernel), ("xla", ragged_paged_attention_reference))}
        errors = {f"{name}_vs_oracle": float(np.abs(out - oracle).max())
                  for name, out in outputs.items()}
        errors["kernel_vs_xla"] = float(np.abs(outputs["kernel"] - outputs["xla"]).max())
        tol = 1e-4 if case.q.dtype == jnp.float32 else 3e-2
        results.append({"seqs": seqs, "dtype": case.q.dtype.name,
                        **{k: v for k, v in options.items() if k != "dtype"},
                        "window": int(window), "softcap": softcap, **errors,
                        "ok": max(errors.values()) < tol})
    return results


def time_ragged(kernel: Callable, groups: list[tuple[int, int, int]], shrink: int,
                repeats: int) -> dict:
    """One ragged batch (contexts and chunks divided by `shrink`): kernel vs XLA reference."""
    seqs = [(max(1, n // shrink), max(1, c // shrink)) for count, n, c in groups
            for _ in range(count)]
    case = make_case(seqs, dtype=jnp.bfloat16, head_dim=256)  # Gemma 3 270M: 4 heads, 1 KV
    context = sum(c for _, c in seqs)
    kv_bytes = 2 * context * case.k_pool.shape[2] * case.k_pool.shape[3] * 2  # bf16 K and V
    result = {"sequences": len(seqs), "tokens": int(case.q.shape[0]),
              "context_tokens": context, "kv_bytes": kv_bytes}
    for name, fn in (("pallas", kernel), ("xla", ragged_paged_attention_reference)):
        seconds = timed(ragged_call(fn, case, NO_WINDOW, None), repeats)
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


def bench_tensor_parallel() -> dict:
    """Dummy Llama 3.2 1B shapes (bf16) on one device and split over every device (a
    power of two, at most 8): tokens/s each, and how many greedy outputs agree."""
    from jaxinfer import LLM, SamplingParams
    from jaxinfer.weights import load_model

    shards = 1 << (min(jax.device_count(), 8).bit_length() - 1)
    model = load_model("llama-3.2-1b", load_format="dummy", dtype="bfloat16")
    prompts = [[1, *range(100, 300 + 7 * i)] for i in range(16)]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    result: dict = {"tensor_parallel_size": shards}
    outputs = {}
    for size in (1, shards):
        llm = LLM(loaded=model, max_model_len=1024, max_num_seqs=16, attention_impl="pallas",
                  tensor_parallel_size=size)
        llm.generate(prompt_token_ids=prompts[:2], sampling_params=params)  # compile
        start = time.perf_counter()
        done = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        seconds = time.perf_counter() - start
        result[f"tp{size}_output_tok_s"] = sum(len(o.token_ids) for o in done) / seconds
        outputs[size] = [o.token_ids for o in done]
        del llm
    result["greedy_outputs_equal"] = sum(
        a == b for a, b in zip(outputs[1], outputs[shards], strict=True))
    result["outputs"] = len(prompts)
    return result


def ragged_steps(target: str, interpret: bool) -> list[tuple[str, Callable[[], object]]]:
    """Check and time the ragged kernel for `target` ("gpu" or "tpu")."""
    kernel = RAGGED_KERNELS[target]
    if interpret:
        kernel = functools.partial(kernel, interpret=True)
    shrink, repeats = (10, 2) if interpret else (1, 20)
    return [(f"ragged_{target}", lambda: check_ragged(kernel)),
            *[(f"ragged_{target}_{name}",
               lambda groups=groups: time_ragged(kernel, groups, shrink, repeats))
              for name, groups in RAGGED_BATCHES.items()]]


def plan(platform: str, interpret: bool) -> list[tuple[str, Callable[[], object]]]:
    """The steps for this machine: see the module docstring."""
    if interpret:
        return ragged_steps("gpu", True) + ragged_steps("tpu", True)
    split = [("tensor_parallel", bench_tensor_parallel)] if jax.device_count() > 1 else []
    if platform == "tpu":
        return ragged_steps("tpu", False) + split
    if platform == "gpu":
        return [*ragged_steps("gpu", False), ("dummy_model", bench_dummy_model), *split]
    return []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu_check.json"))
    parser.add_argument("--interpret", action="store_true",
                        help="run the ragged kernels under their CPU interpreters (smoke run)")
    args = parser.parse_args()
    platform = jax.devices()[0].platform
    report = {"devices": [str(d) for d in jax.devices()], "jax": jax.__version__,
              "interpret": args.interpret}
    steps = plan(platform, args.interpret)
    if not steps:
        report["skipped"] = (f"no GPU or TPU here (platform {platform!r}): nothing compiles "
                             "for real; --interpret runs a smoke check under the interpreters")
        print(report["skipped"], flush=True)
        args.out.write_text(json.dumps(report, indent=1))
    for name, step in steps:
        try:
            report[name] = step()
        except Exception as exc:  # keep going: one failed step must not hide the others
            report[name] = {"error": f"{type(exc).__name__}: {exc}"}
        print(name, json.dumps(report[name], indent=1), flush=True)
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
