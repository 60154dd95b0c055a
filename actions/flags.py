"""The speculative-path flag state engines and routers ask before drafting: decisions and manual
overrides folded into per-scope state, in memory and pure (whoever feeds it does I/O)."""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, field

from specwatch.schemas import Decision
from specwatch.schemas.scope import Scope

__all__ = ["ScopeState", "SpeculationState", "AdmissionState", "FlagStore", "OverrideChange",
           "override_decision", "scope_from_state", "SPECULATION_ON", "STAGES"]


@dataclass(frozen=True)
class ScopeState:
    """The state one decision or override put on one scope."""

    enabled: bool = True
    draft_limit: int | None = None
    reason: str = ""
    decision_id: str = ""
    ts: float = 0.0
    manual_by: str | None = None
    cohort_share: float | None = None


@dataclass(frozen=True)
class SpeculationState:
    """The answer for one (bundle, bucket, cohort): combined over every scope that covers it."""

    enabled: bool
    draft_limit: int | None = None
    reasons: tuple[str, ...] = ()


SPECULATION_ON = SpeculationState(enabled=True)

_DISABLING = {"disable_speculation", "invalidate_bundle"}

STAGES = ("unadmitted", "shadow", "canary", "admitted", "frozen", "invalidated")
"""Admission stages of a bundle, in the order a healthy one passes them (then the two it can fall to)."""
# Reasons only admission decisions carry; with `promote` they are what moves a bundle's stage.
_ADMISSION_REASONS = {"unadmitted_bundle", "canary_judgement"}


@dataclass(frozen=True)
class AdmissionState:
    """A bundle's admission stage as flag clients see it: in shadow or canary only ``cohort``
    speculates (``cohort_share`` of traffic), admitted every cohort, otherwise none.

    >>> canary = AdmissionState("canary", "canary", 0.05)
    >>> canary.allows("canary"), canary.allows("main"), AdmissionState("frozen").allows("canary")
    (True, False, False)
    """

    stage: str
    cohort: str | None = None
    cohort_share: float = 0.0
    reason: str = ""
    decision_id: str = ""
    ts: float = 0.0
    manual_by: str | None = None

    def allows(self, cohort: str) -> bool:
        judged = self.stage in ("shadow", "canary") and cohort == self.cohort
        return self.stage == "admitted" or judged


def _admission_state(decision: Decision) -> AdmissionState | None:
    """The stage an admission decision puts its bundle in; None for every other decision."""
    if decision.bucket is not None or decision.cohort is not None or (
            decision.action != "promote" and decision.reason not in _ADMISSION_REASONS):
        return None
    evidence = decision.evidence
    default = "unadmitted" if decision.reason == "unadmitted_bundle" else "frozen"
    stage = evidence.get("stage") or (default if decision.action != "promote" else "admitted")
    if stage not in STAGES:
        raise ValueError(f"decision {decision.id} names an unknown admission stage {stage!r}")
    share = evidence.get("cohort_share")
    return AdmissionState(stage, evidence.get("cohort"), float(share) if share is not None else 0.0,
                          decision.reason, decision.id, decision.ts)


def scope_from_state(items) -> Scope:
    """A scope as `FlagStore.to_state` writes it: [bundle, bucket or None, cohort or None]."""
    bundle, bucket, cohort = items
    if not isinstance(bundle, str) or not all(part is None or isinstance(part, str) for part in (bucket, cohort)):
        raise ValueError(f"not a scope: {items!r}")
    return bundle, bucket, cohort


def _admission_from_state(fields: dict) -> AdmissionState:
    if fields["stage"] not in STAGES:
        raise ValueError(f"unknown admission stage {fields['stage']!r}")
    return AdmissionState(**fields)


@dataclass
class FlagStore:
    """Current speculative-path state per scope, with manual overrides on top.

    >>> store = FlagStore()
    >>> d = Decision(ts=10.0, bundle_id="b-1", bucket="coding", cohort=None,
    ...              action="disable_speculation", reason="acceptance_drop", detector="al_gate")
    >>> store.apply(d)
    True
    >>> store.lookup("b-1", "coding", "main").enabled, store.lookup("b-1", "chat", "main").enabled
    (False, True)
    >>> store.apply(d)  # same state again: no change
    False
    >>> canary = Decision(ts=11.0, bundle_id="b-1", bucket=None, cohort="canary",
    ...                   action="disable_speculation", reason="latency_slo", detector="latency_p99_gate")
    >>> store.apply(canary)
    True
    >>> store.lookup("b-1", "chat", "canary").enabled, store.lookup("b-1", "chat", "main").enabled
    (False, True)

    Admission decisions put a bundle in a stage; only the stage's cohort speculates:

    >>> shadow = Decision(ts=12.0, bundle_id="b-2", action="promote", reason="unadmitted_bundle",
    ...                   detector="admission", evidence={"stage": "shadow", "cohort": "shadow", "cohort_share": 0.05})
    >>> store.apply(shadow)
    True
    >>> store.admission("b-2").stage, store.lookup("b-2", "chat", "shadow").enabled, store.lookup("b-2", "chat", "main")
    ('shadow', True, SpeculationState(enabled=False, draft_limit=None, reasons=('unadmitted_bundle',)))
    """

    _auto: dict[Scope, ScopeState] = field(default_factory=dict)
    _manual: dict[Scope, ScopeState] = field(default_factory=dict)
    _stages: dict[str, AdmissionState] = field(default_factory=dict)
    _manual_stages: dict[str, AdmissionState] = field(default_factory=dict)
    _cache: dict[tuple[str, str, str], SpeculationState] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def to_state(self) -> dict:
        """Every scope's and bundle's state as plain data (the lock and the lookup cache are this
        process's own).

        >>> store = FlagStore()
        >>> _ = store.apply(Decision(ts=10.0, bundle_id="b-1", bucket="coding", action="disable_speculation",
        ...                          reason="acceptance_drop", detector="gate"))
        >>> FlagStore.from_state(store.to_state()).lookup("b-1", "coding", "main").enabled
        False
        """
        with self._lock:
            return {"auto": [[list(scope), asdict(state)] for scope, state in self._auto.items()],
                    "manual": [[list(scope), asdict(state)] for scope, state in self._manual.items()],
                    "stages": {bundle: asdict(state) for bundle, state in self._stages.items()},
                    "manual_stages": {bundle: asdict(state) for bundle, state in self._manual_stages.items()}}

    @classmethod
    def from_state(cls, state: dict) -> "FlagStore":
        def scopes(pairs) -> dict[Scope, ScopeState]:
            return {scope_from_state(scope): ScopeState(**fields) for scope, fields in pairs}

        def stages(by_bundle) -> dict[str, AdmissionState]:
            return {str(bundle): _admission_from_state(fields) for bundle, fields in by_bundle.items()}

        return cls(_auto=scopes(state["auto"]), _manual=scopes(state["manual"]), _stages=stages(state["stages"]),
                   _manual_stages=stages(state["manual_stages"]))

    def apply(self, decision: Decision) -> bool:
        """Fold one decision in; returns whether the state of its scope changed."""
        scope = decision.scope
        admission = _admission_state(decision)
        if admission is not None:
            return self._apply_stage(decision.bundle_id, admission)
        with self._lock:
            before = self._auto.get(scope)
            if decision.action in _DISABLING:
                after = ScopeState(False, None, decision.reason, decision.id, decision.ts)
            elif decision.action == "reduce_draft_length":
                limit = int(decision.evidence.get("draft_length", 1))
                after = ScopeState(True, limit, decision.reason, decision.id, decision.ts)
            elif decision.action == "restore":
                # a restore naming a D brings the path back at that D, not at the card's
                limit = decision.evidence.get("draft_length")
                after = None if limit is None else ScopeState(True, int(limit), decision.reason, decision.id,
                                                              decision.ts)
            else:  # alerts change nothing on the path
                return False
            if _same(before, after):
                return False
            if after is None:
                self._auto.pop(scope, None)
            else:
                self._auto[scope] = after
            self._cache.clear()
            return True

    def _apply_stage(self, bundle_id: str, after: AdmissionState) -> bool:
        with self._lock:
            before = self._stages.get(bundle_id)
            self._stages[bundle_id] = after
            changed = before is None or (before.stage, before.cohort, before.cohort_share) != (
                after.stage, after.cohort, after.cohort_share)
            invalidated = self._auto.get((bundle_id, None, None))
            if after.stage in ("shadow", "canary", "admitted") and invalidated is not None and (
                    not invalidated.enabled and invalidated.reason == "bundle_changed"):
                # Re-validation has begun: the stage, not the invalidation, now says who speculates.
                del self._auto[(bundle_id, None, None)]
                changed = True
            self._cache.clear()
            return changed

    def set_stage(self, bundle_id: str, stage: str, by: str, reason: str, ts: float,
                  cohort: str | None = None, cohort_share: float = 0.0) -> None:
        """Put a bundle in a stage by hand; it beats the automatic stage until cleared."""
        if not by:
            raise ValueError("a manual stage change needs the name of who made it (by=...)")
        if stage not in STAGES:
            raise ValueError(f"unknown admission stage {stage!r}; choose one of {', '.join(STAGES)}")
        with self._lock:
            self._manual_stages[bundle_id] = AdmissionState(stage, cohort, cohort_share, reason, "", ts, by)
            self._cache.clear()

    def admission(self, bundle_id: str) -> AdmissionState | None:
        """The bundle's admission stage; None when admission never judged it (speculation as flags say)."""
        return self._manual_stages.get(bundle_id) or self._stages.get(bundle_id)

    def stages(self) -> dict[str, AdmissionState]:
        """Every bundle with an admission stage; manual stages shown over automatic ones."""
        with self._lock:
            return {**self._stages, **self._manual_stages}

    def override(self, scope: Scope, enabled: bool, by: str, reason: str, ts: float,
                 draft_limit: int | None = None) -> None:
        """Pin a scope by hand; it beats automatic state on the same scope until cleared."""
        if not by:
            raise ValueError("a manual override needs the name of who made it (by=...)")
        with self._lock:
            self._manual[scope] = ScopeState(enabled, draft_limit, reason, "", ts, by)
            self._cache.clear()

    def lookup(self, bundle_id: str, bucket: str, cohort: str) -> SpeculationState:
        """Combined state for one request's (bundle, bucket, cohort); any 'off' wins."""
        key = (bundle_id, bucket, cohort)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        with self._lock:
            enabled, limit, reasons = True, None, []
            for scope in ((bundle_id, None, None), (bundle_id, None, cohort), (bundle_id, bucket, None),
                          (bundle_id, bucket, cohort)):
                state = self._manual.get(scope) or self._auto.get(scope)
                if state is None:
                    continue
                if not state.enabled:
                    enabled = False
                    reasons.append(state.reason)
                if state.draft_limit is not None:
                    limit = state.draft_limit if limit is None else min(limit, state.draft_limit)
            stage = self.admission(bundle_id)
            if stage is not None and not stage.allows(cohort):
                enabled = False
                reasons.append(stage.reason or stage.stage)
            result = SpeculationState(enabled, limit, tuple(reasons)) if (reasons or limit) else SPECULATION_ON
            self._cache[key] = result
            return result

    def scopes(self) -> dict[Scope, ScopeState]:
        """Every scope with non-default state; manual overrides shown over automatic state."""
        with self._lock:
            return {**self._auto, **self._manual}

    def overrides(self) -> dict[Scope, ScopeState]:
        with self._lock:
            return dict(self._manual)

    def state(self, scope: Scope) -> ScopeState | None:
        with self._lock:
            return self._manual.get(scope) or self._auto.get(scope)


def _same(a: ScopeState | None, b: ScopeState | None) -> bool:
    if a is None or b is None:
        return a is b
    return (a.enabled, a.draft_limit, a.cohort_share) == (b.enabled, b.draft_limit, b.cohort_share)


_MANUAL_DETECTOR = "manual"


@dataclass(frozen=True)
class OverrideChange:
    """A manual override being set (``cleared=False``) or cleared, as recorded and published."""

    bundle_id: str
    bucket: str | None
    cohort: str | None
    enabled: bool
    draft_limit: int | None
    by: str
    reason: str
    ts: float
    cleared: bool = False

    @property
    def scope(self) -> Scope:
        return self.bundle_id, self.bucket, self.cohort


def override_decision(change: OverrideChange, code: str, automatic: ScopeState | None = None,
                      override_id: str = "", *, detector: str = _MANUAL_DETECTOR,
                      audit: dict | None = None) -> Decision:
    """The decision that tells flag clients about ``change`` (reason ``code``); clearing publishes
    ``automatic``, the state archived decisions alone give the scope (None: speculation on).

    >>> c = OverrideChange("b-1", "coding", None, False, None, "alice", "p99 page", 100.0)
    >>> d = override_decision(c, "latency_slo", override_id="o-1")
    >>> d.action, d.reason, d.detector, d.evidence["by"], d.evidence["note"]
    ('disable_speculation', 'latency_slo', 'manual', 'alice', 'p99 page')
    >>> override_decision(OverrideChange("b-1", None, None, True, 2, "bob", "", 101.0), "no_speedup").action
    'reduce_draft_length'
    """
    enabled, limit = change.enabled, change.draft_limit
    if change.cleared:
        enabled = automatic is None or automatic.enabled
        limit = automatic.draft_limit if automatic is not None else None
    evidence = {"by": change.by, "note": change.reason, "override_id": override_id, "cleared": change.cleared}
    evidence.update(audit or {})
    if not enabled:
        action = "disable_speculation"
    elif limit is not None:
        action = "reduce_draft_length"
        evidence["draft_length"] = limit
    else:
        action = "restore"
    return Decision(ts=change.ts, bundle_id=change.bundle_id, bucket=change.bucket, cohort=change.cohort,
                    action=action, reason=code, detector=detector, evidence=evidence)
