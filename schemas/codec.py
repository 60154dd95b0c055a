"""Decoding contract-v1 JSON Lines into validated records, and rejecting the rest with a reason."""

from __future__ import annotations

import gzip
import io
import json
from collections import Counter
from dataclasses import dataclass, field
from typing import BinaryIO, Iterator

from pydantic import TypeAdapter, ValidationError

from .contract import BundleRecord, RequestRecord, ShadowRecord, StepRecord, TelemetryRecord

__all__ = ["MAX_LINE_BYTES", "RECORD_KINDS", "Rejection", "RejectionCounter", "ahead_of_clock", "decode_line",
           "decode_object", "encode_record", "read_json_lines"]

# A step with MAX_REQUESTS_PER_STEP entries is ~400 KB of JSON; lines beyond this are
# rejected before parsing so a runaway producer cannot make the processor allocate GBs.
MAX_LINE_BYTES = 1 << 20

_GZIP_MAGIC = b"\x1f\x8b"
_UTF8_BOM = b"\xef\xbb\xbf"
RECORD_KINDS = {"bundle": BundleRecord, "step": StepRecord, "request": RequestRecord, "shadow": ShadowRecord}
_ADAPTER: TypeAdapter = TypeAdapter(TelemetryRecord)


@dataclass(frozen=True)
class Rejection:
    """A record that broke the contract: ``reason`` is a stable code, ``detail`` explains."""

    reason: str
    detail: str
    raw: str = ""

    def to_json(self) -> dict:
        return {"reason": self.reason, "detail": self.detail, "raw": self.raw[:2048]}


def ahead_of_clock(ts: float, now: float, max_ahead_seconds: float) -> Rejection | None:
    """A rejection when a record's event time is further ahead of ``now`` than allowed.

    >>> ahead_of_clock(1000.0, now=990.0, max_ahead_seconds=60.0) is None
    True
    >>> ahead_of_clock(5000.0, now=990.0, max_ahead_seconds=60.0).reason
    'ts_in_future'
    """
    if ts - now <= max_ahead_seconds:
        return None
    return Rejection("ts_in_future", f"ts {ts:.3f} is {ts - now:.0f} s ahead of this processor's clock "
                                     f"(at most {max_ahead_seconds:.0f} s allowed): check the worker's clock")


@dataclass
class RejectionCounter:
    """Counts rejected records by reason; processing never stops for them."""

    by_reason: Counter = field(default_factory=Counter)

    def add(self, rejection: Rejection) -> None:
        self.by_reason[rejection.reason] += 1

    @property
    def total(self) -> int:
        return sum(self.by_reason.values())

    def as_dict(self) -> dict[str, int]:
        return dict(sorted(self.by_reason.items()))


def _reason_from_validation(error: ValidationError) -> tuple[str, str]:
    first = error.errors(include_url=False)[0]
    loc = ".".join(str(p) for p in first.get("loc", ()))
    kind = first.get("type", "")
    msg = first.get("msg", "")
    if kind == "missing":
        return "missing_field", f"missing required field {loc}"
    if kind == "finite_number":
        return "not_finite", f"{loc} is not a finite number"
    if kind == "literal_error" and loc.endswith("v"):
        return "unsupported_version", f"unsupported contract version at {loc}: {msg}"
    for code in ("accepted_exceeds_drafted", "too_many_requests"):
        if code in msg:
            return code, f"{loc}: {msg.split(code + ': ', 1)[-1]}"
    if kind in ("greater_than_equal", "greater_than") and ("ms" in loc or loc.endswith("ts")):
        return "negative_time", f"{loc} must be >= 0: {msg}"
    return "invalid_value", f"{loc}: {msg}" if loc else msg


def decode_object(obj: object, raw: str = "") -> TelemetryRecord | Rejection:
    """Validate one parsed JSON value as a contract-v1 record.

    >>> decode_object({"kind": "shadow", "v": 1, "ts": 5.0, "bundle_id": "b", "id": "r",
    ...                "bucket": "coding", "check": "token_exact", "match": True}).kind
    'shadow'
    >>> decode_object({"kind": "trace", "v": 1}).reason, decode_object({"kind": [], "v": 1}).reason
    ('unknown_kind', 'unknown_kind')
    """
    if not isinstance(obj, dict):
        return Rejection("not_an_object", f"expected a JSON object, got {type(obj).__name__}", raw)
    kind = obj.get("kind")
    if not isinstance(kind, str) or kind not in RECORD_KINDS:  # a list or dict kind is not even hashable
        return Rejection("unknown_kind", f"kind {str(kind)[:100]!r} is not one of {sorted(RECORD_KINDS)}", raw)
    try:
        # strict: the contract is JSON, so "4" is no count, true no time and 1 no boolean
        return RECORD_KINDS[kind].model_validate(obj, strict=True)
    except ValidationError as error:
        reason, detail = _reason_from_validation(error)
        return Rejection(reason, f"{kind}: {detail}", raw)
    except (TypeError, ValueError, RecursionError) as error:  # pragma: no cover - defensive
        return Rejection("invalid_value", f"{kind}: {error}", raw)


def decode_line(line: str | bytes) -> TelemetryRecord | Rejection | None:
    """Decode one JSON Lines line; blank lines give ``None``.

    >>> decode_line('{"kind": "step", "v": 1}').reason
    'missing_field'
    >>> decode_line("{not json").reason
    'invalid_json'
    """
    if isinstance(line, bytes):
        if len(line) > MAX_LINE_BYTES:
            return Rejection("line_too_long", f"line of {len(line)} bytes > {MAX_LINE_BYTES}", "")
        try:
            line = line.decode("utf-8")
        except UnicodeDecodeError as error:
            return Rejection("invalid_json", f"not UTF-8: {error}", "")
    if len(line) > MAX_LINE_BYTES:
        return Rejection("line_too_long", f"line of {len(line)} chars > {MAX_LINE_BYTES}", line[:256])
    stripped = line.strip()
    if not stripped:
        return None
    try:
        obj = json.loads(stripped)
    except (ValueError, RecursionError) as error:
        return Rejection("invalid_json", f"invalid JSON: {error}", stripped)
    return decode_object(obj, stripped)


def encode_record(record: TelemetryRecord) -> str:
    """One compact JSON line (no newline) in contract form."""
    return record.model_dump_json(exclude_none=False)


def read_json_lines(stream: BinaryIO) -> Iterator[bytes]:
    """The lines of a JSON Lines byte stream, gunzipped if it is gzip, without a leading BOM.

    >>> list(read_json_lines(io.BytesIO(gzip.compress(b'\\xef\\xbb\\xbf{"a":1}\\n{"b":2}\\n'))))
    [b'{"a":1}\\n', b'{"b":2}\\n']
    """
    if not hasattr(stream, "peek"):
        stream = io.BufferedReader(stream)
    if stream.peek(len(_GZIP_MAGIC))[:len(_GZIP_MAGIC)] == _GZIP_MAGIC:
        stream = gzip.GzipFile(fileobj=stream, mode="rb")
    lines = iter(stream)
    first = next(lines, None)
    if first is None:
        return
    yield first[len(_UTF8_BOM):] if first.startswith(_UTF8_BOM) else first
    yield from lines
