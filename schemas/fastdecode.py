"""Decoding step records without building pydantic objects, for the processing hot path.

A step that passes a few cheap type and range checks becomes a `StepColumns` (its rounds as
columns); anything else goes through the reference codec, so records and rejection reasons
are exactly those of `codec.decode_line` and `otlp.decode_request`.
"""

from __future__ import annotations

import math
from collections import Counter
from itertools import chain
from dataclasses import dataclass
from operator import gt, itemgetter
from typing import Any, Callable

import orjson
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest

from .codec import MAX_LINE_BYTES, Rejection, decode_line, decode_object
from .contract import MAX_REQUESTS_PER_STEP, StepRecord, TelemetryRecord
from .otlp import MAX_REQUEST_BYTES, decode_log_record, decode_request
from .otlp import _REQUESTS_PREFIX, _py, record_from_attributes  # noqa: PLC2701 - same contract, same package

__all__ = ["StepColumns", "decode_line_fast", "decode_request_fast", "step_columns"]

_MAX_NAME = 256  # contract.Name
_MAX_DRAFT = 64  # RoundEntry.drafted / accepted bound
# ints beyond this lose precision as floats; such times take the reference path
_MAX_EXACT_INT = 1 << 53
_ROUND = itemgetter("bucket", "cohort", "drafted", "accepted")
_ID = itemgetter("id")
_INF = math.inf
_STR = {str}
_STR_INT = {str, int}
_INT = {int}


@dataclass(slots=True)
class StepColumns:
    """A step record that passed validation, its rounds tallied.

    ``rounds`` counts requests by (bucket, cohort, drafted, accepted), in first-seen order.

    ``record()`` builds the equivalent `StepRecord` through the reference codec; stage 1
    needs it only for the few steps it keeps as samples.
    """

    ts: float
    worker: str
    seq: int
    bundle_id: str
    draft_ms: float
    verify_ms: float
    kv_usage: float
    rounds: Counter
    _build: Callable[[], TelemetryRecord | Rejection]

    kind = "step"

    def record(self) -> StepRecord:
        return self._build()



def _time(x: Any) -> bool:
    kind = type(x)
    return (kind is float and 0.0 <= x < _INF) or (kind is int and 0 <= x < _MAX_EXACT_INT)


def _name(x: Any) -> bool:
    return type(x) is str and 0 < len(x) <= _MAX_NAME


def _names(column: Any) -> bool:
    # type check over the whole column in C; lengths only over its distinct values
    if set(map(type, column)) != _STR:
        return False
    lengths = set(map(len, column))
    return min(lengths) > 0 and max(lengths) <= _MAX_NAME


def _tally(rounds: list) -> Counter | None:
    """Rounds counted by (bucket, cohort, drafted, accepted) if every one is valid, else None."""
    # only str and int anywhere: then equal keys are equal values (no True == 1 == 1.0)
    if not set(map(type, chain.from_iterable(rounds))) <= _STR_INT:
        return None
    tally = Counter(rounds)
    if not tally:
        return tally
    # checked over the distinct rounds, column by column, in C
    buckets, cohorts, drafted, accepted = zip(*tally)
    if not (_names(buckets) and _names(cohorts) and set(map(type, drafted)) == _INT
            and set(map(type, accepted)) == _INT and min(accepted) >= 0 and max(drafted) <= _MAX_DRAFT
            and not any(map(gt, accepted, drafted))):
        return None
    return tally


def _header(obj: dict) -> tuple | None:
    """The step's scalar fields as the reference would type them, or None to take the reference path."""
    v, ts, seq, kv = obj.get("v"), obj.get("ts"), obj.get("seq"), obj.get("kv_usage")
    draft_ms, verify_ms = obj.get("draft_ms"), obj.get("verify_ms")
    worker, bundle_id = obj.get("worker"), obj.get("bundle_id")
    if not (type(v) is int and v == 1 and _time(ts) and _time(draft_ms) and _time(verify_ms)
            and type(seq) is int and seq >= 0 and _name(worker) and _name(bundle_id)):
        return None
    kind = type(kv)
    if not ((kind is float or kind is int) and 0 <= kv <= 1):
        return None
    return float(ts), worker, seq, bundle_id, float(draft_ms), float(verify_ms), float(kv)


def step_columns(obj: Any, build: Callable[[], TelemetryRecord | Rejection]) -> StepColumns | None:
    """``obj`` (a parsed contract-v1 step object) as columns if it passes the cheap checks, else None.

    None means "not proven valid here": the caller decodes it with the reference codec,
    which gives the record or the exact rejection.

    >>> obj = {"kind": "step", "v": 1, "ts": 10, "worker": "w1", "seq": 0, "bundle_id": "b",
    ...        "draft_ms": 1, "verify_ms": 10.0, "kv_usage": 0.5,
    ...        "requests": [{"id": "r1", "bucket": "coding", "cohort": "main", "drafted": 4, "accepted": 3}]}
    >>> step = step_columns(obj, lambda: decode_object(obj))
    >>> step.ts, dict(step.rounds), step.record().requests[0].accepted
    (10.0, {('coding', 'main', 4, 3): 1}, 3)
    >>> obj["requests"][0]["accepted"] = 5
    >>> step_columns(obj, lambda: decode_object(obj)) is None
    True
    """
    if type(obj) is not dict or obj.get("kind") != "step":
        return None
    header = _header(obj)
    requests = obj.get("requests")
    if header is None or type(requests) is not list or len(requests) > MAX_REQUESTS_PER_STEP:
        return None
    try:
        ids = list(map(_ID, requests))
        rounds = list(map(_ROUND, requests))
    except (KeyError, TypeError):  # an entry that is not an object, or lacks a field
        return None
    if ids and not _names(ids):
        return None
    tally = _tally(rounds)
    if tally is None:
        return None
    return StepColumns(*header, tally, build)


def decode_line_fast(line: str | bytes) -> TelemetryRecord | StepColumns | Rejection | None:
    """`codec.decode_line` with steps as `StepColumns`; every other outcome is identical.

    >>> decode_line_fast('{"kind": "step", "v": 1}').reason
    'missing_field'
    >>> decode_line_fast(b'{"kind":"step","v":1,"ts":1.5,"worker":"w","seq":3,"bundle_id":"b",'
    ...                  b'"draft_ms":1.0,"verify_ms":9.0,"kv_usage":0.2,"requests":[]}').seq
    3
    """
    if len(line) > MAX_LINE_BYTES:
        return decode_line(line)
    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError:
        return decode_line(line)  # blank, invalid, or JSON orjson reads differently (NaN, huge ints)
    step = step_columns(obj, lambda: decode_line(line))
    if step is not None:
        return step
    if type(obj) is dict and obj.get("kind") in ("request", "shadow", "bundle"):
        record = decode_object(obj)
        if not isinstance(record, Rejection):
            return record
    return decode_line(line)


def _step_from_log_record(log_record) -> StepColumns | None:
    if log_record.event_name != "specwatch.step":
        return None
    obj: dict[str, Any] = {}
    columns: dict[str, Any] = {}
    attributes = {pair.key: _py(pair.value) for pair in log_record.attributes}
    for key, value in attributes.items():
        if key.startswith(_REQUESTS_PREFIX):
            columns[key[len(_REQUESTS_PREFIX):]] = value
        elif key.startswith("specwatch."):
            obj[key[10:]] = value
    if "ts" not in obj:
        return None
    header = _header(obj)
    if header is None:
        return None
    try:
        ids, buckets, cohorts = columns["id"], columns["bucket"], columns["cohort"]
        drafted, accepted = columns["drafted"], columns["accepted"]
    except KeyError:
        return None
    n = len(ids) if type(ids) is list else -1
    if n > MAX_REQUESTS_PER_STEP or any(type(c) is not list or len(c) != n for c in columns.values()):
        return None

    def build(log_record=log_record, attributes=attributes):
        return record_from_attributes(log_record.event_name, attributes, log_record.time_unix_nano)

    if n and not _names(ids):
        return None
    tally = _tally(list(zip(buckets, cohorts, drafted, accepted)))
    if tally is None:
        return None
    return StepColumns(*header, tally, build)


def decode_request_fast(data: bytes | bytearray | memoryview) -> list[TelemetryRecord | StepColumns | Rejection]:
    """`otlp.decode_request` with steps as `StepColumns`; every other outcome is identical.

    >>> decode_request_fast(b"\\xff\\xff not protobuf")[0].reason
    'invalid_otlp'
    """
    if len(data) > MAX_REQUEST_BYTES:
        return decode_request(data)
    request = ExportLogsServiceRequest()
    try:
        request.ParseFromString(bytes(data))
    except (DecodeError, RecursionError, ValueError, TypeError):
        return decode_request(data)
    out: list = []
    append = out.append
    for resource_logs in request.resource_logs:
        for scope_logs in resource_logs.scope_logs:
            for log_record in scope_logs.log_records:
                try:
                    step = _step_from_log_record(log_record)
                except (TypeError, ValueError, RecursionError):
                    step = None
                append(step if step is not None else decode_log_record(log_record))
    return out
