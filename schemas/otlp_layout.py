"""The bytes of the layout `otlp.encode_records` writes, built with the writer's own functions:
the OTLP block decoder and the compiled step walk compare a record against them piece by piece."""

from __future__ import annotations

from typing import Any

from .otlp import EVENT_PREFIX, REQUESTS_PREFIX, ROUND_COLUMNS
from .otlp_wire import EncodingMemo, encode_attribute

__all__ = ["ACCEPTED_KEY", "BUCKET_KEY", "BUNDLE_KEY", "COHORT_KEY", "COLUMN_PREFIX", "DRAFTED_KEY", "DRAFT_HEAD",
           "EVENT_FIELD", "ID_KEY", "KV_HEAD", "ROUND_COLUMN_KEYS", "SEQ_HEADS", "STEP_EVENT", "VERIFY_HEAD",
           "V_TS_HEAD", "head", "written"]

STEP_EVENT = (EVENT_PREFIX + "step").encode()
COLUMN_PREFIX = REQUESTS_PREFIX.encode()
ROUND_COLUMN_KEYS = tuple(name.encode() for name in ROUND_COLUMNS)


def written(key: str, value: Any) -> bytes:
    return encode_attribute(key, value, EncodingMemo())


def head(key: str, value: Any, tail: int) -> bytes:
    """The bytes the writer puts before the last ``tail`` bytes of this attribute."""
    return written(key, value)[:-tail]


V_TS_HEAD = written("specwatch.v", 1) + head("specwatch.ts", 0.5, 8)
DRAFT_HEAD, VERIFY_HEAD, KV_HEAD = (head(f"specwatch.{name}", 0.5, 8) for name in ("draft_ms", "verify_ms", "kv_usage"))
# seq by the size of its attribute (one byte): the bytes before the varint, and its width
SEQ_HEADS = {len(attribute) - 2: (attribute[:-width], width) for width, attribute in (
    (len(written("specwatch.seq", value)) - len(written("specwatch.seq", 0)) + 1, written("specwatch.seq", value))
    for value in [1 << 7 * k for k in range(9)] + [-1])}
WORKER_KEY, BUNDLE_KEY = b"specwatch.worker", b"specwatch.bundle_id"
ID_KEY, BUCKET_KEY, COHORT_KEY, DRAFTED_KEY, ACCEPTED_KEY = (COLUMN_PREFIX + name for name in ROUND_COLUMN_KEYS)
EVENT_FIELD = b"\x62" + bytes((len(STEP_EVENT),)) + STEP_EVENT
