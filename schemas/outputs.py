"""What stage 2 hands to the action sinks when a slice becomes final: decisions with their
audit and samples, window statistics, bundle cards and sightings."""

from __future__ import annotations

from dataclasses import dataclass, field

from .decisions import Decision

__all__ = ["ActionRecord", "SliceOutput"]


@dataclass
class ActionRecord:
    """A decision with what the archive keeps beside it: audit evidence and raw samples."""

    decision: Decision
    audit: dict
    samples: list[dict]


@dataclass
class SliceOutput:
    """Everything stage 2 produced when one slice became final."""

    slice_index: int
    slice_end: float
    actions: list[ActionRecord] = field(default_factory=list)
    window_rows: list[dict] = field(default_factory=list)
    bundles: list[dict] = field(default_factory=list)
    sightings: list[dict] = field(default_factory=list)  # "sighting" events: bundle, worker, first_seen, ts (last)
    late_records: int = 0
    stage_changes: list = field(default_factory=list)  # admission `StageChange`s, for the bundle registry
