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

from .codec import RECORD_KINDS, Rejection, decode_object
from .contract import (CONTRACT_VERSION, MAX_REQUESTS_PER_STEP, BundleRecord, RequestRecord,
                       ShadowRecord, StepRecord, TelemetryRecord)
from .otlp_wire import (EncodingMemo, OddShape, delimited, encode_attribute, encode_key_value, small_ints,
                        string_values, utf8, varint)

__all__ = ["ATTRIBUTE_PREFIX", "EVENT_PREFIX", "MAX_REQUEST_BYTES", "REQUESTS_PREFIX", "ROUND_COLUMNS",
           "STEP_SCALARS", "LogEntry", "log_entry", "record_from_attributes", "encode_entries", "encode_records",
           "iter_encoded_chunks", "decode_log_record", "decode_request", "log_records", "parse_request"]

EVENT_PREFIX = "specwatch."
ATTRIBUTE_PREFIX = "specwatch."
REQUESTS_PREFIX = "specwatch.requests."
ROUND_COLUMNS = ("id", "bucket", "cohort", "drafted", "accepted")
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


STEP_SCALARS = ("v", "ts", "worker", "seq", "bundle_id", "draft_ms", "verify_ms", "kv_usage")
_STEP_SCALAR_KEYS = tuple(ATTRIBUTE_PREFIX + name for name in STEP_SCALARS)
_STEP_SCALAR_VALUES = attrgetter(*STEP_SCALARS)
_ROUND_GETTERS = tuple((REQUESTS_PREFIX + name, attrgetter(name)) for name in ROUND_COLUMNS)


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

_pack_fixed64 = struct.Struct("<Q").pack


def _log_record(entry: LogEntry, memo: EncodingMemo) -> bytes:
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
                piece = strings[(key, value)] = encode_attribute(key, value, memo)
            append(piece)
        else:
            append(encode_attribute(key, value, memo))
    if nanos:
        append(b"\x59" + stamp[1:])
    if entry.event_name:
        append(delimited(b"\x62", utf8(entry.event_name)))
    return b"".join(parts)


class _Envelope:
    """The request around a run of serialized log records: one resource, one scope."""

    def __init__(self, resource: Mapping[str, Any] | None) -> None:
        attributes = _DEFAULT_RESOURCE if resource is None else resource
        memo = EncodingMemo()
        self.resource = delimited(b"\x0a", b"".join([encode_key_value(str(k), v, memo) for k, v in attributes.items()]))
        scope = delimited(b"\x0a", utf8(_SCOPE_NAME)) + delimited(b"\x12", str(CONTRACT_VERSION).encode())
        self.scope = delimited(b"\x0a", scope)
        # Worst case of the three length prefixes that grow with the content (5 bytes each).
        self.overhead = 1 + len(self.resource) + 1 + len(self.scope) + 3 * 5 + 2

    def wrap(self, log_records: Sequence[bytes]) -> bytes:
        scope_logs = self.scope + b"".join([b"\x12" + varint(len(r)) + r for r in log_records])
        resource_logs = self.resource + delimited(b"\x12", scope_logs)
        return delimited(b"\x0a", resource_logs)


def encode_entries(entries: Iterable[LogEntry], *, resource: Mapping[str, Any] | None = None) -> bytes:
    """One serialized ``ExportLogsServiceRequest`` holding every entry, in order."""
    memo = EncodingMemo()
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
    memo = EncodingMemo()
    pending: list[bytes] = []
    size = envelope.overhead
    for entry in entries:
        record = _log_record(entry, memo)
        record_size = len(record) + 6  # tag and length prefix in ScopeLogs
        if pending and size + record_size > max_bytes:
            yield envelope.wrap(pending), len(pending)
            pending, size = [], envelope.overhead
            memo = EncodingMemo()  # bounded by one chunk's distinct strings
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


def _column_from_wire(data: bytes) -> list | None:
    """The two column shapes a step carries, read from the array's bytes; None otherwise."""
    try:
        return list(small_ints(data))
    except OddShape:
        pass
    try:
        return string_values(data, 0, len(data))
    except (OddShape, IndexError):
        return None


def _rows(columns: dict[str, Any]) -> list[dict[str, Any]] | Rejection:
    lengths = {}
    for name, column in columns.items():
        if not isinstance(column, (list, tuple)):
            return Rejection("invalid_value", f"step: specwatch.requests.{name} is not an array")
        lengths[name] = len(column)
    for name in ROUND_COLUMNS:
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
    if kind not in RECORD_KINDS:
        return Rejection("unknown_kind", f"event name {event_name!r} is not specwatch.<kind> for a known kind")
    obj: dict[str, Any] = {}
    columns: dict[str, Any] = {}
    for key, value in attributes.items():
        if not isinstance(key, str) or not key.startswith(ATTRIBUTE_PREFIX):
            continue
        if key.startswith(REQUESTS_PREFIX):
            columns[key[len(REQUESTS_PREFIX):]] = value
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
