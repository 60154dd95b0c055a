"""Stage 1: folds one source's records into per-(scope, slice) partials and closes slices by event
time (`Stage1`), record by record or a decoded block at once."""

from __future__ import annotations

import math
from collections import Counter
from functools import partial
from itertools import chain
from typing import Callable, Iterable

import numpy as np

from specwatch.schemas.slice_stats import SliceStats, add_round_columns, sample_order
from specwatch.schemas import BundleRecord, Rejection, RequestRecord, StepRecord, TelemetryRecord
from specwatch.schemas.codec import ahead_of_clock
from specwatch.schemas.policy import Policy
from specwatch.schemas.scope import Scope as Key
from specwatch.schemas.step_block import StepBlock

from .intake import DuplicateFilter, EventClock, NativeEventClock, clock_rejection, duplicate, event_clock, writer_of
from .running_requests import RunningRequests, key_stats
from .slice_batch import SliceBatch

__all__ = ["Stage1"]

# How long (event time) after its slice closed a record is still recognised as a duplicate;
# a later copy is folded forward as a late record.
_DUPLICATE_HORIZON_SECONDS = 60.0


class Stage1:
    """Folds one source's records into per-(key, slice) partials; closes slices by event time."""

    def __init__(self, policy: Policy, source: str = "embedded") -> None:
        self.policy = policy
        self.source = source
        self._slice_s = policy.windows.slice_seconds
        self._lateness = policy.windows.lateness_seconds
        self._open: dict[int, SliceBatch] = {}
        # compiled where it is built
        self.clock = event_clock(policy.windows.max_ahead_seconds, close_on_writers=policy.windows.close_on_writers)
        self._folded = DuplicateFilter(math.ceil((self._lateness + _DUPLICATE_HORIZON_SECONDS) / self._slice_s))
        self.watermark = -1  # highest closed slice index
        self.late_records = 0
        self.records = 0
        self.running = RunningRequests()

    def to_state(self) -> dict:
        """Open slices, clock, duplicates and running requests as plain data (the policy is the owner's)."""
        return {"open": [batch.to_state() for batch in self._open.values()], "clock": self.clock.to_state(),
                "folded": self._folded.to_state(), "watermark": self.watermark, "late_records": self.late_records,
                "records": self.records, "running": self.running.to_state()}

    def load_state(self, state: dict) -> None:
        """Take up where `to_state` left (on a stage made with the same policy and source)."""
        self._open = {batch.slice_index: batch for batch in map(SliceBatch.from_state, state["open"])}
        self.clock.load_state(state["clock"])
        self._folded.load_state(state["folded"])
        self.watermark, self.late_records = int(state["watermark"]), int(state["late_records"])
        self.records = int(state["records"])
        self.running.load_state(state["running"])

    def _admit(self, kind: str, ts: float, writer: str, identity: tuple | None) -> float | Rejection:
        """The time to fold a record at (its writer's clock corrected), or why it is not folded:
        outside the clock-skew bound, or folded before."""
        admitted = self.clock.admit(ts, writer)
        if type(admitted) is Rejection:
            return admitted
        if identity is not None and not self._folded.first(int(admitted // self._slice_s), identity):
            return duplicate(kind, identity)
        self.records += 1
        return admitted

    def prime(self, items: Iterable[TelemetryRecord | Rejection],
              now: float | None = None) -> Iterable[TelemetryRecord | Rejection]:
        """Set the source's clock from the first records it is given (those the wall clock ``now``
        does not refuse), before the first is judged; returns ``items`` as they were."""
        if self.clock.primed:
            return items
        items = iter(items)
        head, samples = [], []
        for item in items:  # the first records, as a block's are counted: rejections aside
            head.append(item)
            if type(item) is not Rejection:
                samples.append((writer_of(item), item.ts))
                if len(samples) == EventClock.PRIME_RECORDS:
                    break
        self._prime(samples, now)
        return chain(head, items)

    def _prime_block(self, block: StepBlock, now: float | None) -> None:
        # the block's records in input order (steps are columns, the other kinds apart)
        firsts = sorted([*zip(block.at, block.workers, block.ts.tolist()),
                         *((at, writer_of(item), item.ts) for at, item in block.others if type(item) is not Rejection)])
        self._prime([(worker, ts) for _, worker, ts in firsts], now)

    def _prime(self, samples: list[tuple[str, float]], now: float | None) -> None:
        if now is not None:
            max_ahead = self.policy.windows.max_ahead_seconds
            samples = [(writer, ts) for writer, ts in samples if ahead_of_clock(ts, now, max_ahead) is None]
        self.clock.prime(samples)

    def _slice(self, ts: float) -> SliceBatch:
        index = int(ts // self._slice_s)
        late = index <= self.watermark
        if late:  # folded into the oldest open slice so nothing is lost, and counted
            self.late_records += 1
            index = self.watermark + 1
        batch = self._open.get(index)
        if batch is None:
            batch = self._open[index] = SliceBatch(self.source, index, self.watermark)
        batch.late_records += late
        return batch

    def add(self, record: TelemetryRecord) -> Rejection | None:
        """Fold one validated contract-v1 record, or say why it is not folded (a block: `fold_block`)."""
        kind = record.kind
        if kind == "step":
            return self._add_step(record)
        if kind == "request":
            identity = (record.worker, record.id)
        elif kind == "shadow":
            identity = (record.bundle_id, record.id)
        else:
            identity = None
        ts = self._admit(kind, record.ts, writer_of(record), identity)
        if type(ts) is Rejection:
            return ts
        batch = self._slice(ts)
        if kind == "request":
            key = (record.bundle_id, record.bucket, record.cohort)
            stats = key_stats(batch.partials, key)
            stats.add_request(record.ttft_ms, record.tpot_ms, record.e2e_ms, record.speculative,
                              record.finish_reason, ts)
            _offer_request(stats, record)
            self.running.ended(record.worker, record.id, record.e2e_ms, key, batch.partials)
        elif kind == "shadow":
            batch.events.append({"type": "shadow", "ts": ts, "bundle_id": record.bundle_id,
                                 "bucket": record.bucket, "id": record.id, "check": record.check,
                                 "match": record.match})
        elif kind == "bundle":
            self._add_bundle(batch, record, ts)
        return None

    def take(self, item: TelemetryRecord | Rejection,
             now: float | None) -> tuple[Rejection | None, bool]:
        """Fold one decoded item, checked against the wall clock ``now`` (None: unchecked): why it
        was not folded, and whether it went into a later slice than its own (late)."""
        if type(item) is Rejection:
            return item, False
        if now is not None:
            rejection = ahead_of_clock(item.ts, now, self.policy.windows.max_ahead_seconds)
            if rejection is not None:
                return rejection, False
        late_records = self.late_records
        return self.add(item), self.late_records != late_records

    def _add_step(self, step: StepRecord) -> Rejection | None:
        ts = self._admit("step", step.ts, step.worker, (step.worker, step.seq))
        if type(ts) is Rejection:
            return ts
        batch = self._slice(ts)
        self.running.saw(step.worker, ts, [e.id for e in step.requests],
                         partial(_step_scopes, step))
        # (drafted, accepted) pair counts, folded into the per-position arrays as a slice closes
        rounds = Counter([(e.bucket, e.cohort, e.drafted, e.accepted) for e in step.requests])
        bundle = step.bundle_id
        batch.sighted(bundle, step.worker, ts)
        tokens: dict[Key, list[int]] = {}
        # first-seen order: keys (and their partials) appear in the order the step lists them
        for (bucket, cohort, drafted, accepted), n in rounds.items():
            key = (bundle, bucket, cohort)
            batch.tally(key, (drafted, accepted), n)
            drafted_accepted = tokens.setdefault(key, [0, 0])
            drafted_accepted[0] += drafted * n
            drafted_accepted[1] += accepted * n
        draft_ms, verify_ms, kv_usage = step.draft_ms, step.verify_ms, step.kv_usage
        sample_id = f"{step.worker}:{step.seq}"
        order = sample_order(sample_id)
        for key, (drafted, accepted) in tokens.items():
            key_stats(batch.partials, key).add_step_time(draft_ms, verify_ms, kv_usage, ts)
            lowest = ((accepted / drafted, order, sample_id), step) if drafted else None
            batch.hold_step(key, lowest, ((order, sample_id), step))
        whole = key_stats(batch.partials, (bundle, None, None))
        whole.add_step_time(draft_ms, verify_ms, kv_usage, ts)
        return None

    def _add_bundle(self, batch: SliceBatch, record: BundleRecord, ts: float) -> None:
        batch.sighted(record.bundle_id, record.worker, ts)
        # Every card goes on: whether it changed is a question about the worker's previous
        # card, which may have reached another source. Stage 2 answers it in event-time order.
        batch.events.append({"type": "bundle", "ts": ts, "worker": record.worker,
                             "bundle_id": record.bundle_id, "card": record.card.model_dump(mode="json")})

    def fold_block(self, block: StepBlock, now: float | None = None) -> tuple[list, list, list[SliceBatch]]:
        """Fold a block of records at once, exactly as `add` then `close_ready` after each record would.

        Returns ``(rejected, late, closed)``: ``(position, Rejection)`` of every record not
        folded (the decoder's rejections among them), ``(position, ts)`` of every record
        folded into a later slice than its own, and the closed slices.
        """
        if not self.clock.primed:
            self._prime_block(block, now)
        rows, slices, rejected, late, limits = self._admit_block(block, now)
        if rows:
            self._fold_block(block, np.asarray(rows, dtype=np.int64), np.asarray(slices, dtype=np.int64))
        closed: list[SliceBatch] = []
        for limit, running in limits:
            closed += self._close(limit, running)
        return rejected, late, closed

    def _admit_block(self, block: StepBlock, now: float | None) -> tuple[list, list, list, list, list]:
        """Each step's admission and slice, the block's other records folded, and where the watermark moves."""
        max_ahead = None if now is None else self.policy.windows.max_ahead_seconds
        clock = self.clock
        admit, first = clock.admit, self._folded.first
        slice_s, lateness = self._slice_s, self._lateness
        rows: list[int] = []
        slices: list[int] = []
        rejected: list[tuple[int, Rejection]] = []
        late: list[tuple[int, float]] = []
        limits: list[tuple[int, dict[Key, SliceStats]]] = []
        others = block.others
        next_other = others[0][0] if others else math.inf
        # the requests each step lists, for the running-request tracker (as `_add_step` tells it)
        saw, step_ids = self.running.saw, block.step_ids
        bounds = np.searchsorted(block.round_step, np.arange(len(block) + 1)).tolist()
        other = 0
        at, block_ts = block.at, block.ts

        def fold_other(position: int, item) -> None:
            if type(item) is StepRecord and rows:
                # a step only the reference codec read: the column steps before it fold first,
                # so every sum is added in the order one record at a time adds it
                self._fold_block(block, np.asarray(rows, dtype=np.int64), np.asarray(slices, dtype=np.int64))
                self.records += len(rows)
                rows.clear()
                slices.clear()
            rejection, is_late = self.take(item, now)
            if rejection is not None:
                rejected.append((position, rejection))
                return
            if is_late:
                late.append((position, item.ts))
            self._closes_after_record(limits)

        if type(clock) is NativeEventClock:
            other = self._admit_steps_native(block, now, rows, slices, rejected, late, limits, fold_other)
            for position, item in others[other:]:
                fold_other(position, item)
            self.records += len(rows)
            return rows, slices, rejected, late, limits
        for row, (ts, worker, seq) in enumerate(zip(block.ts.tolist(), block.workers, block.seqs)):
            while next_other < at[row]:  # the records of other kinds before this step
                position, item = others[other]
                other += 1
                next_other = others[other][0] if other < len(others) else math.inf
                fold_other(position, item)
            rejection = None if max_ahead is None else ahead_of_clock(ts, now, max_ahead)
            if rejection is None:
                admitted = admit(ts, worker)
                if type(admitted) is Rejection:
                    rejection = admitted
                else:
                    if admitted != ts:  # its writer's clock corrected: folded (and sighted) at that time
                        ts = block_ts[row] = admitted
                    index = int(ts // slice_s)
                    if not first(index, (worker, seq)):
                        rejection = duplicate("step", (worker, seq))
            if rejection is not None:
                rejected.append((at[row], rejection))
                continue
            watermark = self.watermark
            if index <= watermark:
                late.append((at[row], ts))
            index = self._slice(ts).slice_index
            scopes = partial(_block_scopes, block, bounds[row], bounds[row + 1])
            saw(worker, ts, step_ids[row], scopes)
            rows.append(row)
            slices.append(index)
            if clock.close_on_writers:
                if clock.close_limit(slice_s, lateness, watermark) > watermark:
                    self._closes_after_record(limits)
            elif clock.now != -math.inf and int((clock.now - lateness) // slice_s) - 1 > watermark:
                self._closes_after_record(limits)
        for position, item in others[other:]:
            fold_other(position, item)
        self.records += len(rows)
        return rows, slices, rejected, late, limits

    def _admit_steps_native(self, block: StepBlock, now: float | None, rows: list, slices: list, rejected: list,
                            late: list, limits: list, fold_other: Callable) -> int:
        """The step loop of `_admit_block`, run by run in the compiled clock (`ClockCore.admit_steps`):
        a run stops before a record of another kind and after a step that may close slices, which
        are taken here as the loop takes them. Returns how many of the other records it folded."""
        others, at, workers, seqs, step_ids = block.others, block.at, block.workers, block.seqs, block.step_ids
        saw = self.running.saw
        bounds = np.searchsorted(block.round_step, np.arange(len(block) + 1)).tolist()

        def saw_row(row: int, ts: float) -> None:  # a step the compiled tracker's common case is not
            saw(workers[row], ts, step_ids[row], partial(_block_scopes, block, bounds[row], bounds[row + 1]))

        max_ahead = self.policy.windows.max_ahead_seconds
        admit_steps, ts_list, block_ts = self.clock.core.admit_steps, block.ts.tolist(), block.ts
        row, other, n = 0, 0, len(block)
        while row < n:
            while other < len(others) and others[other][0] < at[row]:  # the records of other kinds before it
                fold_other(*others[other])
                other += 1
            stop_at = others[other][0] if other < len(others) else _NO_OTHER
            run = admit_steps(row, stop_at, ts_list, workers, seqs, at, step_ids, now, max_ahead, self._slice_s,
                              self._lateness, self.watermark, self._folded._by_slice, self.running._workers,
                              self.running.lost_after, saw_row)
            for moved, ts in run["moved"]:
                block_ts[moved] = ts
            for refused, code, ts, off, expected in run["rejected"]:
                if code == _TS_IN_FUTURE:
                    rejection = ahead_of_clock(ts, now, max_ahead)
                elif code == _DUPLICATE:
                    rejection = duplicate("step", (workers[refused], seqs[refused]))
                else:
                    rejection = clock_rejection(code == _CLOCK_AHEAD, ts, off, expected, self.clock.max_skew)
                rejected.append((at[refused], rejection))
            for index, late_records in run["opened"]:
                batch = self._open.get(index)
                if batch is None:
                    batch = self._open[index] = SliceBatch(self.source, index, self.watermark)
                batch.late_records += late_records
                self.late_records += late_records
            late += run["late"]
            rows += run["rows"]
            slices += run["slices"]
            row = run["next_row"]
            if run["close"]:
                self._closes_after_record(limits)
        return other

    def _closes_after_record(self, limits: list[tuple[int, dict[Key, SliceStats]]]) -> None:
        """Where `close_ready` after this record would move the watermark (slices close later)."""
        limit = self._close_limit()
        if limit > self.watermark:
            self.watermark = limit
            self._folded.expire(limit)
            running: dict[Key, SliceStats] = {}  # what the tracker reports here, for the close's last slice
            self.running.close((limit + 1) * self._slice_s, running)
            limits.append((limit, running))

    def _fold_block(self, block: StepBlock, rows: np.ndarray, slices: np.ndarray) -> None:
        """Fold the admitted ``rows`` of a block into their ``slices`` (already open), once per (slice, key)."""
        n_keys = len(block.keys)
        slice_of = np.full(len(block), -1, dtype=np.int64)
        slice_of[rows] = slices
        base = int(slices.min())
        keep = slice_of[block.round_step] >= 0
        round_step, round_key = block.round_step[keep], block.round_key[keep]
        drafted, accepted, count = block.drafted[keep], block.accepted[keep], block.count[keep]
        # each (step, key) a step's rounds touch: its drafted and accepted tokens
        pairs, first_round, pair_of_round = np.unique(round_step * n_keys + round_key, return_index=True,
                                                      return_inverse=True)
        pair_step, pair_key = pairs // n_keys, pairs % n_keys
        pair_drafted = np.bincount(pair_of_round, weights=drafted * count, minlength=len(pairs))
        pair_accepted = np.bincount(pair_of_round, weights=accepted * count, minlength=len(pairs))
        # a step's time goes to each key it served, in first-seen order, then to its bundle
        touch_order = np.lexsort((np.concatenate([first_round, np.full(len(rows), len(round_step))]),
                                  np.concatenate([pair_step, rows])))
        touch_step = np.concatenate([pair_step, rows])[touch_order]
        touch_key = np.concatenate([pair_key, block.bundle_key[rows]])[touch_order]
        codes, first_touch, group = np.unique((slice_of[touch_step] - base) * n_keys + touch_key,
                                              return_index=True, return_inverse=True)
        keys, open_slices = block.keys, self._open
        # created in the order the steps touch them, as step-by-step folding creates them
        stats = [None] * len(codes)
        for g in np.argsort(first_touch, kind="stable").tolist():
            code = int(codes[g])
            stats[g] = key_stats(open_slices[code // n_keys + base].partials, keys[code % n_keys])
        _add_step_times(stats, group, touch_step, block)
        touch_group = np.empty(len(touch_order), dtype=np.int64)
        touch_group[touch_order] = group
        pair_group = touch_group[:len(pairs)]
        bundle_group = np.full(len(block), -1, dtype=np.int64)  # each admitted step's (slice, bundle) group
        bundle_group[rows] = touch_group[len(pairs):]
        add_round_columns(stats, pair_group[pair_of_round], bundle_group[round_step], drafted, accepted, count)
        self._hold_block_samples(block, codes, n_keys, base, pair_step, pair_group, pair_drafted, pair_accepted)
        self._block_sightings(block, rows, slices)

    def _hold_block_samples(self, block, codes, n_keys, base, pair_step, pair_group, pair_drafted,
                            pair_accepted) -> None:
        """Each key's lowest-acceptance step and step control, by the rank `_add_step` keeps them by:
        the first of each (slice, key) ranked for all keys at once."""
        steps = np.unique(pair_step).tolist()
        sample_ids = {row: f"{block.workers[row]}:{block.seqs[row]}" for row in steps}
        order = np.zeros(len(block), dtype=np.int64)
        order[steps] = [sample_order(sample_ids[row]) for row in steps]
        pair_order = order[pair_step]
        acceptance = np.divide(pair_accepted, pair_drafted, out=np.zeros(len(pair_step)), where=pair_drafted > 0)
        drafting = np.flatnonzero(pair_drafted > 0)
        low_groups, low_pairs = _first_ranked(drafting, pair_group, pair_order, acceptance, pair_step, sample_ids)
        groups, control_pairs = _first_ranked(np.arange(len(pair_step)), pair_group, pair_order, None, pair_step,
                                              sample_ids)
        # one held step per row, whichever keys and kinds keep it: a step serves many keys, and
        # what the kept samples hold is walked by the cyclic collector for as long as they are kept
        held_rows = np.unique(pair_step[np.concatenate([low_pairs, control_pairs])]).tolist()
        held_steps = dict(zip(held_rows, map(block.builder, held_rows)))
        # each group's lowest-acceptance pair, -1 where none of its steps drafted
        lowest_of = np.full(len(codes), -1, dtype=np.int64)
        lowest_of[low_groups] = low_pairs
        lowest_pairs = lowest_of[groups]
        low_rows = pair_step[lowest_pairs].tolist()
        lowest = [None if p < 0 else ((severity, rank, sample_ids[row]), held_steps[row])
                  for p, severity, rank, row in zip(lowest_pairs.tolist(), acceptance[lowest_pairs].tolist(),
                                                     pair_order[lowest_pairs].tolist(), low_rows)]
        control_rows = pair_step[control_pairs].tolist()
        group_codes = codes[groups]
        keys, open_slices = block.keys, self._open
        for slice_index, key_index, low, rank, row in zip((group_codes // n_keys + base).tolist(),
                                                          (group_codes % n_keys).tolist(), lowest,
                                                          pair_order[control_pairs].tolist(), control_rows):
            batch = open_slices[slice_index]
            key = keys[key_index]
            control = ((rank, sample_ids[row]), held_steps[row])
            if key in batch.step_candidates:
                batch.hold_step(key, low, control)
            else:  # the key's first steps of the slice: held as they are
                batch.step_candidates[key] = [low, control]

    def _block_sightings(self, block: StepBlock, rows: np.ndarray, slices: np.ndarray) -> None:
        """The first and last time each slice saw each worker run each bundle."""
        worker_table: dict[str, int] = {}
        workers = np.array([worker_table.setdefault(w, len(worker_table)) for w in block.workers], dtype=np.int64)
        n_workers, n_keys = len(worker_table), len(block.keys)
        base = int(slices.min())
        codes, inverse = np.unique(((slices - base) * n_keys + block.bundle_key[rows]) * n_workers + workers[rows],
                                   return_inverse=True)
        ts = block.ts[rows]
        first = np.full(len(codes), np.inf)
        last = np.full(len(codes), -np.inf)
        np.minimum.at(first, inverse, ts)
        np.maximum.at(last, inverse, ts)
        names = list(worker_table)
        for code, low, high in zip(codes.tolist(), first.tolist(), last.tolist()):
            where, worker = divmod(code, n_workers)
            slice_index, key_index = divmod(where, n_keys)
            batch, bundle_id = self._open[slice_index + base], block.keys[key_index][0]
            batch.sighted(bundle_id, names[worker], low)
            batch.sighted(bundle_id, names[worker], high)

    def close_ready(self, final: bool = False) -> list[SliceBatch]:
        """Slices whose end is more than the allowed lateness behind the newest record (or, with
        ``windows.close_on_writers``, that every writer has passed in order: `EventClock.close_limit`)."""
        if final:
            limit = max(self._open, default=self.watermark)
        else:
            limit = self._close_limit()
        if limit <= self.watermark:
            return []
        return self._close(limit)

    def _close_limit(self) -> int:
        """The newest slice the source's event time lets close (the watermark, before any record)."""
        return self.clock.close_limit(self._slice_s, self._lateness, self.watermark)

    def _close(self, limit: int, running: dict[Key, SliceStats] | None = None) -> list[SliceBatch]:
        """Close the open slices up to ``limit``; ``running``: the tracker's reports for this close,
        taken where it came among a block's records (None: taken now)."""
        ready = sorted(i for i in self._open if i <= limit)
        self.watermark = limit
        self._folded.expire(limit)
        out = []
        for index in ready:
            batch = self._open.pop(index)
            # vouches only for the slices sent so far (see docs/STREAMS.md, `Stage1._close`)
            batch.watermark = limit if index == ready[-1] else index
            batch.seal()
            out.append(batch)
        if not out:
            out.append(SliceBatch(self.source, limit, limit))
        partials = out[-1].partials
        if running is None:
            self.running.close((limit + 1) * self._slice_s, partials)
        else:
            for key, reported in running.items():
                stats = partials.get(key)
                if stats is None:
                    partials[key] = reported
                else:
                    stats.running_long.update(reported.running_long)
                    stats.running_done.update(reported.running_done)
        return out


def _step_scopes(step: StepRecord) -> list[Key]:
    """The key of each request a step lists, as `RunningRequests.saw` reads them."""
    return [(step.bundle_id, e.bucket, e.cohort) for e in step.requests]


def _block_scopes(block: StepBlock, start: int, end: int) -> list[Key]:
    """The key of each request of the step whose rounds are ``start:end`` in a block."""
    keys = block.keys
    return [keys[k] for k in block.round_key[start:end].tolist()]


# `ClockCore.admit_steps`: past any record's position, and its codes of refusal
_NO_OTHER = 1 << 62
_TS_IN_FUTURE, _CLOCK_AHEAD, _CLOCK_BEHIND, _DUPLICATE = range(4)


def _add_step_times(stats: list[SliceStats], group: np.ndarray, touch_step: np.ndarray, block: StepBlock) -> None:
    """Each step's times into the stats of every (slice, key) it touches, in step order."""
    n = len(stats)
    bins = np.concatenate([np.arange(n), group])

    def summed(held: list[float], values: np.ndarray) -> list[float]:
        return np.bincount(bins, weights=np.concatenate([held, values[touch_step]]), minlength=n).tolist()

    draft_ms = summed([s.draft_ms for s in stats], block.draft_ms)
    verify_ms = summed([s.verify_ms for s in stats], block.verify_ms)
    kv_peak = np.array([s.kv_peak for s in stats])
    np.maximum.at(kv_peak, group, block.kv_usage[touch_step])
    max_ts = np.array([s.max_ts for s in stats])
    np.maximum.at(max_ts, group, block.ts[touch_step])
    steps = np.bincount(group, minlength=n).tolist()
    for s, n_steps, draft, verify, kv, ts in zip(stats, steps, draft_ms, verify_ms, kv_peak.tolist(),
                                                  max_ts.tolist()):
        s.steps += n_steps
        s.draft_ms = draft
        s.verify_ms = verify
        s.kv_peak = kv
        s.max_ts = ts


def _first_ranked(candidates: np.ndarray, pair_group: np.ndarray, pair_order: np.ndarray,
                  severity: np.ndarray | None, pair_step: np.ndarray, sample_ids: dict[int, str]
                  ) -> tuple[np.ndarray, np.ndarray]:
    """The first of ``candidates`` (pairs) in each group by (severity, order), then sample id, an
    earlier step winning a tie; as (groups ascending, their first pairs)."""
    if not len(candidates):
        return candidates, candidates
    sort_keys = (pair_order[candidates],) if severity is None else (pair_order[candidates], severity[candidates])
    ranked = candidates[np.lexsort((*sort_keys, pair_group[candidates]))]  # stable: earlier steps first
    groups = pair_group[ranked]
    starts = np.flatnonzero(np.r_[True, groups[1:] != groups[:-1]])
    first = ranked[starts]
    # a tie on (severity, order) needs two steps whose ids share a CRC-32: settled one by one
    second = np.minimum(starts + 1, len(ranked) - 1)
    tied = (groups[second] == groups[starts]) & (second != starts) & (pair_order[ranked[second]] == pair_order[first])
    if severity is not None:
        tied &= severity[ranked[second]] == severity[first]
    ends = np.r_[starts[1:], len(ranked)]
    for i in np.flatnonzero(tied).tolist():
        head = ranked[starts[i]]
        same = [p for p in ranked[starts[i]:ends[i]].tolist() if pair_order[p] == pair_order[head]
                and (severity is None or severity[p] == severity[head])]
        first[i] = min(same, key=lambda p: sample_ids[pair_step[p]])
    return groups[starts], first


def _offer_request(stats: SliceStats, record: RequestRecord) -> None:
    """A finished request as a sample: of its failure, or as a healthy control; and by its latency."""
    rid = record.id
    order = sample_order(rid)

    def build() -> dict:
        return record.model_dump(mode="json")

    if record.failed:
        stats.offer_sample(record.finish_reason, (order, rid), build)
    else:
        stats.offer_sample("control_request", (order, rid), build)
    stats.offer_sample("slowest", (-record.e2e_ms, order, rid), build)

