"""The processing topology, written once: stage 1 combines, stage 2 merges, detects and decides.

Stage 1 (one per source: a worker partition) folds validated records into per-(key,
slice) partial aggregates. Stage 2 (one in a process, or one per partition of bundles on
Kafka: see `route_batches`) merges the partials of every source once event time has passed
a slice, runs the monitors and the fallback policy. Both are pure and deterministic, so
embedded runs and Faust runs decide alike.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Callable

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
from specwatch.schemas.fastdecode import StepColumns
from specwatch.schemas.outputs import ActionRecord, SliceOutput
from specwatch.schemas.policy import Policy, WindowPolicy

from .intake import DuplicateFilter, EventClock, duplicate
from .running import RunningRequests, request_ids

__all__ = [
    "Key",
    "SliceBatch",
    "Stage1",
    "Stage2",
    "ActionRecord",
    "SliceOutput",
    "key_to_str",
    "key_from_str",
    "idle_slices",
]

Key = tuple[str, str | None, str | None]  # (bundle_id, bucket, cohort); None = whole bundle

# Evidence windows archived with a decision: this many slices before it.
_EVIDENCE_SLICES = 30
# Samples archived with a decision: the records that show the problem, then healthy
# controls of the same scope, from the slices of the finding's window (or the last few).
_PROBLEM_SAMPLES = 9
_CONTROL_SAMPLES = 3
_SAMPLE_SLICES = 10
_SAMPLES_FOR = {
    "error_rate": (("error", "timeout"), "control_request"),
    "latency_slo": (("slowest",), "control_request"),
    "acceptance_drop": (("lowest_acceptance",), "control_step"),
    "no_speedup": (("lowest_acceptance",), "control_step"),
    "quality_regression": (("mismatch",), "control_request"),
}
_SAMPLES_FOR_OTHERS = (("error", "timeout", "lowest_acceptance", "slowest"), "control_step")
# Acceptance is measured on steps, but a request is what can be re-run (`specwatch
# reproduce`): these findings also keep a few finished requests of the scope and window,
# each of which drafted on the path under suspicion.
_SERVED_REQUESTS_FOR = frozenset({"acceptance_drop", "no_speedup"})
# How long (event time) after its slice closed a record is still recognised as a duplicate;
# a later copy is folded forward as a late record.
_DUPLICATE_HORIZON_SECONDS = 60.0


def key_to_str(key: Key) -> str:
    """Wire form of a key.

    >>> key_to_str(("b-1", "coding", "main")), key_to_str(("b-1", None, None))
    ('b-1/coding/main', 'b-1/*/*')
    >>> key_from_str("b-1/*/*")
    ('b-1', None, None)
    """
    bundle, bucket, cohort = key
    return f"{bundle}/{bucket or '*'}/{cohort or '*'}"


def key_from_str(text: str) -> Key:
    bundle, bucket, cohort = text.rsplit("/", 2)
    return bundle, (None if bucket == "*" else bucket), (None if cohort == "*" else cohort)


@dataclass
class SliceBatch:
    """What one source contributes to one slice: partial aggregates and discrete events.

    ``watermark`` is the highest slice index the source has closed when it sent this.
    """

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

    def __setstate__(self, state: dict) -> None:
        # A stage-1 checkpoint written before sightings existed still restores.
        self.__dict__.update(state)
        self.__dict__.setdefault("sightings", {})

    def sighted(self, bundle_id: str, worker: str, ts: float) -> None:
        """A record of ``worker`` running ``bundle_id`` at ``ts`` (a step or a bundle card)."""
        span = self.sightings.get((bundle_id, worker))
        if span is None:
            self.sightings[(bundle_id, worker)] = [ts, ts]
        elif ts < span[0]:
            span[0] = ts
        elif ts > span[1]:
            span[1] = ts

    def fold_sightings(self) -> None:
        """The slice's sightings as events: one per (bundle, worker), however many records it saw."""
        for (bundle_id, worker), (first, last) in sorted(self.sightings.items()):
            self.events.append({"type": "sighting", "ts": last, "first_seen": first, "worker": worker,
                                "bundle_id": bundle_id})
        self.sightings = {}
    # per key: [(rank, step) of its lowest-acceptance step, (rank, step) of its step control] so far
    step_candidates: dict[Key, list[tuple]] = field(default_factory=dict, repr=False)

    def fold_tallies(self) -> None:
        """Fold stage 1's per-pair round tallies into the partials (and the bundle totals),
        and keep the samples among the slice's steps."""
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

    def to_dict(self) -> dict:
        return {
            "source": self.source,
            "slice_index": self.slice_index,
            "watermark": self.watermark,
            "partials": {key_to_str(k): v.to_dict() for k, v in self.partials.items()},
            "events": self.events,
            "late_records": self.late_records,
        }

    @classmethod
    def from_dict(cls, data: dict) -> "SliceBatch":
        return cls(
            source=data["source"],
            slice_index=int(data["slice_index"]),
            watermark=int(data["watermark"]),
            partials={key_from_str(k): SliceStats.from_dict(v) for k, v in data.get("partials", {}).items()},
            events=list(data.get("events", [])),
            late_records=int(data.get("late_records", 0)),
        )


class Stage1:
    """Folds one source's records into per-(key, slice) partials; closes slices by event time.

    Parameters
    ----------
    policy
        Slice length and allowed lateness.
    source
        Name of this source (a telemetry partition); stage 2 waits for every live source.
    """

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

    def __setstate__(self, state: dict) -> None:
        # A stage-1 checkpoint written before running requests were tracked still restores.
        self.__dict__.update(state)
        self.__dict__.setdefault("running", RunningRequests())

    def _admit(self, kind: str, ts: float, identity: tuple | None) -> Rejection | None:
        """Whether a record may be folded: within the clock-skew bound, and not folded before.

        ``identity`` is (worker or bundle, seq or id); None for records that are never
        counted twice whatever their copies (bundle cards).
        """
        rejection = self.clock.admit(ts)
        if rejection is not None:
            return rejection
        if identity is not None and not self._folded.first(int(ts // self._slice_s), identity):
            return duplicate(kind, identity)
        self.records += 1
        return None

    def _slice(self, ts: float) -> SliceBatch:
        index = int(ts // self._slice_s)
        if index <= self.watermark:
            # late: folded into the oldest open slice so nothing is lost, and counted
            self.late_records += 1
            index = self.watermark + 1
            batch = self._open.get(index)
            if batch is None:
                batch = self._open[index] = SliceBatch(self.source, index, self.watermark)
            batch.late_records += 1
            return batch
        batch = self._open.get(index)
        if batch is None:
            batch = self._open[index] = SliceBatch(self.source, index, self.watermark)
        return batch

    @staticmethod
    def _stats(batch: SliceBatch, key: Key) -> SliceStats:
        stats = batch.partials.get(key)
        if stats is None:
            stats = batch.partials[key] = SliceStats()
        return stats

    def add(self, record: TelemetryRecord | StepColumns) -> Rejection | None:
        """Fold one validated contract-v1 record, or say why it is not folded.

        A step may come as the reference `StepRecord` or as the fast decoders' `StepColumns`:
        both fold through the same tallies and give the same partials.
        """
        kind = record.kind
        if kind == "step":
            return self._add_step(record)
        if kind == "request":
            identity = (record.worker, record.id)
        elif kind == "shadow":
            identity = (record.bundle_id, record.id)
        else:
            identity = None
        ts = record.ts
        rejection = self._admit(kind, ts, identity)
        if rejection is not None:
            return rejection
        batch = self._slice(ts)
        if kind == "request":
            key = (record.bundle_id, record.bucket, record.cohort)
            stats = self._stats(batch, key)
            stats.add_request(record.ttft_ms, record.tpot_ms, record.e2e_ms, record.speculative,
                              record.finish_reason, ts)
            _offer_request(stats, record)
            self.running.ended(record.worker, record.id, record.e2e_ms, key, batch.partials)
        elif kind == "shadow":
            batch.events.append({"type": "shadow", "ts": ts, "bundle_id": record.bundle_id,
                                 "bucket": record.bucket, "id": record.id, "check": record.check,
                                 "match": record.match})
        elif kind == "bundle":
            self._add_bundle(batch, record)
        return None

    def _add_step(self, step: StepRecord | StepColumns) -> Rejection | None:
        ts = step.ts
        rejection = self._admit("step", ts, (step.worker, step.seq))
        if rejection is not None:
            return rejection
        batch = self._slice(ts)
        self.running.saw(step.worker, ts, step.ids if type(step) is StepColumns else request_ids(step), step)
        # Rounds are tallied as (drafted, accepted) pair counts and folded into the
        # per-position arrays once per slice: one dict increment per distinct round instead
        # of a loop over draft positions, the hot path of the whole processor. The fast
        # decoders hand the step over already counted by (bucket, cohort, drafted, accepted).
        rounds = step.rounds if type(step) is StepColumns else \
            Counter([(e.bucket, e.cohort, e.drafted, e.accepted) for e in step.requests])
        bundle = step.bundle_id
        batch.sighted(bundle, step.worker, ts)
        tallies = batch.round_tallies
        tokens: dict[Key, list[int]] = {}
        # first-seen order: keys (and their partials) appear in the order the step lists them
        for (bucket, cohort, drafted, accepted), n in rounds.items():
            key = (bundle, bucket, cohort)
            tally = tallies.get(key)
            if tally is None:
                tally = tallies[key] = {}
            pair = (drafted, accepted)
            tally[pair] = tally.get(pair, 0) + n
            drafted_accepted = tokens.get(key)
            if drafted_accepted is None:
                tokens[key] = [drafted * n, accepted * n]
            else:
                drafted_accepted[0] += drafted * n
                drafted_accepted[1] += accepted * n
        # The step's timings go to each key it served and to its bundle, and the step is a
        # sample candidate of each key. Only the best step of each kind per key is held until
        # the slice closes: holding every step (and what it was decoded from) would cost more
        # than the fold itself.
        draft_ms, verify_ms, kv_usage = step.draft_ms, step.verify_ms, step.kv_usage
        candidates = batch.step_candidates
        sample_id = f"{step.worker}:{step.seq}"
        order = sample_order(sample_id)
        for key, (drafted, accepted) in tokens.items():
            self._stats(batch, key).add_step_time(draft_ms, verify_ms, kv_usage, ts)
            held = candidates.get(key)
            if held is None:
                candidates[key] = [((accepted / drafted, order, sample_id), step) if drafted else None,
                                   ((order, sample_id), step)]
                continue
            if drafted:
                rank = (accepted / drafted, order, sample_id)
                if held[0] is None or rank < held[0][0]:
                    held[0] = (rank, step)
            if (order, sample_id) < held[1][0]:
                held[1] = ((order, sample_id), step)
        self._stats(batch, (bundle, None, None)).add_step_time(draft_ms, verify_ms, kv_usage, ts)
        return None

    def _add_bundle(self, batch: SliceBatch, record: BundleRecord) -> None:
        batch.sighted(record.bundle_id, record.worker, record.ts)
        # Every card goes on: whether it changed is a question about the worker's previous
        # card, which may have reached another source. Stage 2 answers it in event-time order.
        batch.events.append({"type": "bundle", "ts": record.ts, "worker": record.worker,
                             "bundle_id": record.bundle_id, "card": record.card.model_dump(mode="json")})

    def close_ready(self, final: bool = False) -> list[SliceBatch]:
        """Slices whose end is more than the allowed lateness behind the newest record.

        Every call that advances the watermark returns at least one batch, so stage 2
        learns about progress even from a source whose latest slices were empty.
        """
        if final:
            limit = max(self._open, default=self.watermark)
        elif self.clock.now == -math.inf:
            return []  # too few records yet to tell this source's event time
        else:
            limit = int((self.clock.now - self._lateness) // self._slice_s) - 1
        if limit <= self.watermark:
            return []
        ready = sorted(i for i in self._open if i <= limit)
        self.watermark = limit
        self._folded.expire(limit)
        out = []
        for index in ready:
            batch = self._open.pop(index)
            # A batch vouches only for the slices sent so far: the last one of this close for
            # every slice up to the limit, an earlier one for its own. Stage 2 may finalize a
            # slice as soon as every source vouches for it, so a batch that vouched for the
            # close's limit would let a later batch of the same close arrive too late.
            batch.watermark = limit if index == ready[-1] else index
            batch.fold_tallies()
            batch.fold_sightings()
            out.append(batch)
        if not out:
            out.append(SliceBatch(self.source, limit, limit))
        self.running.close((limit + 1) * self._slice_s, out[-1].partials)
        return out


def _keep_step_samples(partials: dict[Key, SliceStats], candidates: dict[Key, list[tuple]]) -> None:
    """Each key's lowest-acceptance step and step control among a slice's steps, ranked by content."""
    for key, (lowest, control) in candidates.items():
        stats = partials[key]
        if lowest is not None:
            stats.keep_samples("lowest_acceptance", [lowest], _step_record)
        stats.keep_samples("control_step", [control], _step_record)


def _step_record(step) -> dict:
    return (step if isinstance(step, StepRecord) else step.record()).model_dump(mode="json")


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


def idle_slices(windows: WindowPolicy) -> int:
    """How many slices a source may lag the newest before stage 2 stops waiting for it (at least one)."""
    return max(1, int(windows.source_idle_seconds / windows.slice_seconds))


class Stage2:
    """Merges partials per slice once every live source has passed it; detects and decides.

    Parameters
    ----------
    policy
        Gates, windows and actions.
    flags
        The speculative-path state it keeps current (and reads to avoid repeating itself).
    owns
        Whether a bundle is decided here (a stage-2 partition on Kafka: every key of a
        bundle and its events are routed to one partition, cards to all, see
        `route_batches`); None: every bundle.
    """

    def __init__(self, policy: Policy, flags: FlagStore | None = None,
                 owns: Callable[[str], bool] | None = None) -> None:
        self.policy = policy
        self.owns = owns
        self.flags = flags if flags is not None else FlagStore()
        self.fallback = FallbackPolicy(policy, self.flags)
        # Admission is a policy switch: off, it does not exist, and no decision changes.
        self.admission = AdmissionController(policy, self.flags) if policy.admission.enforce else None
        self._slice_s = policy.windows.slice_seconds
        self._idle_slices = idle_slices(policy.windows)
        self._sources: dict[str, int] = {}
        self._pending: dict[int, dict[str, list[SliceBatch]]] = defaultdict(dict)
        self.finalized = -1
        self.monitors: dict[Key, KeyMonitor | BundleMonitor] = {}
        self.pools: dict[str, BaselinePool] = {}  # per bundle: what quiet keys borrow baselines from
        self.cards: dict[str, dict] = {}
        self.worker_cards: dict[str, tuple[str, dict]] = {}  # worker -> its latest (bundle_id, card)
        self.shadow_counts: Counter = Counter()
        self.last_mismatch: dict[tuple[str, str], float] = {}  # (bundle, bucket) -> latest strict mismatch ts
        self.late_batches = 0

    # -- progress across sources ---------------------------------------------------------
    def add(self, batch: SliceBatch) -> list[SliceOutput]:
        if batch.slice_index <= self.finalized and (batch.partials or batch.events):
            # a source so far behind that its slice was already decided: fold forward
            self.late_batches += 1
            batch.slice_index = self.finalized + 1
        if batch.partials or batch.events or batch.late_records:
            self._pending[batch.slice_index].setdefault(batch.source, []).append(batch)
        self._sources[batch.source] = max(self._sources.get(batch.source, -1), batch.watermark)
        return self._finalize_ready()

    def _final_limit(self) -> int:
        newest = max(self._sources.values())
        live = [w for w in self._sources.values() if w >= newest - self._idle_slices]
        return min(live)

    def _finalize_ready(self, limit: int | None = None) -> list[SliceOutput]:
        if not self._sources:
            return []
        limit = self._final_limit() if limit is None else limit
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

    # -- one final slice -------------------------------------------------------------------
    def _finalize(self, index: int, by_source: dict[str, list[SliceBatch]]) -> SliceOutput:
        slice_end = (index + 1) * self._slice_s
        merged: dict[Key, SliceStats] = {}
        events: list[dict] = []
        late = 0
        seen_events = set()
        for source in sorted(by_source):  # fixed merge order: same sums however batches arrived
            for batch in by_source[source]:
                late += batch.late_records
                for key, stats in batch.partials.items():
                    if key in merged:
                        merged[key].merge(stats)
                    else:
                        merged[key] = stats.copy()
                for event in batch.events:
                    ident = (event["type"], event["ts"], event.get("worker"), event.get("id"), event.get("bundle_id"))
                    # a card re-sent (cards are never deduplicated by stage 1), or an event read
                    # through two telemetry partitions, is taken once
                    if ident not in seen_events:
                        seen_events.add(ident)
                        events.append(event)
        out = SliceOutput(index, slice_end, late_records=late)
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
        if not (stats.steps or stats.requests or stats.shadow_checks):
            # Only running-request reports (a source that saw none of the key's records in this
            # slice): noted, but no slice of the key's history, which must not depend on how
            # records were spread over sources.
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
                pool = self.pools.get(bundle)
                if pool is None:
                    pool = self.pools[bundle] = BaselinePool()
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
        row = stats.summary()
        row.update(ts=slice_end, bundle_id=bundle, bucket=bucket, cohort=cohort, speculation_on=speculating,
                   steps=stats.steps, plain_entries=stats.plain_entries,
                   accepted_at_least=list(stats.accepted_at_least), drafted_at_least=list(stats.drafted_at_least))
        out.window_rows.append(row)
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
            evidence = []
            traffic = traffic_evidence([self.monitors[k] for k in keys], since, seconds) if keys else None
            if traffic is not None:
                evidence.append(traffic)
            bundle_monitor = self.monitors.get((bundle, None, None))
            kv = bundle_monitor.recovery_evidence(since, seconds) if bundle_monitor is not None else None
            if kv is not None:
                evidence.append(kv)
            mismatches = [ts for (b, bk), ts in self.last_mismatch.items() if b == bundle and bucket in (None, bk)]
            decision = self.fallback.restore(scope, now, evidence, max(mismatches, default=None))
            if decision is None:
                continue
            self.flags.apply(decision)
            # The gates of every key under the scope judge the speculative path afresh.
            for key in keys + ([(bundle, None, None)] if bucket is None and bundle_monitor is not None else []):
                self.monitors[key].rearm(floor=now)
            single = self.monitors.get(scope)
            audit = {
                "thresholds": self._thresholds("restore"),
                "baseline": single.baseline.to_dict() if single is not None else {},
                "window": single.evidence_window(_EVIDENCE_SLICES) if single is not None else [],
                "card": self.cards.get(bundle),
                "finding": decision.evidence,
            }
            out.actions.append(ActionRecord(decision, audit, []))

    def _draft_length(self, bundle: str) -> int | None:
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
        decision = self.fallback.decide(finding, scope, self._draft_length(scope[0]), sample_ids,
                                        {"sample_reasons": reasons} if reasons else None,
                                        curve=self._draft_length_curve(finding, scope, monitor))
        if decision is None:
            return
        self.flags.apply(decision)
        if monitor is not None:
            monitor.rearm()
        audit = {
            "thresholds": self._thresholds(finding.reason),
            "baseline": monitor.baseline.to_dict() if monitor is not None else {},
            "window": monitor.evidence_window(_EVIDENCE_SLICES) if monitor is not None else [],
            "card": self.cards.get(scope[0]),
            "finding": finding.evidence(),
        }
        out.actions.append(ActionRecord(decision, audit, samples))
        if self.admission is not None:
            self._admit(self.admission.vetoed(decision), out)

    def _admit(self, decisions: list[Decision], out: SliceOutput) -> None:
        """Apply admission decisions and archive them with the judgement behind them."""
        for decision in decisions:
            self.flags.apply(decision)
            if decision.action == "promote":
                # A new share is a new normal: step cost follows how much of a batch drafts, and
                # the cohorts that start drafting have no speculative baseline yet. Their
                # monitors learn afresh; the baseline cohort's stay.
                for key in [k for k in self.monitors if k[0] == decision.bundle_id
                            and k[2] != self.policy.baseline_cohort]:
                    del self.monitors[key]
            entry = self.admission.bundles[decision.bundle_id]
            change = next((c for c in reversed(entry.history) if c.decision_id == decision.id), None)
            audit = {
                "thresholds": {"admission": self.policy.admission.model_dump(mode="json"),
                               "baseline_cohort": self.policy.baseline_cohort},
                "baseline": {},
                "window": [],
                "card": self.cards.get(decision.bundle_id),
                "finding": change.detail if change is not None else decision.evidence,
            }
            out.actions.append(ActionRecord(decision, audit, []))
        out.stage_changes.extend(self.admission.take_changes())

    def _thresholds(self, reason: str) -> dict:
        section = {
            "acceptance_drop": "acceptance", "no_speedup": "speedup", "draft_overhead": "draft_overhead",
            "latency_slo": "latency", "kv_pressure": "kv", "error_rate": "errors",
            "quality_regression": "quality",
        }.get(reason)
        body = getattr(self.policy, section).model_dump(mode="json") if section else {}
        body["actions"] = self.policy.actions.model_dump(mode="json")
        return body


def _sample_id(sample: dict) -> str:
    if sample.get("kind") == "step":
        return f"{sample['worker']}:{sample['seq']}"
    return str(sample.get("id"))


def _take_unchosen(candidates, why: str, chosen: dict[str, dict], reasons: dict[str, str]) -> None:
    """Adds up to `_CONTROL_SAMPLES` of ``candidates`` not chosen yet, by rank, as ``why``."""
    taken = 0
    for sample in sorted(candidates, key=lambda s: s["_rank"]):
        if taken == _CONTROL_SAMPLES:
            break
        ident = sample["_rank"][-1]
        if ident not in chosen:
            chosen[ident] = sample
            reasons[ident] = why
            taken += 1


def _pick_samples(reason: str, candidates: dict[str, list[dict]]) -> tuple[list[dict], dict[str, str]]:
    """The samples that show a finding, then healthy controls; and why each was chosen.

    Chosen by kind, then rank (severity, then `sample_order`), each id once: a total order
    on record content, so the same records give the same samples however they arrived.
    """
    problems, control = _SAMPLES_FOR.get(reason, _SAMPLES_FOR_OTHERS)
    chosen: dict[str, dict] = {}
    reasons: dict[str, str] = {}
    ranked = sorted(((index, sample) for index, kind in enumerate(problems) for sample in candidates.get(kind, ())),
                    key=lambda pair: (pair[0], pair[1]["_rank"]))
    for index, sample in ranked:
        if len(chosen) == _PROBLEM_SAMPLES:
            break
        ident = sample["_rank"][-1]
        if ident not in chosen:
            chosen[ident] = sample
            reasons[ident] = problems[index]
    if reason in _SERVED_REQUESTS_FOR:
        _take_unchosen(candidates.get("control_request", ()), "served_request", chosen, reasons)
    _take_unchosen(candidates.get(control, ()), "control", chosen, reasons)
    return [sample_record(s) for s in chosen.values()], reasons
