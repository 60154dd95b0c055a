"""The decider: each final slice of stage 2, its scopes' stats and its events (cards, shadow checks,
sightings), in; the decisions on it out, with the evidence, samples and audit archived beside each.

It holds what judges a slice: the monitors of every scope, the fallback policy, admission, and
the restores of disabled scopes.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Callable

from specwatch.detectors.baseline import BaselinePool
from specwatch.detectors.draft_length import DraftLengthCurve, curve_from_slices
from specwatch.detectors.monitor import BundleMonitor, Finding, KeyMonitor
from specwatch.detectors.recovery import traffic_evidence
from specwatch.schemas.slice_stats import SliceStats, sample_order
from specwatch.schemas import BundleCard, Decision, card_differences
from specwatch.schemas.outputs import ActionRecord, SliceOutput, SliceWindows
from specwatch.schemas.policy import Policy
from specwatch.schemas.reasons import facts_of
from specwatch.schemas.scope import Scope as Key, scope_text

from .admission import AdmissionController
from .flags import FlagStore
from .fallback import FallbackPolicy
from .samples import pick_samples, sample_id

__all__ = ["SliceDecider"]

# Evidence windows archived with a decision: this many slices before it.
_EVIDENCE_SLICES = 30
# Samples come from the slices of the finding's window, or the last few.
_SAMPLE_SLICES = 10


class SliceDecider:
    """Decides on final slices, one at a time in slice order (`decide`); ``owns`` says which
    bundles are decided here (None: all of them)."""

    def __init__(self, policy: Policy, flags: FlagStore | None = None,
                 owns: Callable[[str], bool] | None = None, qualifications: dict | None = None) -> None:
        self.policy = policy
        self.owns = owns
        self.flags = flags if flags is not None else FlagStore()
        self.fallback = FallbackPolicy(policy, self.flags)
        # Admission is a policy switch: off, it does not exist, and no decision changes.
        self.admission = AdmissionController(policy, qualifications) if policy.admission.enforce else None
        self.monitors: dict[Key, KeyMonitor | BundleMonitor] = {}
        self.pools: dict[str, BaselinePool] = {}  # per bundle: what quiet keys borrow baselines from
        self.cards: dict[str, dict] = {}
        self.worker_cards: dict[str, tuple[str, dict]] = {}  # worker -> its latest (bundle_id, card)
        self.shadow_counts: Counter = Counter()
        self.last_mismatch: dict[tuple[str, str], float] = {}  # (bundle, bucket) -> latest strict mismatch ts

    def to_state(self) -> dict:
        """Monitors, baselines, cards, flags, fallback and admission as plain data (the policy and
        ``owns`` are the owner's)."""
        return {"pools": {bundle: pool.to_state() for bundle, pool in self.pools.items()},
                "monitors": [[list(key), monitor.to_state()] for key, monitor in self.monitors.items()],
                "cards": self.cards, "worker_cards": {w: list(pair) for w, pair in self.worker_cards.items()},
                "shadow_counts": [[list(key), n] for key, n in self.shadow_counts.items()],
                "last_mismatch": [[bundle, bucket, ts] for (bundle, bucket), ts in self.last_mismatch.items()],
                "flags": self.flags.to_state(), "fallback": self.fallback.to_state(),
                "admission": self.admission.to_state() if self.admission is not None else None}

    def load_state(self, state: dict) -> None:
        """Take up where `to_state` left (on a decider made with the same policy)."""
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

    def decide(self, index: int, slice_end: float, merged: dict[Key, SliceStats], events: list[dict],
               late_records: int) -> SliceOutput:
        """The decisions on final slice ``index`` (ending at ``slice_end``): its ``events`` in
        event-time order first, then the stats of each scope, then admission and restores."""
        out = SliceOutput(index, slice_end, late_records=late_records, windows=SliceWindows(slice_end))
        for event in events:
            self._on_event(event, out)
        for key in sorted(merged, key=_key_order):
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
            {**s, "_rank": [sample_order(sample_id(s)), sample_id(s)]} for s in extra_samples]}
        if monitor is not None:
            # the slices of the finding's own window (at least the last few)
            history = list(monitor.history)
            recent = [stats for end, stats in history if end > finding.window_start] or \
                [stats for _, stats in history[-_SAMPLE_SLICES:]]
            for stats in recent:
                for kind, kept in stats.samples.items():
                    candidates.setdefault(kind, []).extend(kept)
            if facts_of(finding.reason).served_requests and not candidates.get("control_request"):
                # A window shorter than a request (slow steps, long outputs) holds only steps, and a
                # step is not what `specwatch reproduce` re-runs: take the scope's latest finished
                # requests from the slices before it instead.
                for _, stats in history[-_SAMPLE_SLICES:]:
                    candidates.setdefault("control_request", []).extend(stats.samples.get("control_request", ()))
        samples, reasons = pick_samples(finding.reason, candidates)
        sample_ids = [sample_id(s) for s in samples]
        decision = self.fallback.decide(finding, scope, self.draft_length(scope[0]), sample_ids,
                                        {"sample_reasons": reasons} if reasons else None,
                                        curve=self._draft_length_curve(finding, scope, monitor))
        if decision is None:
            return
        self.flags.apply(decision)
        if monitor is not None:
            monitor.rearm()
        record = self._record(decision, self._thresholds(finding.reason), monitor, finding.evidence(), samples)
        out.actions.append(record)
        if self.admission is not None:
            self._admit(self.admission.vetoed(decision), out)
        if decision.action == "disable_speculation":  # an invalidation voids the evidence instead
            self._last_looks(scope, monitor, decision.ts, out, record)

    def _last_looks(self, scope: Key, decided, at: float, out: SliceOutput, fallback: ActionRecord) -> None:
        """A fallback ends the speculative evidence of every key under ``scope``: each of them,
        but the one it decided, takes its rate tests' last look (`KeyMonitor.last_look`), so an
        incident the fallback covers is still decided with its own reason. What a look left
        undecided is archived beside the fallback (its audit's ``covered``): the keys whose rate
        tests held at least half the evidence the look needed when it switched them off (on
        healthy traffic a test passes s nats with probability at most e**-s, so noise rarely
        does), so a postmortem sees another cause the fallback may hide."""
        bundle, bucket, cohort = scope
        covered = [(key, m) for key, m in sorted(self.monitors.items(), key=lambda i: _key_order(i[0]))
                   if isinstance(m, KeyMonitor) and m is not decided and key[0] == bundle
                   and bucket in (None, key[1]) and cohort in (None, key[2])]
        held = []
        for key, monitor in covered:
            before = len(out.actions)
            for finding in monitor.last_look(len(covered), at):
                self._act(finding, key, monitor, out, [])
            own = self.flags.state(key)
            if len(out.actions) > before or (own is not None and not own.enabled):
                continue  # decided at its look, or off for its own cause before: a decision of its own
            for gate, evidence in monitor.rate_evidence(len(covered)).items():
                if evidence["evidence_nats"] >= evidence["look_threshold_nats"] / 2:
                    held.append({"scope": scope_text(key), "gate": gate, **evidence})
        if held:
            fallback.audit["covered"] = held

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

