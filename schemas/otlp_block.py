"""The OTLP block decoder: an ExportLogsServiceRequest as one `StepBlock`, its steps read from the
wire bytes (or by the compiled walk) without a protobuf object per attribute; docs/STREAMS.md."""

from __future__ import annotations

import struct
from functools import partial
from operator import gt
from typing import Any, Callable, Iterator, NamedTuple

import numpy as np

from .codec import Rejection
from .contract import MAX_DRAFT_TOKENS, MAX_NAME_CHARS, MAX_REQUESTS_PER_STEP, TelemetryRecord, printable, scope_name_ok
from .native_walks import STEP_WALK
from .otlp import ATTRIBUTE_PREFIX, STEP_SCALARS, decode_log_record, log_records, parse_request
from .otlp_layout import (ACCEPTED_KEY, BUCKET_KEY, BUNDLE_KEY, COHORT_KEY, COLUMN_PREFIX, DRAFT_HEAD, DRAFTED_KEY,
                          EVENT_FIELD, ID_KEY, KV_HEAD, ROUND_COLUMN_KEYS, SEQ_HEADS, STEP_EVENT, V_TS_HEAD,
                          VERIFY_HEAD, WORKER_KEY)
from .otlp_wire import OddShape, read_varint, small_ints, string_values
from .step_block import StepBlock, interned_block, is_name, step_header

__all__ = ["record_at", "request_block"]

_INF = float("inf")
_STR = {str}


def _names(column: Any) -> bool:
    # type check over the whole column in C; lengths only over its distinct values
    if set(map(type, column)) != _STR:
        return False
    lengths = set(map(len, column))
    if min(lengths) == 0 or max(lengths) > MAX_NAME_CHARS:
        return False
    joined = "".join(column)
    return joined.isprintable() or printable(joined)


# ---------------------------------------------------------------- OTLP steps from the wire
# Why and how: docs/STREAMS.md, "The OTLP wire reader".

_ATTRIBUTE_PREFIX = ATTRIBUTE_PREFIX.encode()
_COLUMN_PREFIX_LEN = len(COLUMN_PREFIX)
_SCALAR_KEYS = {_ATTRIBUTE_PREFIX + name.encode(): name for name in STEP_SCALARS}
_unpack_double = struct.Struct("<d").unpack_from
_INT64_SIGN = 1 << 63
_UINT64_RANGE = 1 << 64


class _Memo:
    """What repeats across the step records of one request, keyed by the bytes it came from."""

    __slots__ = ("workers", "bundles", "ids", "buckets", "cohorts", "drafted_heads", "accepted_heads",
                 "count_heads", "columns", "strings")

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
        self.count_heads = ((self.drafted_heads, DRAFTED_KEY), (self.accepted_heads, ACCEPTED_KEY))
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
_V_TS = struct.Struct(f"<{len(V_TS_HEAD)}sd")
_V_TS_SIZE = _V_TS.size
_TIMES = struct.Struct(f"<{len(DRAFT_HEAD)}sd{len(VERIFY_HEAD)}sd{len(KV_HEAD)}sd")
_TIMES_SIZE = _TIMES.size
_EVENT_FIELD_SIZE = len(EVENT_FIELD)


def _plain_name(attribute: bytes, key: bytes, names: dict, strings: dict) -> str | None:
    """The worker or bundle id in a serialized attribute (None if not a Name), memoised in ``names``."""
    value = _scalar(attribute, *_attribute_value(attribute, key), strings)
    name = names[attribute] = value if is_name(value) else None
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
    if head != V_TS_HEAD:
        raise OddShape("not v, ts")
    p += _V_TS_SIZE
    # the memo lookups are inline and the helpers run only on a miss: a call per attribute
    # cost this decoder about a tenth of its speed
    q = _attribute_end(buf, p)
    attribute = buf[p:q]
    worker = memo.workers.get(attribute, _MISSING)
    if worker is _MISSING:
        worker = _plain_name(attribute, WORKER_KEY, memo.workers, memo.strings)
    head, width = SEQ_HEADS[buf[q + 1]]
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
        bundle_id = _plain_name(attribute, BUNDLE_KEY, memo.bundles, memo.strings)
    draft_head, draft_ms, verify_head, verify_ms, kv_head, kv_usage = _TIMES.unpack_from(buf, q)
    if draft_head != DRAFT_HEAD or verify_head != VERIFY_HEAD or kv_head != KV_HEAD:
        raise OddShape("not draft_ms, verify_ms, kv_usage")
    p = q + _TIMES_SIZE
    q = _attribute_end(buf, p)
    attribute = buf[p:q]
    ids = memo.ids.get(attribute) or _plain_strings(attribute, ID_KEY, memo.ids)
    p = _attribute_end(buf, q)
    attribute = buf[q:p]
    buckets = memo.buckets.get(attribute) or _plain_strings(attribute, BUCKET_KEY, memo.buckets)
    q = _attribute_end(buf, p)
    attribute = buf[p:q]
    cohorts = memo.cohorts.get(attribute) or _plain_strings(attribute, COHORT_KEY, memo.cohorts)
    p = q
    counts = []
    for heads, key in memo.count_heads:  # drafted, then accepted
        q = _attribute_end(buf, p)
        attribute = buf[p:q]
        head = heads.get(q - p)
        if head is None or not attribute.startswith(head):
            head = _plain_int_head(attribute, key, heads)
        counts.append(small_ints(attribute[len(head):]))
        p = q
    drafted, accepted = counts
    p = _after_unread_fields(buf, p)
    if p + _EVENT_FIELD_SIZE != end or not buf.startswith(EVENT_FIELD, p):
        raise OddShape("not the step event name last")
    # typed by the layout already: only their ranges are left (`step_header`'s checks, inline for speed)
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
                elif key.startswith(COLUMN_PREFIX):
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
    if event != STEP_EVENT:
        return None
    values = {name: _scalar(buf, s, e, memo.strings) for name, (s, e) in scalars.items()}
    header = step_header(*map(values.get, STEP_SCALARS))
    if header is None:
        return None
    try:
        columns = [_array_body(buf, *spans.pop(name)) for name in ROUND_COLUMN_KEYS]
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
    walked = STEP_WALK.records(buf) if native and STEP_WALK is not None else None
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
            if buf.find(STEP_EVENT, start, end) >= 0:
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
    return interned_block(header, round_step, np.concatenate(pair_index) if rows else np.zeros(0, dtype=np.int64),
                          list(pairs), np.frombuffer(b"".join(row.drafted for row in rows), dtype=np.uint8),
                          np.frombuffer(b"".join(row.accepted for row in rows), dtype=np.uint8), at, others,
                          [row.ids for row in rows], lambda position: items[position].build)
