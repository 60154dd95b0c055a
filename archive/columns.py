"""The archive's tables, each written once: its columns (name, ClickHouse type) give the DDL, the
Arrow insert schema (``DEFAULT`` columns left to the engine) and the row order."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import pyarrow as pa

__all__ = ["TABLES", "WINDOW_STATS", "WINDOW_STATS_FIELDS", "Table", "arrow_type"]

_ARCHIVED_AT = ("archived_at", "DateTime64(6, 'UTC') DEFAULT now64(6)")
_SCOPE = (("bucket", "LowCardinality(Nullable(String))"), ("cohort", "LowCardinality(Nullable(String))"))
# Sealed token ids are kept this long after they were archived, then ClickHouse drops them
# (a TTL on the table); the hashes in `samples` stay with the decision.
DEFAULT_SEALED_RETENTION_DAYS = 30
_ARROW_TYPES = {"String": pa.string(), "Float64": pa.float64(), "Bool": pa.bool_(), "UInt16": pa.uint16(),
                "UInt32": pa.uint32(), "UInt64": pa.uint64()}


def arrow_type(kind: str) -> pa.DataType:
    """The Arrow type that inserts into a column of ClickHouse type ``kind``.

    >>> arrow_type("LowCardinality(Nullable(String))"), arrow_type("Array(UInt64)")
    (DataType(string), ListType(list<item: uint64>))
    >>> arrow_type("SimpleAggregateFunction(groupUniqArrayArray, Array(String))")
    ListType(list<item: string>)
    """
    for wrapper in ("LowCardinality(", "Nullable("):
        if kind.startswith(wrapper):
            return arrow_type(kind[len(wrapper):-1])
    if kind.startswith("SimpleAggregateFunction("):
        return arrow_type(kind[len("SimpleAggregateFunction("):-1].split(",", 1)[1].strip())
    if kind.startswith("Array("):
        return pa.list_(arrow_type(kind[len("Array("):-1]))
    return _ARROW_TYPES[kind]


@dataclass(frozen=True)
class Table:
    """One archive table: columns in order (name, ClickHouse type) and its engine clauses."""

    name: str
    columns: tuple[tuple[str, str], ...]
    engine: str
    order_by: str
    partition_by: str | None = None
    ttl: str | None = None
    settings: str | None = None

    def create(self, database: str) -> str:
        """The ``CREATE TABLE IF NOT EXISTS`` statement."""
        clauses = [f"ENGINE = {self.engine}"]
        clauses += [f"{word} {value}" for word, value in (
            ("PARTITION BY", self.partition_by), ("ORDER BY", self.order_by), ("TTL", self.ttl),
            ("SETTINGS", self.settings)) if value]
        body = ",\n    ".join(f"{name} {kind}" for name, kind in self.columns)
        return f"CREATE TABLE IF NOT EXISTS {database}.{self.name} (\n    {body}\n) " + "\n".join(clauses)

    def kind(self, name: str) -> str:
        """The ClickHouse type of one column."""
        return dict(self.columns)[name]

    @cached_property
    def insert_schema(self) -> pa.Schema:
        """The Arrow schema of an insert: every column the engine does not fill itself."""
        return pa.schema([(name, arrow_type(kind)) for name, kind in self.columns if " DEFAULT " not in kind])

    @property
    def insert_names(self) -> list[str]:
        return self.insert_schema.names


# Scope columns (bucket, cohort) are Nullable because NULL means "every bucket/cohort"
# in decisions; the same convention holds in every table, so sorting keys that contain
# them need allow_nullable_key.
DECISIONS = Table("decisions", (
    ("decision_id", "String"), ("ts", "Float64"), ("bundle_id", "LowCardinality(String)"), *_SCOPE,
    ("action", "LowCardinality(String)"), ("reason", "LowCardinality(String)"),
    ("detector", "LowCardinality(String)"), ("evidence", "String"), ("sample_ids", "Array(String)"),
    ("line", "String"), _ARCHIVED_AT,
), "ReplacingMergeTree", "(bundle_id, decision_id)")

AUDIT = Table("audit", (
    ("audit_id", "String"), ("ts", "Float64"), ("kind", "LowCardinality(String)"), ("actor", "String"),
    ("decision_id", "Nullable(String)"), ("bundle_id", "LowCardinality(String)"), ("scope", "String"),
    ("reason", "String"), ("detector", "String"), ("thresholds", "String"), ("baseline", "String"),
    ("window", "String"), ("card", "String"), ("detail", "String"), _ARCHIVED_AT,
), "ReplacingMergeTree", "audit_id")

SAMPLES = Table("samples", (
    ("decision_id", "String"), ("kind", "LowCardinality(String)"), ("sample_id", "String"), ("ts", "Float64"),
    ("bundle_id", "LowCardinality(String)"), *_SCOPE, ("worker", "LowCardinality(Nullable(String))"),
    ("record", "String"),
), "ReplacingMergeTree", "(decision_id, kind, sample_id)")

_COUNT, _RATIO = "UInt64", "Nullable(Float64)"
# One row per (slice end, bundle, bucket, cohort). Counts are raw; ratios are NULL where
# undefined; the per-draft-position survival counts (`SliceStats.accepted_at_least` /
# `drafted_at_least`) are what `specwatch tune` predicts acceptance at every D from.
WINDOW_STATS = Table("window_stats", (
    ("ts", "Float64"), ("bundle_id", "LowCardinality(String)"), *_SCOPE,
    ("rounds", _COUNT), ("drafted_tokens", _COUNT), ("accepted_tokens", _COUNT),
    ("acceptance_length", _RATIO), ("draft_overhead", _RATIO), ("speedup", _RATIO), ("draft_ms", _RATIO),
    ("verify_ms", _RATIO), ("requests", _COUNT), ("errors", _COUNT), ("error_rate", _RATIO),
    ("ttft_p50", _RATIO), ("ttft_p95", _RATIO), ("ttft_p99", _RATIO), ("tpot_p50", _RATIO),
    ("tpot_p95", _RATIO), ("tpot_p99", _RATIO), ("e2e_p50", _RATIO), ("e2e_p95", _RATIO), ("e2e_p99", _RATIO),
    ("kv_peak", _RATIO), ("shadow_checks", _COUNT), ("shadow_mismatches", _COUNT), ("speculation_on", "Bool"),
    ("steps", _COUNT), ("plain_entries", _COUNT), ("accepted_at_least", "Array(UInt64)"),
    ("drafted_at_least", "Array(UInt64)"),
), "ReplacingMergeTree", "(bundle_id, bucket, cohort, ts)",
    partition_by="toYYYYMM(toDateTime(toUInt32(ts), 'UTC'))", settings="allow_nullable_key = 1")
WINDOW_STATS_FIELDS = tuple(name for name, _ in WINDOW_STATS.columns)
"""The keys of one window-stats row, in table column order."""
# Columns added after the first release: an archive created before gets them on open.
WINDOW_ADDED = ("steps", "plain_entries", "accepted_at_least", "drafted_at_least")

BUNDLES = Table("bundles", (
    ("bundle_id", "String"), ("card", "SimpleAggregateFunction(any, String)"),
    ("first_seen", "SimpleAggregateFunction(min, Float64)"), ("last_seen", "SimpleAggregateFunction(max, Float64)"),
    ("workers", "SimpleAggregateFunction(groupUniqArrayArray, Array(String))"),
), "AggregatingMergeTree", "bundle_id")

# Every worker's span of running a bundle; rewritten as it grows (min/max keep it whole).
BUNDLE_SIGHTINGS = Table("bundle_sightings", (
    ("bundle_id", "String"), ("worker", "String"), ("first_seen", "SimpleAggregateFunction(min, Float64)"),
    ("last_seen", "SimpleAggregateFunction(max, Float64)"),
), "AggregatingMergeTree", "(bundle_id, worker)")

OVERRIDES = Table("overrides", (
    ("override_id", "String"), ("ts", "Float64"), ("bundle_id", "LowCardinality(String)"), *_SCOPE,
    ("enabled", "Bool"), ("draft_limit", "Nullable(UInt16)"), ("by", "String"), ("reason", "String"),
    ("cleared", "Bool"), _ARCHIVED_AT,
), "ReplacingMergeTree", "override_id")

BUNDLE_STAGES = Table("bundle_stages", (
    ("change_id", "String"), ("ts", "Float64"), ("bundle_id", "LowCardinality(String)"),
    ("stage", "LowCardinality(String)"), ("previous_stage", "LowCardinality(Nullable(String))"),
    ("cohort_share", "Float64"), ("actor", "String"), ("reason", "String"), ("decision_id", "Nullable(String)"),
    ("detail", "String"), ("seq", "UInt32"), _ARCHIVED_AT,
), "ReplacingMergeTree", "(bundle_id, change_id)")

# Sealed samples: key id and ciphertext, never clear text.
SEALED_SAMPLES = Table("sealed_samples", (
    ("decision_id", "String"), ("sample_id", "String"), ("ts", "Float64"), ("bundle_id", "LowCardinality(String)"),
    ("key_id", "LowCardinality(String)"), ("prompt_sha256", "String"), ("output_sha256", "String"),
    ("sealed", "String"), ("archived_at", "DateTime DEFAULT now()"),
), "ReplacingMergeTree", "(decision_id, sample_id)",
    ttl=f"archived_at + INTERVAL {DEFAULT_SEALED_RETENTION_DAYS} DAY")

# `specwatch reproduce` results.
REPRODUCTIONS = Table("reproductions", (
    ("reproduction_id", "String"), ("decision_id", "String"), ("ts", "Float64"), ("actor", "String"),
    ("verdict", "LowCardinality(String)"), ("result", "String"), _ARCHIVED_AT,
), "ReplacingMergeTree", "(decision_id, reproduction_id)")

# One `specwatch qualify` report per run, under the card's fingerprint; the newest one counts.
QUALIFICATIONS = Table("qualifications", (
    ("qualification_id", "String"), ("bundle_id", "String"), ("ts", "Float64"),
    ("verdict", "LowCardinality(String)"), ("report", "String"), _ARCHIVED_AT,
), "ReplacingMergeTree", "(bundle_id, qualification_id)")

TABLES = (DECISIONS, AUDIT, SAMPLES, WINDOW_STATS, BUNDLES, BUNDLE_SIGHTINGS, OVERRIDES, BUNDLE_STAGES,
          SEALED_SAMPLES, REPRODUCTIONS, QUALIFICATIONS)
"""Every archive table, in the order they are created."""
