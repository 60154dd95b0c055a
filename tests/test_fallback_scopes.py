"""The fallback policy stays quiet about a scope that a wider scope already switched off."""

import pytest

from specwatch.actions.flags import FlagStore
from specwatch.actions.fallback import FallbackPolicy
from specwatch.detectors.monitor import Finding
from specwatch.schemas.policy import Policy

_SLO = Finding("latency_slo", "latency_gate", 300.0, "e2e_p99", 9.0, 5.0, 2.0, 295.0, 300.0)


@pytest.mark.parametrize("off,scope,decides", [
    # a cohort scope: quiet when its bundle or cohort is off, not for another cohort or a bucket
    ([("b-1", None, None)], ("b-1", None, "canary"), False),
    ([("b-1", None, "canary")], ("b-1", None, "canary"), False),
    ([("b-1", None, "main"), ("b-1", "coding", None)], ("b-1", None, "canary"), True),
    # a bucket scope is quiet under a disabled bundle, not under a disabled cohort
    ([("b-1", None, None)], ("b-1", "coding", None), False),
    ([("b-1", None, "canary")], ("b-1", "coding", None), True),
])
def test_a_scope_is_quiet_only_under_an_off_scope_that_covers_it(off, scope, decides):
    flags = FlagStore()
    for covering in off:
        flags.override(covering, False, by="oncall", reason="test", ts=1.0)
    got = FallbackPolicy(Policy(), flags).decide(_SLO, scope, 4)
    assert (None if got is None else (got.action, got.bucket, got.cohort)) == (
        ("disable_speculation", *scope[1:]) if decides else None)
