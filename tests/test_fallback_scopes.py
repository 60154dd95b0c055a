"""The fallback policy stays quiet about a scope that a wider scope already switched off."""

from specwatch.actions.flags import FlagStore
from specwatch.actions.policy import FallbackPolicy
from specwatch.detectors.monitor import Finding
from specwatch.schemas.policy import Policy

_SLO = Finding("latency_slo", "latency_gate", 300.0, "e2e_p99", 9.0, 5.0, 2.0, 295.0, 300.0)


def _policy(*off):
    flags = FlagStore()
    for scope in off:
        flags.override(scope, False, by="oncall", reason="test", ts=1.0)
    return FallbackPolicy(Policy(), flags)


def test_cohort_scope_is_quiet_when_its_bundle_or_cohort_is_off():
    assert _policy(("b-1", None, None)).decide(_SLO, ("b-1", None, "canary"), 4) is None
    assert _policy(("b-1", None, "canary")).decide(_SLO, ("b-1", None, "canary"), 4) is None


def test_cohort_scope_still_decides_when_only_another_cohort_or_a_bucket_is_off():
    decision = _policy(("b-1", None, "main"), ("b-1", "coding", None)).decide(_SLO, ("b-1", None, "canary"), 4)
    assert (decision.action, decision.bucket, decision.cohort) == ("disable_speculation", None, "canary")


def test_bucket_scope_is_quiet_under_a_disabled_bundle_but_not_a_disabled_cohort():
    assert _policy(("b-1", None, None)).decide(_SLO, ("b-1", "coding", None), 4) is None
    decision = _policy(("b-1", None, "canary")).decide(_SLO, ("b-1", "coding", None), 4)
    assert decision.action == "disable_speculation"
