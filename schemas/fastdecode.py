"""Blocks of step records decoded as columns, without a pydantic object each (the batch mode)."""

from __future__ import annotations

import gc
import math
import os
import re
import struct
from dataclasses import dataclass
from functools import partial
from operator import attrgetter, gt
from typing import Annotated, Any, Callable, Iterator, NamedTuple, Sequence, Union

import msgspec
import numpy as np

from .codec import MAX_LINE_BYTES, Rejection, decode_line, decode_object
from .contract import (MAX_DRAFT_TOKENS, MAX_NAME_CHARS, MAX_REQUESTS_PER_STEP, StepRecord, TelemetryRecord,
                       printable, scope_name_ok)
from .otlp import (ATTRIBUTE_PREFIX, EVENT_PREFIX, REQUESTS_PREFIX, ROUND_COLUMNS, STEP_SCALARS, decode_log_record,
                   log_records, parse_request)
from .otlp_wire import EncodingMemo, OddShape, encode_attribute, read_varint, small_ints, string_values
from .scope import EVERY, SEPARATOR

__all__ = ["DECODER", "DECODERS", "StepBlock", "decode_lines_block", "record_at", "request_block"]

# ints beyond this lose precision as floats; such times take the reference path
_MAX_EXACT_INT = 1 << 53
_INF = math.inf
_STR = {str}


def _time(x: Any) -> bool:
    kind = type(x)
    return (kind is float and 0.0 <= x < _INF) or (kind is int and 0 <= x < _MAX_EXACT_INT)


def _name(x: Any) -> bool:
    # isprintable() in C settles nearly every name; `printable` only looks closer when it is False
    return type(x) is str and 0 < len(x) <= MAX_NAME_CHARS and (x.isprintable() or printable(x))


def _names(column: Any) -> bool:
    # type check over the whole column in C; lengths only over its distinct values
    if set(map(type, column)) != _STR:
        return False
    lengths = set(map(len, column))
    if min(lengths) == 0 or max(lengths) > MAX_NAME_CHARS:
        return False
    joined = "".join(column)
    return joined.isprintable() or printable(joined)


def _header(v: Any, ts: Any, worker: Any, seq: Any, bundle_id: Any, draft_ms: Any, verify_ms: Any,
            kv_usage: Any) -> tuple | None:
    """The step's scalar fields as the reference would type them, or None to take the reference path."""
    if not (type(v) is int and v == 1 and _time(ts) and _time(draft_ms) and _time(verify_ms)
            and type(seq) is int and seq >= 0 and _name(worker) and _name(bundle_id)
            and type(kv_usage) in (float, int) and 0 <= kv_usage <= 1):
        return None
    return float(ts), worker, seq, bundle_id, float(draft_ms), float(verify_ms), float(kv_usage)


# ---------------------------------------------------------------- OTLP steps from the wire
# Why and how: docs/STREAMS.md, "The OTLP wire reader".

_STEP_EVENT = (EVENT_PREFIX + "step").encode()
_ATTRIBUTE_PREFIX = ATTRIBUTE_PREFIX.encode()
_COLUMN_PREFIX = REQUESTS_PREFIX.encode()
_COLUMN_PREFIX_LEN = len(_COLUMN_PREFIX)
_SCALAR_KEYS = {_ATTRIBUTE_PREFIX + name.encode(): name for name in STEP_SCALARS}
_ROUND_COLUMN_KEYS = tuple(name.encode() for name in ROUND_COLUMNS)
_unpack_double = struct.Struct("<d").unpack_from
_INT64_SIGN = 1 << 63
_UINT64_RANGE = 1 << 64


class _Memo:
    """What repeats across the step records of one request, keyed by the bytes it came from."""

    __slots__ = ("workers", "bundles", "ids", "buckets", "cohorts", "drafted_heads", "accepted_heads", "columns",
                 "strings")

    def __init__(self) -> None:
        # One dict per attribute of the writer's layout: an attribute's bytes hold its key, but
        # a memo shared between two of them would take one's attribute in the other's place
        # once it had seen it, so that a record's outcome would hang on the records before it.
        self.workers: dict[bytes, str | None] = {}  # worker attribute -> name, None if not one
        self.bundles: dict[bytes, str | None] = {}  # bundle_id attribute -> name, None if not one
        self.ids: dict[bytes, tuple] = {}  # id / bucket / cohort attribute -> what _strings gives
        self.buckets: dict[bytes, tuple] = {}
        self.cohorts: dict[bytes, tuple] = {}
        self.drafted_heads: dict[int, bytes] = {}  # drafted / accepted attribute size -> bytes before the elements
        self.accepted_heads: dict[int, bytes] = {}
        self.columns: dict[bytes, tuple] = {}  # an ArrayValue -> what _strings gives (any field order)
        self.strings: dict[bytes, str] = {}  # AnyValue -> string_value


def _skip(buf: bytes, p: int, wire_type: int) -> int:
    """The position after a field's payload, ``p`` just after its tag."""
    if wire_type == 0:
        while buf[p] & 0x80:
            p += 1
        return p + 1
    if wire_type == 1:
        return p + 8
    if wire_type == 2:
        size, p = read_varint(buf, p)
        return p + size
    if wire_type == 5:
        return p + 4
    raise OddShape("group or invalid wire type")


def _fields(buf: bytes, p: int, end: int, tag: int) -> Iterator[tuple[int, int]]:
    """(start, end) of each length-delimited field ``tag`` in buf[p:end], the others skipped."""
    while p < end:
        found, p = read_varint(buf, p)
        if found != tag:
            p = _skip(buf, p, found & 7)
            continue
        size, p = read_varint(buf, p)
        yield p, p + size
        p += size
    if p != end:
        raise OddShape("a field overruns its message")


def _log_record_spans(buf: bytes) -> list[tuple[int, int]] | None:
    """(start, end) of every LogRecord, in upb's order; None if groups get in the way."""
    try:
        return [log_record for resource_logs in _fields(buf, 0, len(buf), 0x0A)
                for scope_logs in _fields(buf, *resource_logs, 0x12)
                for log_record in _fields(buf, *scope_logs, 0x12)]
    except (OddShape, IndexError):
        return None


def _key_value(buf: bytes, p: int, end: int) -> tuple[bytes, int, int]:
    """Key and value span of the KeyValue in buf[p:end]; an absent value is an empty span."""
    key = b""
    value = None
    while p < end:
        field = buf[p]
        size = buf[p + 1]
        p += 2
        if size & 0x80:
            size, p = read_varint(buf, p - 1)
        if field == 0x0A:
            key = buf[p:p + size]
        elif field == 0x12 and value is None:
            value = (p, p + size)
        else:  # unknown field, or a value in two parts that protobuf would merge
            raise OddShape("KeyValue other than key + value")
        p += size
    if p != end:
        raise OddShape("KeyValue overruns")
    return (key, *value) if value else (key, end, end)


def _attribute_end(buf: bytes, p: int) -> int:
    """The end of the LogRecord attribute (field 6) at ``p``."""
    if buf[p] != 0x32:
        raise OddShape("not an attribute")
    size = buf[p + 1]
    if size < 0x80:
        return p + 2 + size
    high = buf[p + 2]
    if high < 0x80:  # columns of a few dozen rounds
        return p + 3 + ((size & 0x7F) | high << 7)
    size, q = read_varint(buf, p + 1)
    return q + size


def _attribute_value(attribute: bytes, key: bytes) -> tuple[int, int]:
    """The value span of one serialized attribute (tag, size, KeyValue) holding ``key``."""
    size, p = read_varint(attribute, 1)
    found, start, end = _key_value(attribute, p, len(attribute))
    if found != key:
        raise OddShape("another attribute here")
    return start, end


def _scalar(buf: bytes, start: int, end: int, strings: dict) -> Any:
    """The AnyValue in buf[start:end] as `otlp._py` gives it, for a value of one scalar field."""
    if start == end:
        return None
    tag = buf[start]
    if tag == 0x21 and end - start == 9:  # double_value
        return _unpack_double(buf, start + 1)[0]
    if tag == 0x18:  # int_value: int64, negatives as two's complement
        value, p = read_varint(buf, start + 1)
        if p != end:
            raise OddShape("int_value and more")
        return value - _UINT64_RANGE if value >= _INT64_SIGN else value
    if tag == 0x0A:  # string_value
        encoded = buf[start:end]
        value = strings.get(encoded)
        if value is None:
            size, p = read_varint(buf, start + 1)
            if p + size != end:
                raise OddShape("string_value and more")
            value = strings[encoded] = buf[p:end].decode()
        return value
    if tag == 0x10:  # bool_value
        value, p = read_varint(buf, start + 1)
        if p != end:
            raise OddShape("bool_value and more")
        return value != 0
    raise OddShape("not one scalar field")


def _array_body(buf: bytes, start: int, end: int) -> tuple[int, int]:
    """The ArrayValue inside the AnyValue buf[start:end], which must hold nothing else."""
    if start == end or buf[start] != 0x2A:
        raise OddShape("not an array_value")
    size, p = read_varint(buf, start + 1)
    if p + size != end:
        raise OddShape("array_value and more")
    return p, end


def _strings(buf: bytes, start: int, end: int) -> tuple[tuple[str, ...], bool, bool]:
    """An ArrayValue of plain string elements: the values, whether every one is a Name, and
    whether every one is a Name fit for a scope key (a bucket or cohort)."""
    values = tuple(string_values(buf, start, end))
    named = not values or _names(values)
    return values, named, named and all(map(scope_name_ok, set(values)))


def record_at(buf: bytes, start: int, end: int) -> TelemetryRecord | Rejection:
    """The record of one OTLP log record held at ``buf[start:end]``, decoded on the reference path."""
    from opentelemetry.proto.logs.v1.logs_pb2 import LogRecord

    return decode_log_record(LogRecord.FromString(buf[start:end]))


class _StepRow(NamedTuple):
    """A valid OTLP step, its round columns as read (a row of a `StepBlock` to be)."""

    header: tuple
    ids: tuple
    buckets: tuple
    cohorts: tuple
    drafted: bytes
    accepted: bytes
    build: Callable


def _step(header: tuple, ids: tuple, buckets: tuple, cohorts: tuple, drafted: bytes, accepted: bytes,
          build: Callable) -> _StepRow | None:
    """The step if its rounds pass the contract's checks, else None (the reference decides)."""
    ids, ids_named, _ = ids
    buckets, _, buckets_scoped = buckets
    cohorts, _, cohorts_scoped = cohorts
    n = len(ids)
    if not (n <= MAX_REQUESTS_PER_STEP and ids_named and buckets_scoped and cohorts_scoped and len(buckets) == n
            and len(cohorts) == n and len(drafted) == n and len(accepted) == n):
        return None
    if n and (max(drafted) > MAX_DRAFT_TOKENS or any(map(gt, accepted, drafted))):
        return None
    return _StepRow(header, ids, buckets, cohorts, drafted, accepted, build)


# ------------------------------------------------ the layout otlp.encode_records writes


def _written(key: str, value: Any) -> bytes:
    return encode_attribute(key, value, EncodingMemo())


def _head(key: str, value: Any, tail: int) -> bytes:
    """The bytes the writer puts before the last ``tail`` bytes of this attribute."""
    return _written(key, value)[:-tail]


_STAMP, _OBSERVED = 0x09, 0x59
_BODY = 0x2A
# Fields between the attributes and the event name that a step never reads, as the
# Collector re-encodes them: flags (8, fixed32), trace_id (9) and span_id (10), short
# length-delimited, and observed_time_unix_nano (11, fixed64).
_FLAGS, _TRACE_ID, _SPAN_ID = 0x45, 0x4A, 0x52


def _after_unread_fields(buf: bytes, p: int) -> int:
    """The position after any flags, trace id, span id and observed time at ``p``, in field order."""
    if buf[p] == _FLAGS:
        p += 5
    if buf[p] == _TRACE_ID and buf[p + 1] < 0x80:
        p += 2 + buf[p + 1]
    if buf[p] == _SPAN_ID and buf[p + 1] < 0x80:
        p += 2 + buf[p + 1]
    if buf[p] == _OBSERVED:
        p += 9
    return p

_MISSING = object()
_V_TS_HEAD = _written("specwatch.v", 1) + _head("specwatch.ts", 0.5, 8)
_V_TS = struct.Struct(f"<{len(_V_TS_HEAD)}sd")
_V_TS_SIZE = _V_TS.size
_DRAFT_HEAD, _VERIFY_HEAD, _KV_HEAD = (_head(f"specwatch.{name}", 0.5, 8) for name in ("draft_ms", "verify_ms", "kv_usage"))
_TIMES = struct.Struct(f"<{len(_DRAFT_HEAD)}sd{len(_VERIFY_HEAD)}sd{len(_KV_HEAD)}sd")
_TIMES_SIZE = _TIMES.size
# seq by the size of its attribute (one byte): the bytes before the varint, and its width
_SEQ_HEADS = {len(attribute) - 2: (attribute[:-width], width) for width, attribute in (
    (len(_written("specwatch.seq", value)) - len(_written("specwatch.seq", 0)) + 1, _written("specwatch.seq", value))
    for value in [1 << 7 * k for k in range(9)] + [-1])}
_WORKER_KEY, _BUNDLE_KEY = b"specwatch.worker", b"specwatch.bundle_id"
_ID_KEY, _BUCKET_KEY, _COHORT_KEY, _DRAFTED_KEY, _ACCEPTED_KEY = (_COLUMN_PREFIX + name for name in _ROUND_COLUMN_KEYS)
_EVENT_FIELD = b"\x62" + bytes((len(_STEP_EVENT),)) + _STEP_EVENT
_EVENT_FIELD_SIZE = len(_EVENT_FIELD)


def _plain_name(attribute: bytes, key: bytes, names: dict, strings: dict) -> str | None:
    """The worker or bundle id in a serialized attribute (None if not a Name), memoised in ``names``."""
    value = _scalar(attribute, *_attribute_value(attribute, key), strings)
    name = names[attribute] = value if _name(value) else None
    return name


def _plain_strings(attribute: bytes, key: bytes, columns: dict) -> tuple:
    """The id, bucket or cohort column in a serialized attribute, as `_strings` gives it, memoised in ``columns``."""
    body = _array_body(attribute, *_attribute_value(attribute, key))
    found = columns[attribute] = _strings(attribute, *body)
    return found


def _plain_int_head(attribute: bytes, key: bytes, heads: dict) -> bytes:
    """The bytes before the elements of a drafted or accepted attribute, memoised in ``heads``."""
    start, _ = _array_body(attribute, *_attribute_value(attribute, key))
    # keyed by size alone: the key is part of the head, which is compared whole
    head = heads[len(attribute)] = attribute[:start]
    return head


def _step_plain(buf: bytes, start: int, end: int, memo: _Memo) -> _StepRow | None:
    """A step in the writer's layout, or None if its values fail the checks; `OddShape` otherwise."""
    # Every piece is read at the offset the one before it ends: a length read from the
    # bytes, or a fixed layout compared whole. The event name must end the record exactly.
    p = start + 9 if buf[start] == _STAMP else start
    if buf[p] == _BODY and buf[p + 1] == 0:
        p += 2  # the empty body the OpenTelemetry Collector writes into every record it re-encodes
    head, ts = _V_TS.unpack_from(buf, p)
    if head != _V_TS_HEAD:
        raise OddShape("not v, ts")
    p += _V_TS_SIZE
    # the memo lookups are inline and the helpers run only on a miss: a call per attribute
    # cost this decoder about a tenth of its speed
    q = _attribute_end(buf, p)
    attribute = buf[p:q]
    worker = memo.workers.get(attribute, _MISSING)
    if worker is _MISSING:
        worker = _plain_name(attribute, _WORKER_KEY, memo.workers, memo.strings)
    head, width = _SEQ_HEADS[buf[q + 1]]
    if not buf.startswith(head, q):
        raise OddShape("not seq")
    p = q + len(head)
    seq = buf[p]
    if width == 1:
        p += 1
        if seq >= 0x80:
            raise OddShape("seq varint")
    else:
        seq, q = read_varint(buf, p)
        p += width
        if q != p:
            raise OddShape("seq varint")
    q = _attribute_end(buf, p)
    attribute = buf[p:q]
    bundle_id = memo.bundles.get(attribute, _MISSING)
    if bundle_id is _MISSING:
        bundle_id = _plain_name(attribute, _BUNDLE_KEY, memo.bundles, memo.strings)
    draft_head, draft_ms, verify_head, verify_ms, kv_head, kv_usage = _TIMES.unpack_from(buf, q)
    if draft_head != _DRAFT_HEAD or verify_head != _VERIFY_HEAD or kv_head != _KV_HEAD:
        raise OddShape("not draft_ms, verify_ms, kv_usage")
    p = q + _TIMES_SIZE
    q = _attribute_end(buf, p)
    attribute = buf[p:q]
    ids = memo.ids.get(attribute) or _plain_strings(attribute, _ID_KEY, memo.ids)
    p = _attribute_end(buf, q)
    attribute = buf[q:p]
    buckets = memo.buckets.get(attribute) or _plain_strings(attribute, _BUCKET_KEY, memo.buckets)
    q = _attribute_end(buf, p)
    attribute = buf[p:q]
    cohorts = memo.cohorts.get(attribute) or _plain_strings(attribute, _COHORT_KEY, memo.cohorts)
    p = _attribute_end(buf, q)
    attribute = buf[q:p]
    head = memo.drafted_heads.get(p - q)
    if head is None or not attribute.startswith(head):
        head = _plain_int_head(attribute, _DRAFTED_KEY, memo.drafted_heads)
    drafted = small_ints(attribute[len(head):])
    q = _attribute_end(buf, p)
    attribute = buf[p:q]
    head = memo.accepted_heads.get(q - p)
    if head is None or not attribute.startswith(head):
        head = _plain_int_head(attribute, _ACCEPTED_KEY, memo.accepted_heads)
    accepted = small_ints(attribute[len(head):])
    p = q
    p = _after_unread_fields(buf, p)
    if p + _EVENT_FIELD_SIZE != end or not buf.startswith(_EVENT_FIELD, p):
        raise OddShape("not the step event name last")
    # typed by the layout already: only their ranges are left (`_header`'s checks, inline for speed)
    if not (0.0 <= ts < _INF and 0.0 <= draft_ms < _INF and 0.0 <= verify_ms < _INF
            and 0.0 <= kv_usage <= 1.0 and seq < _INT64_SIGN and worker is not None
            and bundle_id is not None):
        return None
    header = (ts, worker, seq, bundle_id, draft_ms, verify_ms, kv_usage)
    build = partial(record_at, buf, start, end)
    return _step(header, ids, buckets, cohorts, drafted, accepted, build)


# ------------------------------------------------ any field order


def _step_from_wire(buf: bytes, start: int, end: int, memo: _Memo) -> _StepRow | None:
    """The LogRecord in buf[start:end] as a step, None if not a valid one; `OddShape` if unsure."""
    event = None
    scalars: dict[str, tuple[int, int]] = {}
    spans: dict[bytes, tuple[int, int]] = {}
    p = start
    while p < end:
        tag = buf[p]
        if tag == 0x32:  # attributes
            size, p = read_varint(buf, p + 1)
            pair_end = p + size
            key, value_start, value_end = _key_value(buf, p, pair_end)
            p = pair_end
            if key.startswith(_ATTRIBUTE_PREFIX):
                name = _SCALAR_KEYS.get(key)
                if name is not None:
                    scalars[name] = (value_start, value_end)
                elif key.startswith(_COLUMN_PREFIX):
                    spans[key[_COLUMN_PREFIX_LEN:]] = (value_start, value_end)
        elif tag == _STAMP or tag == _OBSERVED:
            p += 9
        elif tag == 0x62:  # event_name
            size, p = read_varint(buf, p + 1)
            event = buf[p:p + size]
            p += size
        else:
            tag, p = read_varint(buf, p)
            if tag in _READ_TAGS:  # written overlong: protobuf still reads it as that field
                raise OddShape("overlong tag")
            p = _skip(buf, p, tag & 7)
    if p != end:
        raise OddShape("LogRecord overruns")
    if event != _STEP_EVENT:
        return None
    values = {name: _scalar(buf, s, e, memo.strings) for name, (s, e) in scalars.items()}
    header = _header(*map(values.get, STEP_SCALARS))
    if header is None:
        return None
    try:
        columns = [_array_body(buf, *spans.pop(name)) for name in _ROUND_COLUMN_KEYS]
    except KeyError:
        return None
    found = []
    bodies = memo.columns
    for s, e in columns[:3]:
        body = buf[s:e]
        column = bodies.get(body)
        if column is None:
            column = bodies[body] = _strings(buf, s, e)
        found.append(column)
    ids, buckets, cohorts = found
    for s, e in spans.values():  # columns beyond the contract's: only their lengths matter
        if sum(1 for _ in _fields(buf, *_array_body(buf, s, e), 0x0A)) != len(ids[0]):
            return None
    return _step(header, ids, buckets, cohorts, small_ints(buf[slice(*columns[3])]),
                 small_ints(buf[slice(*columns[4])]), partial(record_at, buf, start, end))


_READ_TAGS = frozenset((0x32, _STAMP, _OBSERVED, 0x62))
_NOT_READ = (OddShape, IndexError, ValueError, TypeError, KeyError, struct.error)


def _native_walk(name: str, *settings: Any) -> Any:
    """A compiled step walk (the package specwatch_native, built from native/) made with
    ``settings``, or None: not built on this machine (or built before it had this walk), or
    SPECWATCH_NATIVE=0 asks for the reference path."""
    if os.environ.get("SPECWATCH_NATIVE", "1") == "0":
        return None
    try:
        import specwatch_native
    except ImportError:
        return None
    walk = getattr(specwatch_native, name, None)
    return None if walk is None else walk(*settings)


# the layout's bytes as the writer makes them here: the two readers cannot drift apart
_NATIVE_WALK = _native_walk("StepWalk", _V_TS_HEAD, _SEQ_HEADS, (_DRAFT_HEAD, _VERIFY_HEAD, _KV_HEAD), _WORKER_KEY,
                            _BUNDLE_KEY, (_ID_KEY, _BUCKET_KEY, _COHORT_KEY, _DRAFTED_KEY, _ACCEPTED_KEY),
                            _EVENT_FIELD, MAX_NAME_CHARS, MAX_REQUESTS_PER_STEP, MAX_DRAFT_TOKENS, EVERY.encode(),
                            ord(SEPARATOR))


def _request_items(data: bytes | bytearray | memoryview,
                   native: bool = True) -> list[TelemetryRecord | _StepRow | Rejection]:
    """`otlp.decode_request` with the steps the wire reader reads as `_StepRow`; every other outcome is identical.

    ``native``: let the compiled walk read the steps in the writer's layout, if it is loaded;
    what it leaves (None) takes the reference path below, record by record.

    >>> _request_items(b"\\xff\\xff not protobuf")[0].reason
    'invalid_otlp'
    """
    buf = bytes(data)
    request = parse_request(buf)
    if isinstance(request, Rejection):
        return [request]
    walked = _NATIVE_WALK.records(buf) if native and _NATIVE_WALK is not None else None
    if walked is None:
        spans = _log_record_spans(buf)
        if spans is None:
            return [decode_log_record(log_record) for log_record in log_records(request)]
        walked = [(start, end, None) for start, end in spans]
    memo = _Memo()
    parsed: list | None = None
    out: list = []
    append = out.append
    for index, (start, end, row) in enumerate(walked):
        if row is not None:
            append(_StepRow(*row, partial(record_at, buf, start, end)))
            continue
        try:
            step = _step_plain(buf, start, end, memo)
        except _NOT_READ:
            step = None
            # without those bytes anywhere the event name cannot be a step's (request, bundle)
            if buf.find(_STEP_EVENT, start, end) >= 0:
                try:
                    step = _step_from_wire(buf, start, end, memo)
                except _NOT_READ:
                    pass
        if step is None:
            if parsed is None:
                parsed = log_records(request)
                if len(parsed) != len(walked):  # cannot happen if _log_record_spans reads as upb does
                    return [decode_log_record(log_record) for log_record in parsed]
            step = decode_log_record(parsed[index])
        append(step)
    return out

# ------------------------------------------------ a block of records, its steps as columns


@dataclass(slots=True, eq=False)
class StepBlock:
    """A block of decoded records, its valid steps as columns (fields: docs/STREAMS.md)."""

    ts: np.ndarray
    workers: list
    seqs: list
    bundle_key: np.ndarray
    draft_ms: np.ndarray
    verify_ms: np.ndarray
    kv_usage: np.ndarray
    at: list
    round_step: np.ndarray
    round_key: np.ndarray
    drafted: np.ndarray
    accepted: np.ndarray
    count: np.ndarray
    keys: list
    others: list
    step_ids: list
    _build: Callable[[int], Callable[[], TelemetryRecord | Rejection]]

    def __len__(self) -> int:
        return len(self.seqs)

    def builder(self, row: int) -> Callable[[], TelemetryRecord | Rejection]:
        return self._build(self.at[row])

    def record(self, row: int) -> StepRecord:
        return self._build(self.at[row])()


_BlockName = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NAME_CHARS)]


# A step's own fields; its requests stay bytes (`_read_rounds` reads them). gc=False: a
# block makes a struct per step and holds them all at once; they hold no containers.
class _BlockStep(msgspec.Struct, tag_field="kind", tag="step", gc=False):
    v: int
    ts: float
    worker: _BlockName
    seq: Annotated[int, msgspec.Meta(ge=0, le=_INT64_SIGN - 1)]
    bundle_id: _BlockName
    draft_ms: float
    verify_ms: float
    kv_usage: float
    requests: msgspec.Raw


_BlockCount = Annotated[int, msgspec.Meta(ge=0, le=MAX_DRAFT_TOKENS)]


# A step's round as `_any_layout` decodes it; gc=False as `_BlockStep`.
class _BlockRound(msgspec.Struct, gc=False):
    id: _BlockName
    bucket: _BlockName
    cohort: _BlockName
    drafted: _BlockCount
    accepted: _BlockCount


_ROUNDS_DECODER = msgspec.json.Decoder(Annotated[list[_BlockRound], msgspec.Meta(max_length=MAX_REQUESTS_PER_STEP)])
_ROUND_ID = attrgetter("id")
_SCOPE = attrgetter("bucket", "cohort")
_DRAFTED = attrgetter("drafted")
_ACCEPTED = attrgetter("accepted")


# Records of the other kinds, read no further here: each is decoded again, alone, by `_decode_other`.
_OTHER_KIND_NAMES = ("request", "shadow", "bundle")
_OTHER_KINDS = tuple(msgspec.defstruct(f"_Other{kind.title()}", [], tag_field="kind", tag=kind)
                     for kind in _OTHER_KIND_NAMES)
_BLOCK_DECODER = msgspec.json.Decoder(list[Union[(_BlockStep, *_OTHER_KINDS)]])
# a union even for one line: msgspec requires the tag only to choose among types, and a line
# without "kind" is no step
_LINE_DECODER = msgspec.json.Decoder(Union[(_BlockStep, *_OTHER_KINDS)])
_ANY_DECODER = msgspec.json.Decoder()
_LINE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError)
_STEP_FIELDS = attrgetter("ts", "worker", "seq", "bundle_id", "draft_ms", "verify_ms", "kv_usage", "v")
_REQUESTS = attrgetter("requests")


_NATIVE_LINES = _native_walk("LineWalk", MAX_LINE_BYTES, MAX_NAME_CHARS, MAX_REQUESTS_PER_STEP, MAX_DRAFT_TOKENS,
                             float(_MAX_EXACT_INT), EVERY.encode(), ord(SEPARATOR))
# which path each encoding's block decoder takes by default: the bench report names them
DECODERS = {"jsonl": "reference" if _NATIVE_LINES is None else "native",
            "otlp": "reference" if _NATIVE_WALK is None else "native"}
DECODER = "native" if set(DECODERS.values()) == {"native"} else "reference"


def _line_step(line: bytes) -> _BlockStep | None:
    if len(line) > MAX_LINE_BYTES:
        return None
    try:
        return _LINE_DECODER.decode(line)
    except _LINE_ERRORS:
        return None


def _decode_other(line: bytes) -> TelemetryRecord | Rejection | None:
    """What `codec.decode_line` gives for a line the block does not hold as columns."""
    if len(line) <= MAX_LINE_BYTES:
        try:
            obj = _ANY_DECODER.decode(line)
        except _LINE_ERRORS:
            return decode_line(line)  # blank, invalid, or JSON the stdlib reads and msgspec does not (NaN, 1e999)
        if type(obj) is dict and obj.get("kind") in _OTHER_KIND_NAMES:
            record = decode_object(obj)
            if not isinstance(record, Rejection):
                return record
    return decode_line(line)


def _parsed_lines(lines: Sequence[bytes]) -> list:
    """Each line as a `_BlockStep` when msgspec reads it as one, else something else."""
    if lines and all(len(line) <= MAX_LINE_BYTES for line in lines):
        try:  # one parse of the whole block: most blocks hold only records of known kinds
            parsed = _BLOCK_DECODER.decode(b"[" + b",".join(lines) + b"]")
        except _LINE_ERRORS:
            pass  # a blank or bad line somewhere: line by line
        else:
            if len(parsed) == len(lines):  # else a line held two objects and a comma: line by line
                return parsed
    return [_line_step(line) for line in lines]


# ---------------------------------------------- round columns read by position from the bytes
# How: docs/STREAMS.md, "Round columns read by position".

_QUOTES_PER_ROUND = 16
_DRAFTED_QUOTE, _ACCEPTED_QUOTE = 13, 15  # the closing quotes of the keys "drafted" and "accepted"
_TEXT = rb'[\x20\x21\x23-\x5b\x5d-\x7e]{1,%d}' % MAX_NAME_CHARS  # a Name: printable ASCII, no quote or backslash
_COUNT = rb'[1-9]?[0-9]'  # 0-99 as JSON writes it; the bounds are checked on the numbers
_ROUND_LAYOUT = (rb'\{"id":"' + _TEXT + rb'","bucket":"' + _TEXT + rb'","cohort":"' + _TEXT + rb'","drafted":'
                 + _COUNT + rb',"accepted":' + _COUNT + rb'\}')
_REQUESTS_LAYOUT = re.compile(rb'\[(?:' + _ROUND_LAYOUT + rb'(?:,' + _ROUND_LAYOUT + rb')*)?\]')
_ROUND_NAMES = re.compile(rb'\{"id":"([^"]*)","bucket":"([^"]*)","cohort":"([^"]*)"')
_MASK = ord("1")  # a count's digits, overwritten: "4" and "7" read alike, "12" and "4" do not
_ZERO = ord("0")


def _digits(buf: np.ndarray, at: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The counts of one or two digits at ``at``: (value, whether two digits, whether a count at all)."""
    first, second = buf[at].astype(np.int64) - _ZERO, buf[at + 1].astype(np.int64) - _ZERO
    two = (second >= 0) & (second <= 9)
    valid = (first >= 0) & (first <= 9) & ~(two & (first == 0))
    return np.where(two, first * 10 + second, first), two, valid


def _step_names(masked: bytes, pairs: dict) -> tuple | None:
    """A step's requests (counts masked) as (ids, each round's index in ``pairs``), None if not read here."""
    if _REQUESTS_LAYOUT.fullmatch(masked) is None:
        return None
    names = _ROUND_NAMES.findall(masked)
    if len(names) > MAX_REQUESTS_PER_STEP:
        return None
    ids, buckets, cohorts = zip(*names) if names else ((), (), ())
    scopes = list(zip(buckets, cohorts))
    index: dict[tuple[bytes, bytes], int] = {}
    for scope in dict.fromkeys(scopes):
        bucket, cohort = scope[0].decode(), scope[1].decode()
        if not (scope_name_ok(bucket) and scope_name_ok(cohort)):
            return None
        index[scope] = pairs.setdefault((bucket, cohort), len(pairs))
    return tuple(rid.decode() for rid in ids), np.fromiter(map(index.__getitem__, scopes), np.int64, len(scopes))


def _read_rounds(raws: list) -> tuple[list, np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict]:
    """Each step's requests (msgspec.Raw, valid JSON) read as round columns, without a Python object per round.

    Returns ``(names, round_step, drafted, accepted, pair, pairs)``: per step, ``(ids, its
    rounds' indices in pairs)``, or None if its requests are not read here; per round of
    the steps read, its step, counts and (bucket, cohort) index; ``pairs``, (bucket,
    cohort) -> index.
    """
    n_steps = len(raws)
    lengths = np.fromiter(map(len, raws), np.int64, n_steps)
    ends = np.cumsum(lengths)
    starts = ends - lengths
    joined = b"".join(raws)
    buf = np.frombuffer(joined + b"\0\0\0", dtype=np.uint8)  # reads just past a step stay inside
    quotes = np.flatnonzero(buf == 0x22)
    per_step = np.diff(np.append(np.searchsorted(quotes, starts), len(quotes)))
    plain = per_step % _QUOTES_PER_ROUND == 0
    if not plain.all():
        quotes = quotes[np.repeat(plain, per_step)]
        per_step = np.where(plain, per_step, 0)
    quotes = quotes.reshape(-1, _QUOTES_PER_ROUND)
    round_step = np.repeat(np.arange(n_steps), per_step // _QUOTES_PER_ROUND)
    drafted_at, accepted_at = quotes[:, _DRAFTED_QUOTE] + 2, quotes[:, _ACCEPTED_QUOTE] + 2
    drafted, two_drafted, drafted_ok = _digits(buf, drafted_at)
    accepted, two_accepted, accepted_ok = _digits(buf, accepted_at)
    # only digits are overwritten, and only inside their own round: a quote follows drafted,
    # `}]` at least follows accepted
    ok = (drafted_ok & accepted_ok & (drafted_at + 1 < quotes[:, _DRAFTED_QUOTE + 1])
          & (accepted_at + 2 < ends[round_step]))
    plain[round_step[~ok]] = False
    masked = buf.copy()
    for at, two in ((drafted_at, two_drafted), (accepted_at, two_accepted)):
        masked[at[ok]] = _MASK
        masked[at[ok & two] + 1] = _MASK
    masked_bytes = masked.tobytes()
    memo: dict[bytes, tuple | None] = {}
    pairs: dict[tuple[str, str], int] = {}
    names: list = []
    append = names.append
    for start, end, read in zip(starts.tolist(), ends.tolist(), plain.tolist()):
        if not read:
            append(None)
            continue
        key = masked_bytes[start:end]
        found = memo.get(key, _MISSING)
        if found is _MISSING:
            found = memo[key] = _step_names(key, pairs)
        append(found)
    others = [i for i, found in enumerate(names) if found is None]
    if others:
        round_step, drafted, accepted = _merged(names, round_step, drafted, accepted,
                                                {i: _any_layout(raws[i], pairs) for i in others})
    return names, round_step, drafted, accepted, pairs


def _merged(names: list, round_step: np.ndarray, drafted: np.ndarray, accepted: np.ndarray,
            decoded: dict[int, tuple | None]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The round columns with each step in ``decoded`` (by `_any_layout`) in place of what was read by position."""
    bounds = np.searchsorted(round_step, np.arange(len(names) + 1)).tolist()
    drafted_parts, accepted_parts = [], []
    for i, found in enumerate(names):
        if i not in decoded:
            drafted_parts.append(drafted[bounds[i]:bounds[i + 1]])
            accepted_parts.append(accepted[bounds[i]:bounds[i + 1]])
            continue
        found = decoded[i]
        names[i] = None if found is None else found[:2]
        drafted_parts.append(found[2] if found else drafted[:0])
        accepted_parts.append(found[3] if found else accepted[:0])
    round_step = np.repeat(np.arange(len(names)), [len(part) for part in drafted_parts])
    return round_step, np.concatenate(drafted_parts), np.concatenate(accepted_parts)


def _any_layout(raw: msgspec.Raw, pairs: dict) -> tuple | None:
    """A step's requests decoded round by round, for a layout `_read_rounds` does not read by position.

    Returns ``(ids, each round's index in pairs, drafted, accepted)``, or None if they fail
    the contract's checks.
    """
    try:
        rounds = _ROUNDS_DECODER.decode(raw)
    except _LINE_ERRORS:
        return None
    ids = tuple(map(_ROUND_ID, rounds))
    scopes = list(map(_SCOPE, rounds))
    drafted = np.fromiter(map(_DRAFTED, rounds), np.int64, len(rounds))
    accepted = np.fromiter(map(_ACCEPTED, rounds), np.int64, len(rounds))
    if not all(map(_name, set(ids))):  # counts are checked with every other round's
        return None
    distinct = dict.fromkeys(scopes)
    if not all(_name(name) and scope_name_ok(name) for scope in distinct for name in scope):
        return None
    index = {scope: pairs.setdefault(scope, len(pairs)) for scope in distinct}
    return ids, np.fromiter(map(index.__getitem__, scopes), np.int64, len(scopes)), drafted, accepted


def decode_lines_block(lines: Sequence[bytes | str], native: bool = True) -> StepBlock:
    """A block of JSON lines as one `StepBlock`, positions being line numbers in the block.

    ``native=False`` keeps to the reference path even where the compiled walk is loaded.

    >>> step = (b'{"kind":"step","v":1,"ts":%d,"worker":"w1","seq":%d,"bundle_id":"b","draft_ms":1.0,'
    ...         b'"verify_ms":9.0,"kv_usage":0.5,"requests":[{"id":"r","bucket":"chat","cohort":"main",'
    ...         b'"drafted":4,"accepted":3}]}')
    >>> block = decode_lines_block([step % (10, 1), step % (11, 2), b"", b"{", step % (12, 3)])
    >>> block.at, [(at, type(item).__name__) for at, item in block.others]
    ([0, 1, 4], [(3, 'Rejection')])
    >>> block.seqs, block.keys, block.round_key.tolist(), block.step_ids, block.record(1).seq
    ([1, 2, 3], [('b', 'chat', 'main'), ('b', None, None)], [0, 0, 0], [('r',), ('r',), ('r',)], 2)
    """
    lines = [line.encode() if type(line) is str else line for line in lines]
    if native and _NATIVE_LINES is not None:
        return _walked_lines_block(lines)
    return _reference_lines_block(lines, lambda position: partial(decode_line, lines[position]))


def _walked_lines_block(lines: list[bytes]) -> StepBlock:
    """`decode_lines_block` with the compiled walk reading the steps in the writer's layout; the
    lines it declines take the reference path, and their steps join the walk's by position."""
    (at, declined, ts, workers, seqs, bundles, draft_ms, verify_ms, kv_usage, step_ids, round_step, pair_index,
     pairs, drafted, accepted) = _NATIVE_LINES.block(lines)

    def build(position: int) -> Callable:
        return partial(decode_line, lines[position])

    header = (np.frombuffer(ts), workers, seqs, bundles, np.frombuffer(draft_ms), np.frombuffer(verify_ms),
              np.frombuffer(kv_usage))
    walked = _interned(header, np.frombuffer(round_step, dtype=np.int64), np.frombuffer(pair_index, dtype=np.int64),
                       pairs, np.frombuffer(drafted, dtype=np.uint8), np.frombuffer(accepted, dtype=np.uint8), at, [],
                       step_ids, build)
    if not declined:
        return walked
    rest = _reference_lines_block([lines[i] for i in declined], build)
    rest.at = [declined[i] for i in rest.at]
    rest.others = [(declined[i], item) for i, item in rest.others]
    if not len(rest):  # lines of other kinds, blank or bad ones: no step to place among the walk's
        walked.others = rest.others
        return walked
    return _joined(walked, rest, build)


def _joined(first: StepBlock, second: StepBlock, build: Callable) -> StepBlock:
    """One block of the steps and other records of two blocks over the same lines, in line order,
    (bucket, cohort) pairs numbered in the order the steps list them."""
    rows = sorted([(position, block, row) for block in (first, second) for row, position in enumerate(block.at)],
                  key=lambda item: item[0])
    pairs: dict[tuple[str, str], int] = {}
    columns: list[list] = [[] for _ in range(7)]
    pair_index, drafted, accepted, step_ids, counts = [], [], [], [], []
    for _, block, row in rows:
        start, end = np.searchsorted(block.round_step, (row, row + 1)).tolist()
        for column, value in zip(columns, (block.ts[row], block.workers[row], block.seqs[row],
                                           block.keys[block.bundle_key[row]][0], block.draft_ms[row],
                                           block.verify_ms[row], block.kv_usage[row])):
            column.append(value)
        pair_index += [pairs.setdefault(block.keys[k][1:], len(pairs)) for k in block.round_key[start:end].tolist()]
        drafted.append(block.drafted[start:end])
        accepted.append(block.accepted[start:end])
        step_ids.append(block.step_ids[row])
        counts.append(end - start)
    round_step = np.repeat(np.arange(len(rows)), counts)
    return _interned(columns, round_step, np.asarray(pair_index, dtype=np.int64), list(pairs),
                     np.concatenate(drafted), np.concatenate(accepted), [position for position, _, _ in rows],
                     sorted(first.others + second.others, key=lambda item: item[0]), step_ids, build)


def _reference_lines_block(lines: list[bytes], build: Callable) -> StepBlock:
    """`decode_lines_block` on the reference path: msgspec for the steps' fields, their rounds read by position."""
    collecting = gc.isenabled()
    gc.disable()  # a block is many objects made at once, none of them in a cycle
    try:
        parsed = _parsed_lines(lines)
        at = [i for i, item in enumerate(parsed) if type(item) is _BlockStep]
        steps = [parsed[i] for i in at]
        header = list(zip(*map(_STEP_FIELDS, steps))) or ((),) * 8
        names, round_step, drafted, accepted, pairs = _read_rounds(list(map(_REQUESTS, steps)))
    finally:
        if collecting:
            gc.enable()
    good = _checked(header, names)
    if len(drafted):
        bad_round = (accepted > drafted) | (drafted > MAX_DRAFT_TOKENS)
        if bad_round.any():
            good[round_step[bad_round]] = False
    keep_round = good[round_step]
    kept = good.tolist()
    if not all(kept):  # a few steps left to `codec.decode_line`
        at = [position for position, keep in zip(at, kept) if keep]
        header = [[value for value, keep in zip(column, kept) if keep] for column in header]
        names = [found for found, keep in zip(names, kept) if keep]
        drafted, accepted = drafted[keep_round], accepted[keep_round]
        round_step = (np.cumsum(good) - 1)[round_step[keep_round]]
    pair = np.concatenate([found[1] for found in names]) if names else np.zeros(0, dtype=np.int64)
    taken = set(at)
    others = [(position, decoded) for position, line in enumerate(lines) if position not in taken
              and (decoded := _decode_other(line)) is not None]
    return _interned(header, round_step, pair, list(pairs), drafted, accepted, at, others,
                     [found[0] for found in names], build)


def _checked(header, names: list) -> np.ndarray:
    """Which steps pass the contract's checks that msgspec and `_read_rounds` did not make."""
    ts, workers, seqs, bundles, draft_ms, verify_ms, kv_usage, v = header
    ts, draft_ms, verify_ms, kv_usage = (np.asarray(column, dtype=np.float64)
                                         for column in (ts, draft_ms, verify_ms, kv_usage))
    good = ((np.asarray(v, dtype=np.float64) == 1) & (ts >= 0) & (ts < _MAX_EXACT_INT) & (draft_ms >= 0)
            & (draft_ms < _INF) & (verify_ms >= 0) & (verify_ms < _INF) & (kv_usage >= 0) & (kv_usage <= 1))
    good &= np.fromiter((found is not None for found in names), bool, len(names))
    bad_names = {name for name in set(workers) | set(bundles) if not _name(name)}
    if bad_names:
        good &= np.fromiter((w not in bad_names and b not in bad_names for w, b in zip(workers, bundles)), bool,
                            len(workers))
    return good


def _interned(header, round_step: np.ndarray, pair_index: np.ndarray, pairs: list, drafted, accepted, at: list,
              others: list, step_ids: list, build) -> StepBlock:
    """A `StepBlock` with (bundle, bucket, cohort) interned."""
    ts, workers, seqs, bundles, draft_ms, verify_ms, kv_usage = header[:7]
    # numbered in first-seen order, every per-item loop in C
    bundle_table = {name: i for i, name in enumerate(dict.fromkeys(bundles))}
    bundle_index = np.fromiter(map(bundle_table.__getitem__, bundles), np.int64, len(bundles))
    bundle_names = list(bundle_table)
    pairs = [*pairs, (None, None)]  # the last: the bundle as a whole
    n_pairs = len(pairs)
    codes, inverse = np.unique(np.concatenate([bundle_index * n_pairs + n_pairs - 1,
                                               bundle_index[round_step] * n_pairs + pair_index]),
                               return_inverse=True)
    keys = [(bundle_names[c // n_pairs], *pairs[c % n_pairs]) for c in codes.tolist()]
    n = len(seqs)
    ts, draft_ms, verify_ms, kv_usage = (np.asarray(column, dtype=np.float64)
                                         for column in (ts, draft_ms, verify_ms, kv_usage))
    return StepBlock(ts, list(workers), list(seqs), inverse[:n].astype(np.int64), draft_ms, verify_ms, kv_usage, at,
                     round_step.astype(np.int64), inverse[n:].astype(np.int64), np.asarray(drafted, dtype=np.int64),
                     np.asarray(accepted, dtype=np.int64), np.ones(len(pair_index), dtype=np.int64),
                     keys, others, step_ids, build)


def request_block(data: bytes | bytearray | memoryview, native: bool = True) -> StepBlock:
    """An OTLP request as one `StepBlock`, positions being the indices of its log records.

    ``native=False`` keeps to the reference path even where the compiled walk is loaded.

    >>> from specwatch.schemas import decode_line
    >>> from specwatch.schemas.otlp import encode_records
    >>> step = ('{"kind":"step","v":1,"ts":%d,"worker":"w1","seq":%d,"bundle_id":"b","draft_ms":1.0,'
    ...         '"verify_ms":9.0,"kv_usage":0.5,"requests":[{"id":"r","bucket":"chat","cohort":"main",'
    ...         '"drafted":4,"accepted":3}]}')
    >>> block = request_block(encode_records([decode_line(step % (10, 1)), decode_line(step % (11, 2))]))
    >>> block.seqs, block.keys, block.drafted.tolist(), block.step_ids, block.record(1).seq
    ([1, 2], [('b', 'chat', 'main'), ('b', None, None)], [4, 4], [('r',), ('r',)], 2)
    """
    items = _request_items(data, native)
    at = [i for i, item in enumerate(items) if type(item) is _StepRow]
    rows = [items[i] for i in at]
    header = list(zip(*(row.header for row in rows))) or ((),) * 7
    pairs: dict[tuple[str, str], int] = {}
    # the wire reader shares a column's tuple between the steps that repeat it: each pair of
    # bucket and cohort columns is numbered once, not once per step
    numbered: dict[tuple[tuple, tuple], np.ndarray] = {}
    pair_index = []
    for row in rows:
        scopes = (row.buckets, row.cohorts)
        index = numbered.get(scopes)
        if index is None:
            index = numbered[scopes] = np.fromiter((pairs.setdefault(pair, len(pairs)) for pair in zip(*scopes)),
                                                   np.int64, len(row.buckets))
        pair_index.append(index)
    round_step = np.repeat(np.arange(len(rows)), [len(row.ids) for row in rows])
    taken = set(at)
    others = [(position, item) for position, item in enumerate(items) if position not in taken]
    return _interned(header, round_step, np.concatenate(pair_index) if rows else np.zeros(0, dtype=np.int64),
                     list(pairs), np.frombuffer(b"".join(row.drafted for row in rows), dtype=np.uint8),
                     np.frombuffer(b"".join(row.accepted for row in rows), dtype=np.uint8), at, others,
                     [row.ids for row in rows], lambda position: items[position].build)
