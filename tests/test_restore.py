"""Restore: a disabled path comes back only when policy allows, on clean evidence, with backoff."""

import pytest

from specwatch.actions.flags import FlagStore
from specwatch.actions.fallback import FallbackPolicy
from specwatch.lab.simulation.simulator import Simulator
from specwatch.detectors.monitor import Finding
from specwatch.detectors.recovery import RecoveryEvidence
from specwatch.schemas import Policy, PolicyError

from telemetry_log import replayed

SCOPE = ("b-1", "extraction", "main")
CLEAN = RecoveryEvidence("traffic", 100.0, 160.0, requests=500, error_rate=0.002, error_limit=0.02)
KV_LOW = RecoveryEvidence("kv", 100.0, 160.0, kv_peak=0.81, kv_limit=0.92)


def _policy(**actions) -> Policy:
    return Policy.model_validate({"actions": {"cooldown_seconds": 30, **actions}})


def _finding(reason: str, ts: float) -> Finding:
    return Finding(reason, f"{reason}_gate", ts, "m", 1.0, 0.5, 0.1, ts - 60.0, ts)


def _disable(fp: FallbackPolicy, reason: str, ts: float, scope=SCOPE):
    decision = fp.decide(_finding(reason, ts), scope, draft_length=4)
    assert decision.action == "disable_speculation"
    fp.flags.apply(decision)
    return decision


def test_restore_is_off_unless_configured():
    fp = FallbackPolicy(Policy(), FlagStore())
    _disable(fp, "error_rate", 100.0)
    assert Policy().actions.restore_after_seconds is None
    assert fp.restore_wait(SCOPE) is None
    assert fp.restore_due(10_000.0) == []
    assert fp.restore(SCOPE, 10_000.0, [CLEAN, KV_LOW]) is None


def test_restore_waits_then_needs_clean_evidence():
    fp = FallbackPolicy(_policy(restore_after_seconds=120), FlagStore())
    disabled = _disable(fp, "error_rate", 100.0)
    assert fp.restore_due(219.0) == [] and fp.restore(SCOPE, 219.0, [CLEAN]) is None
    assert fp.restore_due(220.0) == [SCOPE]
    dirty = RecoveryEvidence("traffic", 160.0, 220.0, requests=500, error_rate=0.05, error_limit=0.02)
    assert fp.restore(SCOPE, 220.0, [dirty, KV_LOW]) is None
    assert fp.restore(SCOPE, 221.0, [CLEAN, RecoveryEvidence("kv", 161.0, 221.0, kv_peak=0.97, kv_limit=0.92)]) is None
    assert fp.restore(SCOPE, 222.0, [KV_LOW]) is None  # no traffic seen: nothing to judge by
    assert fp.restore(SCOPE, 223.0, [CLEAN, KV_LOW], last_mismatch_ts=150.0) is None  # shadow mismatch since
    restore = fp.restore(SCOPE, 224.0, [CLEAN, KV_LOW], last_mismatch_ts=90.0)  # mismatch before: fine
    assert (restore.action, restore.reason, restore.bucket, restore.cohort) == (
        "restore", "error_rate", "extraction", "main")
    assert restore.evidence["restores_decision"] == disabled.id
    assert restore.evidence["disabled_for_seconds"] == 124.0
    assert fp.flags.apply(restore)
    assert fp.flags.lookup("b-1", "extraction", "main").enabled
    assert fp.restore_due(10_000.0) == []


def test_repeated_disables_back_off_exponentially_up_to_the_cap():
    fp = FallbackPolicy(_policy(restore_after_seconds=100, restore_backoff=3.0, restore_max_seconds=1000),
                        FlagStore())
    waits, now = [], 0.0
    for _ in range(4):
        _disable(fp, "error_rate", now)
        waits.append(fp.restore_wait(SCOPE))
        now += waits[-1]
        fp.flags.apply(fp.restore(SCOPE, now, [CLEAN]))
    assert waits == [100.0, 300.0, 900.0, 1000.0]


def test_cooldown_is_the_shortest_wait():
    fp = FallbackPolicy(_policy(restore_after_seconds=60, cooldown_seconds=300), FlagStore())
    _disable(fp, "latency_slo", 0.0)
    assert fp.restore_wait(SCOPE) == 300.0


def test_quality_regressions_and_manual_overrides_are_never_restored_automatically():
    fp = FallbackPolicy(_policy(restore_after_seconds=60), FlagStore())
    bucket_scope = ("b-1", "structured", None)
    _disable(fp, "quality_regression", 0.0, scope=bucket_scope)
    assert fp.restore_wait(bucket_scope) is None and fp.restore_due(1e6) == []
    _disable(fp, "error_rate", 0.0)
    fp.flags.override(SCOPE, enabled=False, by="oncall", reason="investigating", ts=30.0)
    assert fp.restore(SCOPE, 100.0, [CLEAN]) is None
    assert not fp.flags.lookup("b-1", "extraction", "main").enabled


def test_restore_settings_are_validated():
    with pytest.raises(ValueError, match="restore_evidence_seconds must not exceed"):
        _policy(restore_after_seconds=30, restore_evidence_seconds=60)
    with pytest.raises(ValueError, match="restore_reasons"):
        _policy(restore_reasons=["not_a_reason"])
    assert _policy(restore_after_seconds=60).actions.restore_evidence_seconds == 60.0


def test_policy_file_error_names_the_restore_setting(tmp_path):
    from specwatch.schemas import load_policy

    path = tmp_path / "policy.toml"
    path.write_text("[actions]\nrestore_backoff = 0.5\n")
    with pytest.raises(PolicyError, match="actions.restore_backoff"):
        load_policy(path)


def test_closed_loop_restores_with_backoff_and_never_flaps():
    # The coding drafter stays broken: each restore is a trial the gates fail again, so the
    # path comes back after 60 s, then 120 s, then 240 s -- never in a tight loop. A restore
    # brings the path back at the D it was last lowered to, never longer: the first at D 2,
    # which the gates lower to 1, the second at D 1, which they can only disable.
    policy = _policy(restore_after_seconds=60)
    flags = FlagStore()
    sim = Simulator("acceptance_drop", seed=11, minutes=6.0, workers=2, flags=flags, incident_at=90.0)
    pipeline = replayed(sim.records(), policy, flags=flags)
    got = [(round(d.ts - sim.start_ts, 2), d.action, d.bucket, d.cohort) for d in pipeline.decisions]
    assert got == [
        (95.0, "reduce_draft_length", "coding", "main"),
        (113.0, "disable_speculation", "coding", "main"),
        (184.0, "restore", "coding", "main"),
        (191.0, "reduce_draft_length", "coding", "main"),
        (209.0, "disable_speculation", "coding", "main"),
        (241.99, "reduce_draft_length", "coding", "canary"),
        (259.0, "disable_speculation", "coding", "canary"),
        (329.0, "restore", "coding", "main"),
        (337.0, "disable_speculation", "coding", "main"),
    ]
    restores = [d for d in pipeline.decisions if d.action == "restore"]
    assert [d.evidence["waited_for_seconds"] for d in restores] == [60.0, 120.0]
    assert [d.evidence["draft_length"] for d in restores] == [2, 1]
    lowered = [d.evidence["draft_length"] for d in pipeline.decisions
               if d.action == "reduce_draft_length" and d.cohort == "main"]
    assert lowered == [2, 1]
    assert all(d.reason == "acceptance_drop" and d.detector == "restore_policy" for d in restores)
    # every restore was judged on standard-decoding traffic only, and found clean
    for d in restores:
        traffic = [e for e in d.evidence["evidence"] if e["kind"] == "traffic"]
        assert traffic[0]["speculative_requests"] == 0 and traffic[0]["requests"] >= 100
    # the quiet canary cohort never had enough standard traffic to judge: it stays off
    assert not flags.lookup(sim.initial_bundle_id, "coding", "canary").enabled
    assert not flags.lookup(sim.initial_bundle_id, "coding", "main").enabled


def test_a_restore_after_a_lowered_d_comes_back_at_that_d():
    fp = FallbackPolicy(_policy(restore_after_seconds=60), FlagStore())
    scope = ("b-1", "coding", "main")
    drop = Finding("acceptance_drop", "acceptance_gate", 10.0, "acceptance_length", 2.0, 2.5, 3.0, 5.0, 10.0)
    lowered = fp.decide(drop, scope, draft_length=4)
    assert lowered.evidence["draft_length"] == 2
    fp.flags.apply(lowered)
    still = Finding("acceptance_drop", "acceptance_gate", 40.0, "acceptance_length", 1.5, 2.0, 2.4, 35.0, 40.0)
    fp.flags.apply(fp.decide(still, scope, draft_length=4))
    assert not fp.flags.lookup("b-1", "coding", "main").enabled
    restored = fp.restore(scope, 200.0, [CLEAN])
    assert restored.action == "restore" and restored.evidence["draft_length"] == 2
    fp.flags.apply(restored)
    state = fp.flags.lookup("b-1", "coding", "main")
    assert state.enabled and state.draft_limit == 2
