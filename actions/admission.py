"""Admission: a bundle earns speculation on evidence, stage by stage (docs/ADMISSION.md), and
loses it on any change. Pure: events in, decisions out."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Mapping

from specwatch.detectors.canary import CanaryJudge, Judgement, combine
from specwatch.schemas.slice_stats import SliceStats
from specwatch.schemas import Decision
from specwatch.schemas.policy import AdmissionPolicy, Policy

__all__ = ["AdmissionController", "BundleAdmission", "StageChange", "MANUAL_MOVES", "manual_stage",
           "manual_stage_decision", "next_stage", "stage_placement"]

_JUDGE = "canary_judge"
_MANUAL = "manual"
_REGISTRY = "admission_registry"
_VETO = "fallback_veto"
# Judging stages: the speculative path runs on one cohort, compared with the baseline cohort.
_JUDGED = ("shadow", "canary")


def next_stage(stage: str | None, share: float | None, schedule: list[float]) -> tuple[str, float]:
    """The stage (and cohort share) one step after ``stage`` on the cohort ``schedule``.

    >>> schedule = [0.01, 0.05, 0.25, 1.0]
    >>> next_stage("unadmitted", 0.0, schedule), next_stage("shadow", 0.05, schedule)
    (('shadow', 0.0), ('canary', 0.01))
    >>> next_stage("canary", 0.05, schedule), next_stage("canary", 0.25, schedule)
    (('canary', 0.25), ('admitted', 1.0))
    >>> next_stage("admitted", 1.0, schedule)
    Traceback (most recent call last):
    ...
    ValueError: the bundle is admitted already: nothing to promote it to
    """
    if stage == "admitted":
        raise ValueError("the bundle is admitted already: nothing to promote it to")
    if stage in (None, "unadmitted", "invalidated", "frozen"):
        return "shadow", 0.0
    if stage == "shadow":
        share = schedule[0]
    else:
        later = [s for s in schedule if s > (share or 0.0)]
        share = later[0] if later else 1.0
    return ("admitted", 1.0) if share >= 1.0 else ("canary", share)


def stage_placement(settings: AdmissionPolicy, stage: str | None, canary_share: float | None = None,
                    ) -> tuple[str | None, float]:
    """(the one cohort that speculates, its traffic share) in ``stage``; admitted, every cohort does.

    >>> settings = AdmissionPolicy()
    >>> stage_placement(settings, "shadow"), stage_placement(settings, "canary", 0.05)
    (('shadow', 0.05), ('canary', 0.05))
    >>> stage_placement(settings, "admitted"), stage_placement(settings, "frozen")
    ((None, 1.0), (None, 0.0))
    """
    if stage == "shadow":
        return settings.shadow_cohort, settings.shadow_share
    if stage == "canary":
        return settings.canary_cohort, canary_share
    return None, 1.0 if stage == "admitted" else 0.0


MANUAL_MOVES = ("admit", "promote", "freeze")
"""What a person can do to a bundle's stage by hand (`specwatch bundles`)."""


def manual_stage(move: str, stage: str | None, share: float | None,
                 settings: AdmissionPolicy) -> tuple[str, str | None, float]:
    """(stage, speculating cohort, share) after a person's ``move`` from ``stage`` at ``share``.

    Raises ValueError when the move goes nowhere (promoting an admitted bundle).

    >>> settings = AdmissionPolicy()
    >>> manual_stage("promote", "unadmitted", 0.0, settings), manual_stage("promote", "canary", 0.05, settings)
    (('shadow', 'shadow', 0.05), ('canary', 'canary', 0.25))
    >>> manual_stage("admit", "shadow", 0.05, settings), manual_stage("freeze", "canary", 0.25, settings)
    (('admitted', None, 1.0), ('frozen', None, 0.0))
    """
    if move == "admit":
        target = "admitted", 1.0
    elif move == "freeze":
        target = "frozen", 0.0
    elif move == "promote":
        target = next_stage(stage, share, settings.cohort_schedule)
    else:
        raise ValueError(f"unknown stage move {move!r}: one of {', '.join(MANUAL_MOVES)}")
    return (target[0], *stage_placement(settings, *target))


def manual_stage_decision(bundle_id: str, stage: str, share: float, cohort: str | None, by: str, reason: str,
                          ts: float, change_id: str = "") -> Decision:
    """The decision that tells flag clients and routers about a manual stage change.

    >>> d = manual_stage_decision("b-1", "canary", 0.1, "canary", "alice", "judged by hand", 5.0)
    >>> d.action, d.reason, d.detector, d.evidence["stage"], d.evidence["cohort_share"]
    ('promote', 'canary_judgement', 'manual', 'canary', 0.1)
    >>> manual_stage_decision("b-1", "frozen", 0.0, None, "bob", "tail", 6.0).action
    'disable_speculation'
    """
    evidence = {"stage": stage, "cohort_share": share, "cohort": cohort, "by": by, "note": reason,
                "change_id": change_id}
    action = "disable_speculation" if stage == "frozen" else "promote"
    return Decision(ts=ts, bundle_id=bundle_id, bucket=None, cohort=None, action=action,
                    reason="canary_judgement", detector=_MANUAL, evidence=evidence)


@dataclass(frozen=True)
class StageChange:
    """One row of a bundle's stage history; ``actor`` is ``specwatch``, ``policy`` or a person."""

    bundle_id: str
    ts: float
    stage: str
    previous_stage: str | None
    cohort_share: float
    actor: str
    reason: str
    decision_id: str | None = None
    detail: dict = field(default_factory=dict)
    seq: int = 0  # position in the bundle's history: orders changes made at the same event time


@dataclass
class BundleAdmission:
    """What the controller knows about one bundle: its card, stage and the judges of this stage."""

    bundle_id: str
    first_seen: float
    card: dict | None = None
    stage: str | None = None
    stage_decided: bool = False  # False: seen (or changed to), its partials have not reached us since
    stage_since: float = math.nan
    share_index: int = -1  # index into the cohort schedule while in canary
    invalidated: dict | None = None  # the fingerprint change that produced this bundle
    judges: dict[str, CanaryJudge] = field(default_factory=dict)
    judged_versions: dict[str, int] = field(default_factory=dict)
    history: list[StageChange] = field(default_factory=list)

    @property
    def strict(self) -> bool:
        return bool(self.card) and self.card.get("policy", {}).get("acceptance_rule", "strict") == "strict"


def _entry_state(entry: BundleAdmission) -> dict:
    """A bundle's entry as plain data: its judges with the setting each was made with."""
    fields = {name: getattr(entry, name) for name in ("bundle_id", "first_seen", "card", "stage", "stage_decided",
                                                      "stage_since", "share_index", "invalidated",
                                                      "judged_versions")}
    fields["judges"] = {bucket: [judge.require_shadow_checks, judge.to_state()]
                        for bucket, judge in entry.judges.items()}
    fields["history"] = [asdict(change) for change in entry.history]
    return fields


def _judged(entry: BundleAdmission) -> tuple[dict, str]:
    """The judgements of an entry's buckets that have a baseline, and their combined outcome."""
    judged = {b: j.judgement for b, j in sorted(entry.judges.items()) if j.baseline.requests}
    return judged, combine(j.outcome for j in judged.values()) if judged else "marginal"


class AdmissionController:
    """Moves bundles through the admission stages on the events and final slices stage 2 feeds it
    in event-time order; every move is a `Decision` (or a history row) for the caller's flag store.
    """

    def __init__(self, policy: Policy, qualifications: Mapping[str, Mapping] | None = None) -> None:
        self.policy = policy
        self.settings = policy.admission
        self.bundles: dict[str, BundleAdmission] = {}
        self._admitted = frozenset(self.settings.admitted_bundles)
        self.changes: list[StageChange] = []  # stage changes not yet taken by the caller
        # bundle id -> its newest qualification ({"verdict", "qualification_id", "ts", "reasons"})
        self.qualifications: dict[str, Mapping] = dict(qualifications or {})

    def qualified(self, bundle_id: str, qualification: Mapping, ts: float) -> list[Decision]:
        """A qualification of ``bundle_id`` finished: a pass starts an unadmitted strict bundle in shadow
        (when the policy requires qualification and starts bundles in shadow by itself)."""
        self.qualifications[bundle_id] = qualification
        entry = self.bundles.get(bundle_id)
        if (entry is None or entry.stage != "unadmitted" or not self.settings.require_qualification
                or not self._may_shadow(entry)):
            return []
        return [self._shadow(entry, max(ts, entry.stage_since))]

    def to_state(self) -> dict:
        """Every bundle's stage, judges and history as plain data (the settings are the policy's)."""
        return {"bundles": [_entry_state(entry) for entry in self.bundles.values()],
                "changes": [asdict(change) for change in self.changes]}

    def load_state(self, state: dict) -> None:
        self.bundles = {}
        for fields in state["bundles"]:
            entry = BundleAdmission(**{k: v for k, v in fields.items() if k not in ("judges", "history")})
            entry.history = [StageChange(**change) for change in fields["history"]]
            for bucket, (shadow, judge_state) in fields["judges"].items():
                judge = entry.judges[str(bucket)] = CanaryJudge(self.settings, self.policy.quality.strict_checks,
                                                                require_shadow_checks=bool(shadow))
                judge.load_state(judge_state)
            self.bundles[entry.bundle_id] = entry
        self.changes = [StageChange(**change) for change in state["changes"]]

    def take_changes(self) -> list[StageChange]:
        """Stage changes since the last call, oldest first (for the registry in the archive)."""
        changes, self.changes = self.changes, []
        return changes

    # -- what stage 2 saw --------------------------------------------------------------------
    def seen(self, bundle_id: str, card: dict, ts: float) -> None:
        """A bundle's card was announced."""
        self._entry(bundle_id, ts).card = card

    def changed(self, bundle_id: str, previous_bundle_id: str, changed_fields: list[str], card: dict,
                ts: float, worker: str) -> bool:
        """A worker's card changed to ``bundle_id``: whatever it earned before is void. False while
        it is still being validated since an earlier change (the rest of the fleet rolling over)."""
        entry = self._entry(bundle_id, ts)
        entry.card = card
        if entry.stage in ("unadmitted", "invalidated", "shadow") or (
                entry.stage is None and entry.invalidated is not None):
            return False
        previous = self.bundles.get(previous_bundle_id)
        entry.invalidated = {"previous_bundle_id": previous_bundle_id,
                             "previous_stage": previous.stage if previous else None,
                             "changed_fields": list(changed_fields), "worker": worker, "ts": ts,
                             "stage_before": entry.stage}
        # Decided again, as a new bundle is, when its partials next reach this controller.
        entry.stage_decided = False
        return True

    def observe(self, bundle_id: str, bucket: str | None, cohort: str | None, stats: SliceStats,
                slice_end: float, speculating: bool) -> list[Decision]:
        """One key's final slice, and whether its path speculated: in shadow and canary the stage's
        cohort is the judge's canary side, the cohorts that decode normally its baseline."""
        entry = self._entry(bundle_id, stats.max_ts or slice_end)
        decisions: list[Decision] = []
        if not entry.stage_decided:
            decisions += self._enter(entry)
        if bucket is None or entry.stage not in _JUDGED:
            return decisions
        settings = self.settings
        side = ("canary" if cohort == stage_placement(settings, entry.stage)[0]
                else "baseline" if not speculating and cohort not in (settings.shadow_cohort, settings.canary_cohort)
                else None)
        if side is not None:
            self._judge(entry, bucket).update(side, stats)
        return decisions

    def shadow(self, bundle_id: str, bucket: str, check: str, match: bool, request_id: str,
               ts: float) -> list[Decision]:
        """A shadow check; under the strict rule a single mismatch fails the stage at once."""
        entry = self.bundles.get(bundle_id)
        if entry is None or entry.stage not in _JUDGED:
            return []
        judge = self._judge(entry, bucket)
        judge.add_shadow(match, check, request_id, ts)
        if match or check not in self.policy.quality.strict_checks:
            return []
        return [self._freeze(entry, ts, {bucket: judge.judgement}, bucket)]

    def vetoed(self, decision: Decision) -> list[Decision]:
        """A fallback on the speculative path of a bundle under judgement vetoes its promotion."""
        entry = self.bundles.get(decision.bundle_id)
        if (entry is None or entry.stage not in _JUDGED or decision.action != "disable_speculation"
                or decision.reason in ("unadmitted_bundle", "canary_judgement")):
            return []
        evidence = self._stage_evidence(entry, "frozen")
        evidence.update(vetoed_by=decision.id, failed_bucket=decision.bucket,
                        failed_metric=decision.evidence.get("metric", decision.reason), veto_reason=decision.reason)
        return [self._decide(entry, "frozen", decision.ts, "disable_speculation",
                             "canary_judgement", _VETO, evidence)]

    def evaluate(self, now: float) -> list[Decision]:
        """Judge every bundle in shadow or canary whose judges saw new windows; pass promotes, fail freezes."""
        decisions = []
        for bundle_id in sorted(self.bundles):
            entry = self.bundles[bundle_id]
            if entry.stage not in _JUDGED or not entry.judges:
                continue
            versions = {b: j.version for b, j in entry.judges.items()}
            if versions == entry.judged_versions:
                continue  # nothing new since the last look
            entry.judged_versions = versions
            judged, outcome = _judged(entry)
            waited = now - entry.stage_since
            if outcome == "fail":
                decisions.append(self._freeze(entry, now, judged, None))
            elif outcome == "pass" and waited >= self.settings.stage_seconds:
                for judge in entry.judges.values():
                    judge.confirm()  # a promotion acts on all the evidence, not on the last look's
                judged, outcome = _judged(entry)
                if outcome == "pass":
                    decisions.append(self._promote(entry, now, judged))
                elif outcome == "fail":
                    decisions.append(self._freeze(entry, now, judged, None))
            elif outcome != "pass" and waited >= self.settings.max_stage_seconds:
                # No verdict in all that time: the canary has cost its traffic without earning
                # more; it stops speculating until someone looks (specwatch bundles).
                decisions.append(self._freeze(entry, now, judged, None, inconclusive=True))
        return decisions

    # -- stages ------------------------------------------------------------------------------
    def _entry(self, bundle_id: str, ts: float) -> BundleAdmission:
        entry = self.bundles.get(bundle_id)
        if entry is None:
            entry = self.bundles[bundle_id] = BundleAdmission(bundle_id, ts)
        return entry

    def _enter(self, entry: BundleAdmission) -> list[Decision]:
        """The first decision about a bundle: admitted by policy, or no speculation until it earns it."""
        entry.stage_decided = True
        ts = entry.first_seen
        if entry.bundle_id in self._admitted and entry.invalidated is None:
            self._move(entry, "admitted", ts, "policy", "admitted_bundles", None, {})
            return []
        decisions = []
        if entry.invalidated is not None:
            # The fallback table already invalidated it (reason bundle_changed); the stage follows.
            ts = entry.invalidated["ts"]
            self._move(entry, "invalidated", ts, "specwatch", "bundle_changed", None, entry.invalidated)
            entry.invalidated = None
        else:
            evidence = self._stage_evidence(entry, "unadmitted")
            evidence["card_known"] = entry.card is not None
            decisions.append(self._decide(entry, "unadmitted", ts, "disable_speculation",
                                          "unadmitted_bundle", _REGISTRY, evidence))
        if self.settings.auto_shadow and entry.strict:
            refusal = self._qualification_refusal(entry)
            if refusal is None:
                decisions.append(self._shadow(entry, ts))
            elif decisions:
                decisions[-1].evidence.update(refusal)
            else:  # invalidated by a card change: its stage row says why it stays there
                entry.history[-1].detail.update(refusal)
        return decisions

    def _shadow(self, entry: BundleAdmission, ts: float) -> Decision:
        evidence = self._stage_evidence(entry, "shadow")
        evidence["acceptance_rule"] = "strict"
        qualification = self.qualifications.get(entry.bundle_id)
        if self.settings.require_qualification and qualification is not None:
            evidence["qualification_id"] = qualification.get("qualification_id")
        return self._decide(entry, "shadow", ts, "promote", "unadmitted_bundle", _REGISTRY, evidence)

    def _may_shadow(self, entry: BundleAdmission) -> bool:
        return self.settings.auto_shadow and entry.strict and self._qualification_refusal(entry) is None

    def _qualification_refusal(self, entry: BundleAdmission) -> dict | None:
        """Why shadow is refused for want of a passing qualification of this exact card; None if it is not."""
        if not self.settings.require_qualification:
            return None
        qualification = self.qualifications.get(entry.bundle_id)
        if qualification is not None and qualification.get("verdict") == "pass":
            return None
        if qualification is None:
            why = "no qualification of this card: run specwatch qualify (a changed card needs a new one)"
        else:
            why = f"its qualification {qualification.get('qualification_id')} failed"
        return {"shadow_refused": why, "qualification": "missing" if qualification is None else "failed",
                "qualification_reasons": list((qualification or {}).get("reasons") or [])[:5]}

    def _promote(self, entry: BundleAdmission, now: float, judged: dict[str, Judgement]) -> Decision:
        schedule = self.settings.cohort_schedule
        stage, share = next_stage(entry.stage, self._share(entry), schedule)
        entry.share_index = schedule.index(share)
        evidence = self._stage_evidence(entry, stage)
        evidence["judgement"] = {b: _summary(j) for b, j in judged.items()}
        return self._decide(entry, stage, now, "promote", "canary_judgement", _JUDGE, evidence,
                            judged)

    def _freeze(self, entry: BundleAdmission, ts: float, judged: dict[str, Judgement],
                bucket: str | None, inconclusive: bool = False) -> Decision:
        failing = [(b, m) for b, j in judged.items() for m in j.failing]
        first_bucket, first_metric = failing[0] if failing else (bucket, None)
        evidence = self._stage_evidence(entry, "frozen")
        evidence.update(failed_bucket=first_bucket, failed_metric=first_metric.metric if first_metric else None,
                        failing=[dict(m.evidence(), bucket=b) for b, m in failing],
                        judgement={b: _summary(j) for b, j in judged.items()})
        if inconclusive:
            evidence.update(failed_metric="inconclusive", stage_seconds=round(ts - entry.stage_since, 3))
        return self._decide(entry, "frozen", ts, "disable_speculation", "canary_judgement", _JUDGE,
                            evidence, judged)

    def _decide(self, entry: BundleAdmission, stage: str, ts: float, action: str, reason: str,
                detector: str, evidence: dict, judged: dict | None = None) -> Decision:
        """The decision moving ``entry`` to ``stage``, kept in its history (with the judges')."""
        decision = Decision(ts=ts, bundle_id=entry.bundle_id, action=action, reason=reason,
                            detector=detector, evidence=evidence)
        detail = evidence if judged is None else dict(
            evidence, breakdown={b: j.evidence() for b, j in judged.items()})
        self._move(entry, stage, ts, "specwatch", reason, decision.id, detail)
        return decision

    def _stage_evidence(self, entry: BundleAdmission, stage: str) -> dict:
        """What a flag client needs from an admission decision, and where the bundle came from."""
        cohort, share = stage_placement(self.settings, stage, self._canary_share(entry))
        return {"stage": stage, "previous_stage": entry.stage, "cohort": cohort, "cohort_share": share,
                "previous_cohort_share": self._share(entry), "stage_since": entry.stage_since
                if not math.isnan(entry.stage_since) else None}

    def _share(self, entry: BundleAdmission) -> float:
        return stage_placement(self.settings, entry.stage, self._canary_share(entry))[1]

    def _canary_share(self, entry: BundleAdmission) -> float | None:
        return self.settings.cohort_schedule[entry.share_index] if entry.share_index >= 0 else None

    def _judge(self, entry: BundleAdmission, bucket: str) -> CanaryJudge:
        judge = entry.judges.get(bucket)
        if judge is None:
            judge = entry.judges[bucket] = CanaryJudge(self.settings, self.policy.quality.strict_checks,
                                                       require_shadow_checks=entry.stage == "shadow")
        return judge

    def _move(self, entry: BundleAdmission, stage: str, ts: float, actor: str, reason: str,
                decision_id: str | None, detail: dict) -> None:
        previous = entry.stage
        if stage not in ("canary", "admitted"):
            entry.share_index = -1
        change = StageChange(entry.bundle_id, ts, stage, previous,
                             detail.get("cohort_share", 1.0 if stage == "admitted" else 0.0),
                             actor, reason, decision_id, detail, len(entry.history))
        entry.history.append(change)
        self.changes.append(change)
        entry.stage = stage
        entry.stage_since = ts
        entry.judges = {}  # every stage is judged on its own evidence
        entry.judged_versions = {}


def _summary(judgement: Judgement) -> dict:
    return {"outcome": judgement.outcome, "canary_requests": judgement.canary_requests,
            "baseline_requests": judgement.baseline_requests, "shadow_checks": judgement.shadow_checks,
            "waiting_on": [m.metric for m in judgement.waiting], "failing": [m.metric for m in judgement.failing]}
