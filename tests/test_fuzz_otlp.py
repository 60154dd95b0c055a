"""Fuzzing the OTLP decoder, which reads whatever any producer wrote to the telemetry topic."""

from __future__ import annotations

from functools import lru_cache

from hypothesis import example, given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.logs.v1.logs_pb2 import LogRecord

from specwatch.lab.simulation.simulator import Simulator
from specwatch.schemas import Rejection, encode_record
from specwatch.schemas.otlp import decode_request, encode_records

from test_fuzz_codec import _EXAMPLES, _FUZZ, LINE_REASONS, _check_result

OTLP_REASONS = LINE_REASONS | {"invalid_otlp", "message_too_large", "array_length_mismatch"}


@lru_cache(maxsize=1)
def _records() -> tuple:
    return tuple(Simulator("healthy", seed=5, minutes=0.03, workers=2, concurrency=4).records())[:60]


@lru_cache(maxsize=1)
def _valid_request() -> bytes:
    return encode_records(_records())


def _check(results: list, expected_count: int | None = None) -> None:
    assert isinstance(results, list)
    if expected_count is not None:
        assert len(results) == expected_count
    for result in results:
        if isinstance(result, Rejection):
            assert result.reason in OTLP_REASONS, result
            assert result.detail, result
        else:
            _check_result(result)
            # What came in as OTLP round-trips through OTLP too.
            assert decode_request(encode_records([result])) == [result]


def odd_bytes(test):
    """``test`` run on these bytes too: empty, a lone tag, lengths past the end and past 64 bits."""
    for data in (b"", b"\x0a", b"\x0a\xff\xff\xff\xff\x0f", b"\x0a\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01"):
        test = example(data)(test)
    return test


@_FUZZ
@given(st.binary(max_size=2000))
@odd_bytes
def test_any_bytes_decode_or_are_rejected(data):
    _check(decode_request(data))


def damaged(data, payload: bytes, most: int = 6) -> bytes:
    """``payload`` with bytes flipped, dropped, inserted and cut off: the shapes a broken producer makes."""
    payload = bytearray(payload)
    for _ in range(data.draw(st.integers(min_value=1, max_value=most))):
        position = data.draw(st.integers(min_value=0, max_value=max(0, len(payload) - 1)))
        action = data.draw(st.sampled_from(["flip", "drop", "insert", "truncate"]))
        if action == "flip" and payload:
            payload[position] ^= data.draw(st.integers(min_value=1, max_value=255))
        elif action == "drop":
            del payload[position:position + data.draw(st.integers(min_value=1, max_value=8))]
        elif action == "insert":
            payload[position:position] = data.draw(st.binary(min_size=1, max_size=8))
        else:
            del payload[position:]
    return bytes(payload)


@_FUZZ
@given(st.data())
def test_damaged_valid_requests_never_crash_the_decoder(data):
    _check(decode_request(damaged(data, _valid_request())))


_NAMES = st.sampled_from(["v", "ts", "worker", "seq", "bundle_id", "draft_ms", "verify_ms", "kv_usage",
                          "id", "bucket", "cohort", "speculative", "ttft_ms", "tpot_ms", "e2e_ms",
                          "output_tokens", "finish_reason", "error", "sample", "card", "check", "match",
                          "requests.id", "requests.bucket", "requests.cohort", "requests.drafted",
                          "requests.accepted", "requests.extra", "kind"])
_KEYS = st.one_of(_NAMES.map(lambda n: "specwatch." + n), st.text(max_size=12))
_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12), st.binary(max_size=8),
)


_SCALAR_FIELDS = {bool: "bool_value", int: "int_value", float: "double_value", str: "string_value", bytes: "bytes_value"}


def _fill(value: AnyValue, python) -> None:
    if python is None:
        return
    if type(python) in _SCALAR_FIELDS:
        setattr(value, _SCALAR_FIELDS[type(python)], python)
    elif isinstance(python, list):
        value.array_value.SetInParent()
        for item in python:
            _fill(value.array_value.values.add(), item)
    else:
        value.kvlist_value.SetInParent()
        for key, item in python.items():
            pair = value.kvlist_value.values.add()
            pair.key = key
            _fill(pair.value, item)


_VALUES = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=6)
                       | st.dictionaries(st.text(max_size=10), inner, max_size=4), max_leaves=10)
_EVENT_NAMES = st.one_of(st.sampled_from(["specwatch.step", "specwatch.request", "specwatch.bundle",
                                          "specwatch.shadow", "specwatch.", "specwatch.trace", ""]),
                         st.text(max_size=20))


@st.composite
def _log_record(draw) -> LogRecord:
    record = LogRecord()
    record.event_name = draw(_EVENT_NAMES)
    record.time_unix_nano = draw(st.integers(min_value=0, max_value=2**64 - 1))
    for key, value in draw(st.lists(st.tuples(_KEYS, _VALUES), max_size=12)):
        pair = record.attributes.add()
        pair.key = key
        _fill(pair.value, value)
    return record


def _request(log_records) -> bytes:
    request = ExportLogsServiceRequest()
    scope_logs = request.resource_logs.add().scope_logs.add()
    for log_record in log_records:
        scope_logs.log_records.add().CopyFrom(log_record)
    return request.SerializeToString()


# Building protobuf messages field by field costs more per example than the byte-level
# properties: a third of the budget covers the same ground.
_FUZZ_STRUCTURED = settings(_FUZZ, max_examples=max(50, _EXAMPLES // 3))


@_FUZZ_STRUCTURED
@given(st.lists(_log_record(), min_size=1, max_size=5))
def test_arbitrary_log_records_each_give_one_result(log_records):
    _check(decode_request(_request(log_records)), expected_count=len(log_records))


@_FUZZ_STRUCTURED
@given(st.lists(st.tuples(st.integers(min_value=0, max_value=60), _log_record()), max_size=6))
def test_valid_records_among_bad_ones_come_back_exactly_in_place(bad):
    good = ExportLogsServiceRequest()
    good.ParseFromString(_valid_request())
    log_records = list(good.resource_logs[0].scope_logs[0].log_records)
    expected: list = list(_records())
    for position, log_record in sorted(bad, key=lambda p: p[0], reverse=True):
        log_records.insert(position, log_record)
        expected.insert(position, None)
    results = decode_request(_request(log_records))
    assert len(results) == len(expected)
    for result, original in zip(results, expected):
        if original is not None:
            assert result == original, encode_record(original)
    rejected = [r for r in results if isinstance(r, Rejection)]
    assert all(r.reason in OTLP_REASONS and r.detail for r in rejected)
    # Nothing valid is lost, and nothing is counted twice.
    assert len(rejected) + sum(not isinstance(r, Rejection) for r in results) == len(log_records)
