"""Archive rows checked and encoded as insert columns (a bad row fails here, naming itself,
before any insert), and stored JSON decoded again on the way out."""

from __future__ import annotations

import itertools
import json
import math
import operator
from collections import abc
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import pyarrow as pa

from specwatch.archive.columns import AUDIT, DECISIONS, SAMPLES, SEALED_SAMPLES, WINDOW_STATS, WINDOW_STATS_FIELDS
from specwatch.archive.jsonvalue import canonical_json, digest_id
from specwatch.schemas import Decision
from specwatch.schemas.outputs import WINDOW_SUMMARY_FIELDS, WindowColumns, WindowRow
from specwatch.schemas.redaction import redact_record
from specwatch.schemas.sealed import sealed_key_id

__all__ = ["DEFAULT_SAMPLE_TEXT", "WINDOW_ARRAYS", "DecisionBatch", "append_row", "audit_out",
           "decision_out", "finite", "require_text", "stage_row", "window_columns_table",
           "window_out", "window_rows_table", "window_stats_table"]

DEFAULT_SAMPLE_TEXT = "hashes"
_SAMPLE_KINDS = ("request", "step", "shadow")
_AUDIT_JSON = ("thresholds", "baseline", "window", "card", "detail")

# The window-stats columns by what they hold, read off their types in `columns.WINDOW_STATS`.
WINDOW_ARRAYS = tuple(name for name, kind in WINDOW_STATS.columns if kind.startswith("Array("))
_WINDOW_RATIOS = tuple(name for name, kind in WINDOW_STATS.columns if kind == "Nullable(Float64)")
_RATIO_SET = frozenset(_WINDOW_RATIOS)
_WINDOW_TEXT = tuple(name for name, kind in WINDOW_STATS.columns if "String" in kind)
# Every number (counts and the flag too) is unpacked as float64 first, so None, NaN,
# fractions and negatives can be told apart and refused or kept as the field needs.
_WINDOW_NUMBERS = tuple(name for name in WINDOW_STATS_FIELDS if name not in _WINDOW_TEXT + WINDOW_ARRAYS)
_WINDOW_NUMBER_VALUES = operator.itemgetter(*_WINDOW_NUMBERS)
_EXPECTED_OF_KIND = {"UInt64": "a count", "Nullable(Float64)": "a number or NaN", "Bool": "a bool",
                     "Array(UInt64)": "a list of counts",
                     "LowCardinality(Nullable(String))": "a string or None"}
_WINDOW_EXPECTED = {name: _EXPECTED_OF_KIND.get(kind) for name, kind in WINDOW_STATS.columns}
_WINDOW_EXPECTED.update(ts="a finite slice end time", bundle_id="a bundle id string")


class DecisionBatch:
    """Decisions, audit rows and samples encoded into insert columns."""

    def __init__(self, sample_text: str = DEFAULT_SAMPLE_TEXT) -> None:
        self.sample_text = sample_text
        self.decisions: list[list[Any]] = [[] for _ in DECISIONS.insert_schema]
        self.audits: list[list[Any]] = [[] for _ in AUDIT.insert_schema]
        self.samples: list[list[Any]] = [[] for _ in SAMPLES.insert_schema]
        self.sealed: list[list[Any]] = [[] for _ in SEALED_SAMPLES.insert_schema]
        self.count = 0

    def add(self, decision: Decision, audit: Mapping[str, Any] | None,
            samples: Sequence[Mapping[str, Any]]) -> None:
        if not isinstance(decision, Decision):
            raise TypeError(f"write_decision needs a Decision, not {type(decision).__name__}")
        # Everything is encoded before anything is kept, so a bad sample never leaves
        # a half-recorded decision behind.
        decision_id = decision.id  # a digest of the canonical line: computed once
        rows = _decision_row(decision, decision_id), _decision_audit_row(decision, decision_id, audit or {})
        unsealed = [_unsealed(decision_id, sample) for sample in samples]
        sample_rows = [_sample_row(decision_id, record, self.sample_text) for record, _ in unsealed]
        append_row(self.decisions, rows[0])
        append_row(self.audits, rows[1])
        for row in sample_rows:
            append_row(self.samples, row)
        for _, sealed_row in unsealed:
            if sealed_row is not None:
                append_row(self.sealed, sealed_row)
        self.count += 1


def append_row(columns: list[list[Any]], row: Sequence[Any]) -> None:
    """Add one row to column lists (an insert's columns)."""
    for column, value in zip(columns, row):
        column.append(value)


def stage_row(change: Mapping[str, Any]) -> list[Any]:
    """One registry row; its id is a digest of the change, so writing it twice keeps one."""
    bundle_id, ts = change["bundle_id"], finite(change["ts"], "ts")
    require_text(bundle_id, "bundle_id")
    detail = canonical_json(change.get("detail") or {})
    change_id = digest_id("s-", {"bundle_id": bundle_id, "ts": ts, "stage": change["stage"],
                                 "actor": change["actor"], "reason": change.get("reason", ""),
                                 "decision_id": change.get("decision_id"), "detail": detail})
    return [change_id, ts, bundle_id, change["stage"], change.get("previous_stage"),
            float(change.get("cohort_share") or 0.0), change["actor"], change.get("reason", ""),
            change.get("decision_id"), detail, int(change.get("seq") or 0)]


def _decision_row(decision: Decision, decision_id: str) -> list[Any]:
    line = decision.to_json_line()
    evidence = json.loads(line)["evidence"]  # the canonical form: sorted keys, NaN as null
    return [decision_id, decision.ts, decision.bundle_id, decision.bucket, decision.cohort,
            decision.action, decision.reason, decision.detector, canonical_json(evidence),
            list(decision.sample_ids), line]


def _decision_audit_row(decision: Decision, decision_id: str, audit: Mapping[str, Any]) -> list[Any]:
    if not isinstance(audit, abc.Mapping):
        raise TypeError(f"audit must be a dict, not {type(audit).__name__}")
    extra = {k: v for k, v in audit.items() if k not in ("thresholds", "baseline", "window", "card")}
    return [f"a-{decision_id}", decision.ts, "decision", "specwatch", decision_id, decision.bundle_id,
            decision.key, decision.reason, decision.detector, canonical_json(audit.get("thresholds")),
            canonical_json(audit.get("baseline")), canonical_json(audit.get("window")), canonical_json(audit.get("card")),
            canonical_json(extra or None)]


def _unsealed(decision_id: str, sample: Mapping[str, Any] | Any) -> tuple[Any, list[Any] | None]:
    """A sample without its sealed token ids, and the sealed-samples row that keeps them apart."""
    record = sample.model_dump(mode="json") if hasattr(sample, "model_dump") else sample
    inner = record.get("sample") if isinstance(record, abc.Mapping) else None
    sealed = inner.get("sealed") if isinstance(inner, abc.Mapping) else None
    if sealed is None:
        return record, None
    key_id = sealed_key_id(sealed)  # a malformed payload is a bad sample: refused here
    try:
        row = [decision_id, str(record["id"]), finite(record["ts"], "sample ts"), record["bundle_id"], key_id,
               inner.get("prompt_sha256") or "", inner.get("output_sha256") or "", sealed]
    except KeyError as exc:
        raise ValueError(f"sealed sample for {decision_id} has no {exc.args[0]!r}") from None
    return {**record, "sample": {k: v for k, v in inner.items() if k != "sealed"}}, row


def _sample_row(decision_id: str, record: Mapping[str, Any] | Any, sample_text: str) -> list[Any]:
    if not isinstance(record, abc.Mapping):
        raise TypeError(f"a sample must be a contract-v1 record dict, not {type(record).__name__}")
    record = redact_record(record, sample_text)
    kind = record.get("kind")
    if kind not in _SAMPLE_KINDS:
        raise ValueError(f"sample kind {kind!r} is not one of {', '.join(_SAMPLE_KINDS)}")
    try:
        ts = finite(record["ts"], "sample ts")
        bundle_id = record["bundle_id"]
        if kind == "step":
            sample_id = f"{record['worker']}:{record['seq']}"
            # A step carries many requests; its bucket/cohort are set only when they agree.
            buckets = {r.get("bucket") for r in record.get("requests", ())}
            cohorts = {r.get("cohort") for r in record.get("requests", ())}
            bucket = buckets.pop() if len(buckets) == 1 else None
            cohort = cohorts.pop() if len(cohorts) == 1 else None
        else:
            sample_id = record["id"]
            bucket, cohort = record.get("bucket"), record.get("cohort")
    except KeyError as exc:
        raise ValueError(f"{kind} sample for {decision_id} has no {exc.args[0]!r}") from None
    return [decision_id, kind, str(sample_id), ts, bundle_id, bucket, cohort, record.get("worker"),
            canonical_json(record)]


def window_stats_table(rows: Sequence[Mapping[str, Any]], offset: int) -> pa.Table:
    """Window-stats rows as an Arrow table, with the checks a ClickHouse insert would not do.

    >>> row = dict.fromkeys(WINDOW_STATS_FIELDS, 1)
    >>> row.update(ts=10.0, bundle_id="b-1", bucket="coding", cohort=None, speedup=float("nan"),
    ...            accepted_at_least=[1], drafted_at_least=[1])
    >>> table = window_stats_table([row], 0)
    >>> table.column("speedup").null_count, table.column("rounds").type
    (1, DataType(uint64))
    >>> window_stats_table([row, dict(row, rounds=2.5)], 40)
    Traceback (most recent call last):
    ...
    ValueError: window stats row 41: 'rounds' is a count, not 2.5
    """
    # Numbers stream through one C-level pass (itemgetter, chain, fromiter) into a
    # float64 matrix, None becoming NaN: about a quarter of the cost of per-field
    # comprehensions and casts at this width.
    try:
        flat = np.fromiter(itertools.chain.from_iterable(map(_WINDOW_NUMBER_VALUES, rows)),
                           dtype=np.float64, count=len(rows) * len(_WINDOW_NUMBERS))
        texts = {name: [row[name] for row in rows] for name in _WINDOW_TEXT}
    except (KeyError, TypeError, ValueError):
        raise _window_culprit(rows, offset) from None
    matrix = flat.reshape(len(rows), len(_WINDOW_NUMBERS))
    numbers = dict(zip(_WINDOW_NUMBERS, np.ascontiguousarray(matrix.T)))
    lists = {name: _count_lists(rows, name) for name in WINDOW_ARRAYS}
    return _window_table(numbers, texts, lists, lambda index, name: rows[index][name], offset,
                         lambda: _window_culprit(rows, offset))


# Where each number of a `WindowRow` sits: the summary's (its own ts is the latest record's,
# left out) and the row's own.
_SUMMARY_COLUMNS = {name: i for i, name in enumerate(WINDOW_SUMMARY_FIELDS) if name != "ts"}
_ROW_NUMBERS = ("ts", "speculation_on", "steps", "plain_entries")
_ROW_NUMBER_VALUES = operator.itemgetter(*(WindowRow._fields.index(name) for name in _ROW_NUMBERS))
_ROW_SUMMARY = operator.itemgetter(WindowRow._fields.index("summary"))


def window_rows_table(rows: Sequence[WindowRow], offset: int = 0) -> pa.Table:
    """Window rows (`WindowRow` tuples) as an Arrow table, column by column, with no dict per row.

    >>> from specwatch.schemas.slice_stats import SliceStats
    >>> stats = SliceStats(); stats.add_round(drafted=4, accepted=3)
    >>> row = WindowRow(10.0, "b-1", "coding", None, True, 1, 0, [1, 1, 1], [1, 1, 1, 1], stats.summary_values())
    >>> table = window_rows_table([row])
    >>> table.column("acceptance_length")[0].as_py(), table.column("speedup").null_count
    (4.0, 1)
    >>> table.column("drafted_at_least").to_pylist()
    [[1, 1, 1, 1]]
    """
    count = len(rows)
    try:
        summary = np.fromiter(itertools.chain.from_iterable(map(_ROW_SUMMARY, rows)), dtype=np.float64,
                              count=count * len(WINDOW_SUMMARY_FIELDS)).reshape(count, len(WINDOW_SUMMARY_FIELDS))
        own = np.fromiter(itertools.chain.from_iterable(map(_ROW_NUMBER_VALUES, rows)), dtype=np.float64,
                          count=count * len(_ROW_NUMBERS)).reshape(count, len(_ROW_NUMBERS))
    except (TypeError, ValueError):
        raise ValueError(f"window rows {offset}..{offset + count - 1} hold a value that is not a number") from None
    numbers = {name: np.ascontiguousarray(summary[:, i]) for name, i in _SUMMARY_COLUMNS.items()}
    numbers.update(zip(_ROW_NUMBERS, np.ascontiguousarray(own.T)))
    texts = {name: [getattr(row, name) for row in rows] for name in _WINDOW_TEXT}
    positions = {name: WindowColumns.flat_counts([getattr(row, name) for row in rows]) for name in WINDOW_ARRAYS}
    return window_columns_table(WindowColumns(numbers, texts, positions), offset)


def window_columns_table(columns: WindowColumns, offset: int = 0) -> pa.Table:
    """Window-stats insert columns (`WindowColumns`) as an Arrow table, each column checked."""
    lists = {name: _count_list_array(*columns.positions[name]) for name in WINDOW_ARRAYS}

    def value_of(index: int, name: str) -> Any:
        if name in WINDOW_ARRAYS:
            flat, offsets = columns.positions[name]
            return flat[offsets[index]:offsets[index + 1]].tolist()
        return columns.texts[name][index] if name in _WINDOW_TEXT else columns.numbers[name][index].item()

    return _window_table(columns.numbers, columns.texts, lists, value_of, offset,
                         lambda: ValueError(f"window rows {offset}..{offset + len(columns) - 1} do not convert"))


def _window_table(numbers: Mapping[str, np.ndarray], texts: Mapping[str, list],
                  lists: Mapping[str, tuple[pa.Array | None, Sequence[int]]], value_of: Callable[[int, str], Any],
                  offset: int, culprit: Callable[[], ValueError]) -> pa.Table:
    """The window-stats insert from its columns; the first bad value raises ValueError naming its
    row (``offset`` + index) and column."""
    arrays = []
    for name in WINDOW_STATS_FIELDS:
        if name in WINDOW_ARRAYS:
            array, bad = lists[name]
        elif name in _WINDOW_TEXT:
            try:
                array = pa.array(texts[name], type=pa.string())
            except pa.ArrowException:
                raise culprit() from None
            bad = ([i for i, v in enumerate(texts[name]) if v is None]
                   if name == "bundle_id" and array.null_count else ())
        else:
            column = numbers[name]
            if name in _RATIO_SET:
                array, bad = pa.array(column, mask=np.isnan(column)), ()  # NaN -> NULL
            elif name == "ts":
                array, bad = pa.array(column), np.flatnonzero(~np.isfinite(column))
            elif name == "speculation_on":
                array, bad = pa.array(column == 1), np.flatnonzero((column != 0) & (column != 1))
            else:
                with np.errstate(invalid="ignore"):
                    whole = np.isfinite(column) & (column >= 0) & (column == np.floor(column))
                    bad = np.flatnonzero(~whole)
                array = pa.array(column.astype(np.uint64)) if not len(bad) else None
        if len(bad):
            index = int(bad[0])
            raise ValueError(f"window stats row {offset + index}: {name!r} is "
                             f"{_WINDOW_EXPECTED[name]}, not {value_of(index, name)!r}")
        arrays.append(array)
    return pa.Table.from_arrays(arrays, schema=WINDOW_STATS.insert_schema)


def _count_list_array(flat: np.ndarray, offsets: np.ndarray) -> tuple[pa.Array | None, list[int]]:
    """One list-of-counts column from its flat counts and offsets; or the row that holds a negative count."""
    negative = np.flatnonzero(flat < 0)
    if len(negative):
        return None, [int(np.searchsorted(offsets, negative[0], side="right") - 1)]
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(flat.astype(np.uint64))), []


def _count_lists(rows: Sequence[Mapping[str, Any]], name: str) -> tuple[pa.Array | None, list[int]]:
    """One list-of-counts column, or the rows whose value is not a list of whole numbers >= 0."""
    values = [row[name] for row in rows]
    bad = [i for i, v in enumerate(values) if not isinstance(v, (list, tuple))
           or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in v)]
    return (None if bad else pa.array(values, type=pa.list_(pa.uint64()))), bad


def _window_culprit(rows: Sequence[Mapping[str, Any]], offset: int) -> ValueError:
    """The error naming the first row or value that would not convert."""
    for index, row in enumerate(rows):
        if not isinstance(row, abc.Mapping):
            return ValueError(f"window stats row {offset + index} is a {type(row).__name__}, not a dict")
        missing = [name for name in WINDOW_STATS_FIELDS if name not in row]
        if missing:
            return ValueError(f"window stats row {offset + index} lacks {', '.join(map(repr, missing))}")
        for name in WINDOW_STATS_FIELDS:
            value = row[name]
            if name in _WINDOW_TEXT:
                fits = isinstance(value, str) or (value is None and name != "bundle_id")
            elif name in WINDOW_ARRAYS:
                fits = True  # checked column by column in `_count_lists`
            else:
                try:
                    float(value)
                    fits = True
                except (TypeError, ValueError):
                    fits = value is None
            if not fits:
                return ValueError(f"window stats row {offset + index}: {name!r} is "
                                  f"{_WINDOW_EXPECTED[name]}, not {value!r}")
    return ValueError(f"window stats rows {offset}..{offset + len(rows) - 1} do not convert")


def finite(value: Any, name: str) -> float:
    """``value`` as a finite float; ValueError naming ``name`` otherwise."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, not {value!r}") from None
    if not math.isfinite(number):
        raise ValueError(f"{name} must be finite, not {value!r}")
    return number


def require_text(value: Any, name: str) -> None:
    """ValueError naming ``name`` unless ``value`` is a non-empty string."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string, not {value!r}")


def decision_out(row: dict) -> dict:
    """A decisions row as read: evidence parsed, sample ids a list."""
    row["evidence"] = json.loads(row["evidence"])
    row["sample_ids"] = list(row["sample_ids"])
    return row


def audit_out(row: dict) -> dict:
    """An audit row as read: its JSON fields parsed."""
    for name in _AUDIT_JSON:
        row[name] = json.loads(row[name]) if row[name] else None
    window = row.get("window")
    if isinstance(window, list):  # window slices read back like timeline rows
        for entry in window:
            if isinstance(entry, dict):
                window_out(entry)
    return row


def window_out(row: dict) -> dict:
    """A window-stats row as read: undefined ratios (NULL) are NaN again."""
    for name in _WINDOW_RATIOS:
        if name in row and row[name] is None:
            row[name] = math.nan
    return row


