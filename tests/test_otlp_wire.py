"""The OTLP batch mode reads step records from the bytes as `otlp.decode_request` does, on odd and
broken requests from a protobuf writer of this file's own, independent of `otlp.py`."""

from __future__ import annotations

import struct
from functools import lru_cache

import pytest
from hypothesis import given
from hypothesis import strategies as st

from specwatch.lab.simulation.simulator import Simulator
from specwatch.schemas import Rejection, StepRecord
from specwatch.schemas.otlp import decode_request, encode_records, log_entry
from specwatch.schemas.otlp_block import (_log_record_spans, _Memo, _step_from_wire, _step_plain, _StepRow,
                                         request_block)
from specwatch.schemas.otlp_wire import OddShape

from test_fastpath import as_columns, assert_block_is_the_reference
from test_fuzz_otlp import _FUZZ, _SCALARS, _VALUES, damaged

# -- a protobuf writer with knobs ---------------------------------------------------------------

_U64 = (1 << 64) - 1


def _varint(n: int, pad: int = 0) -> bytes:
    """``n`` as a varint; ``pad`` extra bytes make it overlong, which protobuf still reads."""
    n &= _U64
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    pad = min(pad, 10 - len(out))
    if pad > 0:
        out[-1] |= 0x80
        out += b"\x80" * (pad - 1) + b"\x00"
    return bytes(out)


def _tag(number: int, wire_type: int) -> bytes:
    return _varint(number << 3 | wire_type)


def _ld(number: int, payload: bytes, pad: int = 0) -> bytes:
    return _tag(number, 2) + _varint(len(payload), pad) + payload


def _any(value, pad: int = 0) -> bytes:
    """A serialized AnyValue; None is the empty one."""
    if value is None:
        return b""
    if isinstance(value, bool):
        return _tag(2, 0) + _varint(int(value), pad)
    if isinstance(value, int):
        return _tag(3, 0) + _varint(value, pad)
    if isinstance(value, float):
        return _tag(4, 1) + struct.pack("<d", value)
    if isinstance(value, str):
        return _ld(1, value.encode("utf-8", "replace"), pad)
    if isinstance(value, bytes):
        return _ld(7, value, pad)
    if isinstance(value, (list, tuple)):
        return _ld(5, b"".join(_ld(1, _any(item, pad), pad) for item in value), pad)
    return _ld(6, b"".join(_ld(1, _key_value(str(k), item, pad)) for k, item in value.items()), pad)


def _key_value(key: str, value, pad: int = 0, value_first: bool = False) -> bytes:
    key_field = _ld(1, key.encode("utf-8", "replace"), pad) if key else b""
    value_field = _ld(2, _any(value, pad), pad)
    return value_field + key_field if value_first else key_field + value_field


# LogRecord fields a step does not carry, and fields no LogRecord knows; all valid protobuf.
_OTHER_FIELDS = [
    _tag(2, 0) + _varint(9),  # severity_number
    _ld(3, b"INFO"),  # severity_text
    _ld(5, _any("a body")),  # body
    _tag(7, 0) + _varint(2),  # dropped_attributes_count
    _tag(8, 5) + b"\x01\x00\x00\x00",  # flags
    _ld(9, bytes(16)), _ld(10, bytes(8)),  # trace_id, span_id
    _tag(99, 0) + _varint(1), _ld(2000, b"unknown"), _tag(77, 5) + bytes(4), _tag(78, 1) + bytes(8),
    _tag(50, 3) + _tag(1, 0) + _varint(1) + _tag(50, 4),  # an unknown group
    _tag(6, 0) + _varint(3),  # attributes' number with another wire type: unknown to protobuf
    _tag(12, 0) + _varint(1),  # event_name's number, likewise
]
# Envelope fields a request from another producer may carry.
_RESOURCE = _ld(1, _ld(1, _key_value("service.name", "engine")) + _tag(2, 0) + _varint(1))
_SCOPE = _ld(1, _ld(1, b"specwatch") + _ld(2, b"1"))


def _request(log_records: list[bytes], split: int = 0, extras: bool = False) -> bytes:
    """One ExportLogsServiceRequest; ``split`` > 0 spreads the records over several scopes and resources."""
    groups = [log_records[i:i + split] for i in range(0, len(log_records), split)] if split else [log_records]
    resources = []
    for n, group in enumerate(groups):
        scope_logs = (_SCOPE if extras or n else b"") + b"".join(_ld(2, r) for r in group)
        if extras:
            scope_logs += _ld(3, b"https://schema") + _tag(9, 0) + _varint(4)
        resource_logs = (_RESOURCE if extras else b"") + _ld(2, scope_logs)
        if extras:
            resource_logs += _ld(3, b"https://schema") + _tag(4, 0) + _varint(1)
        resources.append(_ld(1, resource_logs))
    body = b"".join(resources)
    return body + (_tag(2, 0) + _varint(5) if extras else b"")


# -- comparing outcomes ---------------------------------------------------------------------------


def _identical(payload: bytes):
    """Decode both ways; the outcomes must match record by record. Returns the block."""
    block = request_block(payload)
    reference = decode_request(payload)
    assert all(isinstance(reference[position], StepRecord) for position in block.at)
    assert_block_is_the_reference(block, reference)
    return block


def _same(row: _StepRow, record: StepRecord) -> None:
    """A step as the wire reader read it holds the reference record's columns."""
    assert isinstance(row, _StepRow)
    assert (*row.header, row.ids, row.buckets, row.cohorts, tuple(row.drafted), tuple(row.accepted)) == as_columns(
        record)
    assert row.build() == record


# -- steps as attribute lists ---------------------------------------------------------------------

_SHORT_NAMES = st.text(alphabet="abcdefghij-_0123456789", min_size=1, max_size=12)
# past one length byte and non-ASCII but valid (at most 256 characters), or not Names at all
_LONG_NAMES = st.one_of(_SHORT_NAMES, st.text(min_size=1, max_size=256), st.just("é" * 256), st.just("x" * 200))
_ANY_NAMES = st.one_of(_SHORT_NAMES, _LONG_NAMES, st.just(""), st.just("x" * 257), st.text(max_size=300))
# one kind of names per step: a single bad one among sixty makes the whole step invalid
_NAME_KINDS = st.sampled_from([_SHORT_NAMES] * 5 + [_LONG_NAMES] * 2 + [_ANY_NAMES])
_ROUNDS = st.integers(0, 64).flatmap(lambda d: st.tuples(st.just(d), st.integers(0, d)))
_TIMES = st.one_of(st.floats(0, 1e4), st.integers(0, 10_000))


@st.composite
def _step_attributes(draw) -> list[tuple[str, object]]:
    """A valid step's attributes, in the writer's order."""
    names = draw(_NAME_KINDS)
    requests = draw(st.lists(st.tuples(names, names, names, _ROUNDS), max_size=20))
    return [
        ("specwatch.v", 1),
        ("specwatch.ts", draw(st.one_of(st.floats(0, 2e9), st.integers(0, (1 << 53) - 1)))),
        ("specwatch.worker", draw(names)),
        ("specwatch.seq", draw(st.one_of(st.integers(0, 1000), st.integers(0, (1 << 63) - 1)))),
        ("specwatch.bundle_id", draw(names)),
        ("specwatch.draft_ms", draw(_TIMES)),
        ("specwatch.verify_ms", draw(_TIMES)),
        ("specwatch.kv_usage", draw(st.one_of(st.floats(0, 1), st.sampled_from([0, 1])))),
        ("specwatch.requests.id", [r[0] for r in requests]),
        ("specwatch.requests.bucket", [r[1] for r in requests]),
        ("specwatch.requests.cohort", [r[2] for r in requests]),
        ("specwatch.requests.drafted", [r[3][0] for r in requests]),
        ("specwatch.requests.accepted", [r[3][1] for r in requests]),
    ]


_EXTRA_KEYS = st.sampled_from(["specwatch.extra", "specwatch.requests.extra", "specwatch.kind", "specwatch.requests",
                               "specwatch.requests.", "event.name", "service.name", ""])
_ODD_INTS = st.sampled_from([-1, -(1 << 63), (1 << 63) - 1, 65, 128, 300, 1 << 53])


@st.composite
def _mutated(draw, attributes: list) -> list:
    """The attributes with a few changes: kept valid, made odd, or made invalid."""
    attributes = list(attributes)
    for _ in range(draw(st.integers(0, 3))):
        n = len(attributes)
        action = draw(st.sampled_from(["shuffle", "retype", "drop", "repeat", "extra", "extra_column",
                                       "element", "longer"]))
        if action == "shuffle":
            attributes = draw(st.permutations(attributes))
        elif action == "retype" and n:
            i = draw(st.integers(0, n - 1))
            attributes[i] = (attributes[i][0], draw(st.one_of(_SCALARS, _ODD_INTS, _VALUES)))
        elif action == "drop" and n:
            del attributes[draw(st.integers(0, n - 1))]
        elif action == "repeat" and n:  # the same key twice: the later one counts
            i = draw(st.integers(0, n - 1))
            position = draw(st.integers(0, n))
            value = draw(st.one_of(st.just(attributes[i][1]), _SCALARS, _VALUES))
            attributes.insert(position, (attributes[i][0], value))
        elif action == "extra":
            attributes.insert(draw(st.integers(0, n)), (draw(_EXTRA_KEYS), draw(_VALUES)))
        elif action == "extra_column":
            rows = len(attributes[-1][1]) if n and isinstance(attributes[-1][1], list) else 0
            size = draw(st.sampled_from([rows, rows, rows + 1]))
            column = draw(st.lists(_SCALARS, min_size=size, max_size=size))
            attributes.insert(draw(st.integers(0, n)), ("specwatch.requests." + draw(_SHORT_NAMES), column))
        elif action in ("element", "longer"):
            columns = [i for i, (_, v) in enumerate(attributes) if isinstance(v, list)]
            if columns:
                i = draw(st.sampled_from(columns))
                key, column = attributes[i]
                column = list(column)
                if action == "longer" or not column:
                    column.append(draw(st.one_of(_SCALARS, _ODD_INTS)))
                else:
                    column[draw(st.integers(0, len(column) - 1))] = draw(st.one_of(_SCALARS, _ODD_INTS))
                attributes[i] = (key, column)
    return attributes


@st.composite
def _step_log_record(draw, attributes: list) -> bytes:
    """The attributes as a LogRecord, laid out in one of the ways protobuf allows."""
    pad = draw(st.sampled_from([0, 0, 0, 1, 2]))
    value_first = draw(st.booleans())
    fields = [_ld(6, _key_value(key, value, pad, value_first and draw(st.booleans()))) for key, value in attributes]
    if fields and draw(st.integers(0, 4)) == 0:  # a tag written overlong still names the field
        i = draw(st.integers(0, len(fields) - 1))
        fields[i] = b"\xb2\x00" + fields[i][1:]
    nanos = draw(st.sampled_from([0, 1_700_000_000_000_000_000]))
    if nanos:
        fields.insert(0, _tag(1, 1) + struct.pack("<Q", nanos))
        fields.append(_tag(11, 1) + struct.pack("<Q", nanos))
    event = draw(st.sampled_from(["specwatch.step"] * 12 + ["specwatch.request", "", "specwatch.step "]))
    if event:
        fields.append(_ld(12, event.encode(), pad))
    if not draw(st.integers(0, 3)):  # the event name first, or twice (the last counts)
        fields.insert(0, _ld(12, draw(st.sampled_from([b"specwatch.step", b"specwatch.bundle"]))))
    for _ in range(draw(st.integers(0, 2))):
        fields.insert(draw(st.integers(0, len(fields))), draw(st.sampled_from(_OTHER_FIELDS)))
    return b"".join(fields)


@lru_cache(maxsize=1)
def _simulated() -> tuple:
    return tuple(Simulator("healthy", seed=3, minutes=0.05, workers=2, concurrency=16).records())


# -- properties -----------------------------------------------------------------------------------


def steps_request(data) -> bytes:
    """A request of valid, odd and invalid steps, some among records the writer wrote."""
    steps = data.draw(st.lists(_step_attributes(), min_size=1, max_size=4))
    log_records = []
    for attributes in steps:
        if data.draw(st.booleans()):
            attributes = data.draw(_mutated(attributes))
        log_records.append(data.draw(_step_log_record(attributes)))
    if data.draw(st.booleans()):  # among records the writer wrote
        position = data.draw(st.integers(0, len(log_records)))
        first = data.draw(st.integers(0, len(_simulated()) - 3))
        written = encode_records(_simulated()[first:first + 3])
        log_records[position:position] = [written[a:b] for a, b in _log_record_spans(written)]
    return _request(log_records, split=data.draw(st.integers(0, 3)), extras=data.draw(st.booleans()))


def damaged_request(data) -> bytes:
    """A request, the writer's or an odd one, with bytes flipped, dropped, inserted and truncated."""
    if data.draw(st.booleans()):
        payload = encode_records(_simulated()[:20])
    else:
        payload = _request([data.draw(_step_log_record(data.draw(_step_attributes())))] * 2)
    return damaged(data, payload, most=4)


@_FUZZ
@given(st.data())
def test_valid_odd_and_invalid_steps_decode_as_the_reference_does(data):
    _identical(steps_request(data))


@_FUZZ
@given(st.data())
def test_damaged_requests_decode_as_the_reference_does(data):
    _identical(damaged_request(data))


# -- which reader takes which record ---------------------------------------------------------------


def _steps_read_by(reader, payload: bytes) -> list:
    memo = _Memo()
    return [reader(payload, start, end, memo) for start, end in _log_record_spans(payload)]


def _assert_plain_reader_takes(payload: bytes, records: list) -> None:
    steps = _steps_read_by(_step_plain, payload)
    assert len(steps) == len(records)
    for step, record in zip(steps, records):
        _same(step, record)
    assert _identical(payload).at == list(range(len(records)))


def _assert_plain_reader_refuses(payload: bytes) -> None:
    start, end = _log_record_spans(payload)[0]
    with pytest.raises(OddShape):
        _step_plain(payload, start, end, _Memo())


def test_the_writers_steps_take_the_plain_reader():
    records = [r for r in _simulated() if r.kind == "step"][:300]
    _assert_plain_reader_takes(encode_records(records), records)


def test_reordered_attributes_take_the_general_reader():
    record = next(r for r in _simulated() if r.kind == "step")
    attributes = [(k, list(v) if isinstance(v, tuple) else v) for k, v in reversed(log_entry(record).attributes.items())]
    fields = [_ld(12, b"specwatch.step")] + [_ld(6, _key_value(k, v)) for k, v in attributes]
    payload = _request([b"".join(fields)])
    _assert_plain_reader_refuses(payload)
    (step,) = _steps_read_by(_step_from_wire, payload)
    _same(step, record)
    assert _identical(payload).record(0) == record


_PLAIN_STEP = {
    "specwatch.v": 1, "specwatch.ts": 5.0, "specwatch.worker": "w1", "specwatch.seq": 3, "specwatch.bundle_id": "b1",
    "specwatch.draft_ms": 1.0, "specwatch.verify_ms": 9.0, "specwatch.kv_usage": 0.5,
    "specwatch.requests.id": ["r1", "r2"], "specwatch.requests.bucket": ["coding", "coding"],
    "specwatch.requests.cohort": ["main", "main"], "specwatch.requests.drafted": [4, 4],
    "specwatch.requests.accepted": [3, 0],
}


def _plain_step_request(change: dict) -> bytes:
    """One step in the writer's attribute order, with ``change`` applied."""
    attributes = {**_PLAIN_STEP, **change}
    return _request([b"".join([_ld(6, _key_value(k, v)) for k, v in attributes.items()]
                                 + [_ld(12, b"specwatch.step")])])


@pytest.mark.parametrize("change", [
    {"specwatch.worker": "w" * 256}, {"specwatch.bundle_id": "é" * 256},
    {"specwatch.requests.id": ["r" * 200, "é" * 100]}, {"specwatch.seq": (1 << 63) - 1},
    {"specwatch.ts": 17}, {"specwatch.kv_usage": 1}, {"specwatch.ts": -0.0}, {"specwatch.draft_ms": -0.0},
])
def test_odd_but_valid_steps_still_come_back_as_columns(change):
    assert _identical(_plain_step_request(change)).at == [0]


@pytest.mark.parametrize("change", [
    {"specwatch.seq": -1}, {"specwatch.v": -1}, {"specwatch.requests.drafted": [65, 4]},
    {"specwatch.requests.accepted": [-1, 0]}, {"specwatch.requests.id": ["", "r2"]},
    {"specwatch.worker": "x" * 257}, {"specwatch.requests.bucket": ["coding"]}, {"specwatch.ts": float("nan")},
    {"specwatch.requests.drafted": [True, 4]}, {"specwatch.requests.accepted": [1 << 40, 0]},
])
def test_invalid_steps_get_the_reference_rejection(change):
    block = _identical(_plain_step_request(change))
    assert block.at == [] and [type(item) for _, item in block.others] == [Rejection]


@pytest.mark.parametrize("late", [("specwatch.seq", 99), ("specwatch.requests.extra", [1, 2, 3]),
                                  ("specwatch.requests.drafted", [4, 1])])
def test_an_attribute_behind_an_overlong_tag_still_counts(late):
    """protobuf reads field 6 written as b2 00 like 32: a reader that skipped it would miss a later value."""
    fields = [_ld(6, _key_value(k, v)) for k, v in _PLAIN_STEP.items()] + [_ld(12, b"specwatch.step")]
    fields.append(b"\xb2\x00" + _ld(6, _key_value(*late))[1:])
    block = _identical(_request([b"".join(fields)]))
    assert block.at == [] or block.record(0).seq == 99


def _recoded_by_collector(payload: bytes, observed: bool, flags: int, trace: bytes, span: bytes) -> bytes:
    """``payload`` as the Collector's kafka exporter re-encodes it: an empty body in every record,
    and the optional fields it may set; every field in field-number order, as pdata writes them."""
    fields_by_record = []
    for start, end in _log_record_spans(payload):
        record = payload[start:end]
        stamp, rest = (record[:9], record[9:]) if record[0] == 0x09 else (b"", record)
        event_at = rest.rindex(b"\x62\x0especwatch.step")
        attributes, event = rest[:event_at], rest[event_at:]
        if attributes[-9] == 0x59:  # the writer's own observed time: re-placed below
            attributes = attributes[:-9]
        fields = [stamp, _ld(5, b""), attributes]
        if flags:
            fields.append(_tag(8, 5) + struct.pack("<I", flags))
        if trace is not None:
            fields.append(_ld(9, trace))
        if span is not None:
            fields.append(_ld(10, span))
        if observed:
            fields.append(_tag(11, 1) + struct.pack("<Q", 1_800_000_000_123_456_789))
        fields.append(event)
        fields_by_record.append(b"".join(fields))
    return _request(fields_by_record, extras=True)


@pytest.mark.parametrize("observed,flags,trace,span", [
    (False, 0, None, None),  # the empty body alone
    (True, 0, None, None),
    (True, 1, None, None),
    (True, 1, b"", b""),  # trace ids present but empty
    (True, 0, bytes(range(16)), bytes(range(8))),
    (False, 1, bytes(16), None),
])
def test_steps_recoded_by_the_collector_take_the_plain_reader(observed, flags, trace, span):
    records = [r for r in _simulated() if r.kind == "step"][:200]
    payload = _recoded_by_collector(encode_records(records), observed, flags, trace, span)
    _assert_plain_reader_takes(payload, records)


def test_a_body_with_content_is_not_read_as_the_empty_one():
    record = next(r for r in _simulated() if r.kind == "step")
    payload = encode_records([record])
    start, end = _log_record_spans(payload)[0]
    inner = payload[start:end]
    stamp, rest = inner[:9], inner[9:]
    payload = _request([b"".join([stamp, _ld(5, _any("a body")), rest])])
    _assert_plain_reader_refuses(payload)
    assert _identical(payload).record(0) == record
