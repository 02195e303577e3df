"""A fast GGUF reader: metadata, tensor directory and memory-mapped tensor data.

`gguf.GGUFReader` builds a numpy view per metadata item, which takes tens of
seconds on a 262,144-piece vocabulary; here string arrays are decoded in one
pass and numeric arrays with one `np.frombuffer`. Tensor bytes stay in the
memory map until a loader dequantizes them (with `gguf.quants`).

Layout (v2/v3): magic `GGUF`, version u32, tensor count u64, kv count u64, the
key/values, the tensor infos (name, dims, type, offset), then the data section
at the next multiple of `general.alignment` (32 by default).
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from jaxinfer.errors import ModelLoadError

STRING, ARRAY = 8, 9
FIXED_TYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4",
               7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
PLAIN_DTYPES = {
    gguf.GGMLQuantizationType.F32: np.float32,
    gguf.GGMLQuantizationType.F16: np.float16,
}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # numpy order: GGUF's dims reversed, rows first
    qtype: gguf.GGMLQuantizationType
    data: np.ndarray  # raw bytes [rows, bytes per row] for quantized types

    def dequantize(self) -> np.ndarray:
        """The tensor as f32 numpy, shape `self.shape`."""
        return np.asarray(gguf.quants.dequantize(self.data, self.qtype), np.float32).reshape(
            self.shape
        )


@dataclass
class GGUFFile:
    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)


class _Cursor:
    """Reads GGUF values one after another from a buffer."""

    def __init__(self, buf: mmap.mmap | bytes) -> None:
        self.buf, self.pos = buf, 0

    def u32(self) -> int:
        (value,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return value

    def u64(self) -> int:
        (value,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return value

    def strings(self, count: int) -> list[str]:
        out, buf, pos, unpack = [], self.buf, self.pos, _U64.unpack_from
        for _ in range(count):
            (size,) = unpack(buf, pos)
            out.append(buf[pos + 8 : pos + 8 + size].decode("utf-8"))
            pos += 8 + size
        if pos > len(buf):
            raise struct.error("a string runs past the end of the file")
        self.pos = pos
        return out

    def value(self, vtype: int) -> Any:
        if vtype == STRING:
            return self.strings(1)[0]
        if vtype == ARRAY:
            return self.array()
        if vtype not in FIXED_TYPES:
            raise ValueError(f"unknown metadata value type {vtype}")
        return self.array_of(vtype, 1)[0].item()

    def array(self) -> Any:
        etype, count = self.u32(), self.u64()
        if etype == STRING:
            return self.strings(count)
        if etype in FIXED_TYPES:
            return self.array_of(etype, count)
        return [self.value(etype) for _ in range(count)]

    def array_of(self, etype: int, count: int) -> np.ndarray:
        values = np.frombuffer(self.buf, FIXED_TYPES[etype], count=count, offset=self.pos)
        self.pos += values.nbytes
        return values.copy()


def read_gguf(path: str | os.PathLike[str], *, with_tensors: bool = True) -> GGUFFile:
    """Parse a GGUF file; every failure is a ModelLoadError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"GGUF file not found: {path}")
    try:
        with open(path, "rb") as handle:
            buf = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        return _parse(path, buf, with_tensors)
    except ModelLoadError:
        raise
    except (OSError, ValueError, struct.error, UnicodeDecodeError, KeyError) as exc:
        raise ModelLoadError(
            f"{path} is not a readable GGUF file (corrupt or truncated?): {exc}"
        ) from exc


def _parse(path: Path, buf: mmap.mmap, with_tensors: bool) -> GGUFFile:
    if buf[:4] != b"GGUF":
        raise ModelLoadError(f"{path} is not a readable GGUF file (no GGUF magic)")
    cur = _Cursor(buf)
    cur.pos = 4
    version = cur.u32()
    if version not in (2, 3):
        raise ModelLoadError(f"{path}: GGUF version {version} is not supported (2 or 3)")
    tensor_count, kv_count = cur.u64(), cur.u64()
    metadata = {}
    for _ in range(kv_count):
        key = cur.strings(1)[0]
        metadata[key] = cur.value(cur.u32())
    tensors = _read_tensors(cur, tensor_count, metadata) if with_tensors else {}
    return GGUFFile(path, version, metadata, tensors)


def _read_tensors(cur: _Cursor, count: int, metadata: dict[str, Any]) -> dict[str, GGUFTensor]:
    infos = []
    for _ in range(count):
        name = cur.strings(1)[0]
        dims = tuple(cur.u64() for _ in range(cur.u32()))
        infos.append((name, dims, gguf.GGMLQuantizationType(cur.u32()), cur.u64()))
    alignment = int(metadata.get("general.alignment", 32))
    start = -(-cur.pos // alignment) * alignment
    return {name: _tensor(cur.buf, name, dims, qtype, start + offset)
            for name, dims, qtype, offset in infos}


def _tensor(
    buf: mmap.mmap, name: str, dims: tuple[int, ...], qtype: gguf.GGMLQuantizationType,
    offset: int,
) -> GGUFTensor:
    shape = tuple(int(d) for d in reversed(dims))
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    row_bytes = shape[-1] // block * type_size
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    nbytes = rows * row_bytes
    if offset + nbytes > len(buf):
        raise ModelLoadError(f"GGUF tensor {name} runs past the end of the file (truncated?)")
    raw = np.frombuffer(buf, np.uint8, count=nbytes, offset=offset)
    if qtype in PLAIN_DTYPES:
        data = raw.view(PLAIN_DTYPES[qtype]).reshape(shape)
    else:
        data = raw.reshape(*shape[:-1], row_bytes)
    return GGUFTensor(name, shape, qtype, data)
