"""The fallback table as code: findings in, decisions out, with hysteresis, cooldown and restore
(docs/RESTORE.md). Pure: no I/O."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from specwatch.detectors.draft_length import DraftLengthCurve
from specwatch.detectors.monitor import Finding
from specwatch.detectors.recovery import RecoveryEvidence
from specwatch.schemas.slice_stats import round_evidence as _round
from specwatch.schemas import Decision
from specwatch.schemas.policy import Policy
from specwatch.schemas.reasons import REASONS
from specwatch.schemas.scope import Scope, scope_text

from .flags import FlagStore, ScopeState, scope_from_state

__all__ = ["FallbackPolicy", "ScopeMemory"]

# Reasons whose table row says "lower D first, then disable".
_REDUCE_FIRST = frozenset(reason for reason, facts in REASONS.items() if facts.fallback == "reduce_first")
# An invalidated bundle's evidence is void: no other finding on it is decided.
_VOIDING = "bundle_changed"


@dataclass
class ScopeMemory:
    """What the policy remembers about one scope between findings: ``disables`` (restored or
    not) sets the restore backoff; a restore brings the path back at ``lowered_to``."""

    reduced_at: float | None = None
    lowered_to: int | None = None
    last_alert_ts: float | None = None
    disables: int = 0
    restores: int = 0
    disabled_at: float | None = None
    disabled_reason: str | None = None
    disabled_decision_id: str | None = None
    # every reason this scope was disabled for since it last speculated (the flag keeps the first)
    off_reasons: set[str] = field(default_factory=set)


class FallbackPolicy:
    """Maps a `Finding` on a scope to at most one `Decision`; it reads ``flags`` not to repeat
    itself, and the caller applies the decisions it returns.

    >>> from specwatch.detectors.monitor import Finding
    >>> fp = FallbackPolicy(Policy(), FlagStore())
    >>> f = Finding("acceptance_drop", "acceptance_gate", 300.0, "acceptance_length", 2.0, 2.5, 3.0, 295.0, 300.0)
    >>> first = fp.decide(f, ("b-1", "coding", "main"), draft_length=4)
    >>> first.action, first.evidence["draft_length"]
    ('reduce_draft_length', 2)
    >>> fp.flags.apply(first)
    True
    >>> fp.decide(f, ("b-1", "coding", "main"), draft_length=4) is None  # still settling
    True
    >>> later = Finding("acceptance_drop", "acceptance_gate", 330.0, "acceptance_length", 1.5, 2.0, 2.4, 325.0, 330.0)
    >>> fp.decide(later, ("b-1", "coding", "main"), draft_length=4).action
    'disable_speculation'
    """

    def __init__(self, policy: Policy, flags: FlagStore) -> None:
        self.policy = policy
        self.flags = flags
        self.memory: dict[Scope, ScopeMemory] = {}

    def to_state(self) -> dict:
        """What the policy remembers per scope, as plain data (the flags are the owner's)."""
        return {"memory": [[list(scope), {**asdict(memory), "off_reasons": sorted(memory.off_reasons)}]
                           for scope, memory in self.memory.items()]}

    def load_state(self, state: dict) -> None:
        self.memory = {scope_from_state(scope): ScopeMemory(**{**fields, "off_reasons": set(fields.get("off_reasons", ()))})
                       for scope, fields in state["memory"]}

    def _held_off_by(self, scope: Scope) -> list[tuple[Scope, ScopeState]] | None:
        """None while ``scope`` speculates; else the automatic fallbacks at it or above that hold
        it off, in scope order (empty when only admission or a manual override does)."""
        bundle, bucket, cohort = scope
        covering = sorted({(bundle, None, None), (bundle, bucket, None), (bundle, None, cohort),
                           (bundle, bucket, cohort)}, key=lambda s: (s[1] is not None, s[2] is not None, s))
        off = [(s, state) for s in covering if (state := self.flags.state(s)) is not None and not state.enabled]
        if bucket is not None and cohort is not None:
            if self.flags.lookup(bundle, bucket, cohort).enabled:
                return None
        elif not off:  # a scope left open is off where it, or a scope above it, is off
            return None
        return [(s, state) for s, state in off if state.manual_by is None and state.decision_id] \
            if all(state.manual_by is None for _, state in off) else []

    def decide(self, finding: Finding, scope: Scope, draft_length: int | None,
               sample_ids: list[str] | None = None, extra_evidence: dict | None = None,
               curve: DraftLengthCurve | None = None) -> Decision | None:
        """At most one decision for ``finding`` on ``scope``; ``curve`` (predicted speedup per D)
        lets lowering D name the best D below the current one instead of halving.

        Attribution: a scope already on standard decoding gets no second decision for the reason
        that put it there, nor when admission or a person holds it off, nor once its bundle is
        invalidated (a changed card voids all of its evidence). A fallback for another
        reason (at the scope or wider, e.g. the whole bundle for KV pressure) does not silence
        it: the finding is decided on its own evidence and recorded with its own reason, as a
        `disable_speculation` whose evidence names the fallbacks already in force
        (``already_off``). The operator sees both causes, and the scope stays off for its own
        cause when the wider fallback is restored.

        >>> from specwatch.detectors.monitor import Finding
        >>> fp = FallbackPolicy(Policy(), FlagStore())
        >>> kv = Finding("kv_pressure", "kv_watermark_gate", 290.0, "kv_peak", 0.97, 0.92, math.nan, 287.0, 290.0)
        >>> fp.flags.apply(fp.decide(kv, ("b-1", None, None), draft_length=4)), fp.flags.state(("b-1", None, None))
        (True, ScopeState(enabled=True, draft_limit=2, ...))
        >>> later = Finding("kv_pressure", "kv_watermark_gate", 310.0, "kv_peak", 0.97, 0.92, math.nan, 307.0, 310.0)
        >>> fp.flags.apply(fp.decide(later, ("b-1", None, None), draft_length=4))
        True
        >>> fp.decide(kv, ("b-1", "coding", "main"), draft_length=4) is None  # same reason, covered
        True
        >>> burst = Finding("error_rate", "error_rate_cusum", 312.0, "error_rate", 0.03, 0.01, 0.002, 255.0, 312.0)
        >>> d = fp.decide(burst, ("b-1", "extraction", "main"), draft_length=4)
        >>> d.action, d.reason, [(o["scope"], o["reason"]) for o in d.evidence["already_off"]]
        ('disable_speculation', 'error_rate', [('b-1/*/*', 'kv_pressure')])
        """
        held_off = self._held_off_by(scope)
        if held_off is not None and (not held_off or any(state.reason in (finding.reason, _VOIDING)
                                                         for _, state in held_off)
                                     or finding.reason in self.memory.get(scope, ScopeMemory()).off_reasons):
            return None  # already on standard decoding here or above, for this reason, by hand, or void
        return self._decide(finding, scope, draft_length, sample_ids, extra_evidence, curve, held_off or [])

    def _decide(self, finding: Finding, scope: Scope, draft_length: int | None, sample_ids: list[str] | None,
                extra_evidence: dict | None, curve: DraftLengthCurve | None,
                held_off: list[tuple[Scope, ScopeState]]) -> Decision | None:

        memory = self.memory.setdefault(scope, ScopeMemory())
        actions = self.policy.actions
        evidence = finding.evidence()
        if extra_evidence:
            evidence.update(extra_evidence)
        if held_off:
            evidence["already_off"] = [{"scope": scope_text(s), "reason": state.reason,
                                        "decision_id": state.decision_id} for s, state in held_off]
        reason = finding.reason

        if reason == "draft_overhead":
            if memory.last_alert_ts is not None and finding.ts - memory.last_alert_ts < actions.alert_repeat_seconds:
                return None
            memory.last_alert_ts = finding.ts
            return self._decision(finding, scope, "alert", evidence, sample_ids)

        if reason == "bundle_changed":
            return self._decision(finding, scope, "invalidate_bundle", evidence, sample_ids)

        if reason in _REDUCE_FIRST and not held_off:  # a lower D means nothing on a path already off
            state = self.flags.state(scope)
            limit = (state.draft_limit if state is not None else None) or draft_length
            if memory.reduced_at is not None:
                if finding.ts - memory.reduced_at < self.policy.acceptance.settle_seconds:
                    return None  # the lower D has not had time to show its effect
            elif self.policy.acceptance.reduce_first and limit and limit > actions.min_draft_length:
                new_limit = self._lower_draft_length(limit, curve, evidence)
                memory.lowered_to = new_limit
                memory.reduced_at = finding.ts
                evidence["draft_length"] = new_limit
                evidence["previous_draft_length"] = limit
                return self._decision(finding, scope, "reduce_draft_length", evidence, sample_ids)

        if reason == "quality_regression":
            evidence["promotion_frozen"] = True
        decision = self._decision(finding, scope, "disable_speculation", evidence, sample_ids)
        memory.disables += 1
        memory.disabled_at, memory.disabled_reason, memory.disabled_decision_id = finding.ts, reason, decision.id
        memory.off_reasons.add(reason)
        memory.reduced_at = None  # after a restore, the table's order starts over: lower D first
        return decision

    def _lower_draft_length(self, limit: int, curve: DraftLengthCurve | None, evidence: dict) -> int:
        """The D to lower to: the best predicted below ``limit``, or half of it on thin evidence or
        without a curve (KV pressure)."""
        floor = self.policy.actions.min_draft_length
        halved = max(floor, limit // 2)
        if curve is None:
            return halved
        thin = curve.thin
        best = curve.best(floor, limit - 1) if thin is None else None
        if best is None:
            evidence["draft_length_basis"] = f"halving: {thin or 'no prediction below D=' + str(limit)}"
            return halved
        evidence.update(curve.evidence(best.draft_length, min(limit, len(curve.points))))
        return best.draft_length

    # -- restore ---------------------------------------------------------------------------
    def restore_wait(self, scope: Scope) -> float | None:
        """Seconds the scope's current disable must last before a restore, backing off per disable;
        None = never (restores off, or a reason outside ``restore_reasons``).

        >>> policy = Policy.model_validate({"actions": {"restore_after_seconds": 600}})
        >>> fp = FallbackPolicy(policy, FlagStore())
        >>> scope = ("b-1", "coding", "main")
        >>> f = Finding("error_rate", "error_rate_gate", 100.0, "error_rate", 0.05, 0.02, 0.002, 40.0, 100.0)
        >>> _ = fp.decide(f, scope, draft_length=4)
        >>> fp.restore_wait(scope)
        600.0
        >>> fp.memory[scope].disables = 3
        >>> fp.restore_wait(scope)
        2400.0
        """
        actions = self.policy.actions
        memory = self.memory.get(scope)
        if (actions.restore_after_seconds is None or memory is None or memory.disabled_at is None
                or memory.disabled_reason not in actions.restore_reasons):
            return None
        wait = actions.restore_after_seconds * actions.restore_backoff ** max(0, memory.disables - 1)
        return min(actions.restore_max_seconds, max(actions.cooldown_seconds, wait))

    def restore_due(self, now: float) -> list[Scope]:
        """Scopes this policy disabled whose wait is over at event time ``now``, in a fixed order."""
        waits = {scope: self.restore_wait(scope) for scope in self.memory}
        due = [scope for scope, wait in waits.items()
               if wait is not None and now - self.memory[scope].disabled_at >= wait]
        return sorted(due, key=lambda s: (s[0], s[1] or "", s[2] or ""))

    def restore(self, scope: Scope, now: float, evidence: list[RecoveryEvidence],
                last_mismatch_ts: float | None = None) -> Decision | None:
        """A `restore` decision for a due scope when its ``evidence`` (traffic, KV peak) is there
        and clean, with no strict shadow mismatch since the disable; else None (look again)."""
        memory, wait = self.memory.get(scope), self.restore_wait(scope)
        if wait is None or now - memory.disabled_at < wait:  # None: nothing disabled, or no restore
            return None
        state = self.flags.state(scope)
        if state is None or state.enabled or state.manual_by is not None:
            memory.disabled_at = None  # restored or overridden by hand meanwhile: nothing to do
            return None
        min_requests = self.policy.errors.min_requests
        problems = [p for e in evidence for p in e.problems(min_requests)]
        mismatched = last_mismatch_ts is not None and last_mismatch_ts >= memory.disabled_at
        if not any(e.kind == "traffic" for e in evidence) or problems or mismatched:
            return None
        disabled_at, reason = memory.disabled_at, memory.disabled_reason
        body = {
            "restores_decision": memory.disabled_decision_id,
            "disabled_at": _round(disabled_at),
            "disabled_for_seconds": _round(now - disabled_at),
            "waited_for_seconds": _round(wait),
            "disables": memory.disables,
            "next_wait_seconds": _round(min(self.policy.actions.restore_max_seconds,
                                            wait * self.policy.actions.restore_backoff)),
            "last_strict_mismatch_ts": last_mismatch_ts,
            "evidence": [e.evidence() for e in evidence],
        }
        if memory.lowered_to is not None:
            body["draft_length"] = memory.lowered_to
        memory.restores += 1
        memory.disabled_at = None
        memory.off_reasons.clear()
        bundle, bucket, cohort = scope
        return Decision(ts=now, bundle_id=bundle, bucket=bucket, cohort=cohort, action="restore",
                        reason=reason, detector="restore_policy", evidence=body)

    @staticmethod
    def _decision(finding: Finding, scope: Scope, action: str, evidence: dict,
                  sample_ids: list[str] | None) -> Decision:
        bundle, bucket, cohort = scope
        return Decision(ts=finding.ts, bundle_id=bundle, bucket=bucket, cohort=cohort, action=action,
                        reason=finding.reason, detector=finding.detector, evidence=evidence,
                        sample_ids=sorted(set(sample_ids or ())))
