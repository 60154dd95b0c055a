"""The speculative-path flag state: what engines and routers ask before drafting.

A `FlagStore` folds decisions (and manual overrides) into per-scope state and answers
"is speculation on for this bundle/bucket/cohort, and with what draft length?" from
local memory. It is pure: whoever feeds it (replay, decisions topic, archive) does I/O.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from specwatch.schemas import Decision

__all__ = ["Scope", "ScopeState", "SpeculationState", "FlagStore", "SPECULATION_ON"]

Scope = tuple[str, str | None, str | None]  # (bundle_id, bucket or None=all, cohort or None=all)


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
    """

    _auto: dict[Scope, ScopeState] = field(default_factory=dict)
    _manual: dict[Scope, ScopeState] = field(default_factory=dict)
    _cache: dict[tuple[str, str, str], SpeculationState] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def apply(self, decision: Decision) -> bool:
        """Fold one decision in; returns whether the state of its scope changed."""
        scope: Scope = (decision.bundle_id, decision.bucket, decision.cohort)
        with self._lock:
            before = self._auto.get(scope)
            if decision.action in _DISABLING:
                after = ScopeState(False, None, decision.reason, decision.id, decision.ts)
            elif decision.action == "reduce_draft_length":
                limit = int(decision.evidence.get("draft_length", 1))
                after = ScopeState(True, limit, decision.reason, decision.id, decision.ts)
            elif decision.action == "restore":
                after = None
            elif decision.action == "promote":
                share = decision.evidence.get("cohort_share")
                base = before or ScopeState()
                after = ScopeState(base.enabled, base.draft_limit, base.reason, decision.id, decision.ts,
                                   None, float(share) if share is not None else None)
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

    def override(self, scope: Scope, enabled: bool, by: str, reason: str, ts: float,
                 draft_limit: int | None = None) -> None:
        """Pin a scope by hand; it beats automatic state on the same scope until cleared."""
        if not by:
            raise ValueError("a manual override needs the name of who made it (by=...)")
        with self._lock:
            self._manual[scope] = ScopeState(enabled, draft_limit, reason, "", ts, by)
            self._cache.clear()

    def clear_override(self, scope: Scope) -> bool:
        with self._lock:
            removed = self._manual.pop(scope, None) is not None
            self._cache.clear()
            return removed

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
            result = SpeculationState(enabled, limit, tuple(reasons)) if (reasons or limit) else SPECULATION_ON
            self._cache[key] = result
            return result

    def scopes(self) -> dict[Scope, ScopeState]:
        """Every scope with non-default state; manual overrides shown over automatic state."""
        with self._lock:
            merged = dict(self._auto)
            merged.update(self._manual)
            return merged

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
