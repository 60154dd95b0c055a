"""The processing topology, written once: stage 1 combines, stage 2 merges, detects and decides."""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from functools import partial
from itertools import chain
from typing import Callable, Iterable

import numpy as np

from specwatch.actions.admission import AdmissionController
from specwatch.actions.flags import FlagStore
from specwatch.actions.policy import FallbackPolicy
from specwatch.detectors.draft_length import DraftLengthCurve, curve_from_slices
from specwatch.detectors.baseline import BaselinePool
from specwatch.detectors.monitor import BundleMonitor, Finding, KeyMonitor, traffic_evidence
from specwatch.detectors.window import SliceStats, sample_order, sample_record
from specwatch.schemas import (
    BundleCard,
    BundleRecord,
    Decision,
    Rejection,
    RequestRecord,
    StepRecord,
    TelemetryRecord,
    card_differences,
)
from specwatch.schemas.codec import ahead_of_clock
from specwatch.schemas.fastdecode import StepBlock
from specwatch.schemas.outputs import ActionRecord, SliceOutput, SliceWindows
from specwatch.schemas.policy import Policy
from specwatch.schemas.reasons import facts_of
from specwatch.schemas.scope import Scope as Key, scope_from_text, scope_text

from .intake import DuplicateFilter, EventClock, duplicate, writer_of
from .running_requests import RunningRequests, key_stats

__all__ = [
    "SliceBatch",
    "Stage1",
    "Stage2",
    "ActionRecord",
    "SliceOutput",
]


# Evidence windows archived with a decision: this many slices before it.
_EVIDENCE_SLICES = 30
# Samples archived with a decision: the records that show the problem, then healthy
# controls of the same scope, from the slices of the finding's window (or the last few).
_PROBLEM_SAMPLES = 9
_CONTROL_SAMPLES = 3
_SAMPLE_SLICES = 10
# How long (event time) after its slice closed a record is still recognised as a duplicate;
# a later copy is folded forward as a late record.
_DUPLICATE_HORIZON_SECONDS = 60.0


@dataclass
class SliceBatch:
    """What one source contributes to one slice: partial aggregates and discrete events."""

    source: str
    slice_index: int
    watermark: int
    partials: dict[Key, SliceStats] = field(default_factory=dict)
    events: list[dict] = field(default_factory=list)
    late_records: int = 0
    round_tallies: dict[Key, dict[tuple[int, int], int]] = field(default_factory=dict, repr=False)
    # (bundle_id, worker) -> [first, last] event time this slice saw the worker run the bundle;
    # turned into one "sighting" event per pair when the slice closes.
    sightings: dict[tuple[str, str], list[float]] = field(default_factory=dict, repr=False)
    # per key: [(rank, step) of its lowest-acceptance step, (rank, step) of its step control] so far
    step_candidates: dict[Key, list[tuple]] = field(default_factory=dict, repr=False)

    def to_state(self) -> dict:
        """The slice as plain data, held steps built now (`from_state` reads it back)."""
        return {"source": self.source, "slice_index": self.slice_index, "watermark": self.watermark,
                "partials": [[list(key), stats.to_state()] for key, stats in self.partials.items()],
                "events": self.events, "late_records": self.late_records,
                "round_tallies": [[list(key), [[d, a, n] for (d, a), n in tally.items()]]
                                  for key, tally in self.round_tallies.items()],
                "sightings": [[bundle, worker, span] for (bundle, worker), span in self.sightings.items()],
                "step_candidates": [[list(key), [None if held is None else [list(held[0]), _step_record(held[1])]
                                                 for held in pair]] for key, pair in self.step_candidates.items()]}

    @classmethod
    def from_state(cls, state: dict) -> "SliceBatch":
        def key(items) -> Key:
            return tuple(items)

        def held(item) -> tuple | None:
            return None if item is None else (tuple(item[0]), StepRecord.model_validate(item[1]))

        return cls(str(state["source"]), int(state["slice_index"]), int(state["watermark"]),
                   partials={key(k): SliceStats.from_state(v) for k, v in state["partials"]},
                   events=[dict(event) for event in state["events"]], late_records=int(state["late_records"]),
                   round_tallies={key(k): {(int(d), int(a)): int(n) for d, a, n in tally}
                                  for k, tally in state["round_tallies"]},
                   sightings={(str(b), str(w)): [float(span[0]), float(span[1])] for b, w, span in state["sightings"]},
                   step_candidates={key(k): [held(item) for item in pair] for k, pair in state["step_candidates"]})

    def sighted(self, bundle_id: str, worker: str, ts: float) -> None:
        """A record of ``worker`` running ``bundle_id`` at ``ts`` (a step or a bundle card)."""
        span = self.sightings.get((bundle_id, worker))
        if span is None:
            self.sightings[(bundle_id, worker)] = [ts, ts]
        elif ts < span[0]:
            span[0] = ts
        elif ts > span[1]:
            span[1] = ts

    def tally(self, key: Key, pair: tuple[int, int], n: int) -> None:
        """``n`` more rounds of ``key`` that drafted and accepted ``pair``."""
        tally = self.round_tallies.setdefault(key, {})
        tally[pair] = tally.get(pair, 0) + n

    def seal(self) -> None:
        """As the slice closes: the round tallies into the partials (and the bundle totals), the
        samples among its steps kept, its sightings as one event per (bundle, worker)."""
        if self.step_candidates:
            _keep_step_samples(self.partials, self.step_candidates)
            self.step_candidates = {}
        for key, tally in self.round_tallies.items():
            self.partials[key].add_round_counts(tally)
            whole = self.partials[(key[0], None, None)]
            for (drafted, accepted), n in tally.items():
                if drafted:
                    whole.rounds += n
                    whole.drafted_tokens += drafted * n
                    whole.accepted_tokens += accepted * n
                else:
                    whole.plain_entries += n
        self.round_tallies = {}
        for (bundle_id, worker), (first, last) in sorted(self.sightings.items()):
            self.events.append({"type": "sighting", "ts": last, "first_seen": first,
                                "worker": worker, "bundle_id": bundle_id})
        self.sightings = {}

    def to_dict(self) -> dict:
        return {
            "source": self.source,
            "slice_index": self.slice_index,
            "watermark": self.watermark,
            "partials": {scope_text(k): v.to_dict() for k, v in self.partials.items()},
            "events": self.events,
            "late_records": self.late_records,
        }

    @classmethod
    def from_dict(cls, data: dict) -> "SliceBatch":
        return cls(
            source=data["source"],
            slice_index=int(data["slice_index"]),
            watermark=int(data["watermark"]),
            partials={scope_from_text(k): SliceStats.from_dict(v) for k, v in data.get("partials", {}).items()},
            events=list(data.get("events", [])),
            late_records=int(data.get("late_records", 0)),
        )


class Stage1:
    """Folds one source's records into per-(key, slice) partials; closes slices by event time."""

    def __init__(self, policy: Policy, source: str = "embedded") -> None:
        self.policy = policy
        self.source = source
        self._slice_s = policy.windows.slice_seconds
        self._lateness = policy.windows.lateness_seconds
        self._open: dict[int, SliceBatch] = {}
        self.clock = EventClock(policy.windows.max_ahead_seconds)
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
        candidates = batch.step_candidates
        sample_id = f"{step.worker}:{step.seq}"
        order = sample_order(sample_id)
        for key, (drafted, accepted) in tokens.items():
            key_stats(batch.partials, key).add_step_time(draft_ms, verify_ms, kv_usage, ts)
            lowest = ((accepted / drafted, order, sample_id), step) if drafted else None
            _hold(candidates, key, lowest, ((order, sample_id), step))
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
            if clock.now != -math.inf and int((clock.now - lateness) // slice_s) - 1 > watermark:
                self._closes_after_record(limits)
        for position, item in others[other:]:
            fold_other(position, item)
        self.records += len(rows)
        return rows, slices, rejected, late, limits

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
        self._fold_block_rounds(block, slice_of, base, round_step, round_key, drafted, accepted, count)
        is_pair = touch_order < len(pairs)
        pair_group = np.empty(len(pairs), dtype=np.int64)
        pair_group[touch_order[is_pair]] = group[is_pair]
        self._hold_block_samples(block, codes, n_keys, base, pair_step, pair_group, pair_drafted, pair_accepted)
        self._block_sightings(block, rows, slices)

    def _fold_block_rounds(self, block, slice_of, base, round_step, round_key, drafted, accepted, count) -> None:
        """The rounds' (drafted, accepted) tallies of each (slice, key)."""
        n_keys, width = len(block.keys), _MAX_DRAFT_PAIRS
        codes, inverse = np.unique(((slice_of[round_step] - base) * n_keys + round_key) * width * width
                                   + drafted * width + accepted, return_inverse=True)
        counts = np.bincount(inverse, weights=count, minlength=len(codes)).astype(np.int64)
        keys, open_slices = block.keys, self._open
        for code, n in zip(codes.tolist(), counts.tolist()):
            where, pair = divmod(code, width * width)
            slice_index, key_index = divmod(where, n_keys)
            open_slices[slice_index + base].tally(keys[key_index], divmod(pair, width), n)

    def _hold_block_samples(self, block, codes, n_keys, base, pair_step, pair_group, pair_drafted,
                            pair_accepted) -> None:
        """Each key's lowest-acceptance step and step control, by the rank `_add_step` keeps them by."""
        steps = np.unique(pair_step)
        sample_ids = {}
        order = np.zeros(len(block), dtype=np.int64)
        for row in steps.tolist():
            sample_id = sample_ids[row] = f"{block.workers[row]}:{block.seqs[row]}"
            order[row] = sample_order(sample_id)
        pair_order = order[pair_step]
        acceptance = np.divide(pair_accepted, pair_drafted, out=np.zeros(len(pair_step)), where=pair_drafted > 0)
        # one held step per row, whichever keys and kinds keep it: a step serves many keys, and
        # what the kept samples hold is walked by the cyclic collector for as long as they are kept
        held_steps: dict[int, Callable[[], StepRecord]] = {}

        def best(candidates: np.ndarray, severity: np.ndarray | None) -> dict[int, tuple]:
            # first of each group by (severity, order), then sample id; an earlier step wins a tie
            if not len(candidates):
                return {}
            sort_keys = (pair_order[candidates],) if severity is None else (pair_order[candidates],
                                                                            severity[candidates])
            ranked = candidates[np.lexsort((*sort_keys, pair_group[candidates]))]
            groups = pair_group[ranked]
            starts = np.flatnonzero(np.r_[True, groups[1:] != groups[:-1]]).tolist() + [len(ranked)]
            out = {}
            for start, end in zip(starts[:-1], starts[1:]):
                tied = [ranked[start]]
                for i in range(start + 1, end):
                    p = ranked[i]
                    if pair_order[p] != pair_order[tied[0]] or (severity is not None
                                                                  and severity[p] != severity[tied[0]]):
                        break
                    tied.append(p)
                p = min(tied, key=lambda p: sample_ids[pair_step[p]])
                row = int(pair_step[p])
                head = () if severity is None else (float(severity[p]),)
                held = held_steps.get(row)
                if held is None:
                    held = held_steps[row] = block.builder(row)
                out[int(groups[start])] = ((*head, int(pair_order[p]), sample_ids[row]), held)
            return out

        lowest = best(np.flatnonzero(pair_drafted > 0), acceptance)
        control = best(np.arange(len(pair_step)), None)
        keys, open_slices = block.keys, self._open
        for g, held_control in control.items():
            code = int(codes[g])
            candidates = open_slices[code // n_keys + base].step_candidates
            _hold(candidates, keys[code % n_keys], lowest.get(g), held_control)

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
        """Slices whose end is more than the allowed lateness behind the newest record."""
        if final:
            limit = max(self._open, default=self.watermark)
        else:
            limit = self._close_limit()
        if limit <= self.watermark:
            return []
        return self._close(limit)

    def _close_limit(self) -> int:
        """The newest slice the source's event time lets close (the watermark, before any record)."""
        if self.clock.now == -math.inf:
            return self.watermark  # too few records yet to tell this source's event time
        return int((self.clock.now - self._lateness) // self._slice_s) - 1

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


# drafted and accepted are at most 64: a (drafted, accepted) pair as one number
_MAX_DRAFT_PAIRS = 65


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


def _hold(candidates: dict[Key, list[tuple]], key: Key, lowest: tuple | None,
          control: tuple) -> None:
    """Keep the (rank, step) pairs ranked first for ``key``: lowest acceptance, control."""
    held = candidates.get(key)
    if held is None:
        candidates[key] = [lowest, control]
        return
    if lowest is not None and (held[0] is None or lowest[0] < held[0][0]):
        held[0] = lowest
    if control[0] < held[1][0]:
        held[1] = control


def _keep_step_samples(partials: dict[Key, SliceStats], candidates: dict[Key, list[tuple]]) -> None:
    """Each key's lowest-acceptance step and step control among a slice's steps, ranked by content."""
    for key, (lowest, control) in candidates.items():
        stats = partials[key]
        if lowest is not None:
            stats.keep_samples("lowest_acceptance", [lowest], _step_record)
        stats.keep_samples("control_step", [control], _step_record)


def _step_record(step) -> dict:
    return (step if isinstance(step, StepRecord) else step()).model_dump(mode="json")


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


class Stage2:
    """Merges partials per slice once every source it waits for has passed it; detects and decides.
    """

    def __init__(self, policy: Policy, flags: FlagStore | None = None,
                 owns: Callable[[str], bool] | None = None, qualifications: dict | None = None) -> None:
        self.policy = policy
        self.owns = owns
        self.flags = flags if flags is not None else FlagStore()
        self.fallback = FallbackPolicy(policy, self.flags)
        # Admission is a policy switch: off, it does not exist, and no decision changes.
        self.admission = AdmissionController(policy, qualifications) if policy.admission.enforce else None
        self._slice_s = policy.windows.slice_seconds
        self._sources: dict[str, int] = {}
        self._released: set[str] = set()
        self._pending: dict[int, dict[str, list[SliceBatch]]] = defaultdict(dict)
        self.finalized = -1
        self.monitors: dict[Key, KeyMonitor | BundleMonitor] = {}
        self.pools: dict[str, BaselinePool] = {}  # per bundle: what quiet keys borrow baselines from
        self.cards: dict[str, dict] = {}
        self.worker_cards: dict[str, tuple[str, dict]] = {}  # worker -> its latest (bundle_id, card)
        self.shadow_counts: Counter = Counter()
        self.last_mismatch: dict[tuple[str, str], float] = {}  # (bundle, bucket) -> latest strict mismatch ts

    def to_state(self) -> dict:
        """Sources, pending slices, monitors, baselines, flags and admission as plain data (the policy
        and ``owns`` are the owner's)."""
        return {"sources": self._sources, "released": sorted(self._released),
                "pending": [[index, [[source, [b.to_state() for b in batches]] for source, batches in by_source.items()]]
                            for index, by_source in self._pending.items()],
                "finalized": self.finalized,
                "pools": {bundle: pool.to_state() for bundle, pool in self.pools.items()},
                "monitors": [[list(key), monitor.to_state()] for key, monitor in self.monitors.items()],
                "cards": self.cards, "worker_cards": {w: list(pair) for w, pair in self.worker_cards.items()},
                "shadow_counts": [[list(key), n] for key, n in self.shadow_counts.items()],
                "last_mismatch": [[bundle, bucket, ts] for (bundle, bucket), ts in self.last_mismatch.items()],
                "flags": self.flags.to_state(), "fallback": self.fallback.to_state(),
                "admission": self.admission.to_state() if self.admission is not None else None}

    def load_state(self, state: dict) -> None:
        """Take up where `to_state` left (on a stage made with the same policy)."""
        self._sources = {str(source): int(w) for source, w in state["sources"].items()}
        self._released = {str(source) for source in state["released"]}
        self._pending = defaultdict(dict, {int(index): {str(source): [SliceBatch.from_state(b) for b in batches]
                                                        for source, batches in by_source}
                                           for index, by_source in state["pending"]})
        self.finalized = int(state["finalized"])
        self.pools = {str(bundle): BaselinePool.from_state(pool) for bundle, pool in state["pools"].items()}
        self.monitors = {}
        for items, monitor_state in state["monitors"]:
            bundle, bucket, cohort = key = tuple(items)
            monitor = BundleMonitor(self.policy) if bucket is None else KeyMonitor(
                self.policy, bucket, self.pools.setdefault(bundle, BaselinePool()))
            monitor.load_state(monitor_state)
            self.monitors[key] = monitor
        self.cards = dict(state["cards"])
        self.worker_cards = {str(w): (str(bundle), card) for w, (bundle, card) in state["worker_cards"].items()}
        self.shadow_counts = Counter({tuple(key): int(n) for key, n in state["shadow_counts"]})
        self.last_mismatch = {(bundle, bucket): float(ts) for bundle, bucket, ts in state["last_mismatch"]}
        self.flags = FlagStore.from_state(state["flags"])
        self.fallback = FallbackPolicy(self.policy, self.flags)
        self.fallback.load_state(state["fallback"])
        if (state["admission"] is None) != (self.admission is None):
            raise ValueError("the checkpoint's admission state does not match the policy's admission.enforce")
        if self.admission is not None:
            self.admission.load_state(state["admission"])

    def add(self, batch: SliceBatch) -> list[SliceOutput]:
        if batch.slice_index <= self.finalized and (batch.partials or batch.events):
            # a source so far behind that its slice was already decided: fold forward
            batch.slice_index = self.finalized + 1
        if batch.partials or batch.events or batch.late_records:
            self._pending[batch.slice_index].setdefault(batch.source, []).append(batch)
        self._sources[batch.source] = max(self._sources.get(batch.source, -1), batch.watermark)
        self._released.discard(batch.source)
        return self._finalize_ready()

    def release(self, source: str) -> list[SliceOutput]:
        """Stop waiting for ``source``, gone idle (`streams.sources.IdleRule`), until it sends again."""
        self._sources.setdefault(source, -1)
        self._released.add(source)
        return self._finalize_ready()

    def _finalize_ready(self, limit: int | None = None) -> list[SliceOutput]:
        if not self._sources:
            return []
        if limit is None:
            waited = [w for source, w in self._sources.items() if source not in self._released]
            limit = min(waited) if waited else max(self._sources.values())
        outputs = []
        for index in sorted(i for i in self._pending if i <= limit):
            outputs.append(self._finalize(index, self._pending.pop(index)))
        self.finalized = max(self.finalized, limit)
        return outputs

    def flush(self) -> list[SliceOutput]:
        """Decide every pending slice (end of input)."""
        if not self._pending:
            return []
        return self._finalize_ready(max(self._pending))

    def _finalize(self, index: int, by_source: dict[str, list[SliceBatch]]) -> SliceOutput:
        slice_end = (index + 1) * self._slice_s
        merged: dict[Key, SliceStats] = {}
        copied: set[Key] = set()  # keys whose merged stats are this slice's own, not a batch's partial
        events: list[dict] = []
        late = 0
        seen_events = set()
        for source in sorted(by_source):  # fixed merge order: same sums however batches arrived
            for batch in by_source[source]:
                late += batch.late_records
                for key, stats in batch.partials.items():
                    mine = merged.get(key)
                    if mine is None:  # taken as it is; copied once a second partial comes
                        merged[key] = stats
                        continue
                    if key not in copied:
                        copied.add(key)
                        mine = merged[key] = mine.copy()
                    mine.merge(stats)
                for event in batch.events:
                    ident = (event["type"], event["ts"], event.get("worker"), event.get("id"), event.get("bundle_id"))
                    # a card re-sent, or an event read through two telemetry partitions: once
                    if ident not in seen_events:
                        seen_events.add(ident)
                        events.append(event)
        out = SliceOutput(index, slice_end, late_records=late, windows=SliceWindows(slice_end))
        events.sort(key=lambda e: (e["ts"], e["type"], e.get("worker") or "", e.get("id") or ""))
        for event in events:
            self._on_event(event, out)
        for key in sorted(merged, key=lambda k: (k[0], k[1] or "", k[2] or "")):
            self._on_stats(key, merged[key], slice_end, out)
        if self.admission is not None:
            self._admit(self.admission.evaluate(slice_end), out)
        if self.policy.actions.restore_after_seconds is not None:
            self._restores(slice_end, out)
        return out

    def _on_event(self, event: dict, out: SliceOutput) -> None:
        kind = event["type"]
        if kind == "bundle":
            self._on_card(event, out)
        elif kind == "sighting":
            out.sightings.append(event)
        elif kind == "shadow":
            if self.admission is not None:
                self._admit(self.admission.shadow(event["bundle_id"], event["bucket"], event["check"],
                                                  event["match"], event["id"], event["ts"]), out)
            pair = (event["bundle_id"], event["bucket"])
            self.shadow_counts[pair + ("checks",)] += 1
            if not event["match"]:
                self.shadow_counts[pair + ("mismatches",)] += 1
                if event["check"] in self.policy.quality.strict_checks:
                    self.last_mismatch[pair] = max(event["ts"], self.last_mismatch.get(pair, event["ts"]))
                    checks = self.shadow_counts[pair + ("checks",)]
                    mismatches = self.shadow_counts[pair + ("mismatches",)]
                    finding = Finding("quality_regression", "shadow_strict_mismatch", event["ts"],
                                      "shadow_mismatches", float(mismatches), 0.0, 0.0, event["ts"], event["ts"],
                                      {"check": event["check"], "request_id": event["id"],
                                       "shadow_checks": checks})
                    sample = {"kind": "shadow", "v": 1, **{k: event[k] for k in
                              ("ts", "bundle_id", "id", "bucket", "check", "match")}}
                    self._act(finding, (event["bundle_id"], event["bucket"], None), None, out, [sample])

    def _on_card(self, event: dict, out: SliceOutput) -> None:
        """A worker's card, in event-time order: a new bundle, or the worker's change to another."""
        bundle, worker, card = event["bundle_id"], event["worker"], event["card"]
        previous = self.worker_cards.get(worker)
        self.worker_cards[worker] = (bundle, card)
        if previous is not None and previous[0] == bundle:
            return  # the same card again (a heartbeat)
        if self.owns is not None and not self.owns(bundle):
            return  # another partition's bundle: only the worker's latest card matters here
        if bundle not in self.cards:
            out.bundles.append(event)
        self.cards[bundle] = card
        if self.admission is not None:
            self.admission.seen(bundle, card, event["ts"])
        if previous is None:
            return
        changed = card_differences(BundleCard.model_validate(previous[1]), BundleCard.model_validate(card))
        if self.admission is not None and not self.admission.changed(bundle, previous[0], changed, card,
                                                                     event["ts"], worker):
            return  # the fleet rolling over to a card already being validated: nothing new is void
        finding = Finding("bundle_changed", "bundle_fingerprint", event["ts"], "card", math.nan, math.nan,
                          math.nan, event["ts"], event["ts"],
                          {"previous_bundle_id": previous[0], "worker": worker, "changed_fields": changed})
        self._act(finding, (bundle, None, None), None, out, [])

    def _on_stats(self, key: Key, stats: SliceStats, slice_end: float, out: SliceOutput) -> None:
        bundle, bucket, cohort = key
        if not (stats.steps or stats.rounds or stats.requests or stats.shadow_checks):
            # only running-request reports: noted, but no slice of the key's history
            monitor = self.monitors.get(key)
            if isinstance(monitor, KeyMonitor):
                monitor.stalls.update(stats, slice_end, None)
            return
        if self.admission is not None:
            speculating = bucket is None or self.flags.lookup(bundle, bucket, cohort).enabled
            self._admit(self.admission.observe(bundle, bucket, cohort, stats, slice_end, speculating), out)
        monitor = self.monitors.get(key)
        if monitor is None:
            if bucket is None:
                monitor = BundleMonitor(self.policy)
            else:
                pool = self.pools.setdefault(bundle, BaselinePool())
                monitor = KeyMonitor(self.policy, bucket, pool)
            self.monitors[key] = monitor
        if bucket is None:
            state = self.flags.state((bundle, None, None))
            stage = self.flags.admission(bundle)
            speculating = (state is None or state.enabled) and (
                stage is None or stage.stage in ("shadow", "canary", "admitted"))
        else:
            speculating = self.flags.lookup(bundle, bucket, cohort).enabled
        findings = monitor.update(stats, slice_end, speculating)
        out.windows.add(key, speculating, stats)  # read as rows or columns by whoever wants them
        for finding in findings:
            self._act(finding, key, monitor, out, [])

    def _restores(self, now: float, out: SliceOutput) -> None:
        """Restore the disabled scopes whose wait is over and whose evidence is clean."""
        seconds = self.policy.actions.restore_evidence_seconds
        for scope in self.fallback.restore_due(now):
            bundle, bucket, cohort = scope
            keys = [k for k in self.monitors if k[0] == bundle and k[1] is not None
                    and (bucket is None or k[1] == bucket) and (cohort is None or k[2] == cohort)]
            since = self.fallback.memory[scope].disabled_at
            traffic = traffic_evidence([self.monitors[k] for k in keys], since, seconds) if keys else None
            bundle_monitor = self.monitors.get((bundle, None, None))
            kv = bundle_monitor.recovery_evidence(since, seconds) if bundle_monitor is not None else None
            evidence = [found for found in (traffic, kv) if found is not None]
            mismatches = [ts for (b, bk), ts in self.last_mismatch.items() if b == bundle and bucket in (None, bk)]
            decision = self.fallback.restore(scope, now, evidence, max(mismatches, default=None))
            if decision is None:
                continue
            self.flags.apply(decision)
            # The gates of every key under the scope judge the speculative path afresh.
            for key in keys + ([(bundle, None, None)] if bucket is None and bundle_monitor is not None else []):
                self.monitors[key].rearm(floor=now)
            out.actions.append(self._record(decision, self._thresholds("restore"),
                                            self.monitors.get(scope), decision.evidence, []))

    def draft_length(self, bundle: str) -> int | None:
        """The draft length D on the bundle's card, None before its card arrived."""
        card = self.cards.get(bundle)
        return card["drafter"]["draft_length"] if card else None

    def _draft_length_curve(self, finding: Finding, scope: Key, monitor) -> DraftLengthCurve | None:
        """A key's predicted speedup per D: the gate's window of acceptance, the bundle's step costs."""
        card = self.cards.get(scope[0])
        bundle_monitor = self.monitors.get((scope[0], None, None))
        if finding.reason != "acceptance_drop" or not isinstance(monitor, KeyMonitor) or card is None \
                or bundle_monitor is None:
            return None
        window = [s for end, s in monitor.history if finding.window_start <= end <= finding.window_end]
        costs = [s for end, s in bundle_monitor.history if end > bundle_monitor.floor]
        return curve_from_slices(window, costs, card["drafter"]["mechanism"])

    def _act(self, finding: Finding, scope: Key, monitor, out: SliceOutput, extra_samples: list[dict]) -> None:
        candidates: dict[str, list[dict]] = {"mismatch": [
            {**s, "_rank": [sample_order(_sample_id(s)), _sample_id(s)]} for s in extra_samples]}
        if monitor is not None:
            # the slices of the finding's own window (at least the last few)
            history = list(monitor.history)
            recent = [stats for end, stats in history if end > finding.window_start] or \
                [stats for _, stats in history[-_SAMPLE_SLICES:]]
            for stats in recent:
                for kind, kept in stats.samples.items():
                    candidates.setdefault(kind, []).extend(kept)
        samples, reasons = _pick_samples(finding.reason, candidates)
        sample_ids = [_sample_id(s) for s in samples]
        decision = self.fallback.decide(finding, scope, self.draft_length(scope[0]), sample_ids,
                                        {"sample_reasons": reasons} if reasons else None,
                                        curve=self._draft_length_curve(finding, scope, monitor))
        if decision is None:
            return
        self.flags.apply(decision)
        if monitor is not None:
            monitor.rearm()
        out.actions.append(self._record(decision, self._thresholds(finding.reason), monitor,
                                        finding.evidence(), samples))
        if self.admission is not None:
            self._admit(self.admission.vetoed(decision), out)
        if decision.action == "disable_speculation":  # an invalidation voids the evidence instead
            self._last_looks(scope, monitor, decision.ts, out)

    def _last_looks(self, scope: Key, decided, at: float, out: SliceOutput) -> None:
        """A fallback ends the speculative evidence of every key under ``scope``: each of them,
        but the one it decided, takes its rate tests' last look (`KeyMonitor.last_look`), so an
        incident the fallback covers is still decided with its own reason."""
        bundle, bucket, cohort = scope
        covered = [(key, m) for key, m in sorted(self.monitors.items(), key=lambda i: _key_order(i[0]))
                   if isinstance(m, KeyMonitor) and m is not decided and key[0] == bundle
                   and bucket in (None, key[1]) and cohort in (None, key[2])]
        for key, monitor in covered:
            for finding in monitor.last_look(len(covered), at):
                self._act(finding, key, monitor, out, [])

    def _admit(self, decisions: list[Decision], out: SliceOutput) -> None:
        """Apply admission decisions and archive them with the judgement behind them."""
        for decision in decisions:
            self.flags.apply(decision)
            if decision.action == "promote":
                # a new share is a new normal: every monitor but the baseline cohort's learns afresh
                for key in [k for k in self.monitors if k[0] == decision.bundle_id
                            and k[2] != self.policy.baseline_cohort]:
                    del self.monitors[key]
            entry = self.admission.bundles[decision.bundle_id]
            change = next((c for c in reversed(entry.history) if c.decision_id == decision.id), None)
            thresholds = {"admission": self.policy.admission.model_dump(mode="json"),
                          "baseline_cohort": self.policy.baseline_cohort}
            finding = change.detail if change is not None else decision.evidence
            out.actions.append(self._record(decision, thresholds, None, finding, []))
        out.stage_changes.extend(self.admission.take_changes())

    def _record(self, decision: Decision, thresholds: dict, monitor, finding: dict,
                samples: list[dict]) -> ActionRecord:
        """A decision with the audit archived beside it."""
        return ActionRecord(decision, {
            "thresholds": thresholds,
            "baseline": monitor.baseline.to_dict() if monitor is not None else {},
            "window": monitor.evidence_window(_EVIDENCE_SLICES) if monitor is not None else [],
            "card": self.cards.get(decision.bundle_id),
            "finding": finding,
        }, samples)

    def _thresholds(self, reason: str) -> dict:
        section = facts_of(reason).section
        body = getattr(self.policy, section).model_dump(mode="json") if section else {}
        body["actions"] = self.policy.actions.model_dump(mode="json")
        return body


def _key_order(key: Key) -> tuple[str, str, str]:
    return key[0], key[1] or "", key[2] or ""


def _sample_id(sample: dict) -> str:
    if sample.get("kind") == "step":
        return f"{sample['worker']}:{sample['seq']}"
    return str(sample.get("id"))


def _take_unchosen(ranked, limit: int, chosen: dict[str, dict], reasons: dict[str, str]) -> None:
    """Adds up to ``limit`` of the ``(why, sample)`` pairs whose sample is not chosen yet."""
    taken = 0
    for why, sample in ranked:
        if taken == limit:
            break
        ident = sample["_rank"][-1]
        if ident not in chosen:
            chosen[ident] = sample
            reasons[ident] = why
            taken += 1


def _controls(candidates, why: str) -> list[tuple[str, dict]]:
    return [(why, sample) for sample in sorted(candidates, key=lambda s: s["_rank"])]


def _pick_samples(reason: str, candidates: dict[str, list[dict]]) -> tuple[list[dict], dict[str, str]]:
    """The samples that show a finding, then healthy controls; and why each was chosen."""
    facts = facts_of(reason)
    problems, control = facts.problem_samples, facts.control_samples
    chosen: dict[str, dict] = {}
    reasons: dict[str, str] = {}
    ranked = sorted(((index, sample) for index, kind in enumerate(problems) for sample in candidates.get(kind, ())),
                    key=lambda pair: (pair[0], pair[1]["_rank"]))
    _take_unchosen([(problems[index], sample) for index, sample in ranked], _PROBLEM_SAMPLES,
                   chosen, reasons)
    if facts.served_requests:
        served = _controls(candidates.get("control_request", ()), "served_request")
        _take_unchosen(served, _CONTROL_SAMPLES, chosen, reasons)
    controls = _controls(candidates.get(control, ()), "control")
    _take_unchosen(controls, _CONTROL_SAMPLES, chosen, reasons)
    return [sample_record(s) for s in chosen.values()], reasons
