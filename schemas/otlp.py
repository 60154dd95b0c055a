"""Contract-v1 records as OTLP log records: the bytes that travel on the telemetry topic."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from operator import attrgetter
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, NamedTuple

from google.protobuf.message import DecodeError
from pydantic import BaseModel

if TYPE_CHECKING:  # the protobuf classes load when OTLP is read, not for JSON Lines
    from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue
    from opentelemetry.proto.logs.v1.logs_pb2 import LogRecord as PbLogRecord

from .codec import _KINDS, Rejection, decode_object  # noqa: PLC2701
from .contract import (CONTRACT_VERSION, MAX_REQUESTS_PER_STEP, BundleRecord, RequestRecord,
                       ShadowRecord, StepRecord, TelemetryRecord)

__all__ = ["EVENT_PREFIX", "MAX_REQUEST_BYTES", "LogEntry", "log_entry", "record_from_attributes",
           "encode_entries", "encode_records", "iter_encoded_chunks", "decode_log_record",
           "decode_request", "log_records", "parse_request"]

EVENT_PREFIX = "specwatch."
ATTRIBUTE_PREFIX = "specwatch."
_REQUESTS_PREFIX = "specwatch.requests."
_ROUND_COLUMNS = ("id", "bucket", "cohort", "drafted", "accepted")
_DEFAULT_RESOURCE: Mapping[str, str] = MappingProxyType({"service.name": "specwatch"})
_SCOPE_NAME = "specwatch"
# Kafka's default message limit is 1 MiB; a chunk stays below it with room for headers.
_DEFAULT_MAX_CHUNK_BYTES = 900_000
# Beyond any chunk a producer writes: decoding a bigger blob is refused, not attempted.
MAX_REQUEST_BYTES = 16 << 20
_MAX_RAW_CHARS = 2048
# time_unix_nano is fixed64: event times past year 2554 cannot be expressed (ts still is).
_MAX_UNIX_NANO = (1 << 64) - 1


class LogEntry(NamedTuple):
    """One OTLP log record before encoding: what an OTel SDK ``LogRecord`` carries too."""

    event_name: str
    time_unix_nano: int
    attributes: Mapping[str, Any]


# ---------------------------------------------------------------- records -> attributes


_STEP_SCALARS = ("v", "ts", "worker", "seq", "bundle_id", "draft_ms", "verify_ms", "kv_usage")
_STEP_SCALAR_KEYS = tuple(ATTRIBUTE_PREFIX + name for name in _STEP_SCALARS)
_STEP_SCALAR_VALUES = attrgetter(*_STEP_SCALARS)
_ROUND_GETTERS = tuple((_REQUESTS_PREFIX + name, attrgetter(name)) for name in _ROUND_COLUMNS)


def _step_attributes(record: StepRecord) -> dict[str, Any]:
    attributes = dict(zip(_STEP_SCALAR_KEYS, _STEP_SCALAR_VALUES(record)))
    # attrgetter over map: one C-level pass per column, no Python frame per request
    attributes.update((key, tuple(map(get, record.requests))) for key, get in _ROUND_GETTERS)
    return attributes


def _fields_attributes(record: BundleRecord | RequestRecord | ShadowRecord) -> dict[str, Any]:
    """Every field but ``kind``, in the model's order, nested parts (card, sample) as dicts."""
    return {ATTRIBUTE_PREFIX + name: value.model_dump() if isinstance(value, BaseModel) else value
            for name in type(record).model_fields if name != "kind"
            for value in (getattr(record, name),)}


def log_entry(record: TelemetryRecord) -> LogEntry:
    """The OTLP form of one record: event name, event time in ns, attributes.

    >>> from specwatch.schemas import ShadowRecord
    >>> entry = log_entry(ShadowRecord(v=1, ts=1.5, bundle_id="b-1", id="r9",
    ...                                bucket="structured", check="token_exact", match=False))
    >>> entry.event_name, entry.time_unix_nano, entry.attributes["specwatch.match"]
    ('specwatch.shadow', 1500000000, False)
    """
    attributes = _step_attributes(record) if record.kind == "step" else _fields_attributes(record)
    nanos = round(record.ts * 1e9)
    nanos = nanos if 0 <= nanos <= _MAX_UNIX_NANO else 0
    return LogEntry(EVENT_PREFIX + record.kind, nanos, attributes)


# ---------------------------------------------------------------- attributes -> protobuf
# Why the wire format is written by hand: docs/STREAMS.md, "schemas/otlp.py".

_pack_double = struct.Struct("<d").pack
_pack_fixed64 = struct.Struct("<Q").pack
_LENGTH = tuple(bytes((n,)) for n in range(128))
# An ArrayValue element holding int_value v (0 <= v < 128): drafted/accepted counts.
_SMALL_INT_ELEMENT = tuple(b"\x0a\x02\x18" + bytes((v,)) for v in range(128))
# The prefix of an ArrayValue element holding a string of n < 126 UTF-8 bytes.
_SHORT_STRING_ELEMENT = tuple(bytes((0x0A, n + 2, 0x0A, n)) for n in range(126))
_STR_ONLY = frozenset((str,))
_INT_ONLY = frozenset((int,))
_UINT64 = (1 << 64) - 1


def _varint(n: int) -> bytes:
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


def _field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field: tag, length, payload."""
    return tag + _varint(len(payload)) + payload


def _utf8(text: str) -> bytes:
    # Lone surrogates cannot be UTF-8; one bad character must not sink a whole chunk.
    return text.encode("utf-8", "replace")


class _Memo:
    """Encoded pieces that repeat across the records of one request: keys, ids, names."""

    __slots__ = ("keys", "strings", "elements")

    def __init__(self) -> None:
        self.keys: dict[str, bytes] = {}
        self.strings: dict[tuple[str, str], bytes] = {}
        self.elements: dict[str, bytes] = {}


def _any_value(value: Any, memo: _Memo) -> bytes:
    """A serialized AnyValue. Oneof members are written even when they hold 0 or ''."""
    kind = type(value)
    if kind is str:
        return _field(b"\x0a", _utf8(value))
    if kind is float:
        return b"\x21" + _pack_double(value)
    if kind is int:
        return b"\x18" + _varint(value & _UINT64)  # int64: negatives as two's complement
    if kind is bool:
        return b"\x10\x01" if value else b"\x10\x00"
    if value is None:
        return b""  # the empty AnyValue is OTLP's null
    if isinstance(value, (tuple, list)):
        return _field(b"\x2a", _array_values(value, memo))
    if isinstance(value, Mapping):
        return _field(b"\x32", b"".join([_key_value(str(k), v, memo) for k, v in value.items()]))
    for base in (bool, int, float, str):  # subclasses, as their base type
        if isinstance(value, base):
            return _any_value(base(value), memo)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return _field(b"\x3a", bytes(value))
    raise TypeError(f"cannot encode {kind.__name__} as an OTLP attribute value")


def _array_values(values: Sequence[Any], memo: _Memo) -> bytes:
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
                    piece = _field(b"\x0a", _field(b"\x0a", encoded))
                elements[v] = piece
            append(piece)
        return b"".join(parts)
    if types == _INT_ONLY and min(values) >= 0 and max(values) < 128:
        return b"".join([_SMALL_INT_ELEMENT[v] for v in values])
    return b"".join([_field(b"\x0a", _any_value(v, memo)) for v in values])


def _key_value(key: str, value: Any, memo: _Memo) -> bytes:
    """A KeyValue as an element of a repeated field number 1 (KeyValueList, Resource)."""
    body = (_field(b"\x0a", _utf8(key)) if key else b"") + _field(b"\x12", _any_value(value, memo))
    return _field(b"\x0a", body)


def _attribute(key: str, value: Any, memo: _Memo) -> bytes:
    """One entry of LogRecord.attributes (field 6): a KeyValue."""
    prefix = memo.keys.get(key)
    if prefix is None:
        prefix = memo.keys[key] = _field(b"\x0a", _utf8(key)) if key else b""
    encoded = _any_value(value, memo)
    body = prefix + b"\x12" + _varint(len(encoded)) + encoded
    return b"\x32" + _varint(len(body)) + body


def _log_record(entry: LogEntry, memo: _Memo) -> bytes:
    """A serialized LogRecord (fields 1 time, 6 attributes, 11 observed time, 12 event name)."""
    nanos = entry.time_unix_nano
    stamp = b"\x09" + _pack_fixed64(nanos) if nanos else b""
    parts = [stamp]
    append = parts.append
    strings = memo.strings
    for key, value in entry.attributes.items():
        if type(value) is str:  # worker, bundle id, names: the same few values record after record
            piece = strings.get((key, value))
            if piece is None:
                piece = strings[(key, value)] = _attribute(key, value, memo)
            append(piece)
        else:
            append(_attribute(key, value, memo))
    if nanos:
        append(b"\x59" + stamp[1:])
    if entry.event_name:
        append(_field(b"\x62", _utf8(entry.event_name)))
    return b"".join(parts)


class _Envelope:
    """The request around a run of serialized log records: one resource, one scope."""

    def __init__(self, resource: Mapping[str, Any] | None) -> None:
        attributes = _DEFAULT_RESOURCE if resource is None else resource
        memo = _Memo()
        self.resource = _field(b"\x0a", b"".join([_key_value(str(k), v, memo) for k, v in attributes.items()]))
        scope = _field(b"\x0a", _utf8(_SCOPE_NAME)) + _field(b"\x12", str(CONTRACT_VERSION).encode())
        self.scope = _field(b"\x0a", scope)
        # Worst case of the three length prefixes that grow with the content (5 bytes each).
        self.overhead = 1 + len(self.resource) + 1 + len(self.scope) + 3 * 5 + 2

    def wrap(self, log_records: Sequence[bytes]) -> bytes:
        scope_logs = self.scope + b"".join([b"\x12" + _varint(len(r)) + r for r in log_records])
        resource_logs = self.resource + _field(b"\x12", scope_logs)
        return _field(b"\x0a", resource_logs)


def encode_entries(entries: Iterable[LogEntry], *, resource: Mapping[str, Any] | None = None) -> bytes:
    """One serialized ``ExportLogsServiceRequest`` holding every entry, in order."""
    memo = _Memo()
    return _Envelope(resource).wrap([_log_record(entry, memo) for entry in entries])


def encode_records(records: Iterable[TelemetryRecord], *, resource: Mapping[str, Any] | None = None) -> bytes:
    """One serialized ``ExportLogsServiceRequest`` holding every record, in order."""
    return encode_entries((log_entry(r) for r in records), resource=resource)


def iter_encoded_chunks(entries: Iterable[LogEntry], *, max_bytes: int = _DEFAULT_MAX_CHUNK_BYTES,
                        resource: Mapping[str, Any] | None = None) -> Iterator[tuple[bytes, int]]:
    """Serialized requests of at most ``max_bytes`` each, with the number of entries in each.

    >>> from specwatch.schemas import ShadowRecord
    >>> shadows = [log_entry(ShadowRecord(v=1, ts=float(i), bundle_id="b-1", id=f"r{i}",
    ...            bucket="coding", check="token_exact", match=True)) for i in range(100)]
    >>> chunks = list(iter_encoded_chunks(shadows, max_bytes=4000))
    >>> [count for _, count in chunks], max(len(data) for data, _ in chunks) <= 4000
    ([17, 17, 17, 17, 17, 15], True)
    """
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    envelope = _Envelope(resource)
    memo = _Memo()
    pending: list[bytes] = []
    size = envelope.overhead
    for entry in entries:
        record = _log_record(entry, memo)
        record_size = len(record) + 6  # tag and length prefix in ScopeLogs
        if pending and size + record_size > max_bytes:
            yield envelope.wrap(pending), len(pending)
            pending, size = [], envelope.overhead
            memo = _Memo()  # bounded by one chunk's distinct strings
        pending.append(record)
        size += record_size
    if pending:
        yield envelope.wrap(pending), len(pending)


# ---------------------------------------------------------------- protobuf -> records


_SCALAR_FIELDS = frozenset(("string_value", "bool_value", "int_value", "double_value", "bytes_value"))


def _py(value: AnyValue) -> Any:
    which = value.WhichOneof("value")
    if which in _SCALAR_FIELDS:
        return getattr(value, which)
    if which is None:
        return None
    if which == "array_value":
        array = value.array_value
        column = _column_from_wire(array.SerializeToString())
        if column is not None:
            return column
        out = []
        append = out.append
        for item in array.values:
            kind = item.WhichOneof("value")
            append(getattr(item, kind) if kind in _SCALAR_FIELDS else _py(item))
        return out
    return {pair.key: _py(pair.value) for pair in value.kvlist_value.values}


class _OddShape(Exception):
    """Bytes that are valid protobuf but not in a shape the wire readers read."""


def _read_varint(buf: bytes, p: int) -> tuple[int, int]:
    """The varint at ``p`` and the position after it."""
    value = shift = 0
    while True:
        byte = buf[p]
        p += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, p
        shift += 7


def _small_ints(body: bytes) -> bytes:
    """An ArrayValue body of int elements in the plain form (0a 02 18 vv): the values vv."""
    count = len(body) >> 2
    if len(body) != count << 2 or body[0::4] != b"\x0a" * count or body[1::4] != b"\x02" * count \
            or body[2::4] != b"\x18" * count:
        raise _OddShape("not small ints in the plain form")
    # vv < 0x80 needs no check: a varint byte of 0x80 or more would need another byte
    return body[3::4]


def _string_values(buf: bytes, start: int, end: int) -> list[str]:
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
                raise _OddShape("ArrayValue field other than values")
            size, p = _read_varint(buf, p + 1)
            element_end = p + size
            if size == 0 or buf[p] != 0x0A:
                raise _OddShape("element is not a string")
            length, p = _read_varint(buf, p + 1)
            if p + length != element_end:
                raise _OddShape("string element and more")
        append(buf[p:p + length].decode())
        p += length
    if p != end:
        raise _OddShape("element overruns the array")
    return values


def _column_from_wire(data: bytes) -> list | None:
    """The two column shapes a step carries, read from the array's bytes; None otherwise."""
    try:
        return list(_small_ints(data))
    except _OddShape:
        pass
    try:
        return _string_values(data, 0, len(data))
    except (_OddShape, IndexError):
        return None


def _rows(columns: dict[str, Any]) -> list[dict[str, Any]] | Rejection:
    lengths = {}
    for name, column in columns.items():
        if not isinstance(column, (list, tuple)):
            return Rejection("invalid_value", f"step: specwatch.requests.{name} is not an array")
        lengths[name] = len(column)
    for name in _ROUND_COLUMNS:
        if name not in columns:
            return Rejection("missing_field", f"step: missing required field specwatch.requests.{name}")
    sizes = set(lengths.values())
    if len(sizes) > 1:
        return Rejection("array_length_mismatch",
                         f"step: the specwatch.requests.* columns differ in length: {lengths}")
    if sizes and max(sizes) > MAX_REQUESTS_PER_STEP:
        return Rejection("too_many_requests",
                         f"step: {max(sizes)} > {MAX_REQUESTS_PER_STEP} requests per step")
    names = list(columns)
    return [dict(zip(names, row)) for row in zip(*columns.values())]


def _raw(obj: Any) -> str:
    try:
        return json.dumps(obj, default=repr, allow_nan=True)[:_MAX_RAW_CHARS]
    except (TypeError, ValueError, RecursionError):
        return repr(obj)[:_MAX_RAW_CHARS]


def record_from_attributes(event_name: str, attributes: Mapping[str, Any],
                           time_unix_nano: int = 0) -> TelemetryRecord | Rejection:
    """Validate one log record's event name and attributes as a contract-v1 record.

    >>> record_from_attributes("specwatch.shadow", {"specwatch.v": 1, "specwatch.ts": 2.0,
    ...     "specwatch.bundle_id": "b-1", "specwatch.id": "r1", "specwatch.bucket": "coding",
    ...     "specwatch.check": "token_exact", "specwatch.match": True}).match
    True
    """
    kind = event_name[len(EVENT_PREFIX):] if isinstance(event_name, str) and event_name.startswith(EVENT_PREFIX) else None
    if kind not in _KINDS:
        return Rejection("unknown_kind", f"event name {event_name!r} is not specwatch.<kind> for a known kind")
    obj: dict[str, Any] = {}
    columns: dict[str, Any] = {}
    for key, value in attributes.items():
        if not isinstance(key, str) or not key.startswith(ATTRIBUTE_PREFIX):
            continue
        if key.startswith(_REQUESTS_PREFIX):
            columns[key[len(_REQUESTS_PREFIX):]] = value
        else:
            obj[key[len(ATTRIBUTE_PREFIX):]] = value
    obj["kind"] = kind  # the event name decides, whatever a stray attribute says
    if "ts" not in obj and time_unix_nano:
        obj["ts"] = time_unix_nano / 1e9
    if kind == "step" and columns:
        rows = _rows(columns)
        if isinstance(rows, Rejection):
            return replace(rows, raw=_raw(obj))
        obj["requests"] = rows
    result = decode_object(obj)
    if isinstance(result, Rejection):
        return replace(result, raw=_raw({**obj, "requests": columns} if columns else obj))
    return result


def decode_log_record(log_record: PbLogRecord) -> TelemetryRecord | Rejection:
    """One protobuf ``LogRecord`` as a contract record, or why it is not one."""
    try:
        event_name = log_record.event_name
        if not event_name:  # older OTel event convention: the name as an attribute
            for pair in log_record.attributes:
                if pair.key == "event.name":
                    event_name = pair.value.string_value
                    break
        attributes = {pair.key: _py(pair.value) for pair in log_record.attributes}
        return record_from_attributes(event_name, attributes, log_record.time_unix_nano)
    except (TypeError, ValueError, RecursionError) as error:  # malformed but parseable input
        return Rejection("invalid_value", f"log record: {error}")


def parse_request(data: bytes) -> ExportLogsServiceRequest | Rejection:
    """``data`` parsed as an ``ExportLogsServiceRequest``, or why it is not one."""
    if len(data) > MAX_REQUEST_BYTES:
        return Rejection("message_too_large",
                         f"OTLP request of {len(data)} bytes > {MAX_REQUEST_BYTES}")
    from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest

    request = ExportLogsServiceRequest()
    try:
        request.ParseFromString(data)
    except (DecodeError, RecursionError, ValueError, TypeError) as error:
        return Rejection("invalid_otlp", f"not an OTLP ExportLogsServiceRequest: {error}",
                         data[:256].hex())
    return request


def log_records(request: ExportLogsServiceRequest) -> list[PbLogRecord]:
    """Every log record of a parsed request, in order."""
    return [log_record for resource_logs in request.resource_logs
            for scope_logs in resource_logs.scope_logs for log_record in scope_logs.log_records]


def decode_request(data: bytes | bytearray | memoryview) -> list[TelemetryRecord | Rejection]:
    """Every log record of a serialized ``ExportLogsServiceRequest``, in order."""
    request = parse_request(bytes(data))
    if isinstance(request, Rejection):
        return [request]
    return [decode_log_record(log_record) for log_record in log_records(request)]
