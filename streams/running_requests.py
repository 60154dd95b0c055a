"""Requests still running, tracked from the step records that list them (stage 1's stalls)."""

from __future__ import annotations

import math
from itertools import repeat
from typing import Callable, Sequence

from specwatch.schemas.slice_stats import SliceStats
from specwatch.schemas.scope import Scope

__all__ = ["RunningRequests", "WorkerRequests", "REPORT_AFTER_SECONDS", "LOST_AFTER_SECONDS", "key_stats"]

# Event time since a request's first step before it is reported as running (docs/STREAMS.md).
REPORT_AFTER_SECONDS = 10.0
# A request is reported only while steps still list it: last listed this close to the slice's end.
STILL_LISTED_SECONDS = 2.0
# A request no step has listed for this long, with no request record, is lost: forgotten.
LOST_AFTER_SECONDS = 10.0


class WorkerRequests:
    """One worker's running requests: its latest step's ids, and when each request was seen."""

    __slots__ = ("ids", "ts", "last", "first", "gone")

    def __init__(self) -> None:
        self.ids: Sequence[str] = ()  # the latest step's requests, listed at ``ts``
        self.ts = 0.0
        self.last: dict[str, float] = {}  # request id -> last step listing it (before the latest run of steps)
        self.first: dict[str, list] = {}  # request id -> [first ts, key, reported], in first-seen order
        self.gone: dict[str, Scope] = {}  # reported requests lost in a jump, to report as lost at the next close

    def jumped(self) -> None:
        """Its steps stopped for longer than a request may go unlisted (paused, or its clock moved on):
        what it ran is lost, as a close in the gap would have found it, and what it lists next is new."""
        self.gone.update((rid, entry[1]) for rid, entry in self.first.items() if entry[2])
        self.ids, self.last, self.first = (), {}, {}

    def to_state(self) -> dict:
        return {"ids": list(self.ids), "ids_tuple": type(self.ids) is tuple, "ts": self.ts, "last": self.last,
                "first": [[rid, ts, list(key), reported] for rid, (ts, key, reported) in self.first.items()],
                "gone": [[rid, list(key)] for rid, key in self.gone.items()]}

    @classmethod
    def from_state(cls, state: dict) -> "WorkerRequests":
        w = cls()
        ids = [str(rid) for rid in state["ids"]]
        w.ids = tuple(ids) if state["ids_tuple"] else ids  # a step's ids compare equal to the same type only
        w.ts = float(state["ts"])
        w.last = {str(rid): float(ts) for rid, ts in state["last"].items()}
        w.first = {str(rid): [float(ts), tuple(key), bool(reported)] for rid, ts, key, reported in state["first"]}
        w.gone = {str(rid): tuple(key) for rid, key in state.get("gone", ())}  # none in format 1's first states
        return w

    def stamp(self) -> None:
        """Bring ``last`` up to date for the requests the latest step lists."""
        self.last.update(zip(self.ids, repeat(self.ts)))


class RunningRequests:
    """The requests one source's steps list, from first sighting until their request record.

    >>> running = RunningRequests(report_after=10.0, lost_after=10.0)
    >>> for ts in (100.0, 105.0, 111.0):
    ...     running.saw("w1", ts, ["r1", "r2"], lambda: [("b", "chat", "main")] * 2)
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
        self._workers: dict[str, WorkerRequests] = {}

    def to_state(self) -> dict:
        return {"workers": {worker: w.to_state() for worker, w in self._workers.items()}}

    def load_state(self, state: dict) -> None:
        self._workers = {str(worker): WorkerRequests.from_state(w) for worker, w in state["workers"].items()}

    def __len__(self) -> int:
        return sum(len(w.first) for w in self._workers.values())

    def saw(self, worker: str, ts: float, ids: Sequence[str],
            scopes: Callable[[], list[Scope]]) -> None:
        """A step of ``worker`` at ``ts`` listed the requests ``ids``, of the keys ``scopes()``."""
        w = self._workers.get(worker)
        if w is None:
            w = self._workers[worker] = WorkerRequests()
        elif ts - w.ts >= self.lost_after and w.first:
            w.jumped()  # the time it did not step is not time its requests ran
        elif ids == w.ids:
            w.ts = ts  # the same batch as the step before: the common case, settled in C
            return
        w.stamp()
        w.ids, w.ts = ids, ts
        w.stamp()
        first = w.first
        for rid, key in zip(ids, scopes()):
            if rid not in first:
                first[rid] = [ts, key, False]

    def ended(self, worker: str, rid: str, e2e_ms: float, key: Scope, partials: dict[Scope, SliceStats]) -> None:
        """The request record of ``rid`` (of ``key``) arrived: it runs no more."""
        w = self._workers.get(worker)
        entry = None
        if w is not None:
            w.last.pop(rid, None)
            entry = w.first.pop(rid, None)
        if entry is not None and entry[2]:
            key_stats(partials, entry[1]).running_done[f"{worker}/{rid}"] = True
        elif e2e_ms >= self.report_after * 1000.0:
            key_stats(partials, key).running_done[f"{worker}/{rid}"] = True

    def close(self, slice_end: float, partials: dict[Scope, SliceStats]) -> None:
        """At the end of a slice: report requests now past ``report_after``, forget the lost ones."""
        report_before = slice_end - self.report_after
        lost_before = slice_end - self.lost_after
        for worker, w in self._workers.items():
            if w.gone:
                for rid, key in w.gone.items():
                    key_stats(partials, key).running_done[f"{worker}/{rid}"] = False
                w.gone.clear()
            w.stamp()
            first = w.first
            # only tracked requests: a record may have ended one the latest step still lists
            lost = [rid for rid, ts in w.last.items() if ts < lost_before or rid not in first]
            for rid in lost:
                del w.last[rid]
                entry = first.pop(rid, None)
                if entry is not None and entry[2]:
                    key_stats(partials, entry[1]).running_done[f"{worker}/{rid}"] = False
            listed_since = slice_end - STILL_LISTED_SECONDS
            last = w.last
            # first sightings are in (nearly) time order: stop at the first too young to report
            for rid, entry in first.items():
                if entry[0] > report_before:
                    break
                if not entry[2] and last.get(rid, -math.inf) >= listed_since:
                    entry[2] = True
                    key_stats(partials, entry[1]).running_long[f"{worker}/{rid}"] = entry[0]


def key_stats(partials: dict[Scope, SliceStats], key: Scope) -> SliceStats:
    """The stats of ``key`` in ``partials``, created empty the first time."""
    stats = partials.get(key)
    if stats is None:
        stats = partials[key] = SliceStats()
    return stats
