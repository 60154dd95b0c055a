"""The fallback table as code: findings in, decisions out, with hysteresis, cooldown and restore
(docs/RESTORE.md). Pure: no I/O."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from specwatch.detectors.draft_length import DraftLengthCurve
from specwatch.detectors.monitor import Finding, RecoveryEvidence
from specwatch.detectors.window import round_evidence as _round
from specwatch.schemas import Decision
from specwatch.schemas.policy import Policy
from specwatch.schemas.reasons import REASONS
from specwatch.schemas.scope import Scope

from .flags import FlagStore, scope_from_state

__all__ = ["FallbackPolicy", "ScopeMemory"]

# Reasons whose table row says "lower D first, then disable".
_REDUCE_FIRST = frozenset(reason for reason, facts in REASONS.items() if facts.fallback == "reduce_first")


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
        return {"memory": [[list(scope), asdict(memory)] for scope, memory in self.memory.items()]}

    def load_state(self, state: dict) -> None:
        self.memory = {scope_from_state(scope): ScopeMemory(**fields) for scope, fields in state["memory"]}

    def _is_off(self, scope: Scope) -> bool:
        bundle, bucket, cohort = scope
        if bucket is not None and cohort is not None:
            return not self.flags.lookup(bundle, bucket, cohort).enabled
        # A scope left open (every bucket or every cohort) is off where it, or its bundle, is off.
        wider = {(bundle, None, None), (bundle, bucket, None), (bundle, None, cohort)}
        states = map(self.flags.state, wider)
        return any(state is not None and not state.enabled for state in states)

    def decide(self, finding: Finding, scope: Scope, draft_length: int | None,
               sample_ids: list[str] | None = None, extra_evidence: dict | None = None,
               curve: DraftLengthCurve | None = None) -> Decision | None:
        """At most one decision for ``finding`` on ``scope``; ``curve`` (predicted speedup per D)
        lets lowering D name the best D below the current one instead of halving."""
        if self._is_off(scope):
            return None  # already on standard decoding here or above: nothing more to say
        memory = self.memory.setdefault(scope, ScopeMemory())
        actions = self.policy.actions
        evidence = finding.evidence()
        if extra_evidence:
            evidence.update(extra_evidence)
        reason = finding.reason

        if reason == "draft_overhead":
            if memory.last_alert_ts is not None and finding.ts - memory.last_alert_ts < actions.alert_repeat_seconds:
                return None
            memory.last_alert_ts = finding.ts
            return self._decision(finding, scope, "alert", evidence, sample_ids)

        if reason == "bundle_changed":
            return self._decision(finding, scope, "invalidate_bundle", evidence, sample_ids)

        if reason in _REDUCE_FIRST:
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

