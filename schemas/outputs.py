"""What stage 2 hands to the action sinks when a slice becomes final: decisions with their
audit and samples, window statistics, bundle cards and sightings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from .decisions import Decision

__all__ = ["WINDOW_SUMMARY_FIELDS", "ActionRecord", "SliceOutput", "WindowRow"]

WINDOW_SUMMARY_FIELDS = (
    "ts", "rounds", "drafted_tokens", "accepted_tokens", "acceptance_length", "draft_overhead", "speedup",
    "draft_ms", "verify_ms", "requests", "errors", "error_rate", "kv_peak", "shadow_checks", "shadow_mismatches",
    "ttft_p50", "ttft_p95", "ttft_p99", "tpot_p50", "tpot_p95", "tpot_p99", "e2e_p50", "e2e_p95", "e2e_p99",
)
"""The read-side view of one key's slice statistics (`SliceStats.summary_values`), in order."""


@dataclass
class ActionRecord:
    """A decision with what the archive keeps beside it: audit evidence and raw samples."""

    decision: Decision
    audit: dict
    samples: list[dict]


class WindowRow(NamedTuple):
    """One key's statistics over one final slice, as stage 2 read them: one window-stats row.

    A tuple, not a dict: the archive builds its insert columns from these in one pass per
    batch. ``summary`` holds the values of `WINDOW_SUMMARY_FIELDS` (its ``ts`` is the latest
    record's time; the row's ``ts`` is the slice end).
    """

    ts: float
    bundle_id: str
    bucket: str | None
    cohort: str | None
    speculation_on: bool
    steps: int
    plain_entries: int
    accepted_at_least: list[int]
    drafted_at_least: list[int]
    summary: tuple

    def as_dict(self) -> dict:
        """The row as a dict keyed by window-stats column name."""
        row = dict(zip(WINDOW_SUMMARY_FIELDS, self.summary))
        row.update(ts=self.ts, bundle_id=self.bundle_id, bucket=self.bucket, cohort=self.cohort,
                   speculation_on=self.speculation_on, steps=self.steps, plain_entries=self.plain_entries,
                   accepted_at_least=self.accepted_at_least, drafted_at_least=self.drafted_at_least)
        return row


@dataclass
class SliceOutput:
    """Everything stage 2 produced when one slice became final."""

    slice_index: int
    slice_end: float
    actions: list[ActionRecord] = field(default_factory=list)
    windows: list[WindowRow] = field(default_factory=list)  # one per key with traffic, in key order
    bundles: list[dict] = field(default_factory=list)
    sightings: list[dict] = field(default_factory=list)  # "sighting" events: bundle, worker, first_seen, ts (last)
    late_records: int = 0
    stage_changes: list = field(default_factory=list)  # admission `StageChange`s, for the bundle registry

    @property
    def window_rows(self) -> list[dict]:
        """`windows` as dicts keyed by column name, for readers that want names."""
        return [row.as_dict() for row in self.windows]
