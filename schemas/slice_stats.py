"""Raw-count statistics of one key over one event-time slice, mergeable across sources; every
ratio is computed where it is read, by one formula here."""

from __future__ import annotations

import base64
import heapq
import itertools
import math
import zlib
from operator import add, attrgetter, itemgetter
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import numpy as np

from specwatch.schemas.outputs import WINDOW_SUMMARY_FIELDS, SliceWindows, WindowColumns

from .latency_sketch import LatencySketch, quantiles_of

__all__ = ["SAMPLE_KINDS", "SliceStats", "add_round_columns", "held_sample", "merge_all", "ratio", "ratios",
           "round_evidence", "sample_order", "sample_record", "speedup_leaving_out", "window_columns"]

# Samples kept per key per slice: records that show a problem and healthy controls of each kind.
SAMPLE_KINDS = {"error": 3, "timeout": 3, "slowest": 2, "lowest_acceptance": 1,
                "control_request": 2, "control_step": 1}


def sample_order(sample_id: str) -> int:
    """A fixed pseudo-random rank of a sample id (CRC-32): every order of the same records keeps
    the same samples.

    >>> sample_order("w1:17"), sample_order("r-9")
    (2455475965, 3608917963)
    """
    return zlib.crc32(sample_id.encode("utf-8"))


_first = itemgetter(0)
_ranked = itemgetter("_rank")
_SUMMARY_QUANTILES = (0.5, 0.95, 0.99)
_SKETCH_NAMES = ("ttft", "tpot", "e2e")
# SliceStats fields that are numbers, lists and dicts of numbers: checkpointed as they are
_PLAIN_FIELDS = ("max_ts", "steps", "rounds", "plain_entries", "drafted_tokens", "accepted_tokens",
                 "accepted_at_least", "drafted_at_least", "draft_ms", "verify_ms", "kv_peak", "requests",
                 "speculative_requests", "errors", "timeouts", "shadow_checks", "shadow_mismatches",
                 "running_long", "running_done")


def _merge_ranked(into: list, other: list, quota: int) -> list:
    """The first ``quota`` of both lists by (rank, id), each id once; both are so ordered."""
    merged = sorted(into + other, key=_ranked)
    out, ids = [], set()
    for sample in merged:
        ident = sample["_rank"][-1]
        if ident not in ids:
            ids.add(ident)
            out.append(sample)
            if len(out) == quota:
                break
    return out


def held_sample(rank: Sequence, item: object, make: Callable[[object], dict]) -> dict:
    """A kept sample of rank ``rank``, ``make(item)`` built only when needed (`sample_record`), with
    no closure per sample."""
    return {"_rank": list(rank), "_make": make, "_item": item}


def sample_record(sample: dict) -> dict:
    """The telemetry record a kept sample stands for, without the ranking it was kept by."""
    make = sample.get("_make")
    record = make(sample["_item"]) if make is not None else sample
    return {k: v for k, v in record.items() if not k.startswith("_")}


def ratio(numerator: float, denominator: float) -> float:
    """``numerator / denominator``, NaN when the denominator is zero.

    >>> ratio(3, 2), math.isnan(ratio(1, 0))
    (1.5, True)
    """
    return numerator / denominator if denominator else math.nan


def round_evidence(value, digits: int = 6):
    """Floats to ``digits`` significant digits (None for NaN and infinities), lists item by item:
    evidence reads the same however partials were grouped.

    >>> round_evidence([1 / 3, math.nan, 7]), round_evidence(2 / 3, 3)
    ([0.333333, None, 7], 0.667)
    """
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return None
        return float(f"{value:.{digits}g}")
    if isinstance(value, list):
        return [round_evidence(v, digits) for v in value]
    return value


def ratios(numerators: np.ndarray, denominators: np.ndarray) -> np.ndarray:
    """`ratio` of two arrays, element by element: the same floats, NaN where a denominator is zero.

    >>> ratios(np.array([3, 1]), np.array([2, 0]))
    array([1.5, nan])
    """
    out = np.full(len(denominators), math.nan)
    np.divide(numerators, denominators, out=out, where=denominators != 0)
    return out


# Each derived value written once, for a key (`ratio`) and for many keys at once (`ratios`).
def _acceptance_length(accepted_tokens, rounds, divide=ratio):
    return divide(accepted_tokens + rounds, rounds)


def _draft_overhead(draft_ms, verify_ms, divide=ratio):
    return divide(draft_ms, draft_ms + verify_ms)


def _speedup(acceptance_length, draft_ms, verify_ms, divide=ratio):
    return acceptance_length * divide(verify_ms, draft_ms + verify_ms)


def speedup_leaving_out(slices: Sequence["SliceStats"]) -> list[float]:
    """The speedup of ``slices`` merged, leaving out each slice in turn."""
    accepted = sum(s.accepted_tokens for s in slices)
    rounds = sum(s.rounds for s in slices)
    draft_ms = sum(s.draft_ms for s in slices)
    verify_ms = sum(s.verify_ms for s in slices)
    return [_speedup(_acceptance_length(accepted - s.accepted_tokens, rounds - s.rounds),
                     draft_ms - s.draft_ms, verify_ms - s.verify_ms) for s in slices]


def _add_counts(into: list[int], other: list[int]) -> None:
    """``other`` added into ``into`` position by position, ``into`` extended as far as ``other`` reaches.

    >>> counts = [3, 1]; _add_counts(counts, [1, 1, 1]); counts
    [4, 2, 1]
    """
    n = len(other)
    if n > len(into):
        into.extend([0] * (n - len(into)))
    into[:n] = map(add, into, other)  # the sums are all taken before any is written back


@dataclass(slots=True)
class SliceStats:
    """Counts for one (bundle, bucket, cohort) key over one slice of event time.

    ``accepted_at_least[i]`` / ``drafted_at_least[i]``: rounds that accepted / drafted
    position ``i+1``, hence the acceptance length to expect at any D.

    >>> s = SliceStats()
    >>> s.add_round(drafted=4, accepted=3); s.add_round(drafted=4, accepted=1)
    >>> s.rounds, s.acceptance_length
    (2, 3.0)
    >>> s.accepted_at_least, s.drafted_at_least
    ([2, 1, 1], [2, 2, 2, 2])
    """

    max_ts: float = 0.0
    steps: int = 0
    rounds: int = 0
    plain_entries: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    accepted_at_least: list[int] = field(default_factory=list)
    drafted_at_least: list[int] = field(default_factory=list)
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    kv_peak: float = 0.0
    requests: int = 0
    speculative_requests: int = 0
    errors: int = 0
    timeouts: int = 0
    ttft: LatencySketch | None = None
    tpot: LatencySketch | None = None
    e2e: LatencySketch | None = None
    shadow_checks: int = 0
    shadow_mismatches: int = 0
    samples: dict[str, list[dict]] = field(default_factory=dict)  # by SAMPLE_KINDS, each in rank order
    # by "worker/id": requests seen running long (-> first-seen ts); ended (True) or lost (False)
    running_long: dict[str, float] = field(default_factory=dict)
    running_done: dict[str, bool] = field(default_factory=dict)

    def add_round(self, drafted: int, accepted: int, n: int = 1) -> None:
        """Fold ``n`` rounds that drafted ``drafted`` and accepted ``accepted`` tokens."""
        if drafted == 0:
            self.plain_entries += n
            return
        self.rounds += n
        self.drafted_tokens += drafted * n
        self.accepted_tokens += accepted * n
        for counts, positions in ((self.drafted_at_least, drafted),
                                  (self.accepted_at_least, accepted)):
            if len(counts) < positions:
                counts.extend([0] * (positions - len(counts)))
            for i in range(positions):
                counts[i] += n

    def add_round_counts(self, counts: dict[tuple[int, int], int]) -> None:
        """Fold many rounds at once from ``{(drafted, accepted): n}``."""
        for (drafted, accepted), n in counts.items():
            self.add_round(drafted, accepted, n)

    def add_step_time(self, draft_ms: float, verify_ms: float, kv_usage: float, ts: float) -> None:
        self.steps += 1
        self.draft_ms += draft_ms
        self.verify_ms += verify_ms
        if kv_usage > self.kv_peak:
            self.kv_peak = kv_usage
        if ts > self.max_ts:
            self.max_ts = ts

    def add_request(self, ttft_ms: float, tpot_ms: float | None, e2e_ms: float, speculative: bool,
                    finish_reason: str, ts: float) -> None:
        self.requests += 1
        if speculative:
            self.speculative_requests += 1
        if finish_reason == "error":
            self.errors += 1
        elif finish_reason == "timeout":
            self.timeouts += 1
        if self.ttft is None:
            self.ttft, self.tpot, self.e2e = LatencySketch(), LatencySketch(), LatencySketch()
        self.ttft.add(ttft_ms)
        if tpot_ms is not None:
            self.tpot.add(tpot_ms)
        self.e2e.add(e2e_ms)
        if ts > self.max_ts:
            self.max_ts = ts

    def offer_sample(self, kind: str, rank: tuple, make: Callable[[], dict]) -> None:
        """Keep ``make()`` as a ``kind`` sample if it is among the first of its kind by ``rank``
        (severity first, the sample id last).

        >>> s = SliceStats()
        >>> for e2e, rid in ((900.0, "r1"), (4000.0, "r2"), (2500.0, "r3")):
        ...     s.offer_sample("slowest", (-e2e, sample_order(rid), rid), lambda rid=rid: {"id": rid})
        >>> [sample["id"] for sample in s.samples["slowest"]]
        ['r2', 'r3']
        """
        kept = self.samples.setdefault(kind, [])
        quota = SAMPLE_KINDS[kind]
        rank = list(rank)
        if len(kept) == quota and rank >= kept[-1]["_rank"]:
            return
        if any(sample["_rank"][-1] == rank[-1] for sample in kept):
            return
        record = make()
        record["_rank"] = rank
        kept.append(record)
        kept.sort(key=_ranked)
        del kept[quota:]

    def keep_samples(self, kind: str, candidates: list[tuple[tuple, object]], make: Callable[[object], dict]) -> None:
        """Keep the first of ``candidates`` ((rank, item) pairs) by rank as ``kind`` samples; ``make(item)`` builds one.

        >>> s = SliceStats()
        >>> s.keep_samples("slowest", [((-50.0, 9, "r1"), 1), ((-90.0, 7, "r2"), 2), ((-10.0, 1, "r3"), 3)],
        ...                lambda item: {"id": f"r{item}"})
        >>> [sample_record(sample)["id"] for sample in s.samples["slowest"]]
        ['r2', 'r1']
        """
        quota = SAMPLE_KINDS[kind]
        chosen = sorted(candidates, key=_first) if len(candidates) <= quota else heapq.nsmallest(quota, candidates, key=_first)
        if not chosen:
            return
        fresh = [held_sample(rank, item, make) for rank, item in chosen]
        mine = self.samples.get(kind)
        self.samples[kind] = fresh if mine is None else _merge_ranked(mine, fresh, quota)

    def merge(self, other: "SliceStats", sketches: bool = True, samples: bool = True) -> None:
        """Add ``other``'s counts in; ``sketches=False`` skips latency sketches and samples (most
        of a merge's cost), ``samples=False`` the samples only."""
        if other.max_ts > self.max_ts:
            self.max_ts = other.max_ts
        self.steps += other.steps
        self.rounds += other.rounds
        self.plain_entries += other.plain_entries
        self.drafted_tokens += other.drafted_tokens
        self.accepted_tokens += other.accepted_tokens
        if other.accepted_at_least:
            _add_counts(self.accepted_at_least, other.accepted_at_least)
        if other.drafted_at_least:
            _add_counts(self.drafted_at_least, other.drafted_at_least)
        self.draft_ms += other.draft_ms
        self.verify_ms += other.verify_ms
        if other.kv_peak > self.kv_peak:
            self.kv_peak = other.kv_peak
        self.requests += other.requests
        self.speculative_requests += other.speculative_requests
        self.errors += other.errors
        self.timeouts += other.timeouts
        self.shadow_checks += other.shadow_checks
        self.shadow_mismatches += other.shadow_mismatches
        if not sketches:
            return
        if other.running_long:
            self.running_long.update(other.running_long)
        if other.running_done:
            for rid, finished in other.running_done.items():
                if finished or rid not in self.running_done:  # finished wins over lost (another source's view)
                    self.running_done[rid] = finished
        if other.ttft is not None or other.tpot is not None or other.e2e is not None:  # most slices of a key have none
            for name in _SKETCH_NAMES:
                theirs, mine = getattr(other, name), getattr(self, name)
                if mine is None and theirs is not None:
                    setattr(self, name, theirs.copy())
                elif theirs is not None:
                    mine.merge(theirs)
        if samples and other.samples:
            for kind, theirs in other.samples.items():
                mine = self.samples.get(kind)
                self.samples[kind] = list(theirs) if mine is None else _merge_ranked(mine, theirs, SAMPLE_KINDS[kind])

    def copy(self) -> "SliceStats":
        out = SliceStats()
        out.merge(self)
        return out

    def to_state(self) -> dict:
        """The counts as plain data; kept samples built now (they are built lazily otherwise).

        >>> s = SliceStats(); s.add_round(4, 3); s.add_request(80.0, 9.0, 900.0, True, "stop", 1.0)
        >>> s.offer_sample("slowest", (-900.0, 1, "r1"), lambda: {"id": "r1"})
        >>> SliceStats.from_state(s.to_state()).to_state() == s.to_state()
        True
        """
        state = {name: getattr(self, name) for name in _PLAIN_FIELDS}
        for name in _SKETCH_NAMES:
            sketch = getattr(self, name)
            state[name] = sketch.to_state() if sketch is not None else None
        state["samples"] = {kind: [{**sample_record(sample), "_rank": list(sample["_rank"])} for sample in kept]
                            for kind, kept in self.samples.items()}
        return state

    @classmethod
    def from_state(cls, state: dict) -> "SliceStats":
        out = cls(**{name: state[name] for name in _PLAIN_FIELDS})
        for name in _SKETCH_NAMES:
            if state[name] is not None:
                setattr(out, name, LatencySketch.from_state(state[name]))
        out.samples = {str(kind): [dict(sample) for sample in kept] for kind, kept in state["samples"].items()}
        return out

    @property
    def acceptance_length(self) -> float:
        """Mean tokens gained per speculative round: accepted drafts plus the target's own token."""
        return _acceptance_length(self.accepted_tokens, self.rounds)

    @property
    def draft_overhead(self) -> float:
        """Share of step time spent drafting."""
        return _draft_overhead(self.draft_ms, self.verify_ms)

    @property
    def draft_to_verify(self) -> float:
        """Draft time per unit of verify time (rho*D for serial drafters)."""
        return ratio(self.draft_ms, self.verify_ms)

    @property
    def speedup(self) -> float:
        """Estimated speedup over standard decoding, whose step costs one verify:
        AL * verify / (draft + verify) = AL / (1 + rho*D)."""
        return _speedup(self.acceptance_length, self.draft_ms, self.verify_ms)

    @property
    def error_rate(self) -> float:
        return ratio(self.errors + self.timeouts, self.requests)

    def position_rates(self) -> list[float]:
        """Per-position acceptance: P(accepted >= i+1 | drafted >= i+1)."""
        return [ratio(self.accepted_at_least[i] if i < len(self.accepted_at_least) else 0, d)
                for i, d in enumerate(self.drafted_at_least)]

    def quantile(self, metric: str, q: float) -> float:
        sketch = getattr(self, metric)
        return math.nan if sketch is None else sketch.quantile(q)

    def summary(self) -> dict:
        """Read-side view (ratios and percentiles) for evidence, archive and display."""
        return dict(zip(WINDOW_SUMMARY_FIELDS, self.summary_values()))

    def summary_values(self) -> tuple:
        """`summary` as a tuple, in `WINDOW_SUMMARY_FIELDS` order (what the archive's columns are built from)."""
        ttft, tpot, e2e = self.ttft, self.tpot, self.e2e
        return (self.max_ts, self.rounds, self.drafted_tokens, self.accepted_tokens, self.acceptance_length,
                self.draft_overhead, self.speedup, ratio(self.draft_ms, self.steps), ratio(self.verify_ms, self.steps),
                self.requests, self.errors + self.timeouts, self.error_rate, self.kv_peak, self.shadow_checks,
                self.shadow_mismatches,
                *_percentiles((ttft, tpot, e2e)))

    def to_dict(self) -> dict:
        """For changelog-backed tables and partial-aggregate messages."""
        out = {name: getattr(self, name) for name in _SERIALIZED_COUNTS}
        out["samples"] = {kind: [{**sample_record(s), "_rank": s["_rank"]} for s in kept]
                          for kind, kept in self.samples.items()}
        for name in _SKETCH_NAMES:
            sketch = getattr(self, name)
            if sketch is not None:
                out[name] = base64.b64encode(sketch.to_bytes()).decode("ascii")
        for name in ("running_long", "running_done"):
            if getattr(self, name):
                out[name] = dict(getattr(self, name))
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "SliceStats":
        out = cls()
        for name in _SERIALIZED_COUNTS:
            value = data.get(name, [] if name in _POSITION_FIELDS else 0)
            setattr(out, name, list(value) if name in _POSITION_FIELDS else value)
        out.samples = {kind: list(kept) for kind, kept in data.get("samples", {}).items()}
        out.running_long = dict(data.get("running_long", {}))
        out.running_done = dict(data.get("running_done", {}))
        for name in _SKETCH_NAMES:
            if data.get(name):
                setattr(out, name, LatencySketch.from_bytes(base64.b64decode(data[name])))
        return out


# What `to_dict` writes before the samples, in field order.
_SERIALIZED_COUNTS = ("max_ts", "steps", "rounds", "plain_entries", "drafted_tokens",
                      "accepted_tokens", "accepted_at_least", "drafted_at_least", "draft_ms",
                      "verify_ms", "kv_peak", "requests", "speculative_requests", "errors",
                      "timeouts", "shadow_checks", "shadow_mismatches")
# What `window_columns` reads off each key's statistics, in C-level passes over the keys.
_COUNT_FIELDS = ("rounds", "drafted_tokens", "accepted_tokens", "requests", "errors", "timeouts", "shadow_checks",
                 "shadow_mismatches", "steps", "plain_entries")
_TIME_FIELDS = ("draft_ms", "verify_ms", "kv_peak")
_SKETCHES = attrgetter(*_SKETCH_NAMES)
_NO_SKETCHES = (None, None, None)
_POSITION_FIELDS = ("accepted_at_least", "drafted_at_least")


def window_columns(windows: Sequence[SliceWindows], *, per_sketch: bool = False) -> WindowColumns:
    """The window rows of many final slices as insert columns, built across keys at once: each
    number the one `SliceStats.summary_values` gives the key. The latency percentiles are read
    from all sketches at once (`quantiles_of`); ``per_sketch`` reads them sketch by sketch, the
    reference the bulk read is measured and tested against.

    >>> a, b = SliceStats(), SliceStats()
    >>> a.add_round(drafted=4, accepted=3); b.add_step_time(1.0, 9.0, 0.5, 3.2)
    >>> keys = [("b-1", "chat", "main"), ("b-1", None, None)]
    >>> columns = window_columns([SliceWindows(4.0, keys, [True, True], [a, b])])
    >>> columns.numbers["acceptance_length"].tolist(), columns.numbers["draft_overhead"].tolist()
    ([4.0, nan], [nan, 0.1])
    >>> columns.texts["bucket"], columns.positions["drafted_at_least"][0].tolist()
    (['chat', None], [1, 1, 1, 1])
    """
    keys: list = []
    speculating: list[bool] = []
    parts: list[SliceStats] = []
    for window in windows:
        keys += window.keys
        speculating += window.speculating
        parts += window.stats
    n = len(parts)
    counts = np.fromiter(itertools.chain.from_iterable(map(attrgetter(*_COUNT_FIELDS), parts)), dtype=np.int64,
                         count=n * len(_COUNT_FIELDS)).reshape(n, len(_COUNT_FIELDS)).T
    times = np.fromiter(itertools.chain.from_iterable(map(attrgetter(*_TIME_FIELDS), parts)), dtype=np.float64,
                        count=n * len(_TIME_FIELDS)).reshape(n, len(_TIME_FIELDS)).T
    numbers = {name: np.ascontiguousarray(column) for name, column in zip(_COUNT_FIELDS, counts)}
    draft_ms, verify_ms, kv_peak = (np.ascontiguousarray(column) for column in times)
    rounds, steps = numbers["rounds"], numbers["steps"]
    failed = numbers.pop("errors") + numbers.pop("timeouts")
    acceptance_length = _acceptance_length(numbers["accepted_tokens"], rounds, ratios)
    numbers.update(
        ts=np.repeat(np.array([window.slice_end for window in windows], dtype=np.float64),
                     [len(window) for window in windows]),
        speculation_on=np.array(speculating, dtype=bool), acceptance_length=acceptance_length,
        draft_overhead=_draft_overhead(draft_ms, verify_ms, ratios),
        speedup=_speedup(acceptance_length, draft_ms, verify_ms, ratios), draft_ms=ratios(draft_ms, steps),
        verify_ms=ratios(verify_ms, steps), errors=failed, error_rate=ratios(failed, numbers["requests"]),
        kv_peak=kv_peak)
    if per_sketch:
        percentiles = np.full((n, 3 * len(_SUMMARY_QUANTILES)), math.nan)
        for row, sketches in enumerate(map(_SKETCHES, parts)):
            if sketches != _NO_SKETCHES:
                percentiles[row] = _percentiles(sketches)
    else:  # (ttft, tpot, e2e) of each key in turn: a key's row is its three sketches' quantiles
        percentiles = quantiles_of(list(itertools.chain.from_iterable(map(_SKETCHES, parts))),
                                   _SUMMARY_QUANTILES).reshape(n, 3 * len(_SUMMARY_QUANTILES))
    numbers.update(zip(WINDOW_SUMMARY_FIELDS[-percentiles.shape[1]:], np.ascontiguousarray(percentiles.T)))
    bundles, buckets, cohorts = (list(names) for names in zip(*keys)) if keys else ([], [], [])
    positions = {name: WindowColumns.flat_counts(list(map(attrgetter(name), parts))) for name in _POSITION_FIELDS}
    return WindowColumns(numbers, {"bundle_id": bundles, "bucket": buckets, "cohort": cohorts}, positions)


def add_round_columns(stats: list["SliceStats"], group: np.ndarray, bundle_group: np.ndarray,
                      drafted: np.ndarray, accepted: np.ndarray, count: np.ndarray) -> None:
    """Rounds given as columns (``drafted``, ``accepted``, ``count`` of each) added to ``stats`` at
    once: each into the stats its ``group`` numbers, its totals (not its positions) also into the
    stats its ``bundle_group`` numbers. Integer sums: the counts `SliceStats.add_round` gives, in
    whatever order they are added.

    >>> a, b = SliceStats(), SliceStats()
    >>> add_round_columns([a, b], np.array([0, 0, 0]), np.array([1, 1, 1]), np.array([4, 2, 0]),
    ...                   np.array([3, 0, 0]), np.array([1, 2, 1]))
    >>> a.rounds, a.plain_entries, a.drafted_at_least, a.accepted_at_least, (b.rounds, b.drafted_tokens)
    (3, 1, [3, 3, 1, 1], [1, 1, 1], (3, 8))
    """
    n = len(stats)
    if not len(group):
        return
    speculative = np.where(drafted > 0, count, 0)
    weights = (speculative, count - speculative, drafted * count, accepted * count)
    sums = np.array([np.bincount(group, weights=w, minlength=n) + np.bincount(bundle_group, weights=w, minlength=n)
                     for w in weights]).astype(np.int64)
    width = int(drafted.max()) + 1
    at_least = []
    for positions in (drafted, accepted):  # rounds that reached position i+1: a reversed running sum
        reached = np.bincount(group * width + positions, weights=count, minlength=n * width).reshape(n, width)
        at_least.append(np.cumsum(reached[:, :0:-1], axis=1)[:, ::-1].astype(np.int64))
    touched = np.flatnonzero(sums[0] + sums[1])
    lengths = [np.count_nonzero(counts[touched], axis=1).tolist() for counts in at_least]
    for g, rounds, plain, drafted_tokens, accepted_tokens, drafted_at, d_len, accepted_at, a_len in zip(
            touched.tolist(), *sums[:, touched].tolist(), at_least[0][touched].tolist(), lengths[0],
            at_least[1][touched].tolist(), lengths[1]):
        s = stats[g]
        s.rounds += rounds
        s.plain_entries += plain
        s.drafted_tokens += drafted_tokens
        s.accepted_tokens += accepted_tokens
        # a stats' first rounds take the lists as they are (each row is a list of its own)
        if s.drafted_at_least:
            _add_counts(s.drafted_at_least, drafted_at[:d_len])
        elif d_len:
            s.drafted_at_least = drafted_at[:d_len]
        if s.accepted_at_least:
            _add_counts(s.accepted_at_least, accepted_at[:a_len])
        elif a_len:
            s.accepted_at_least = accepted_at[:a_len]


def _percentiles(sketches: tuple) -> list[float]:
    """The summary's latency percentiles of (ttft, tpot, e2e) sketches, NaN for a missing one."""
    out: list[float] = []
    for sketch in sketches:
        out += _NO_PERCENTILES if sketch is None else sketch.quantiles(_SUMMARY_QUANTILES)
    return out


_NO_PERCENTILES = [math.nan] * len(_SUMMARY_QUANTILES)


def merge_all(parts: Iterable[SliceStats], sketches: bool = True) -> SliceStats:
    """One SliceStats holding the sum of ``parts`` (which are left unchanged).

    >>> a, b = SliceStats(), SliceStats()
    >>> a.add_round(4, 2); b.add_round(4, 4); b.add_request(90.0, 10.0, 900.0, True, "stop", 1.0)
    >>> whole, counts = merge_all([a, b]), merge_all([a, b], sketches=False)
    >>> (whole.rounds, whole.requests, whole.e2e is None), (counts.rounds, counts.requests, counts.e2e is None)
    ((2, 1, False), (2, 1, True))
    """
    out = SliceStats()
    for part in parts:
        out.merge(part, sketches)
    return out
