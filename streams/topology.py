"""The processing topology, written once: stage 1 combines, stage 2 merges, detects and decides.

Stage 1 (one per source: a worker partition) folds validated records into per-(key,
slice) partial aggregates. Stage 2 (keyed by bundle/bucket/cohort) merges the partials of
every source once event time has passed a slice, runs the monitors and the fallback
policy. Both are pure and deterministic, so embedded runs and Faust runs decide alike.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from specwatch.actions.admission import AdmissionController
from specwatch.actions.flags import FlagStore
from specwatch.actions.policy import FallbackPolicy
from specwatch.detectors.baseline import BaselinePool
from specwatch.detectors.monitor import BundleMonitor, Finding, KeyMonitor, traffic_evidence
from specwatch.detectors.window import SliceStats
from specwatch.schemas import (
    BundleCard,
    BundleRecord,
    Decision,
    RequestRecord,
    ShadowRecord,
    StepRecord,
    card_differences,
)
from specwatch.schemas.policy import Policy

__all__ = [
    "Key",
    "SliceBatch",
    "Stage1",
    "Stage2",
    "ActionRecord",
    "SliceOutput",
    "key_to_str",
    "key_from_str",
]

Key = tuple[str, str | None, str | None]  # (bundle_id, bucket, cohort); None = whole bundle

# Evidence windows archived with a decision: this many slices before it.
_EVIDENCE_SLICES = 30
_MAX_SAMPLES_PER_DECISION = 12


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

    def fold_tallies(self) -> None:
        """Fold stage 1's per-pair round tallies into the partials (and the bundle totals)."""
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

    def split(self, route) -> dict[object, "SliceBatch"]:
        """Split by ``route(key)`` (e.g. a stage-2 partition); every route gets the events.

        Events are small and rare; sending them to every stage-2 partition lets each
        partition see bundle cards without a broadcast channel.
        """
        parts: dict[object, SliceBatch] = {}
        for key, stats in self.partials.items():
            target = route(key)
            if target not in parts:
                parts[target] = SliceBatch(self.source, self.slice_index, self.watermark)
            parts[target].partials[key] = stats
        for part in parts.values():
            part.events = self.events
        return parts


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
        self._max_ts = -math.inf
        self.watermark = -1  # highest closed slice index
        self._worker_cards: dict[str, tuple[str, BundleCard]] = {}
        self.late_records = 0
        self.records = 0

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

    def add(self, record) -> None:
        """Fold one validated contract-v1 record."""
        self.records += 1
        if record.ts > self._max_ts:
            self._max_ts = record.ts
        batch = self._slice(record.ts)
        if isinstance(record, StepRecord):
            self._add_step(batch, record)
        elif isinstance(record, RequestRecord):
            stats = self._stats(batch, (record.bundle_id, record.bucket, record.cohort))
            stats.add_request(record.ttft_ms, record.tpot_ms, record.e2e_ms, record.speculative,
                              record.finish_reason, record.ts)
            important = record.failed
            if important or len(stats.samples) < 4:
                stats.offer_sample(record.model_dump(mode="json"), important)
        elif isinstance(record, ShadowRecord):
            batch.events.append({"type": "shadow", "ts": record.ts, "bundle_id": record.bundle_id,
                                 "bucket": record.bucket, "id": record.id, "check": record.check,
                                 "match": record.match})
        elif isinstance(record, BundleRecord):
            self._add_bundle(batch, record)

    def _add_step(self, batch: SliceBatch, step: StepRecord) -> None:
        # Rounds are tallied as (drafted, accepted) pair counts and folded into the
        # per-position arrays once per slice: one dict increment per round instead of
        # a loop over draft positions, the hot path of the whole processor.
        bundle = step.bundle_id
        tallies = batch.round_tallies
        seen: dict[Key, SliceStats] = {}
        for entry in step.requests:
            key = (bundle, entry.bucket, entry.cohort)
            tally = tallies.get(key)
            if tally is None:
                tally = tallies[key] = {}
            pair = (entry.drafted, entry.accepted)
            tally[pair] = tally.get(pair, 0) + 1
            if key not in seen:
                seen[key] = self._stats(batch, key)
        trace = None
        for stats in seen.values():
            stats.add_step_time(step.draft_ms, step.verify_ms, step.kv_usage, step.ts)
            if not stats.samples:
                trace = trace or step.model_dump(mode="json")
                stats.offer_sample(trace)
        self._stats(batch, (bundle, None, None)).add_step_time(step.draft_ms, step.verify_ms, step.kv_usage,
                                                                step.ts)

    def _add_bundle(self, batch: SliceBatch, record: BundleRecord) -> None:
        previous = self._worker_cards.get(record.worker)
        self._worker_cards[record.worker] = (record.bundle_id, record.card)
        card = record.card.model_dump(mode="json")
        if previous is None or previous[0] != record.bundle_id:
            batch.events.append({"type": "bundle", "ts": record.ts, "worker": record.worker,
                                 "bundle_id": record.bundle_id, "card": card})
        if previous is not None and previous[0] != record.bundle_id:
            batch.events.append({"type": "bundle_change", "ts": record.ts, "worker": record.worker,
                                 "bundle_id": record.bundle_id, "previous_bundle_id": previous[0],
                                 "changed": card_differences(previous[1], record.card), "card": card})

    def close_ready(self, final: bool = False) -> list[SliceBatch]:
        """Slices whose end is more than the allowed lateness behind the newest record.

        Every call that advances the watermark returns at least one batch, so stage 2
        learns about progress even from a source whose latest slices were empty.
        """
        if final:
            limit = max(self._open, default=self.watermark)
        else:
            limit = int((self._max_ts - self._lateness) // self._slice_s) - 1
        if limit <= self.watermark:
            return []
        ready = sorted(i for i in self._open if i <= limit)
        self.watermark = limit
        out = []
        for index in ready:
            batch = self._open.pop(index)
            batch.watermark = limit
            batch.fold_tallies()
            out.append(batch)
        if not out:
            out.append(SliceBatch(self.source, limit, limit))
        return out


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
    late_records: int = 0
    stage_changes: list = field(default_factory=list)  # admission `StageChange`s, for the bundle registry


class Stage2:
    """Merges partials per slice once every live source has passed it; detects and decides.

    Parameters
    ----------
    policy
        Gates, windows and actions.
    flags
        The speculative-path state it keeps current (and reads to avoid repeating itself).
    """

    def __init__(self, policy: Policy, flags: FlagStore | None = None) -> None:
        self.policy = policy
        self.flags = flags if flags is not None else FlagStore()
        self.fallback = FallbackPolicy(policy, self.flags)
        # Admission is a policy switch: off, it does not exist, and no decision changes.
        self.admission = AdmissionController(policy, self.flags) if policy.admission.enforce else None
        self._slice_s = policy.windows.slice_seconds
        self._idle_slices = max(1, int(policy.windows.source_idle_seconds / self._slice_s))
        self._sources: dict[str, int] = {}
        self._pending: dict[int, dict[str, list[SliceBatch]]] = defaultdict(dict)
        self.finalized = -1
        self.monitors: dict[Key, KeyMonitor | BundleMonitor] = {}
        self.pools: dict[str, BaselinePool] = {}  # per bundle: what quiet keys borrow baselines from
        self.cards: dict[str, dict] = {}
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
                    if ident not in seen_events:  # events reach every partition; count each once
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
            if event["bundle_id"] not in self.cards:
                out.bundles.append(event)
            self.cards[event["bundle_id"]] = event["card"]
            if self.admission is not None:
                self.admission.seen(event["bundle_id"], event["card"], event["ts"])
        elif kind == "bundle_change":
            self.cards[event["bundle_id"]] = event["card"]
            if self.admission is not None and not self.admission.changed(
                    event["bundle_id"], event["previous_bundle_id"], event["changed"], event["card"], event["ts"],
                    event["worker"]):
                return  # the fleet rolling over to a card already being validated: nothing new is void
            finding = Finding("bundle_changed", "bundle_fingerprint", event["ts"], "card", math.nan, math.nan,
                              math.nan, event["ts"], event["ts"],
                              {"previous_bundle_id": event["previous_bundle_id"], "worker": event["worker"],
                               "changed_fields": event["changed"]})
            self._act(finding, (event["bundle_id"], None, None), None, out, [])
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

    def _on_stats(self, key: Key, stats: SliceStats, slice_end: float, out: SliceOutput) -> None:
        bundle, bucket, cohort = key
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
        row.update(ts=slice_end, bundle_id=bundle, bucket=bucket, cohort=cohort, speculation_on=speculating)
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

    def _act(self, finding: Finding, scope: Key, monitor, out: SliceOutput, extra_samples: list[dict]) -> None:
        samples = list(extra_samples)
        if monitor is not None:
            for _, stats in list(monitor.history)[-10:]:
                samples.extend(stats.samples)
        samples = [{k: v for k, v in s.items() if k != "_important"} for s in samples]
        samples = _pick_samples(samples)
        sample_ids = [_sample_id(s) for s in samples]
        decision = self.fallback.decide(finding, scope, self._draft_length(scope[0]), sample_ids)
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


def _pick_samples(samples: list[dict]) -> list[dict]:
    """Failures first, then the rest in time order; unique ids; bounded."""
    unique: dict[str, dict] = {}
    for s in sorted(samples, key=lambda s: (s.get("finish_reason") not in ("error", "timeout"), s.get("ts", 0))):
        unique.setdefault(_sample_id(s), s)
        if len(unique) >= _MAX_SAMPLES_PER_DECISION:
            break
    return list(unique.values())
