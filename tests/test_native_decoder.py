"""The compiled OTLP step walk (native/, the package specwatch_native) gives what the reference
path gives, position by position, on the block decoder's own inputs and on hostile bytes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from specwatch.schemas import Rejection, StepRecord
from specwatch.schemas import native_walks
from specwatch.schemas.contract import RoundEntry
from specwatch.schemas.otlp_block import _log_record_spans, _request_items, _StepRow, request_block
from specwatch.schemas.otlp import decode_request, encode_records
from specwatch.lab.simulation.simulator import Simulator

from test_fastpath import as_columns, block_outcomes
from test_fuzz_otlp import _FUZZ, damaged, odd_bytes
from test_otlp_wire import (_PLAIN_STEP, _ld, _key_value, _plain_step_request, _recoded_by_collector, _request,
                            _simulated, damaged_request, steps_request)


def _cargo() -> str | None:
    """cargo as deploy/bootstrap.sh finds it: present, and able to run (rustup with a toolchain)."""
    cargo = shutil.which("cargo") or next(
        (str(path) for path in [Path.home() / ".cargo/bin/cargo"] if path.exists()), None)
    if cargo is None or subprocess.run([cargo, "--version"], capture_output=True).returncode != 0:
        return None
    return cargo


# Where the toolchain is, bootstrap builds the walk: a comparison skipped there would hide a broken build.
pytestmark = pytest.mark.skipif(native_walks.DECODER != "native"
                                and (_cargo() is None or os.environ.get("SPECWATCH_NATIVE") == "0"),
                                reason="no Rust toolchain here (only the reference path exists), or SPECWATCH_NATIVE=0")


def test_the_walk_is_built_wherever_cargo_is():
    assert native_walks.DECODER == "native", f"cargo at {_cargo()} but specwatch_native is not importable"


def test_specwatch_native_0_forces_the_reference_path():
    code = "from specwatch.schemas.native_walks import DECODER, STEP_WALK; print(DECODER, STEP_WALK)"
    env = {**os.environ, "SPECWATCH_NATIVE": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["reference", "None"]


def _outcome(item):
    """A step row as its columns and the record it builds; any other outcome as it is."""
    if type(item) is _StepRow:
        return (*item.header, item.ids, item.buckets, item.cohorts, tuple(item.drafted), tuple(item.accepted),
                item.build())
    return item


def _native_rows(payload: bytes) -> int:
    """How many records the compiled walk read as steps itself."""
    walked = native_walks.STEP_WALK.records(payload)
    return sum(row is not None for _, _, row in walked)


def _same_both_ways(payload: bytes) -> list:
    """Decode with and without the compiled walk: equal outcome at every position, as blocks too,
    and both what `otlp.decode_request` gives. Returns the outcomes."""
    native = [_outcome(item) for item in _request_items(payload, native=True)]
    reference = [_outcome(item) for item in _request_items(payload, native=False)]
    assert native == reference
    assert block_outcomes(request_block(payload, native=True)) == block_outcomes(request_block(payload, native=False))
    decoded = decode_request(payload)
    assert [item[:12] if type(item) is tuple else as_columns(item) for item in native] == list(map(as_columns, decoded))
    return native


def _records(seed: int, concurrency: int) -> list:
    return list(Simulator("healthy", seed=seed, minutes=0.05, workers=2, concurrency=concurrency).records())


@pytest.mark.parametrize("seed,concurrency", [(3, 1), (5, 16), (7, 64)])
def test_the_writers_requests_are_read_by_the_walk_and_equal_the_reference(seed, concurrency):
    records = _records(seed, concurrency)
    for i in range(0, len(records), 200):
        chunk = records[i:i + 200]
        payload = encode_records(chunk)
        outcomes = _same_both_ways(payload)
        steps = sum(record.kind == "step" for record in chunk)
        # every step of the writer's layout is the compiled walk's, no other record is
        assert _native_rows(payload) == steps > 0
        assert [type(o) is tuple for o in outcomes] == [record.kind == "step" for record in chunk]


@pytest.mark.parametrize("observed,flags,trace,span", [
    (False, 0, None, None), (True, 0, None, None), (True, 1, None, None), (True, 1, b"", b""),
    (True, 0, bytes(range(16)), bytes(range(8))), (False, 1, bytes(16), None),
])
def test_steps_recoded_by_the_collector_take_the_walk(observed, flags, trace, span):
    records = [r for r in _simulated() if r.kind == "step"][:200]
    payload = _recoded_by_collector(encode_records(records), observed, flags, trace, span)
    _same_both_ways(payload)
    assert _native_rows(payload) == len(records)


# The wire reader's tests' changes (test_otlp_wire.py), and names the walk leaves to the reference.
_VALID = [
    {"specwatch.worker": "w" * 256}, {"specwatch.requests.id": ["r" * 200, "s" * 200]},
    {"specwatch.seq": (1 << 63) - 1}, {"specwatch.seq": 0}, {"specwatch.seq": 127}, {"specwatch.seq": 128},
    {"specwatch.kv_usage": 1.0}, {"specwatch.kv_usage": 0.0}, {"specwatch.ts": -0.0},
    {"specwatch.draft_ms": -0.0}, {"specwatch.worker": "w x~"}, {"specwatch.requests.bucket": ["**", "c*"]},
    {"specwatch.requests.id": [], "specwatch.requests.bucket": [], "specwatch.requests.cohort": [],
     "specwatch.requests.drafted": [], "specwatch.requests.accepted": []},
    {"specwatch.requests.drafted": [64, 64], "specwatch.requests.accepted": [64, 0]},
]
_LEFT_TO_THE_REFERENCE = [  # valid, but outside printable ASCII or typed otherwise: the reference decides
    {"specwatch.ts": 17}, {"specwatch.kv_usage": 1}, {"specwatch.draft_ms": 0},
    {"specwatch.bundle_id": "é" * 256}, {"specwatch.requests.id": ["r" * 200, "é" * 100]},
    {"specwatch.requests.bucket": ["b\u00e9", "coding"]}, {"specwatch.worker": "w\u2764"},
]
# (change, the reference's reason, where the detail says it is)
_INVALID = [
    ({"specwatch.seq": -1}, "invalid_value", "seq"), ({"specwatch.v": -1}, "unsupported_version", "unsupported"),
    ({"specwatch.v": 2}, "unsupported_version", "unsupported"),
    ({"specwatch.requests.drafted": [65, 4]}, "invalid_value", "requests.0.drafted"),
    ({"specwatch.requests.accepted": [-1, 0]}, "invalid_value", "requests.0.accepted"),
    ({"specwatch.requests.accepted": [5, 0]}, "accepted_exceeds_drafted", "requests.0"),
    ({"specwatch.requests.id": ["", "r2"]}, "invalid_value", "requests.0.id"),
    ({"specwatch.worker": "x" * 257}, "invalid_value", "worker"), ({"specwatch.worker": ""}, "invalid_value", "worker"),
    ({"specwatch.requests.bucket": ["coding"]}, "array_length_mismatch", "the specwatch.requests.* columns"),
    ({"specwatch.ts": float("nan")}, "not_finite", "ts"), ({"specwatch.ts": float("inf")}, "not_finite", "ts"),
    ({"specwatch.ts": -1.0}, "negative_time", "ts"), ({"specwatch.kv_usage": 1.5}, "invalid_value", "kv_usage"),
    ({"specwatch.verify_ms": float("-inf")}, "not_finite", "verify_ms"),
    ({"specwatch.requests.drafted": [True, 4]}, "invalid_value", "requests.0.drafted"),
    ({"specwatch.requests.accepted": [1 << 40, 0]}, "invalid_value", "requests.0.accepted"),
    ({"specwatch.requests.bucket": ["*", "coding"]}, "invalid_value", "requests.0.bucket"),
    ({"specwatch.requests.cohort": ["main", "a/b"]}, "invalid_value", "requests.1.cohort"),
    ({"specwatch.worker": "w\x1b[2J"}, "invalid_value", "worker"),
    ({"specwatch.bundle_id": "b\u202e"}, "invalid_value", "bundle_id"),
    ({"specwatch.requests.id": ["r\x9b", "r"]}, "invalid_value", "requests.0.id"),
    ({"specwatch.requests.cohort": ["c\n", "main"]}, "invalid_value", "requests.0.cohort"),
    ({"specwatch.requests.id": ["r\x00", "r"]}, "invalid_value", "requests.0.id"),
    ({"specwatch.worker": 7}, "invalid_value", "worker"), ({"specwatch.bundle_id": 1.5}, "invalid_value", "bundle_id"),
    ({"specwatch.requests.id": [1, 2]}, "invalid_value", "requests.0.id"),
    ({"specwatch.seq": 2.0}, "invalid_value", "seq"), ({"specwatch.ts": "5"}, "invalid_value", "ts"),
]


@pytest.mark.parametrize("change", _VALID)
def test_odd_but_valid_steps_are_the_walks_and_equal_the_reference(change):
    payload = _plain_step_request(change)
    assert [type(o) for o in _same_both_ways(payload)] == [tuple]
    assert _native_rows(payload) == 1


@pytest.mark.parametrize("change", _LEFT_TO_THE_REFERENCE)
def test_names_past_ascii_are_left_to_the_reference_and_come_back_the_same(change):
    payload = _plain_step_request(change)
    assert [type(o) for o in _same_both_ways(payload)] == [tuple]
    assert _native_rows(payload) == 0


@pytest.mark.parametrize("change,reason,where", _INVALID)
def test_invalid_steps_get_the_same_rejection_both_ways(change, reason, where):
    payload = _plain_step_request(change)
    (outcome,) = _same_both_ways(payload)
    assert isinstance(outcome, Rejection) and (outcome.reason, outcome.detail.startswith(f"step: {where}")) == (
        reason, True), outcome
    assert _native_rows(payload) == 0


def _plain_fields() -> list[bytes]:
    """The fields of test_otlp_wire's plain step, in the writer's order."""
    return [_ld(6, _key_value(k, v)) for k, v in _PLAIN_STEP.items()] + [_ld(12, b"specwatch.step")]


def test_an_attribute_in_another_attributes_place_is_not_taken_for_it_after_a_good_step():
    """The layout's memo is one per attribute: a bundle_id attribute seen in its own place, then in
    the worker's, is no worker; nor is a bucket column in the id column's place, nor accepted in
    drafted's -- a record's outcome does not hang on the records before it."""
    good = _plain_fields()
    keys = list(_PLAIN_STEP)
    for into, taken, missing in (("specwatch.worker", "specwatch.bundle_id", "worker"),
                                 ("specwatch.requests.id", "specwatch.requests.bucket", "specwatch.requests.id"),
                                 ("specwatch.requests.drafted", "specwatch.requests.accepted",
                                  "specwatch.requests.drafted")):
        odd = list(good)
        odd[keys.index(into)] = good[keys.index(taken)]
        payload = _request([b"".join(good), b"".join(odd)])
        outcomes = _same_both_ways(payload)
        assert type(outcomes[0]) is tuple
        assert isinstance(outcomes[1], Rejection)
        assert (outcomes[1].reason, outcomes[1].detail) == ("missing_field", f"step: missing required field {missing}")


def test_names_and_types_decode_the_same_among_good_steps():
    """test_fastpath's names and types, in a request between two good steps."""
    rounds = [RoundEntry.model_construct(id="r1", bucket="coding", cohort="main", drafted=4, accepted=3),
              RoundEntry.model_construct(id="r2", bucket="chat", cohort="main", drafted=4, accepted=4)]
    fields = dict(v=1, ts=10.0, worker="w1", seq=3, bundle_id="b1", draft_ms=1.0, verify_ms=9.0, kv_usage=0.5)
    good = StepRecord.model_construct(**fields, requests=rounds[:1])
    for field, value in [("worker", "w\x1b[2J"), ("bundle_id", "b\u202e"), ("id", "r\x9b"), ("bucket", "*"),
                         ("bucket", "a/b"), ("cohort", "*"), ("cohort", "c\n"), ("bucket", "b\u00e9"), ("cohort", "**"),
                         ("seq", 2.0), ("v", True)]:
        changed = dict(fields)
        steps = list(rounds)
        if field in changed:
            changed[field] = value
        else:
            steps[1] = steps[1].model_copy(update={field: value})
        payload = encode_records([good, StepRecord.model_construct(**changed, requests=steps), good])
        outcomes = _same_both_ways(payload)
        assert [type(o) is tuple for o in outcomes] == [True, value in ("b\u00e9", "**"), True]


def test_every_truncation_and_flip_of_a_request_decodes_the_same():
    records = _simulated()[:6]
    payload = encode_records(records)
    for end in range(len(payload) + 1):
        _same_both_ways(payload[:end])
    for at in range(len(payload)):
        for flip in (0x01, 0x80, 0xFF):
            broken = bytearray(payload)
            broken[at] ^= flip
            _same_both_ways(bytes(broken))


@_FUZZ
@given(st.data())
def test_valid_odd_and_invalid_steps_decode_the_same(data):
    _same_both_ways(steps_request(data))


@_FUZZ
@given(st.data())
def test_damaged_requests_decode_the_same(data):
    _same_both_ways(damaged_request(data))


@_FUZZ
@given(st.binary(max_size=2000))
@odd_bytes
@example(b"\x0a\x02\x12\x00")
@example(b"\x0a\x04\x12\x02\x12\x00")
@example(b"\x0a\x06\x12\x04\x12\x02\x32\x7f")
def test_hostile_bytes_neither_crash_the_walk_nor_split_otherwise(data):
    """The walk is handed bytes upb never saw: it reads the same records or none, and never fails."""
    walked = native_walks.STEP_WALK.records(data)
    spans = _log_record_spans(data)
    assert (None if walked is None else [(start, end) for start, end, _ in walked]) == spans
    _same_both_ways(data)


@_FUZZ
@given(st.data())
def test_hostile_records_in_a_valid_envelope_never_crash_the_walk(data):
    """A LogRecord of any bytes, or a good step damaged, handed to the walk directly."""
    good = b"".join(_plain_fields())
    record = damaged(data, good, most=3) if data.draw(st.booleans()) else data.draw(st.binary(max_size=600))
    payload = _request([record, good])
    native_walks.STEP_WALK.records(payload)
    _same_both_ways(payload)
