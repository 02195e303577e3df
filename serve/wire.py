"""Request decoding that turns malformed input into a precise error.

protobuf rejects a `string` field holding invalid UTF-8 with a DecodeError
that names no field, and grpc answers such a request with INTERNAL. The
servers here decode requests with `tolerant(cls)` instead: a bad request
becomes a `MalformedRequest` whose message names the field (walking the wire
format to find it), and the servicer answers INVALID_ARGUMENT.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message

_VARINT, _FIXED64, _LEN, _FIXED32 = 0, 1, 2, 5


@dataclass(frozen=True)
class MalformedRequest:
    """A request that failed to decode; `message` says which field and why."""

    message: str


def tolerant(cls: type[Message]) -> Callable[[bytes], Message | MalformedRequest]:
    """A request deserializer that returns MalformedRequest instead of raising."""

    def deserialize(data: bytes) -> Message | MalformedRequest:
        try:
            return cls.FromString(data)
        except DecodeError as exc:
            where = find_bad_utf8(cls.DESCRIPTOR, data)
            return MalformedRequest(where or f"not a valid {cls.DESCRIPTOR.full_name}: {exc}")

    return deserialize


def find_bad_utf8(descriptor: Descriptor, data: bytes, prefix: str = "") -> str | None:
    """'<field path> is not valid UTF-8 ...' for the first bad string field, else None."""
    seen: Counter[int] = Counter()
    pos = 0
    try:
        while pos < len(data):
            key, pos = _varint(data, pos)
            number, wire_type = key >> 3, key & 7
            if wire_type != _LEN:
                pos = _skip(data, pos, wire_type)
                continue
            size, pos = _varint(data, pos)
            chunk, pos = data[pos : pos + size], pos + size
            field = descriptor.fields_by_number.get(number)
            if field is not None:
                problem = _check_field(field, chunk, _path(prefix, field, seen))
                if problem:
                    return problem
    except (IndexError, ValueError):  # truncated or corrupt: no field to name
        return None
    return None


def _check_field(field: FieldDescriptor, chunk: bytes, path: str) -> str | None:
    if field.type == FieldDescriptor.TYPE_STRING:
        try:
            chunk.decode("utf-8")
        except UnicodeDecodeError as exc:
            return (f"{path} is not valid UTF-8 (byte 0x{chunk[exc.start]:02x} at offset "
                    f"{exc.start}): send text as UTF-8")
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return find_bad_utf8(field.message_type, chunk, path + ".")
    return None


def _path(prefix: str, field: FieldDescriptor, seen: Counter[int]) -> str:
    if not field.is_repeated:
        return prefix + field.name
    index = seen[field.number]
    seen[field.number] += 1
    return f"{prefix}{field.name}[{index}]"


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def _skip(data: bytes, pos: int, wire_type: int) -> int:
    if wire_type == _VARINT:
        return _varint(data, pos)[1]
    if wire_type in (_FIXED64, _FIXED32):
        return pos + (8 if wire_type == _FIXED64 else 4)
    raise ValueError(f"unsupported wire type {wire_type}")
