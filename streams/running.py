"""Requests still running, tracked from the step records that list them: stage 1's view of stalls.

A request that runs long past its key's usual duration is evidence of a tail before it
finishes. Stage 1 reports such requests once; stage 2 judges them against the key's limit.
"""

from __future__ import annotations

from itertools import repeat
from typing import Sequence

from specwatch.detectors.window import SliceStats

__all__ = ["RunningRequests", "REPORT_AFTER_SECONDS", "LOST_AFTER_SECONDS"]

Key = tuple[str, str | None, str | None]

# A running request is reported to stage 2 once it has run this long (event time since the
# first step that listed it). Stage 1 does not know a key's limit (stage 2 learns it), so it
# reports every request past this floor and stage 2 counts those past the key's own limit.
# Learned e2e limits are tens of seconds; a key whose limit is lower counts its stalled
# requests from this age on, still long before they finish.
REPORT_AFTER_SECONDS = 10.0
# A request no step has listed for this long, with no request record, is lost (its worker
# died, the record was dropped, it went back to the queue): it is forgotten, not stalled.
LOST_AFTER_SECONDS = 10.0


class RunningRequests:
    """The requests one source's steps list, from first sighting until their request record.

    Parameters
    ----------
    report_after
        Seconds a request runs before it is reported (``SliceStats.running_long``).
    lost_after
        Seconds without a step listing a request before it counts as lost.

    The hot path (`saw`, once per step) only stamps the step's ids with its time; keys and
    first sightings are written for new ids alone, and reports and losses are worked out
    in bulk when a slice closes (`close`). A reported request that ends, or is lost,
    is reported again (``SliceStats.running_done``: True if it finished, False if lost),
    as is any request whose record shows it ran ``report_after`` or longer, so stage 2
    counts a stalled request once, not again when its record arrives. Request ids are
    per worker.

    >>> running = RunningRequests(report_after=10.0, lost_after=10.0)
    >>> for ts in (100.0, 105.0, 111.0):
    ...     running.saw("w1", "b", ts, ["r1", "r2"], ["chat", "chat"], ["main", "main"])
    >>> running.ended("w1", "r2", 4000.0, ("b", "chat", "main"), {})  # r2 finished before it was reported
    >>> partials = {}
    >>> running.close(112.0, partials)
    >>> {key: stats.running_long for key, stats in partials.items()}
    {('b', 'chat', 'main'): {'w1/r1': 100.0}}
    >>> partials = {}
    >>> running.ended("w1", "r1", 12000.0, ("b", "chat", "main"), partials)
    >>> partials[("b", "chat", "main")].running_done
    {'w1/r1': True}
    """

    __slots__ = ("report_after", "lost_after", "_workers")

    def __init__(self, report_after: float = REPORT_AFTER_SECONDS, lost_after: float = LOST_AFTER_SECONDS) -> None:
        if not report_after > 0 or not lost_after > 0:
            raise ValueError(f"report_after and lost_after must be > 0, got {report_after} and {lost_after}")
        self.report_after = report_after
        self.lost_after = lost_after
        # worker -> (request id -> last step ts listing it, request id -> [first ts, key, reported])
        self._workers: dict[str, tuple[dict[str, float], dict[str, list]]] = {}

    def __len__(self) -> int:
        return sum(len(last) for last, _ in self._workers.values())

    def saw(self, worker: str, bundle_id: str, ts: float, ids: Sequence[str], buckets: Sequence[str],
            cohorts: Sequence[str]) -> None:
        """A step of ``worker`` at ``ts`` listed these requests (parallel columns)."""
        tracked = self._workers.get(worker)
        if tracked is None:
            tracked = self._workers[worker] = ({}, {})
        last, first = tracked
        known = len(last)
        last.update(zip(ids, repeat(ts)))
        if len(last) == known:
            return  # nobody new: the common case, settled in C
        for rid, bucket, cohort in zip(ids, buckets, cohorts):
            if rid not in first:
                first[rid] = [ts, (bundle_id, bucket, cohort), False]

    def ended(self, worker: str, rid: str, e2e_ms: float, key: Key, partials: dict[Key, SliceStats]) -> None:
        """The request record of ``rid`` (of ``key``) arrived: it runs no more.

        It is reported as finished if it was reported as running long, or if its e2e says it
        ran that long: where a worker's records are spread over sources (unkeyed telemetry),
        the source that reported it running may not be the one that gets its record.
        """
        tracked = self._workers.get(worker)
        entry = None
        if tracked is not None:
            tracked[0].pop(rid, None)
            entry = tracked[1].pop(rid, None)
        if entry is not None and entry[2]:
            _stats(partials, entry[1]).running_done[f"{worker}/{rid}"] = True
        elif e2e_ms >= self.report_after * 1000.0:
            _stats(partials, key).running_done[f"{worker}/{rid}"] = True

    def close(self, slice_end: float, partials: dict[Key, SliceStats]) -> None:
        """At the end of a slice: report requests now past ``report_after``, forget the lost ones."""
        report_before = slice_end - self.report_after
        lost_before = slice_end - self.lost_after
        for worker, (last, first) in self._workers.items():
            lost = [rid for rid, ts in last.items() if ts < lost_before]
            for rid in lost:
                del last[rid]
                first_ts, key, reported = first.pop(rid)
                if reported:
                    _stats(partials, key).running_done[f"{worker}/{rid}"] = False
            # first sightings are in (nearly) time order: stop at the first too young to report
            for rid, entry in first.items():
                if entry[0] > report_before:
                    break
                if not entry[2]:
                    entry[2] = True
                    _stats(partials, entry[1]).running_long[f"{worker}/{rid}"] = entry[0]


def _stats(partials: dict[Key, SliceStats], key: Key) -> SliceStats:
    stats = partials.get(key)
    if stats is None:
        stats = partials[key] = SliceStats()
    return stats
