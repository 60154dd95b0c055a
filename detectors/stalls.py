"""Stalled requests as tail evidence: a request running past a key's limit counts as past it now,
once (from stage 1's ``SliceStats.running_long`` and ``running_done``)."""

from __future__ import annotations

import math

from specwatch.schemas.slice_stats import SliceStats

__all__ = ["StalledRequests"]

# A request counted while it ran and then lost keeps its count; its record may still come
# (through another source), and is taken back then. After this long it is forgotten.
_FORGET_SECONDS = 3600.0


class StalledRequests:
    """One key's long-running requests: waiting to pass the limit, or counted as past it.

    ``update`` returns ``(stalled, finished)``: requests that passed ``limit_ms`` while running
    in the slice, and counted ones among its finished requests (not to be counted again). A
    counted request that is lost keeps its count for an hour; ``forget`` uncounts them all.

    >>> ledger = StalledRequests()
    >>> s = SliceStats(); s.running_long = {"w1/r1": 100.0, "w1/r2": 104.0}
    >>> ledger.update(s, 112.0, limit_ms=10_000.0)
    (1, 0)
    >>> ledger.update(SliceStats(), 115.0, limit_ms=10_000.0), ledger.oldest_age(115.0)
    ((1, 0), 15.0)
    >>> s = SliceStats(); s.running_done = {"w1/r1": True, "w1/r2": False}
    >>> ledger.update(s, 130.0, limit_ms=10_000.0), list(ledger.counted), len(ledger.waiting)
    ((0, 1), ['w1/r2'], 0)
    >>> s = SliceStats(); s.running_done = {"w1/r2": True}
    >>> ledger.update(s, 131.0, limit_ms=10_000.0), len(ledger.counted)
    ((0, 1), 0)
    """

    __slots__ = ("waiting", "counted", "counted_total")

    def __init__(self) -> None:
        self.waiting: dict[str, float] = {}  # reported, not past the limit yet: id -> first-seen ts
        self.counted: dict[str, float] = {}  # counted as past the limit, still running: id -> first-seen ts
        self.counted_total = 0  # requests counted while running, ever

    def update(self, stats: SliceStats, slice_end: float, limit_ms: float | None) -> tuple[int, int]:
        finished = 0
        counted, waiting = self.counted, self.waiting
        for rid, first in stats.running_long.items():
            if rid not in counted and first < waiting.get(rid, math.inf):  # another source may report it too
                waiting[rid] = first
        for rid, ended in stats.running_done.items():
            waiting.pop(rid, None)
            if ended and counted.pop(rid, None) is not None:
                finished += 1
        if counted and min(counted.values()) < slice_end - _FORGET_SECONDS:
            # lost for good: no record came for it
            self.counted = {rid: first for rid, first in counted.items() if first >= slice_end - _FORGET_SECONDS}
        if limit_ms is None or not self.waiting:
            return 0, finished
        since = slice_end - limit_ms / 1000.0
        stalled = [rid for rid, first in self.waiting.items() if first <= since]
        for rid in stalled:
            self.counted[rid] = self.waiting.pop(rid)
        self.counted_total += len(stalled)
        return len(stalled), finished

    def to_state(self) -> dict:
        return {"waiting": self.waiting, "counted": self.counted, "counted_total": self.counted_total}

    def load_state(self, state: dict) -> None:
        self.waiting = {str(rid): float(first) for rid, first in state["waiting"].items()}
        self.counted = {str(rid): float(first) for rid, first in state["counted"].items()}
        self.counted_total = int(state["counted_total"])

    def forget(self) -> None:
        """Counted requests count again when they finish (the tests that counted them are gone)."""
        self.waiting.update(self.counted)
        self.counted.clear()

    def oldest_age(self, now: float) -> float:
        """Seconds the oldest counted request has run, NaN if none runs."""
        return now - min(self.counted.values()) if self.counted else math.nan
