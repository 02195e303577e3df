"""GGUF quant blocks read straight into integers and scales, a chunk of rows at a time.

`gguf.quants.dequantize` turns a whole tensor into f32 (plus temporaries of the same
size): 670 MB for Gemma 3's 262k x 640 embedding, only to be quantized again. Here each
block format is decoded, vectorized in numpy, to the integers it stores and the scales
(and offsets) that make them weights, exactly as llama.cpp defines them (ggml-quants.c;
the same arithmetic as gguf-py's quants.py, so `w = q * scale [+ offset]` is bit-equal
to gguf's f32):

| type | block | bytes | stored | decoded |
|---|---|---|---|---|
| Q8_0 | 32 | 34 | f16 d, 32 x int8 q | int8 q, scale d per 32 |
| Q5_0 | 32 | 22 | f16 d, 32 high bits, 32 low nibbles | int8 q - 16, scale d per 32 |
| Q6_K | 256 | 210 | 4+2 bit q, int8 sc per 16, f16 d | int8 q - 32, scale d*sc per 16 |
| Q4_K | 256 | 144 | f16 d, dmin, 6-bit sc/m per 32, 4-bit u | u 0..15, scale d*sc, offset -dmin*m |

A `GGUFMatrix` wraps one tensor's memory-mapped bytes (and an optional row order, for
llama.cpp's Q/K permutation) and converts itself to our formats chunk by chunk, so
the only f32 ever built is one chunk (`CHUNK_ELEMENTS` values):
- `quantize_int8()`: int8 per output channel, a chunk of rows at a time.
- `quantize_int4(group)`: asymmetric int4 in groups along the input axis.
- `dequantize(dtype)`: the float matrix, written chunk by chunk into its final dtype.
Rows are independent in every format, so the result does not depend on the chunking
and equals quantizing gguf's f32 tensor at once (`quantize.quantize_int8/int4`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import gguf
import numpy as np

from jaxinfer.gguf_file import GGUFTensor
from jaxinfer.model.quant import QuantizedWeight, unpack_int4
from jaxinfer.weights.quantize import quantize_int4, quantize_int8

QType = gguf.GGMLQuantizationType
CHUNK_ELEMENTS = 1 << 22  # f32 values decoded at a time (16 MiB)
_NIBBLE_SHIFTS = np.array([0, 4], np.uint8)
_CRUMB_SHIFTS = np.array([0, 2, 4, 6], np.uint8)


@dataclass(frozen=True)
class Blocks:
    """Rows of a GGUF tensor as integers and per-block scales: w = q * scale [+ offset]."""

    q: np.ndarray  # int8 [rows, n] (signed types) | uint8 [rows, n] (Q4_K: 0..15)
    scale: np.ndarray  # f32 [rows, n // block]
    offset: np.ndarray | None = None  # f32 [rows, n // block] (Q4_K)

    @property
    def block(self) -> int:
        return self.q.shape[-1] // self.scale.shape[-1]

    def dequantize(self) -> np.ndarray:
        """f32 [rows, n], with gguf.quants' arithmetic (bit-equal to its output)."""
        rows, n = self.q.shape
        w = self.q.reshape(rows, -1, self.block).astype(np.float32)
        w *= self.scale[..., None]
        if self.offset is not None:
            w += self.offset[..., None]
        return w.reshape(rows, n)


def _blocks(raw: np.ndarray, qtype: QType) -> np.ndarray:
    """uint8 [rows, bytes per row] -> uint8 [rows * blocks per row, bytes per block]."""
    return np.ascontiguousarray(raw).reshape(-1, gguf.GGML_QUANT_SIZES[qtype][1])


def _f16(two_bytes: np.ndarray) -> np.ndarray:
    """uint8 [..., 2] (little-endian f16) -> f32 [...]."""
    return np.ascontiguousarray(two_bytes).view("<f2")[..., 0].astype(np.float32)


def _rows(q: np.ndarray, scale: np.ndarray, rows: int, offset: np.ndarray | None = None
          ) -> Blocks:
    """Per-block arrays [rows * blocks, ...] -> Blocks of `rows` rows."""
    return Blocks(q.reshape(rows, -1), scale.reshape(rows, -1),
                  None if offset is None else offset.reshape(rows, -1))


def decode_q8_0(raw: np.ndarray) -> Blocks:
    """Q8_0: f16 d, then 32 int8 values; w = q * d."""
    b = _blocks(raw, QType.Q8_0)
    return _rows(b[:, 2:].view(np.int8), _f16(b[:, :2]), raw.shape[0])


def decode_q5_0(raw: np.ndarray) -> Blocks:
    """Q5_0: f16 d, u32 of fifth bits, 16 bytes of nibbles (j low, j + 16 high);
    w = (q - 16) * d."""
    b = _blocks(raw, QType.Q5_0)
    high = np.unpackbits(b[:, 2:6], axis=-1, bitorder="little")  # [B, 32]: bit j of qh
    low = (b[:, 6:, None] >> _NIBBLE_SHIFTS) & 15  # [B, 16, 2]
    low = low.transpose(0, 2, 1).reshape(-1, 32)
    q = (low | (high << 4)).view(np.int8) - np.int8(16)
    return _rows(q, _f16(b[:, :2]), raw.shape[0])


def decode_q6_k(raw: np.ndarray) -> Blocks:
    """Q6_K: 128 bytes of low nibbles, 64 of high crumbs, 16 int8 sub-scales, f16 d;
    w = (q - 32) * d * sc, one sc per 16 values."""
    b = _blocks(raw, QType.Q6_K)
    low = (b[:, :128].reshape(-1, 2, 1, 64) >> _NIBBLE_SHIFTS[:, None]) & 15
    high = (b[:, 128:192].reshape(-1, 2, 1, 32) >> _CRUMB_SHIFTS[:, None]) & 3
    q = (low.reshape(-1, 8, 32) | (high.reshape(-1, 8, 32) << 4)).view(np.int8) - np.int8(32)
    scale = _f16(b[:, 208:210])[:, None] * b[:, 192:208].view(np.int8).astype(np.float32)
    return _rows(q, scale, raw.shape[0])


def decode_q4_k(raw: np.ndarray) -> Blocks:
    """Q4_K: f16 d and dmin, 12 bytes of 6-bit sub-scales and mins, 128 bytes of nibbles
    (sub-block 2i low, 2i + 1 high); w = u * d * sc - dmin * m, per 32 values."""
    b = _blocks(raw, QType.Q4_K)
    sc, m = _q4_k_scale_min(b[:, 4:16])
    u = (b[:, 16:].reshape(-1, 4, 1, 32) >> _NIBBLE_SHIFTS[:, None]) & 15  # [B, 4, 2, 32]
    scale = _f16(b[:, 0:2])[:, None] * sc.astype(np.float32)
    offset = -(_f16(b[:, 2:4])[:, None] * m.astype(np.float32))
    return _rows(u, scale, raw.shape[0], offset)


def _q4_k_scale_min(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """uint8 [B, 12] -> 6-bit (sc, m), each uint8 [B, 8] (llama.cpp's get_scale_min_k4)."""
    d, m, md = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mins


DECODERS: dict[QType, Callable[[np.ndarray], Blocks]] = {
    QType.Q8_0: decode_q8_0,
    QType.Q5_0: decode_q5_0,
    QType.Q6_K: decode_q6_k,
    QType.Q4_K: decode_q4_k,
}


def can_decode(tensor: GGUFTensor) -> bool:
    """Whether `tensor` is a matrix in a block format decoded here."""
    return tensor.qtype in DECODERS and len(tensor.shape) == 2


@dataclass(frozen=True)
class GGUFMatrix:
    """A quantized GGUF matrix [out, in], converted a chunk of rows at a time."""

    name: str
    qtype: QType
    raw: np.ndarray  # uint8 [out, bytes per row], memory-mapped
    row_order: np.ndarray | None = None  # int [out]: row i is raw row row_order[i]
    chunk_elements: int = CHUNK_ELEMENTS

    @classmethod
    def from_tensor(cls, tensor: GGUFTensor) -> GGUFMatrix:
        if not can_decode(tensor):
            raise ValueError(f"no direct decoder for {tensor.name} ({tensor.qtype.name})")
        return cls(tensor.name, tensor.qtype, tensor.data)

    @property
    def shape(self) -> tuple[int, int]:
        block, type_size = gguf.GGML_QUANT_SIZES[self.qtype]
        return self.raw.shape[0], self.raw.shape[1] // type_size * block

    def permute_rows(self, order: np.ndarray) -> GGUFMatrix:
        """The matrix with rows taken in `order` (int [out]), composed with any earlier order."""
        order = np.asarray(order)
        return replace(self, row_order=order if self.row_order is None else self.row_order[order])

    def chunks(self) -> Iterator[tuple[slice, Blocks]]:
        """(rows, their Blocks) for consecutive row ranges covering the matrix."""
        rows, n_in = self.shape
        step = max(1, self.chunk_elements // n_in)
        for start in range(0, rows, step):
            rows_here = slice(start, min(start + step, rows))
            index = rows_here if self.row_order is None else self.row_order[rows_here]
            yield rows_here, DECODERS[self.qtype](self.raw[index])

    def dequantize(self, dtype: np.dtype = np.float32) -> np.ndarray:
        """The float matrix [out, in] in `dtype` (gguf.quants' f32 values, then cast)."""
        out = np.empty(self.shape, dtype)
        for rows, blocks in self.chunks():
            out[rows] = blocks.dequantize()
        return out

    def quantize_int8(self) -> QuantizedWeight:
        """Symmetric int8, one scale per output row (`quantize.quantize_int8`)."""
        values = np.empty(self.shape, np.int8)  # [out, in]
        scales = np.empty((self.shape[0], 1), np.float32)  # [out, 1]
        for rows, blocks in self.chunks():
            part = quantize_int8(blocks.dequantize())
            values[rows], scales[rows] = part.values, part.scales
        return QuantizedWeight(values=values, scales=scales, bits=8, group_size=self.shape[1])

    def quantize_int4(self, group_size: int) -> QuantizedWeight:
        """Asymmetric int4 in groups of `group_size` inputs (`quantize.quantize_int4`)."""
        out, n_in = self.shape
        group = min(group_size, n_in)  # quantize_int4 checks that it divides n_in
        groups = n_in // group
        values = np.empty((out, n_in // 2), np.uint8)  # [out, in // 2], two per byte
        scales = np.empty((out, groups), np.float32)  # [out, in // group_size]
        offsets = np.empty((out, groups), np.float32)
        for rows, blocks in self.chunks():
            part = quantize_int4(blocks.dequantize(), group)
            values[rows], scales[rows], offsets[rows] = part.values, part.scales, part.offsets
        return QuantizedWeight(values=values, scales=scales, offsets=offsets, bits=4,
                               group_size=group)

    def exact(self) -> QuantizedWeight:
        """The blocks as they are, losslessly: int8 grouped per 32 (Q8_0, Q5_0) or 16
        (Q6_K), int4 g32 with offsets (Q4_K). More scale bytes than our defaults."""
        parts = [blocks for _, blocks in self.chunks()]
        q = np.concatenate([p.q for p in parts])
        scale = np.concatenate([p.scale for p in parts])
        block = parts[0].block
        if self.qtype != QType.Q4_K:
            return QuantizedWeight(values=q, scales=scale, bits=8, group_size=block)
        offset = np.concatenate([p.offset for p in parts])
        packed = q[:, 0::2] | (q[:, 1::2] << 4)
        return QuantizedWeight(values=packed, scales=scale, offsets=offset, bits=4,
                               group_size=block)


def common_form(weights: list[QuantizedWeight]) -> list[QuantizedWeight]:
    """Layers of one tensor in one stackable form, exactly.

    llama.cpp's mixes (Q4_K_M: some layers' ffn_down and attn_v in Q6_K, the rest in
    Q4_K) give a tensor layers of different block forms. Such layers become int8
    values with a scale and an offset per group of the smallest group size: Q4_K's
    0..15 and Q6_K's signed values both fit int8, its group of 32 splits into groups
    of 16 sharing the scale and min, Q6_K's offset is 0. `w = q * scale + offset`
    gives each layer's file values exactly (a Q6_K zero may lose its sign: -0.0 + 0).
    """
    forms = {(w.bits, w.group_size, w.offsets is not None) for w in weights}
    if len(forms) == 1:
        return weights
    group = min(w.group_size for w in weights)
    return [_int8_with_offsets(w, group) for w in weights]


def _int8_with_offsets(weight: QuantizedWeight, group: int) -> QuantizedWeight:
    values = unpack_int4(weight.values) if weight.bits == 4 else weight.values
    repeat = weight.group_size // group
    scales = np.repeat(weight.scales, repeat, axis=-1)
    offsets = (np.zeros_like(scales) if weight.offsets is None
               else np.repeat(weight.offsets, repeat, axis=-1))
    return QuantizedWeight(values=values.astype(np.int8), scales=scales, offsets=offsets,
                           bits=8, group_size=group)
