"""Decoding contract-v1 JSON Lines into validated records, and rejecting the rest with a reason."""

from __future__ import annotations

import gzip
import io
import json
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import BinaryIO, Iterator

from pydantic import TypeAdapter, ValidationError

from .contract import BundleRecord, RequestRecord, ShadowRecord, StepRecord, TelemetryRecord

__all__ = ["MAX_GZIP_RATIO", "MAX_LINE_BYTES", "RECORD_KINDS", "DecompressionBombError", "Rejection",
           "RejectionCounter", "ahead_of_clock", "decode_line", "decode_object", "encode_record", "read_json_lines"]

# A step with MAX_REQUESTS_PER_STEP entries is ~400 KB of JSON; lines beyond this are
# rejected before parsing so a runaway producer cannot make the processor allocate GBs.
MAX_LINE_BYTES = 1 << 20

# Telemetry JSON gzips about 23:1 (gzip -9 of `specwatch simulate`); 200:1 past the first
# MiB is a decompression bomb (a few MB of gzip that inflate to GBs of zeros or newlines).
MAX_GZIP_RATIO = 200
_GZIP_RATIO_FROM_BYTES = 1 << 20
_SKIP_CHUNK = 1 << 16

_GZIP_MAGIC = b"\x1f\x8b"
_UTF8_BOM = b"\xef\xbb\xbf"
RECORD_KINDS = {"bundle": BundleRecord, "step": StepRecord, "request": RequestRecord, "shadow": ShadowRecord}
_ADAPTER: TypeAdapter = TypeAdapter(TelemetryRecord)


class DecompressionBombError(ValueError):
    """A gzip stream inflating far beyond what telemetry does; reading stopped."""


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
            # `read_json_lines` keeps only the first MAX_LINE_BYTES + 1 bytes of a longer line
            return Rejection("line_too_long", f"line longer than {MAX_LINE_BYTES} bytes", "")
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


def read_json_lines(stream: BinaryIO, max_line_bytes: int = MAX_LINE_BYTES,
                    max_gzip_ratio: float = MAX_GZIP_RATIO) -> Iterator[bytes]:
    """The lines of a JSON Lines byte stream, gunzipped if it is gzip, without a leading BOM.

    Memory stays bounded whatever the input: a line longer than ``max_line_bytes`` is read no
    further than that and given as its first ``max_line_bytes + 1`` bytes (`decode_line` rejects
    it as ``line_too_long``); the rest of it is skipped unkept. A gzip stream that inflates more
    than ``max_gzip_ratio`` times past its first MiB raises `DecompressionBombError`.

    >>> list(read_json_lines(io.BytesIO(gzip.compress(b'\\xef\\xbb\\xbf{"a":1}\\n{"b":2}\\n'))))
    [b'{"a":1}\\n', b'{"b":2}\\n']
    >>> [len(line) for line in read_json_lines(io.BytesIO(b"x" * 100 + b"\\n{}\\n"), max_line_bytes=10)]
    [11, 3]
    """
    counted = _CountingReader(stream)
    source: BinaryIO = io.BufferedReader(counted)
    gzipped = source.peek(len(_GZIP_MAGIC))[:len(_GZIP_MAGIC)] == _GZIP_MAGIC
    if gzipped:
        source = gzip.GzipFile(fileobj=source, mode="rb")
    # plain input is never checked; gzip from its first MiB on
    check_at, inflated, first = _GZIP_RATIO_FROM_BYTES if gzipped else math.inf, 0, True
    while line := source.readline(max_line_bytes + 1):
        inflated += len(line)
        if len(line) > max_line_bytes and not line.endswith(b"\n"):
            while (rest := source.readline(_SKIP_CHUNK)) and not rest.endswith(b"\n"):
                inflated += len(rest)
                if inflated > check_at:
                    _check_ratio(inflated, counted.bytes_read, max_gzip_ratio)
            inflated += len(rest)
        if inflated > check_at:
            _check_ratio(inflated, counted.bytes_read, max_gzip_ratio)
        if first:
            first = False
            line = line[len(_UTF8_BOM):] if line.startswith(_UTF8_BOM) else line
        yield line


def _check_ratio(inflated: int, compressed: int, max_ratio: float) -> None:
    if inflated > max_ratio * max(compressed, 1):
        raise DecompressionBombError(f"{inflated} bytes inflated from {compressed} bytes of gzip, more than "
                                     f"{max_ratio:g} times: refused as a decompression bomb (telemetry "
                                     "compresses about 20 times)")


class _CountingReader(io.RawIOBase):
    """The raw bytes read from a stream, counted: the compressed size a gzip ratio is taken over."""

    def __init__(self, stream: BinaryIO) -> None:
        # read1: what is there, without waiting for a pipe to fill the whole buffer
        self._read = getattr(stream, "read1", stream.read)
        self.bytes_read = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        chunk = self._read(len(buffer))
        size = len(chunk)
        buffer[:size] = chunk
        self.bytes_read += size
        return size
