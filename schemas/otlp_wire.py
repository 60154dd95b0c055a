"""The protobuf wire pieces OTLP's writer (`specwatch.schemas.otlp`) and the block reader
(`specwatch.schemas.otlp_block`) share: varints, AnyValues, attributes, plain array columns."""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["EncodingMemo", "OddShape", "encode_any_value", "encode_attribute", "encode_key_value",
           "delimited", "read_varint", "small_ints", "string_values", "utf8", "varint"]

_pack_double = struct.Struct("<d").pack
_LENGTH = tuple(bytes((n,)) for n in range(128))
# An ArrayValue element holding int_value v (0 <= v < 128): drafted/accepted counts.
_SMALL_INT_ELEMENT = tuple(b"\x0a\x02\x18" + bytes((v,)) for v in range(128))
# The prefix of an ArrayValue element holding a string of n < 126 UTF-8 bytes.
_SHORT_STRING_ELEMENT = tuple(bytes((0x0A, n + 2, 0x0A, n)) for n in range(126))
_STR_ONLY = frozenset((str,))
_INT_ONLY = frozenset((int,))
_UINT64 = (1 << 64) - 1


def varint(n: int) -> bytes:
    if n < 0x80:
        return _LENGTH[n]
    if n < 0x4000:  # most lengths in a step record: arrays and attribute bodies
        return bytes(((n & 0x7F) | 0x80, n >> 7))
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def delimited(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field: tag, length, payload."""
    return tag + varint(len(payload)) + payload


def utf8(text: str) -> bytes:
    # Lone surrogates cannot be UTF-8; one bad character must not sink a whole chunk.
    return text.encode("utf-8", "replace")


class EncodingMemo:
    """Encoded pieces that repeat across the records of one request: keys, ids, names."""

    __slots__ = ("keys", "strings", "elements")

    def __init__(self) -> None:
        self.keys: dict[str, bytes] = {}
        self.strings: dict[tuple[str, str], bytes] = {}
        self.elements: dict[str, bytes] = {}


def encode_any_value(value: Any, memo: EncodingMemo) -> bytes:
    """A serialized AnyValue. Oneof members are written even when they hold 0 or ''."""
    kind = type(value)
    if kind is str:
        return delimited(b"\x0a", utf8(value))
    if kind is float:
        return b"\x21" + _pack_double(value)
    if kind is int:
        return b"\x18" + varint(value & _UINT64)  # int64: negatives as two's complement
    if kind is bool:
        return b"\x10\x01" if value else b"\x10\x00"
    if value is None:
        return b""  # the empty AnyValue is OTLP's null
    if isinstance(value, (tuple, list)):
        return delimited(b"\x2a", _array_values(value, memo))
    if isinstance(value, Mapping):
        return delimited(b"\x32", b"".join([encode_key_value(str(k), v, memo) for k, v in value.items()]))
    for base in (bool, int, float, str):  # subclasses, as their base type
        if isinstance(value, base):
            return encode_any_value(base(value), memo)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return delimited(b"\x3a", bytes(value))
    raise TypeError(f"cannot encode {kind.__name__} as an OTLP attribute value")


def _array_values(values: Sequence[Any], memo: EncodingMemo) -> bytes:
    """The repeated ``values`` of an ArrayValue; columns of one type take a fast path."""
    types = set(map(type, values))
    if types == _STR_ONLY:
        elements = memo.elements  # buckets and cohorts repeat within and across steps
        parts = []
        append = parts.append
        for v in values:
            piece = elements.get(v)
            if piece is None:
                encoded = v.encode("utf-8", "replace")
                n = len(encoded)
                if n < 126:
                    piece = _SHORT_STRING_ELEMENT[n] + encoded
                else:
                    piece = delimited(b"\x0a", delimited(b"\x0a", encoded))
                elements[v] = piece
            append(piece)
        return b"".join(parts)
    if types == _INT_ONLY and min(values) >= 0 and max(values) < 128:
        return b"".join([_SMALL_INT_ELEMENT[v] for v in values])
    return b"".join([delimited(b"\x0a", encode_any_value(v, memo)) for v in values])


def encode_key_value(key: str, value: Any, memo: EncodingMemo) -> bytes:
    """A KeyValue as an element of a repeated field number 1 (KeyValueList, Resource)."""
    body = (delimited(b"\x0a", utf8(key)) if key else b"") + delimited(b"\x12", encode_any_value(value, memo))
    return delimited(b"\x0a", body)


def encode_attribute(key: str, value: Any, memo: EncodingMemo) -> bytes:
    """One entry of LogRecord.attributes (field 6): a KeyValue."""
    prefix = memo.keys.get(key)
    if prefix is None:
        prefix = memo.keys[key] = delimited(b"\x0a", utf8(key)) if key else b""
    encoded = encode_any_value(value, memo)
    body = prefix + b"\x12" + varint(len(encoded)) + encoded
    return b"\x32" + varint(len(body)) + body


class OddShape(Exception):
    """Bytes that are valid protobuf but not in a shape the wire readers read."""


def read_varint(buf: bytes, p: int) -> tuple[int, int]:
    """The varint at ``p`` and the position after it."""
    value = shift = 0
    while True:
        byte = buf[p]
        p += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, p
        shift += 7


def small_ints(body: bytes) -> bytes:
    """An ArrayValue body of int elements in the plain form (0a 02 18 vv): the values vv."""
    count = len(body) >> 2
    if len(body) != count << 2 or body[0::4] != b"\x0a" * count or body[1::4] != b"\x02" * count \
            or body[2::4] != b"\x18" * count:
        raise OddShape("not small ints in the plain form")
    # vv < 0x80 needs no check: a varint byte of 0x80 or more would need another byte
    return body[3::4]


def string_values(buf: bytes, start: int, end: int) -> list[str]:
    """An ArrayValue body of plain string elements, as strings."""
    values: list[str] = []
    append = values.append
    p = start
    while p < end:
        # element: 0a <size>, then the AnyValue: 0a <length> <utf-8>
        size = buf[p + 1]
        length = buf[p + 3]
        if buf[p] == 0x0A and buf[p + 2] == 0x0A and size == length + 2 and size < 0x80:
            p += 4
        else:  # lengths past one byte, or not a plain string element
            if buf[p] != 0x0A:
                raise OddShape("ArrayValue field other than values")
            size, p = read_varint(buf, p + 1)
            element_end = p + size
            if size == 0 or buf[p] != 0x0A:
                raise OddShape("element is not a string")
            length, p = read_varint(buf, p + 1)
            if p + length != element_end:
                raise OddShape("string element and more")
        append(buf[p:p + length].decode())
        p += length
    if p != end:
        raise OddShape("element overruns the array")
    return values
