"""What stage 1 checks before it folds a record: a clock-skew bound, and one fold per record."""

from __future__ import annotations

import math

from specwatch.schemas import Rejection

__all__ = ["EventClock", "DuplicateFilter"]

# Recent event times the source's clock is the median of. A median of 15 moves only when
# 8 of them agree, so one record (or seven) stamped by a wrong clock cannot move it.
_DEFAULT_RECENT_RECORDS = 15
_REFRESH_EVERY = 4


class EventClock:
    """A source's event time: the median of its recent records' times, and the skew allowed around it.

    Parameters
    ----------
    max_skew_seconds
        A record further than this ahead of, or behind, the median of the recent records
        is refused (``clock_ahead`` / ``clock_behind``). Its time still counts among the
        recent ones, so after a real jump in event time (a fleet back from an outage) the
        median follows once most recent records agree.
    recent
        How many recent records the median is taken over (odd).

    >>> clock = EventClock(max_skew_seconds=300.0, recent=5)
    >>> [clock.admit(ts) is None for ts in (100.0, 101.0, 3700.0, 102.0, 103.0)]
    [True, True, False, True, True]
    >>> clock.admit(3700.0).reason, clock.admit(50.0), clock.now
    ('clock_ahead', None, 102.0)
    >>> clock.admit(-500.0).reason
    'clock_behind'
    """

    __slots__ = ("max_skew", "now", "_median", "_recent", "_size", "_seen")

    def __init__(self, max_skew_seconds: float, recent: int = _DEFAULT_RECENT_RECORDS) -> None:
        if not max_skew_seconds > 0:
            raise ValueError(f"max_skew_seconds must be positive, got {max_skew_seconds}")
        if recent < 1 or recent % 2 == 0:
            raise ValueError(f"recent must be a positive odd count (a median of it), got {recent}")
        self.max_skew = max_skew_seconds
        self.now = -math.inf
        self._median = math.nan
        self._recent: list[float] = []
        self._size = recent
        self._seen = 0

    def to_state(self) -> dict:
        return {"now": self.now, "median": self._median, "recent": self._recent, "seen": self._seen}

    def load_state(self, state: dict) -> None:
        """Take up where `to_state` left (on a clock made with the same settings)."""
        recent = [float(ts) for ts in state["recent"]]
        if len(recent) > self._size:
            raise ValueError(f"a clock over {self._size} recent records cannot hold {len(recent)}")
        self.now, self._median = float(state["now"]), float(state["median"])
        self._recent, self._seen = recent, int(state["seen"])

    def admit(self, ts: float) -> Rejection | None:
        """Take one record's time; a rejection when it is too far from the source's clock."""
        seen = self._seen
        median = ts if seen == 0 else self._median
        recent = self._recent
        if seen < self._size:
            recent.append(ts)
        else:
            recent[seen % self._size] = ts
        seen = self._seen = seen + 1
        if seen <= self._size or seen % _REFRESH_EVERY == 0:
            ordered = sorted(recent)
            self._median = ordered[(len(ordered) - 1) >> 1]
            if len(ordered) >= 3 and self._median > self.now:
                self.now = self._median
        skew = ts - median
        if skew > self.max_skew:
            return Rejection("clock_ahead", f"ts {ts:.3f} is {skew:.0f} s ahead of its source's event time "
                                            f"{median:.3f} (at most {self.max_skew:.0f} s allowed): "
                                            "check the worker's clock")
        if -skew > self.max_skew:
            return Rejection("clock_behind", f"ts {ts:.3f} is {-skew:.0f} s behind its source's event time "
                                             f"{median:.3f} (at most {self.max_skew:.0f} s allowed): "
                                             "check the worker's clock, or replay old telemetry on its own")
        return None


class DuplicateFilter:
    """Remembers which records a source has folded, per event-time slice, for a bounded time.

    >>> seen = DuplicateFilter(horizon_slices=2)
    >>> seen.first(5, ("w1", 7)), seen.first(5, ("w1", 7)), seen.first(6, ("w1", 7))
    (True, False, True)
    >>> seen.expire(closed=8); seen.first(5, ("w1", 7))
    True
    """

    __slots__ = ("horizon", "_by_slice", "_oldest")

    def __init__(self, horizon_slices: int) -> None:
        if horizon_slices < 0:
            raise ValueError(f"horizon_slices must be >= 0, got {horizon_slices}")
        self.horizon = horizon_slices
        self._by_slice: dict[int, set] = {}
        self._oldest = -math.inf

    def to_state(self) -> dict:
        # sets in a stable order, so that one state is always the same bytes
        return {"by_slice": [[index, [list(identity) for identity in sorted(seen, key=str)]]
                             for index, seen in self._by_slice.items()],
                "oldest": self._oldest}

    def load_state(self, state: dict) -> None:
        self._by_slice = {int(index): {tuple(identity) for identity in seen} for index, seen in state["by_slice"]}
        oldest = state["oldest"]  # -inf, then a slice index
        self._oldest = oldest if isinstance(oldest, int) else float(oldest)

    def first(self, slice_index: int, identity: tuple) -> bool:
        """True the first time ``identity`` is offered for this slice (and it is remembered)."""
        seen = self._by_slice.get(slice_index)
        if seen is None:
            seen = self._by_slice[slice_index] = set()
        elif identity in seen:
            return False
        seen.add(identity)
        return True

    def expire(self, closed: int) -> None:
        """Forget the slices more than ``horizon_slices`` behind slice ``closed``."""
        limit = closed - self.horizon
        if limit <= self._oldest:
            return
        self._oldest = limit
        for index in [i for i in self._by_slice if i < limit]:
            del self._by_slice[index]


def duplicate(kind: str, identity: tuple) -> Rejection:
    """The rejection of a record already folded."""
    return Rejection("duplicate", f"{kind} {'/'.join(map(str, identity))} was already folded "
                                  "(delivered twice): counted once")
