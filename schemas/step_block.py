"""A block of decoded records, its valid steps as columns (`StepBlock`), and the contract's
checks of a step's scalar fields that both block decoders (JSON Lines and OTLP) make."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from .codec import Rejection
from .contract import MAX_NAME_CHARS, StepRecord, TelemetryRecord, printable

__all__ = ["MAX_EXACT_INT", "StepBlock", "interned_block", "is_name", "step_header"]

# ints beyond this lose precision as floats; such times take the reference path
MAX_EXACT_INT = 1 << 53
_INF = math.inf


def _time(x: Any) -> bool:
    kind = type(x)
    return (kind is float and 0.0 <= x < _INF) or (kind is int and 0 <= x < MAX_EXACT_INT)


def is_name(x: Any) -> bool:
    # isprintable() in C settles nearly every name; `printable` only looks closer when it is False
    return type(x) is str and 0 < len(x) <= MAX_NAME_CHARS and (x.isprintable() or printable(x))


def step_header(v: Any, ts: Any, worker: Any, seq: Any, bundle_id: Any, draft_ms: Any, verify_ms: Any,
                kv_usage: Any) -> tuple | None:
    """The step's scalar fields as the reference would type them, or None to take the reference path."""
    if not (type(v) is int and v == 1 and _time(ts) and _time(draft_ms) and _time(verify_ms)
            and type(seq) is int and seq >= 0 and is_name(worker) and is_name(bundle_id)
            and type(kv_usage) in (float, int) and 0 <= kv_usage <= 1):
        return None
    return float(ts), worker, seq, bundle_id, float(draft_ms), float(verify_ms), float(kv_usage)


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


# Below this many possible (bundle, pair) codes a table numbers them, over it a sort does
_MAX_CODE_TABLE = 1 << 20


def _numbered(codes: np.ndarray, n_codes: int) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(codes, return_inverse=True)`` for codes in ``range(n_codes)``: one pass over
    a table of the codes present where the table is small, not a sort of every code.

    >>> [part.tolist() for part in _numbered(np.array([5, 1, 5, 3]), 6)]
    [[1, 3, 5], [2, 0, 2, 1]]
    """
    if n_codes > _MAX_CODE_TABLE or codes.dtype.kind not in "iu":
        return np.unique(codes, return_inverse=True)
    present = np.zeros(n_codes, dtype=bool)
    present[codes] = True
    number = np.cumsum(present) - 1
    return np.flatnonzero(present), number[codes]


def interned_block(header, round_step: np.ndarray, pair_index: np.ndarray, pairs: list, drafted, accepted,
                   at: list, others: list, step_ids: list, build) -> StepBlock:
    """A `StepBlock` with (bundle, bucket, cohort) interned."""
    ts, workers, seqs, bundles, draft_ms, verify_ms, kv_usage = header[:7]
    # numbered in first-seen order, every per-item loop in C
    bundle_table = {name: i for i, name in enumerate(dict.fromkeys(bundles))}
    bundle_index = np.fromiter(map(bundle_table.__getitem__, bundles), np.int64, len(bundles))
    bundle_names = list(bundle_table)
    pairs = [*pairs, (None, None)]  # the last: the bundle as a whole
    n_pairs = len(pairs)
    codes, inverse = _numbered(np.concatenate([bundle_index * n_pairs + n_pairs - 1,
                                               bundle_index[round_step] * n_pairs + pair_index]),
                               len(bundle_names) * n_pairs)
    keys = [(bundle_names[c // n_pairs], *pairs[c % n_pairs]) for c in codes.tolist()]
    n = len(seqs)
    ts, draft_ms, verify_ms, kv_usage = (np.asarray(column, dtype=np.float64)
                                         for column in (ts, draft_ms, verify_ms, kv_usage))
    return StepBlock(ts, list(workers), list(seqs), inverse[:n].astype(np.int64), draft_ms, verify_ms, kv_usage, at,
                     round_step.astype(np.int64), inverse[n:].astype(np.int64), np.asarray(drafted, dtype=np.int64),
                     np.asarray(accepted, dtype=np.int64), np.ones(len(pair_index), dtype=np.int64),
                     keys, others, step_ids, build)
