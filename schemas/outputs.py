"""What stage 2 hands to the action sinks when a slice becomes final: decisions with their
audit and samples, window statistics, bundle cards and sightings."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from .decisions import Decision

__all__ = ["WINDOW_SUMMARY_FIELDS", "ActionRecord", "SliceOutput", "SliceWindows", "WindowColumns", "WindowRow"]

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
    """One key's statistics over one final slice, as stage 2 read them: one window-stats row."""

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
        row.update(zip(self._fields[:-1], self[:-1]))  # every field but the summary
        return row


class SliceWindows(Sequence):
    """The window rows of one final slice as stage 2 hands them over: each key with traffic,
    its speculative-path flag and its slice statistics, in key order.
    """

    __slots__ = ("slice_end", "keys", "speculating", "stats", "_rows")

    def __init__(self, slice_end: float, keys: list | None = None, speculating: list[bool] | None = None,
                 stats: list | None = None) -> None:
        self.slice_end = slice_end
        self.keys: list[tuple[str, str | None, str | None]] = [] if keys is None else keys
        self.speculating: list[bool] = [] if speculating is None else speculating
        self.stats: list[Any] = [] if stats is None else stats  # `SliceStats`, one per key
        self._rows: list[WindowRow] | None = None

    def add(self, key: tuple[str, str | None, str | None], speculating: bool, stats: Any) -> None:
        self.keys.append(key)
        self.speculating.append(speculating)
        self.stats.append(stats)
        self._rows = None

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, index):
        return self.rows()[index]

    def __iter__(self):
        return iter(self.rows())

    def __reduce__(self):  # the lists, not the rows a reader built
        return SliceWindows, (self.slice_end, self.keys, self.speculating, self.stats)

    def rows(self) -> list[WindowRow]:
        """One `WindowRow` per key."""
        if self._rows is None:
            end = self.slice_end
            self._rows = [WindowRow(end, bundle, bucket, cohort, speculating, stats.steps, stats.plain_entries,
                                    list(stats.accepted_at_least), list(stats.drafted_at_least),
                                    stats.summary_values())
                          for (bundle, bucket, cohort), speculating, stats in zip(self.keys, self.speculating,
                                                                                  self.stats)]
        return self._rows


@dataclass(frozen=True)
class WindowColumns:
    """Window-stats rows as insert columns, by window-stats column name: ``numbers`` (numpy
    arrays: counts, ratios with NaN where undefined, slice ends, the flag), ``texts``
    (lists: bundle, bucket, cohort) and ``positions`` (each list-of-counts column as one flat
    array of counts and its row offsets, ``len + 1`` of them)."""

    numbers: dict
    texts: dict
    positions: dict

    def __len__(self) -> int:
        return len(self.texts["bundle_id"])

    @staticmethod
    def flat_counts(lists: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
        """Lists of counts as one ``positions`` column: the flat counts and each list's offsets.

        >>> [a.tolist() for a in WindowColumns.flat_counts([[3, 1], [], [2]])]
        [[3, 1, 2], [0, 2, 2, 3]]
        """
        offsets = np.zeros(len(lists) + 1, dtype=np.int64)
        np.cumsum(np.fromiter(map(len, lists), dtype=np.int64, count=len(lists)), out=offsets[1:])
        return np.fromiter(itertools.chain.from_iterable(lists), dtype=np.int64, count=int(offsets[-1])), offsets


@dataclass
class SliceOutput:
    """Everything stage 2 produced when one slice became final."""

    slice_index: int
    slice_end: float
    actions: list[ActionRecord] = field(default_factory=list)
    # one per key with traffic, in key order: stage 2 hands over `SliceWindows`
    windows: Sequence[WindowRow] = field(default_factory=list)
    bundles: list[dict] = field(default_factory=list)
    sightings: list[dict] = field(default_factory=list)  # "sighting" events: bundle, worker, first_seen, ts (last)
    late_records: int = 0
    stage_changes: list = field(default_factory=list)  # admission `StageChange`s, for the bundle registry

    @property
    def window_rows(self) -> list[dict]:
        """`windows` as dicts keyed by column name, for readers that want names."""
        return [row.as_dict() for row in self.windows]
