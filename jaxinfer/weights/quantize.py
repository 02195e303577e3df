"""Weight quantization at load time (numpy, host side): float matrices -> QuantizedWeight.

Methods (`quantization=`):
- `none`: keep the float weights.
- `int8`: symmetric int8, one scale per output channel, every matrix including the
  embedding / LM head; weight-only, except that the LM head quantizes its input per
  row when it scores two or more rows (see quant.py).
- `w8a8`: the same weights, and batched steps (2+ rows) quantize every matmul's
  activations to int8 too and run int8 x int8 dots (the fastest form on CPU; less
  accurate).
- `int4`: asymmetric int4 in groups of `group_size` inputs (default 128), packed two
  per byte; the embedding / LM head is int8 per channel (as llama.cpp's Q4_K_M keeps
  it at 8 bits): at Gemma's 262k vocabulary it is the most sensitive matrix.
- `int4-awq`: int4 after activation-aware scaling (see `awq.py`).
- `gguf`: a GGUF file's own quant blocks kept exactly (Q8_0, Q5_0, Q6_K as int8 with
  the file's scale per 32 or 16 inputs; Q4_K as int4 with its scales and mins per
  32), weight-only everywhere, so the weights equal the file's bit for bit; tensors
  of other types stay float. Only for GGUF sources.

Matrices are quantized one at a time, over their stacked layer axis at once, so the
host never holds a second float copy of the model. A quantizer also accepts an
`EncodedMatrix` (a GGUF tensor still in its quant blocks, `gguf_quants.GGUFMatrix`),
which converts itself a chunk of rows at a time without a float copy of the tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import jax
import numpy as np

from jaxinfer.choices import QUANTIZATIONS
from jaxinfer.errors import ConfigError
from jaxinfer.model.quant import QuantizedWeight
from jaxinfer.ops import int8

INT8_METHODS = ("int8", "w8a8")
DEFAULT_GROUP_SIZE = 128
LAYER_MATRICES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TOP_MATRICES = ("embed", "lm_head")


@runtime_checkable
class EncodedMatrix(Protocol):
    """A matrix [out, in] held in another compact form, converting itself chunk by chunk."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    def quantize_int8(self) -> QuantizedWeight: ...

    def quantize_int4(self, group_size: int) -> QuantizedWeight: ...

    def dequantize(self, dtype: Any = np.float32) -> np.ndarray: ...

    def exact(self) -> QuantizedWeight: ...


Quantizer = Callable[[str, "np.ndarray | EncodedMatrix"], Any]


def check_quantization(method: str) -> None:
    if method not in QUANTIZATIONS:
        raise ConfigError(
            f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {method!r}"
        )


def quantize_int8(w: np.ndarray, group_size: int | None = None) -> QuantizedWeight:
    """Symmetric int8 of w [..., out, in] (ops/int8.py's rule): per output channel, or per
    group of inputs."""
    w = np.asarray(w, np.float32)
    group = _group_size(w.shape[-1], group_size)
    grouped = w.reshape(*w.shape[:-1], w.shape[-1] // group, group)
    values, scales = int8.quantize_int8(grouped)  # [..., out, G, group], [..., out, G]
    return QuantizedWeight(values=values.reshape(w.shape), scales=scales, bits=8,
                           group_size=group)


def quantize_int4(
    w: np.ndarray, group_size: int = DEFAULT_GROUP_SIZE, act_scale: np.ndarray | None = None
) -> QuantizedWeight:
    """Asymmetric int4 of w [..., out, in] in groups along `in`; `w ≈ u * scale + offset`.

    With `act_scale [..., in]` the stored matrix is w / act_scale (the matmul multiplies
    its input by act_scale), which is what AWQ searches over.
    """
    w = np.asarray(w, np.float32)
    if act_scale is not None:
        w = w / act_scale[..., None, :]
    group = _group_size(w.shape[-1], group_size)
    grouped = w.reshape(*w.shape[:-1], w.shape[-1] // group, group)
    low, high = grouped.min(axis=-1), grouped.max(axis=-1)
    scales = (high - low) / 15.0
    scales = np.where(scales == 0, 1.0, scales).astype(np.float32)
    u = np.clip(np.rint((grouped - low[..., None]) / scales[..., None]), 0, 15).astype(np.uint8)
    u = u.reshape(w.shape)
    packed = u[..., 0::2] | (u[..., 1::2] << 4)
    act = None if act_scale is None else np.asarray(act_scale, np.float32)
    return QuantizedWeight(values=packed, scales=scales, offsets=low.astype(np.float32),
                           act_scale=act, bits=4, group_size=group)


def _group_size(n_in: int, group_size: int | None) -> int:
    """The group along the input axis: per channel for None; must divide `n_in`."""
    if group_size is None or group_size >= n_in:
        return n_in
    if group_size < 2 or group_size % 2 or n_in % group_size:
        raise ConfigError(
            f"quantization group size {group_size} must be even and divide the input "
            f"dimension {n_in}"
        )
    return group_size


def matrix_quantizer(method: str, group_size: int = DEFAULT_GROUP_SIZE) -> Quantizer | None:
    """(name, float or encoded matrix) -> quantized matrix for `method`; None for `none`.

    Norms, biases and other vectors pass through unchanged (an encoded one as f32).
    """
    check_quantization(method)
    if method == "none":
        return None
    if method == "gguf":
        return _keep_exactly

    def quantize(name: str, w: np.ndarray | EncodedMatrix) -> Any:
        encoded = isinstance(w, EncodedMatrix)
        if name in TOP_MATRICES or (name in LAYER_MATRICES and method in INT8_METHODS):
            weight = w.quantize_int8() if encoded else quantize_int8(w)
            # the LM head quantizes its activations in batched steps (quant.py)
            return weight.replace(w8a8=name in TOP_MATRICES or method == "w8a8")
        if name in LAYER_MATRICES:
            group = fitting_group(w.shape[-1], group_size)
            return w.quantize_int4(group) if encoded else quantize_int4(w, group)
        return w.dequantize() if encoded else w

    return quantize


def _keep_exactly(name: str, w: np.ndarray | EncodedMatrix) -> Any:
    """`gguf`: a matrix still in its file blocks stays in them; anything else as it is."""
    if not isinstance(w, EncodedMatrix):
        return w
    return w.exact() if name in (*LAYER_MATRICES, *TOP_MATRICES) else w.dequantize()


def fitting_group(n_in: int, group_size: int) -> int:
    """`group_size` where it divides n_in, else the largest even divisor below it
    (0 stays 0: no groups)."""
    if group_size == 0:
        return 0
    for group in range(min(group_size, n_in), 1, -1):
        if n_in % group == 0 and group % 2 == 0:
            return group
    return n_in


def quantize_params(params: dict[str, Any], quantizer: Quantizer) -> dict[str, Any]:
    """Apply `quantizer` to every weight of a float params pytree (freeing as it goes)."""
    out = {name: quantizer(name, w) for name, w in params.items() if name != "layers"}
    out["layers"] = {name: quantizer(name, w) for name, w in params["layers"].items()}
    return out


def params_nbytes(params: dict[str, Any]) -> int:
    """Bytes of every array in the params pytree, quantized or not."""
    return sum(np.asarray(leaf).nbytes for leaf in jax.tree.leaves(params))
