"""The fallback table as code: findings in, decisions out, with hysteresis and cooldown.

Lower D first where the table says so, then disable; disable at once for SLO, error and
quality breaches; invalidate a changed bundle; alert on cost changes. Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from specwatch.detectors.monitor import Finding
from specwatch.schemas import Decision
from specwatch.schemas.policy import Policy

from .flags import FlagStore, Scope

__all__ = ["FallbackPolicy", "ScopeMemory"]

# Reasons whose table row says "lower D first, then disable".
_REDUCE_FIRST = {"acceptance_drop", "kv_pressure"}
# Reasons that disable at once.
_DISABLE_AT_ONCE = {"no_speedup", "latency_slo", "error_rate", "quality_regression", "unadmitted_bundle"}


@dataclass
class ScopeMemory:
    """What the policy remembers about one scope between findings."""

    last_decision_ts: float | None = None
    reduced_at: float | None = None
    last_alert_ts: float | None = None
    frozen: bool = False


class FallbackPolicy:
    """Maps a `Finding` on a scope to at most one `Decision`.

    Parameters
    ----------
    policy
        Thresholds and action settings.
    flags
        The current path state; the policy reads it to avoid repeating itself and the
        caller applies the decisions it returns.

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

    def _is_off(self, scope: Scope) -> bool:
        bundle, bucket, cohort = scope
        if bucket is None:
            state = self.flags.state((bundle, None, None))
            return state is not None and not state.enabled
        if cohort is None:
            for s in ((bundle, None, None), (bundle, bucket, None)):
                state = self.flags.state(s)
                if state is not None and not state.enabled:
                    return True
            return False
        return not self.flags.lookup(bundle, bucket, cohort).enabled

    def current_draft_limit(self, scope: Scope) -> int | None:
        state = self.flags.state(scope)
        return None if state is None else state.draft_limit

    def decide(self, finding: Finding, scope: Scope, draft_length: int | None,
               sample_ids: list[str] | None = None, extra_evidence: dict | None = None) -> Decision | None:
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
            memory.last_decision_ts = finding.ts
            return self._decision(finding, scope, "invalidate_bundle", evidence, sample_ids)

        if reason in _REDUCE_FIRST:
            limit = self.current_draft_limit(scope) or draft_length
            if memory.reduced_at is not None:
                if finding.ts - memory.reduced_at < self.policy.acceptance.settle_seconds:
                    return None  # the lower D has not had time to show its effect
            elif self.policy.acceptance.reduce_first and limit and limit > actions.min_draft_length:
                new_limit = max(actions.min_draft_length, limit // 2)
                memory.reduced_at = finding.ts
                memory.last_decision_ts = finding.ts
                evidence["draft_length"] = new_limit
                evidence["previous_draft_length"] = limit
                return self._decision(finding, scope, "reduce_draft_length", evidence, sample_ids)

        if reason == "quality_regression":
            memory.frozen = True
            evidence["promotion_frozen"] = True
        memory.last_decision_ts = finding.ts
        return self._decision(finding, scope, "disable_speculation", evidence, sample_ids)

    @staticmethod
    def _decision(finding: Finding, scope: Scope, action: str, evidence: dict,
                  sample_ids: list[str] | None) -> Decision:
        bundle, bucket, cohort = scope
        return Decision(ts=finding.ts, bundle_id=bundle, bucket=bucket, cohort=cohort, action=action,
                        reason=finding.reason, detector=finding.detector, evidence=evidence,
                        sample_ids=sorted(set(sample_ids or ())))
