"""What stage 1 checks before it folds a record: each writer's clock against the others', and one fold per record.

Why correct rather than refuse: a worker whose clock runs steadily ahead or behind still
serves real traffic, and its evidence is needed to decide the incidents it sees. Refusing
every record of it (it is out of line from the first record to the last) would blind its
scopes for good, and folding them where they claim to be would put its evidence in the
wrong slices (ahead: minutes late; behind: every record late). So a writer's steady offset
from the consensus of the writers is measured and taken off its records, and only what a
measured offset does not explain (a record stamped far off, a handful in a burst) is held
out, counted as ``clock_ahead`` or ``clock_behind`` when it is beyond the skew bound, and
folded at the source's time when it is within it. Holding out loses one record, never an
incident; correcting keeps every record and every incident decidable.
"""

from __future__ import annotations

import math
import os
from itertools import islice
from typing import Iterable

from specwatch.schemas import Rejection

__all__ = ["EventClock", "NativeEventClock", "DuplicateFilter", "NATIVE_ADMISSION", "clock_rejection", "event_clock",
           "writer_of"]

# Recent in-line event times the source's time is the median of. A median of 15 moves only
# when 8 of them agree; records out of line with their writer's clock never enter it.
_DEFAULT_RECENT_RECORDS = 15
# Recent skews of one writer its offset is the median of: 16 of 31 must agree before a
# writer's clock is taken to have moved (a burst of 15 records from it moves nothing).
_DEFAULT_WRITER_RECORDS = 31
_REFRESH_EVERY = 4
# A writer is among those the consensus is taken over while its last record came this
# close (in event time) to the source's time; one that stopped does not anchor it.
_ACTIVE_SECONDS = 60.0
# Writers not heard from for this long are forgotten (checked every so many in-line records),
# so a fleet that turns its workers over keeps a clock per worker it runs, not per worker it ran.
_FORGET_SECONDS = 3600.0
_FORGET_EVERY = 8192
# With ``close_on_writers``: source time a record out of order keeps slices to the lateness rule
# (the recent past a writer must have delivered in order over), and how many of its records a
# writer must have sent before the most it has lagged is trusted for it.
_IN_ORDER_SECONDS = 60.0
_LAG_TRUSTED_AFTER = 16


class _Writer:
    """One writer's clock: its recent skews from the source's time and the offset taken off its records."""

    __slots__ = ("skews", "count", "offset", "seen", "newest", "lag")

    def __init__(self, offset: float = 0.0) -> None:
        self.skews: list[float] = []
        self.count = 0
        self.offset = offset
        self.seen = -math.inf  # the source's time at its latest record
        self.newest = -math.inf  # its latest in-line time (``close_on_writers``)
        self.lag = -math.inf  # the most its in-line records arrived behind the source's time (``close_on_writers``)


class EventClock:
    """A source's event time, judged writer by writer: offsets corrected, outliers refused.

    Each record comes from a writer (an engine worker, or a bundle's shadow checker) with a
    clock of its own. Its skew is its time minus the source's time (the median of recent
    in-line records). A writer's offset is the median of its recent skews once most of them
    agree on more than ``max_skew_seconds / 5`` (the tolerance): its records are folded at
    their time minus the offset. A record further than ``max_skew_seconds`` from where its
    writer's offset puts it is refused (``clock_ahead`` / ``clock_behind``); one further than
    the tolerance is folded at the source's time (its values are real, its stamp is not) and
    does not move it. When at least half of the
    active writers are ahead by a common offset, time itself has moved (a fleet back from a
    pause, a clock stepped forward): the source's time jumps by that much and those
    writers' offsets return to zero. It never moves back once slices have closed.

    ``prime`` sets the clock from the records of the first payload, before the first one is
    judged: the lower median of the writers' own median times, so a handful of records at
    the start is judged like any other, and a writer steadily off counts from its first record.

    `close_limit` is the newest slice the source's time lets close: its end ``lateness``
    behind the source's time. With ``close_on_writers`` it may be newer, up to the slice
    before the earliest of: the clock's recent in-line records (where a record out of line
    is folded), and for each writer heard from in the last minute, its newest in-line time,
    or once it has sent 16 records, the later of that and the source's time less the most
    any of its records arrived behind it. That holds only while the source is in order: a
    record behind its writer's newest, behind what closed that way, out of line or refused
    keeps the lateness rule for the next minute of source time, as does the first minute,
    while the writers of the start are still to be heard from (docs/RELIABILITY.md).

    Parameters
    ----------
    max_skew_seconds
        How far a record may be from where its writer's clock puts it.
    recent
        How many in-line records the source's time is the median of (odd).
    writer_recent
        How many of a writer's recent skews its offset is the median of (odd).
    close_on_writers
        Whether `close_limit` closes slices sooner on writers in order (the policy's
        ``windows.close_on_writers``).

    >>> clock = EventClock(max_skew_seconds=300.0, recent=5)
    >>> clock.prime([("w1", 3700.0), ("w1", 100.0), ("w2", 100.5), ("w1", 101.0), ("w2", 101.5)])
    >>> [type(clock.admit(ts, w)).__name__ for w, ts in [("w1", 3700.0), ("w1", 100.0), ("w2", 100.5)]]
    ['Rejection', 'float', 'float']
    >>> clock.admit(3700.0, "w1").reason, clock.admit(101.0, "w1"), clock.now
    ('clock_ahead', 101.0, 100.5)
    >>> clock.admit(-500.0, "w2").reason
    'clock_behind'
    """

    PRIME_RECORDS = 512  # the records of the first payload the clock is set from

    __slots__ = ("max_skew", "tolerance", "now", "primed", "_start", "_median", "_recent", "_size", "_seen",
                 "_writers", "_writer_size", "close_on_writers", "_calm_from", "_promised", "_blocker")

    def __init__(self, max_skew_seconds: float, recent: int = _DEFAULT_RECENT_RECORDS,
                 writer_recent: int = _DEFAULT_WRITER_RECORDS, close_on_writers: bool = False) -> None:
        if not max_skew_seconds > 0:
            raise ValueError(f"max_skew_seconds must be positive, got {max_skew_seconds}")
        for name, count in (("recent", recent), ("writer_recent", writer_recent)):
            if count < 1 or count % 2 == 0:
                raise ValueError(f"{name} must be a positive odd count (a median of it), got {count}")
        self.max_skew = max_skew_seconds
        self.tolerance = max_skew_seconds / 5.0
        self.now = -math.inf
        self.primed = False
        self._start = math.nan  # the source's time before its first in-line record
        self._median = math.nan
        self._recent: list[float] = []
        self._size = recent
        self._seen = 0
        self._writers: dict[str, _Writer] = {}
        self._writer_size = writer_recent
        self.close_on_writers = close_on_writers
        self._calm_from = -math.inf  # the source's time from which slices may close on writers again
        self._promised = -math.inf  # the latest time slices closed on writers before
        self._blocker: _Writer | None = None  # the writer that held them back last (only a shortcut)

    def to_state(self) -> dict:
        if not self.close_on_writers:
            writers = [[name, w.offset, w.count, w.skews, w.seen] for name, w in sorted(self._writers.items())]
            return {"now": self.now, "primed": self.primed, "start": self._start, "median": self._median,
                    "recent": self._recent, "seen": self._seen, "writers": writers}
        writers = [[name, w.offset, w.count, w.skews, w.seen, w.newest, w.lag]
                   for name, w in sorted(self._writers.items())]
        return {"now": self.now, "primed": self.primed, "start": self._start, "median": self._median,
                "recent": self._recent, "seen": self._seen, "writers": writers, "calm_from": self._calm_from,
                "promised": self._promised}

    def load_state(self, state: dict) -> None:
        """Take up where `to_state` left (on a clock made with the same settings).

        A state from before writers were told apart (no ``writers``) is one writer with no offset;
        one without what ``close_on_writers`` keeps has every writer still to pass a slice in order."""
        recent = [float(ts) for ts in state["recent"]]
        if len(recent) > self._size:
            raise ValueError(f"a clock over {self._size} recent records cannot hold {len(recent)}")
        self.now, self._median = float(state["now"]), float(state["median"])
        self._recent, self._seen = recent, int(state["seen"])
        self.primed = bool(state.get("primed", True))
        self._start = float(state.get("start", self._median))
        self._writers = {}
        for name, offset, count, skews, seen, *passed in state.get("writers", ()):
            skews = [float(skew) for skew in skews]
            if len(skews) > self._writer_size:
                raise ValueError(f"a writer's clock over {self._writer_size} skews cannot hold {len(skews)}")
            writer = self._writers[str(name)] = _Writer(float(offset))
            writer.count, writer.skews, writer.seen = int(count), skews, float(seen)
            if passed:
                writer.newest, writer.lag = float(passed[0]), float(passed[1])
        self._calm_from = float(state.get("calm_from", -math.inf))
        self._promised = float(state.get("promised", -math.inf))
        self._blocker = None

    def prime(self, samples: Iterable[tuple[str, float]]) -> None:
        """Set the source's time from ``(writer, ts)`` of the first records, once, before any is admitted."""
        if self.primed:
            return
        times: dict[str, list[float]] = {}
        for writer, ts in islice(samples, self.PRIME_RECORDS):
            times.setdefault(writer, []).append(ts)
        if not times:
            return
        self.primed = True
        medians = {writer: _lower_median(sorted(ts)) for writer, ts in times.items()}
        start = self._start = _lower_median(sorted(medians.values()))
        if self.close_on_writers:  # the writers of the start are yet to be heard from
            self._out_of_order(start)
        for writer, median in medians.items():
            if abs(median - start) > self.tolerance:
                self._writers[writer] = _Writer(median - start)  # steadily off from its first record

    def admit(self, ts: float, writer: str = "") -> float | Rejection:
        """Take one record's time: the time to fold it at, or why it is refused."""
        seen = self._seen
        if seen:
            reference = self._median
        else:
            if self._start != self._start:  # never primed: the first record is its own reference
                self.primed = True
                self._start = ts
                if self.close_on_writers:
                    self._out_of_order(ts)
            reference = self._start
        w = self._writers.get(writer)
        if w is None:
            w = self._writers[writer] = _Writer()
        skew = ts - reference
        w.seen = reference
        count = w.count
        if count < self._writer_size:
            w.skews.append(skew)
        else:
            w.skews[count % self._writer_size] = skew
        count = w.count = count + 1
        if count >= (self._writer_size + 1) >> 1 and (count <= self._writer_size or count % _REFRESH_EVERY == 0):
            measured = _lower_median(sorted(w.skews))
            if abs(measured - w.offset) > self.tolerance:
                w.offset = measured if abs(measured) > self.tolerance else 0.0
                self._follow_writers()
                if seen:
                    reference = self._median
                skew = ts - reference
        off = skew - w.offset
        if off > self.max_skew or -off > self.max_skew:
            if self.close_on_writers:
                self._out_of_order(reference)
            return clock_rejection(off > 0, ts, off, reference + w.offset, self.max_skew)
        if -self.tolerance <= off <= self.tolerance:
            corrected = ts - w.offset if w.offset else ts
            if self.close_on_writers:
                self._passed(w, corrected, reference)
            self._add_recent(corrected)
            return corrected
        # out of line with its writer but within the bound: its values are real, its stamp is not
        if self.close_on_writers:
            self._out_of_order(reference)
        return reference

    def _passed(self, w: _Writer, ts: float, reference: float) -> None:
        """A writer's in-line record at ``ts``: how far it is, and whether it came in order."""
        if ts < w.newest or ts < self._promised:
            self._out_of_order(reference)
        if ts > w.newest:
            w.newest = ts
        lag = self.now - ts
        if lag > w.lag:
            w.lag = lag

    def _out_of_order(self, reference: float) -> None:
        calm_from = reference + _IN_ORDER_SECONDS
        if calm_from > self._calm_from:
            self._calm_from = calm_from

    def close_limit(self, slice_seconds: float, lateness: float, watermark: int) -> int:
        """The newest slice index the source's time lets close (``watermark`` before it has one); see the class."""
        now = self.now
        if now == -math.inf:
            return watermark
        limit = int((now - lateness) // slice_seconds) - 1
        if not self.close_on_writers or now < self._calm_from:
            return limit
        base = limit if limit > watermark else watermark
        if int(now // slice_seconds) - 1 <= base:  # nothing closes before the source's time
            return limit
        horizon = now - _ACTIVE_SECONDS
        blocker = self._blocker
        if blocker is not None and blocker.seen >= horizon:
            at = self._passed_at(blocker, now)
            if at == -math.inf or int(at // slice_seconds) - 1 <= base:
                return limit  # the writer that held the slice back still does
        settled = min(self._recent)
        blocker = None
        for w in self._writers.values():
            if w.seen >= horizon:
                at = self._passed_at(w, now)
                if at < settled:
                    settled, blocker = at, w
        self._blocker = blocker
        if settled == -math.inf:  # a writer heard from with no in-line record yet
            return limit
        early = int(settled // slice_seconds) - 1
        if early <= base:
            return limit
        if settled > self._promised:
            self._promised = settled
        return early

    @staticmethod
    def _passed_at(w: _Writer, now: float) -> float:
        """The time before which a writer in order sends nothing more, as far as it has shown."""
        if w.count < _LAG_TRUSTED_AFTER:
            return w.newest
        behind = now - w.lag if w.lag > 0.0 else now
        return behind if behind > w.newest else w.newest

    def _add_recent(self, ts: float) -> None:
        recent = self._recent
        seen = self._seen
        if seen < self._size:
            recent.append(ts)
        else:
            recent[seen % self._size] = ts
        seen = self._seen = seen + 1
        if seen <= self._size or seen % _REFRESH_EVERY == 0:
            self._refresh()
            if seen % _FORGET_EVERY == 0:
                horizon = self._median - _FORGET_SECONDS
                self._writers = {name: w for name, w in self._writers.items() if w.seen >= horizon}
                self._blocker = None

    def _refresh(self) -> None:
        ordered = sorted(self._recent)
        self._median = ordered[(len(ordered) - 1) >> 1]
        if len(ordered) >= 3 and self._median > self.now:
            self.now = self._median

    def _follow_writers(self) -> None:
        """Move the source's time when at least half of the active writers agree it has moved."""
        reference = self._median if self._seen else self._start
        active = sorted(w.offset for w in self._writers.values() if w.seen >= reference - _ACTIVE_SECONDS)
        shift = _lower_median(active) if active else 0.0
        if shift <= self.tolerance and not (shift < -self.tolerance and self.now == -math.inf):
            return  # time never moves back once a slice has closed: writers behind are corrected
        for w in self._writers.values():
            if abs(w.offset - shift) <= self.tolerance:  # it moved with the others
                w.skews = [skew - shift for skew in w.skews]
                w.offset = 0.0
            else:  # not heard from since, or off by its own offset: judged afresh from its next records
                w.skews.clear()
                w.count = 0
        self._start += shift
        if self._seen:
            self._recent = [ts + shift for ts in self._recent]
            self._refresh()


def clock_rejection(ahead: bool, ts: float, off: float, expected: float, max_skew: float) -> Rejection:
    """The rejection of a record ``off`` seconds from ``expected``, where its writer's clock puts it."""
    if ahead:
        return Rejection("clock_ahead", f"ts {ts:.3f} is {off:.0f} s ahead of where its writer's clock puts it "
                                        f"({expected:.3f}; at most {max_skew:.0f} s allowed): "
                                        "check the worker's clock")
    return Rejection("clock_behind", f"ts {ts:.3f} is {-off:.0f} s behind where its writer's clock puts it "
                                     f"({expected:.3f}; at most {max_skew:.0f} s allowed): "
                                     "check the worker's clock, or replay old telemetry on its own")


class NativeEventClock:
    """`EventClock` with its state and arithmetic compiled (``specwatch_native.ClockCore``): the
    same times, refusals and states record for record; `EventClock` is the reference.

    >>> clock = event_clock(300.0)
    >>> clock.prime([("w1", 100.0), ("w2", 100.5)]); clock.admit(100.2, "w1"), clock.admit(9000.0, "w2").reason
    (100.2, 'clock_ahead')
    """

    PRIME_RECORDS = EventClock.PRIME_RECORDS

    __slots__ = ("max_skew", "tolerance", "close_on_writers", "core", "_settings")

    def __init__(self, max_skew_seconds: float, recent: int = _DEFAULT_RECENT_RECORDS,
                 writer_recent: int = _DEFAULT_WRITER_RECORDS, close_on_writers: bool = False) -> None:
        reference = EventClock(max_skew_seconds, recent, writer_recent)  # its checks of the settings
        self.max_skew, self.tolerance = reference.max_skew, reference.tolerance
        self.close_on_writers = close_on_writers
        self._settings = (max_skew_seconds, recent, writer_recent, close_on_writers)
        self.core = _NATIVE.ClockCore(*self._settings)

    @property
    def now(self) -> float:
        return self.core.now

    @property
    def primed(self) -> bool:
        return self.core.primed

    def to_state(self) -> dict:
        now, primed, start, median, recent, seen, writers, calm_from, promised = self.core.export()
        state = {"now": now, "primed": primed, "start": start, "median": median, "recent": recent, "seen": seen}
        if not self.close_on_writers:
            return {**state, "writers": [list(writer[:5]) for writer in writers]}
        return {**state, "writers": [list(writer) for writer in writers], "calm_from": calm_from,
                "promised": promised}

    def load_state(self, state: dict) -> None:
        """As `EventClock.load_state` (whose checks and older formats it goes through)."""
        reference = EventClock(*self._settings)
        reference.load_state(state)
        self._take(reference)

    def prime(self, samples: Iterable[tuple[str, float]]) -> None:
        """As `EventClock.prime` (it runs once per source: the reference does it)."""
        if self.primed:
            return
        reference = EventClock(*self._settings)
        reference.load_state(self.to_state())
        reference.prime(samples)
        self._take(reference)

    def _take(self, reference: EventClock) -> None:
        state = reference.to_state()
        writers = reference._writers
        self.core.import_((state["now"], state["primed"], state["start"], state["median"], state["recent"],
                           state["seen"], [(name, w.offset, w.count, w.skews, w.seen, w.newest, w.lag)
                                           for name, w in sorted(writers.items())],
                           reference._calm_from, reference._promised))

    def __reduce__(self):  # the compiled core does not pickle: its state does
        return _restored_clock, (self._settings, self.to_state())

    def admit(self, ts: float, writer: str = "") -> float | Rejection:
        """As `EventClock.admit`."""
        admitted = self.core.admit(ts, writer)
        if type(admitted) is float:
            return admitted
        ahead, off, expected = admitted
        return clock_rejection(ahead, ts, off, expected, self.max_skew)

    def close_limit(self, slice_seconds: float, lateness: float, watermark: int) -> int:
        """As `EventClock.close_limit`."""
        return self.core.close_limit(slice_seconds, lateness, watermark)


def _restored_clock(settings: tuple, state: dict) -> NativeEventClock:
    clock = NativeEventClock(*settings)
    clock.load_state(state)
    return clock


def _native_module():
    """The compiled package with the clock, or None: not built here (or built before it had
    the clock), or SPECWATCH_NATIVE=0 asks for the reference path."""
    if os.environ.get("SPECWATCH_NATIVE", "1") == "0":
        return None
    try:
        import specwatch_native
    except ImportError:
        return None
    return specwatch_native if hasattr(specwatch_native, "ClockCore") else None


_NATIVE = _native_module()
NATIVE_ADMISSION = _NATIVE is not None


def event_clock(max_skew_seconds: float, native: bool = NATIVE_ADMISSION,
                close_on_writers: bool = False) -> EventClock | NativeEventClock:
    """A source's clock: compiled where it is built (and ``native``), else the reference."""
    clock = NativeEventClock if native and _NATIVE is not None else EventClock
    return clock(max_skew_seconds, close_on_writers=close_on_writers)


def writer_of(record) -> str:
    """Whose clock stamped a record: its worker, or for a shadow check its bundle's checker."""
    worker = getattr(record, "worker", None)
    return worker if worker is not None else f"{record.bundle_id} shadow checks"


def _lower_median(ordered: list[float]) -> float:
    return ordered[(len(ordered) - 1) >> 1]


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
