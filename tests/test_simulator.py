"""The simulated fleet: deterministic, contract-valid, and each incident does what it claims.
Short runs with incidents brought forward: a clean stretch before each incident, enough after."""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict

import numpy as np
import pytest

from specwatch.actions.flags import FlagStore
from specwatch.cli import main
from specwatch.lab.simulation.simulator import (BUCKETS, COHORTS, DEFAULT_CARD, SCENARIOS, Incident, Simulator,
                                            acceptance_length)
from specwatch.schemas import (BundleRecord, Decision, RequestRecord, ShadowRecord, StepRecord, bundle_digest,
                               card_differences, decode_line, encode_record)
from specwatch.schemas.codec import Rejection

SEED = 5
INCIDENT_AT = 30.0


def _run(scenario: str, **settings) -> tuple[Simulator, list]:
    settings = {"seed": SEED, "workers": 3, "minutes": 1.25, "incident_at": INCIDENT_AT, **settings}
    sim = Simulator(scenario, **settings)
    return sim, list(sim.records())


def _split(sim: Simulator, records: list, at: float | None = None) -> tuple[list, list]:
    cut = sim.start_ts + (INCIDENT_AT if at is None else at)
    return [r for r in records if r.ts < cut], [r for r in records if r.ts >= cut]


def _acceptance_lengths(records) -> dict[str, float]:
    rounds, accepted = defaultdict(int), defaultdict(int)
    for record in records:
        if record.kind == "step":
            for entry in record.requests:
                if entry.drafted:
                    rounds[entry.bucket] += 1
                    accepted[entry.bucket] += entry.accepted
    return {bucket: 1.0 + accepted[bucket] / rounds[bucket] for bucket in rounds}


def _requests(records, bucket: str | None = None, cohort: str | None = None) -> list[RequestRecord]:
    return [r for r in records
            if r.kind == "request" and bucket in (None, r.bucket) and cohort in (None, r.cohort)]


def _lines(records) -> list[str]:
    return [encode_record(r) for r in records]


@pytest.fixture(scope="module")
def demo_run():
    # every incident kind of the demo inside two and a half minutes
    return _run("demo", workers=2, minutes=2.5, incident_at=5.0)


@pytest.fixture(scope="module")
def healthy_run():
    return _run("healthy")


def test_same_seed_gives_identical_lines_and_another_seed_does_not():
    def demo(seed):
        return Simulator("demo", seed=seed, workers=2, minutes=0.5, incident_at=5.0)

    sim = demo(3)
    first, rerun = _lines(sim.records()), _lines(sim.records())  # each call is a fresh run
    again, other = (_lines(demo(seed).records()) for seed in (3, 4))
    assert first == rerun == again
    assert len(first) > 4_000
    assert other != first
    assert other[:2] == first[:2]  # the same fleet announces the same bundle at start


def test_records_round_trip_through_the_contract_and_steps_behave_like_validated_ones(demo_run):
    _, records = demo_run
    kinds = defaultdict(int)
    for record in records:
        line = encode_record(record)
        decoded = decode_line(line)
        assert not isinstance(decoded, Rejection), decoded
        assert decoded == record
        assert encode_record(decoded) == line
        kinds[record.kind] += 1
    assert set(kinds) == {"bundle", "step", "request", "shadow"}
    for step in [r for r in records if isinstance(r, StepRecord)][::500]:
        validated = StepRecord(**{name: getattr(step, name) for name in step.model_fields_set})
        assert validated == step and validated.model_fields_set == step.model_fields_set
        assert encode_record(validated) == encode_record(step)
        assert step.model_copy(update={"seq": 0}).seq == 0 and step.seq > 0


def test_records_come_in_event_time_order_with_per_worker_sequences(demo_run):
    sim, records = demo_run
    times = [r.ts for r in records]
    assert times == sorted(times)
    assert times[0] == sim.start_ts and times[-1] <= sim.end_ts
    last_seq: dict[str, int] = {}
    bundle_of: dict[str, str] = {}
    for record in records:
        if record.kind == "bundle":
            bundle_of[record.worker] = record.bundle_id
        elif record.kind == "step":
            assert record.worker in bundle_of, "a worker announces its bundle before its first step"
            assert record.bundle_id == bundle_of[record.worker]
            assert record.seq > last_seq.get(record.worker, -1)
            last_seq[record.worker] = record.seq
            assert len({e.id for e in record.requests}) == len(record.requests)
    assert sorted(last_seq) == ["w1", "w2"]


def test_heartbeats_every_minute(healthy_run):
    sim, records = healthy_run
    beats = defaultdict(list)
    for record in records:
        if record.kind == "bundle":
            beats[record.worker].append(record.ts - sim.start_ts)
    for times in beats.values():
        assert times[0] == 0.0
        assert len(times) == 2 and 60.0 <= times[1] < 60.2
    assert all(r.card == DEFAULT_CARD for r in records if r.kind == "bundle")


def test_request_records_are_consistent(demo_run):
    sim, records = demo_run
    requests = _requests(records)
    assert len(requests) > 1_000
    for r in requests:
        assert r.ttft_ms > 0 and r.e2e_ms >= r.ttft_ms
        if r.output_tokens > 1:
            assert math.isclose(r.tpot_ms, (r.e2e_ms - r.ttft_ms) / (r.output_tokens - 1), rel_tol=1e-3, abs_tol=1e-3)
        else:
            assert r.tpot_ms is None
        assert (r.error is not None) == r.failed
        assert len(r.sample.prompt_sha256) == 64 and int(r.sample.prompt_sha256, 16) >= 0
        assert r.sample.sampling.max_tokens >= r.output_tokens
    reasons = Counter(r.finish_reason for r in requests)
    assert reasons["stop"] > reasons["length"] > 0
    assert reasons["error"] > 0 and reasons["timeout"] > 0


def test_bucket_acceptance_lengths_follow_their_profiles(healthy_run):
    _, records = healthy_run
    observed = _acceptance_lengths(records)
    expected = {b.name: acceptance_length(b.position_acceptance, 4, b.acceptance_decay) for b in BUCKETS}
    assert sorted(observed, key=observed.get, reverse=True) == [
        "structured", "coding", "extraction", "summarization", "reasoning", "long_context"]
    for bucket, al in observed.items():
        assert abs(al - expected[bucket]) < 0.1, (bucket, al, expected[bucket])
    assert 1.0 < min(observed.values()) and max(observed.values()) < 5.0


def test_baseline_cohort_never_drafts_and_speculative_cohorts_do(healthy_run):
    _, records = healthy_run
    drafted = defaultdict(int)
    for record in records:
        if record.kind == "step":
            for entry in record.requests:
                drafted[entry.cohort] += entry.drafted
                if entry.cohort == "baseline":
                    assert entry.drafted == 0 and entry.accepted == 0
                else:
                    assert entry.drafted == 4
        elif record.kind == "request":
            assert record.speculative == (record.cohort != "baseline")
        elif record.kind == "shadow":
            assert record.match
    assert drafted["baseline"] == 0 and drafted["main"] > drafted["canary"] > 0
    assert COHORTS == ("main", "canary", "baseline", "shadow")


def test_healthy_fleet_is_plausible(healthy_run):
    sim, records = healthy_run
    steps = [r for r in records if r.kind == "step"]
    kv = np.array([s.kv_usage for s in steps])
    batch = np.array([len(s.requests) for s in steps])
    draft = sum(s.draft_ms for s in steps)
    verify = sum(s.verify_ms for s in steps)
    assert 0.35 < kv.mean() < 0.75 and kv.max() < 0.9
    assert 12 < batch.mean() < 20
    assert 0.2 < draft / verify < 0.5
    al = _acceptance_lengths(records)
    speedup = {b: a / (1 + draft / verify) for b, a in al.items()}  # AL / (1 + rho*D)
    assert min(speedup.values()) > 1.1 and 1.5 < speedup["coding"] < 2.6
    cohorts = Counter(r.cohort for r in _requests(records))
    total = sum(cohorts.values())
    assert 0.85 < cohorts["main"] / total < 0.95
    assert 0.02 < cohorts["canary"] / total < 0.08 and 0.02 < cohorts["baseline"] / total < 0.08


# Admission scenarios without an incident of their own kind: a clean rollout, and a card change.
# A quiet-bucket scenario changes the mix from the start (tested below).
INCIDENT_SCENARIOS = [name for name in SCENARIOS
                      if name not in ("healthy", "mix_shift", "diurnal", "demo", "admission", "admission_change")
                      and not name.endswith("_quiet_bucket")]


@pytest.mark.parametrize("scenario", INCIDENT_SCENARIOS)
def test_nothing_changes_before_the_incident(scenario, healthy_run):
    sim, records = _run(scenario, minutes=0.6)
    before, after = _split(sim, records)
    healthy_before, _ = _split(*healthy_run)
    assert _lines(before) == _lines(healthy_before)
    assert after
    [incident] = sim.incidents
    assert isinstance(incident, Incident)
    assert incident.start_ts == sim.start_ts + INCIDENT_AT and scenario.startswith(incident.kind)


def test_quiet_keys_carry_a_few_percent_and_only_theirs_is_hit():
    _, records = _run("error_burst_quiet_bucket", intensity=40.0, minutes=3.0)
    requests = _requests(records)
    share = sum(r.bucket == "extraction" for r in requests) / len(requests)
    assert 0.025 < share < 0.045  # 3 / 88 of the weights
    sim, records = _run("error_burst_quiet_cohort", intensity=40.0, minutes=3.0)
    [incident] = sim.incidents
    assert (incident.bucket, incident.cohort, incident.expected_reason) == ("extraction", "canary", "error_rate")
    _, after = _split(sim, records)
    failed = Counter((r.cohort, r.finish_reason in ("error", "timeout"))
                     for r in _requests(after, "extraction") if r.speculative)
    # x40 on canary (0.2% to 8%), main as before
    assert failed["canary", True] / (failed["canary", True] + failed["canary", False]) > 0.04
    assert failed["main", True] / (failed["main", True] + failed["main", False]) < 0.01


def test_acceptance_drop_lowers_one_bucket_by_the_intensity():
    sim, records = _run("acceptance_drop", intensity=0.4)
    before, after = _split(sim, records)
    al_before, al_after = _acceptance_lengths(before), _acceptance_lengths(after)
    assert al_after["coding"] / al_before["coding"] == pytest.approx(0.6, abs=0.04)
    for bucket in al_before:
        if bucket != "coding":
            assert al_after[bucket] == pytest.approx(al_before[bucket], rel=0.06)
    [incident] = sim.incidents
    assert (incident.bucket, incident.cohort, incident.expected_reason) == ("coding", None, "acceptance_drop")


def test_draft_regression_multiplies_draft_time():
    sim, records = _run("draft_regression")
    before, after = _split(sim, records)

    def mean_draft(steps):
        return np.mean([s.draft_ms for s in steps if s.kind == "step"])

    assert mean_draft(after) / mean_draft(before) == pytest.approx(3.0, rel=0.08)
    assert sim.incidents[0].expected_reason == "draft_overhead"


@pytest.mark.parametrize("scenario,field", [("target_update", "target.revision"),
                                            ("bundle_change", "target.tokenizer_digest")])
def test_card_changes_announce_a_new_bundle(scenario, field):
    sim, records = _run(scenario)
    [incident] = sim.incidents
    old = bundle_digest(DEFAULT_CARD)
    assert incident.bundle_id != old and incident.expected_reason == "bundle_changed"
    assert set(sim.bundle_cards) == {old, incident.bundle_id}
    assert card_differences(DEFAULT_CARD, sim.bundle_cards[incident.bundle_id]) == [field]
    announced = {}
    for record in records:
        if record.kind == "bundle" and record.bundle_id == incident.bundle_id:
            assert record.ts >= incident.start_ts
            assert bundle_digest(record.card) == record.bundle_id
            announced.setdefault(record.worker, record.ts - incident.start_ts)
        if record.kind in ("step", "request") and record.ts < incident.start_ts:
            assert record.bundle_id == old
    assert sorted(announced) == ["w1", "w2", "w3"]
    assert max(announced.values()) < 10.0  # rolled over the fleet within ten seconds
    before, after = _split(sim, records, INCIDENT_AT + 10.0)
    new_steps = [r for r in after if r.kind == "step"]
    assert new_steps and all(s.bundle_id == incident.bundle_id for s in new_steps)
    ratio = _acceptance_lengths(after)["coding"] / _acceptance_lengths(before)["coding"]
    if scenario == "target_update":
        assert ratio < 0.6  # the old drafter no longer matches the new target
    else:
        assert ratio == pytest.approx(1.0, abs=0.06)


def test_latency_tail_hits_a_tenth_of_one_bucket_and_cohort():
    sim, records = _run("latency_tail", workers=4)
    before, after = _split(sim, records)

    def p99(rs, metric, bucket, cohort):
        return np.percentile([getattr(r, metric) for r in _requests(rs, bucket, cohort)], 99)

    # stalled requests finish late, so their records (and the e2e tail) arrive over time
    assert p99(after, "tpot_ms", "reasoning", "main") > 2.5 * p99(before, "tpot_ms", "reasoning", "main")
    assert p99(after, "e2e_ms", "reasoning", "main") > 1.3 * p99(before, "e2e_ms", "reasoning", "main")
    for metric in ("tpot_ms", "e2e_ms"):
        assert p99(after, metric, "coding", "main") < 1.3 * p99(before, metric, "coding", "main")
        assert p99(after, metric, "reasoning", "canary") < 1.3 * p99(before, metric, "reasoning", "canary")
    late = _requests(after, "reasoning", "main")
    slow = [r for r in late if r.tpot_ms > 20.0]  # healthy reasoning TPOT is ~7 ms
    assert 0.04 < len(slow) / len(late) < 0.15


def test_kv_pressure_pushes_some_workers_above_the_watermark():
    sim, records = _run("kv_pressure", workers=4)
    [incident] = sim.incidents
    assert incident.workers == ("w4",)
    before, after = _split(sim, records)
    assert max(s.kv_usage for s in before if s.kind == "step") < 0.9
    assert max(s.kv_usage for s in after if s.kind == "step" and s.worker != "w4") < 0.9
    peaks: dict[int, float] = defaultdict(float)  # per second of event time, as a monitor slices it
    for s in after:
        if s.kind == "step" and s.worker == "w4" and s.ts > incident.start_ts + 10:
            peaks[int(s.ts)] = max(peaks[int(s.ts)], s.kv_usage)
    assert np.mean([peak > 0.95 for peak in peaks.values()]) > 0.5


def test_quality_mismatch_appears_only_in_its_bucket_after_the_start():
    sim, records = _run("quality_mismatch", workers=4, minutes=1.5, intensity=1.0)
    shadows = [r for r in records if isinstance(r, ShadowRecord)]
    mismatched = [s for s in shadows if not s.match]
    assert len(mismatched) >= 3
    assert all(s.bucket == "structured" and s.ts >= sim.incidents[0].start_ts for s in mismatched)
    assert all(s.match for s in shadows if s.bucket != "structured")
    assert sim.incidents[0].expected_reason == "quality_regression"


def test_error_burst_raises_the_error_rate_of_one_bucket():
    sim, records = _run("error_burst", workers=4, minutes=1.5)
    before, after = _split(sim, records)

    def failure_rate(rs, bucket):
        return np.mean([r.failed for r in _requests(rs, bucket)])

    assert failure_rate(after, "extraction") > 0.02
    assert failure_rate(before, "extraction") < 0.01
    assert failure_rate(after, "coding") < 0.01
    assert all(r.error for r in _requests(after) if r.failed)


def test_demo_staggers_five_incidents_with_their_reasons():
    sim = Simulator("demo")
    assert sim.minutes == 6.0
    got = [(i.kind, i.start_ts - sim.start_ts, i.bucket, i.cohort, i.expected_reason) for i in sim.incidents]
    assert got == [
        ("acceptance_drop", 150.0, "coding", None, "acceptance_drop"),
        ("quality_mismatch", 185.0, "structured", None, "quality_regression"),
        ("latency_tail", 220.0, "reasoning", "main", "latency_slo"),
        ("error_burst", 255.0, "extraction", None, "error_rate"),
        ("kv_pressure", 290.0, None, None, "kv_pressure"),
    ]
    assert {i.bundle_id for i in sim.incidents} == {bundle_digest(DEFAULT_CARD)}
    # incidents past the end are not reported
    assert Simulator("acceptance_drop", minutes=3.0).incidents == []
    assert Simulator("healthy").incidents == []


def test_mix_shift_moves_traffic_to_hard_buckets_without_changing_them():
    sim, records = _run("mix_shift", workers=2, minutes=3.0)
    before, after = _split(sim, records, 60.0)
    _, late = _split(sim, records, 150.0)

    def share(rs, bucket):
        return np.mean([r.bucket == bucket for r in _requests(rs)])

    assert share(late, "reasoning") > share(before, "reasoning") + 0.05
    al_before, al_late = _acceptance_lengths(before), _acceptance_lengths(late)
    for bucket in al_before:
        assert al_late[bucket] == pytest.approx(al_before[bucket], rel=0.06)
    assert sim.incidents == []


def test_flag_decisions_take_effect_on_later_rounds_and_requests():
    flags = FlagStore()
    sim = Simulator("healthy", seed=SEED, workers=3, minutes=1.0, flags=flags)
    bundle_id = bundle_digest(DEFAULT_CARD)
    disable_at, limit_at = sim.start_ts + 20.0, sim.start_ts + 40.0
    lag = 0.5  # a decision reaches every engine within a block of steps
    applied = set()
    late_coding, late_reasoning, coding_requests = [], [], []
    for record in sim.records():
        if record.ts >= disable_at and "disable" not in applied:
            applied.add("disable")
            flags.apply(Decision(ts=record.ts, bundle_id=bundle_id, bucket="coding", cohort=None,
                                 action="disable_speculation", reason="acceptance_drop", detector="test"))
        if record.ts >= limit_at and "limit" not in applied:
            applied.add("limit")
            flags.apply(Decision(ts=record.ts, bundle_id=bundle_id, bucket="reasoning", cohort="main",
                                 action="reduce_draft_length", reason="kv_pressure", detector="test",
                                 evidence={"draft_length": 2}))
        if isinstance(record, StepRecord):
            for entry in record.requests:
                if entry.bucket == "coding" and record.ts > disable_at + lag:
                    late_coding.append(entry)
                if (entry.bucket, entry.cohort) == ("reasoning", "main") and record.ts > limit_at + lag:
                    late_reasoning.append(entry)
        elif isinstance(record, RequestRecord) and record.bucket == "coding":
            coding_requests.append(record)
    assert late_coding and all(e.drafted == 0 and e.accepted == 0 for e in late_coding)
    assert late_reasoning and {e.drafted for e in late_reasoning} == {2}
    admitted_after = [r for r in coding_requests if r.ts - r.e2e_ms / 1000.0 > disable_at + lag]
    finished_before = [r for r in coding_requests if r.ts < disable_at and r.cohort != "baseline"]
    assert admitted_after and not any(r.speculative for r in admitted_after)
    assert finished_before and all(r.speculative for r in finished_before)


def test_disabled_from_the_start_the_bucket_never_speculates():
    flags = FlagStore()
    flags.apply(Decision(ts=0.0, bundle_id=bundle_digest(DEFAULT_CARD), bucket="structured", cohort=None,
                         action="disable_speculation", reason="quality_regression", detector="test"))
    sim, records = _run("quality_mismatch", minutes=0.75, intensity=1.0, flags=flags)
    structured = _requests(records, "structured")
    assert structured and not any(r.speculative for r in structured)
    assert not any(isinstance(r, ShadowRecord) and r.bucket == "structured" for r in records)
    assert any(r.speculative for r in _requests(records))


@pytest.mark.parametrize("settings,message", [
    ({"scenario": "nope"}, "unknown scenario 'nope'"),
    ({"scenario": "acceptance_drop", "intensity": 1.5}, "intensity for acceptance_drop"),
    ({"scenario": "demo", "intensity": 0.5}, "has 5 incidents"),
    ({"scenario": "healthy", "minutes": 0}, "minutes must be a positive number"),
    ({"scenario": "healthy", "workers": 0}, "workers must be between"),
    ({"scenario": "healthy", "seed": -1}, "seed must be a non-negative integer"),
    ({"scenario": "healthy", "flags": object()}, "lookup(bundle_id, bucket, cohort)"),
])
def test_bad_settings_are_refused_with_a_reason(settings, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Simulator(**settings)


def test_simulate_command_writes_contract_lines(tmp_path, capsys):
    out = tmp_path / "telemetry.jsonl"
    args = ["simulate", "--output", str(out), "--scenario", "error_burst", "--seed", "3", "--workers", "2",
            "--minutes", "0.3", "--incident-at", "10", "--intensity", "30"]
    assert main(args) == 0
    summary = capsys.readouterr().err.strip().splitlines()
    assert len(summary) == 1
    assert "error_burst@10s[extraction]" in summary[0] and "2 bundle" in summary[0]
    lines = out.read_text().splitlines()
    expected = Simulator("error_burst", seed=3, workers=2, minutes=0.3, incident_at=10.0, intensity=30.0)
    assert lines == _lines(expected.records())
    assert isinstance(decode_line(lines[0]), BundleRecord)


def test_simulate_command_lists_scenarios_and_refuses_bad_input(tmp_path, capsys):
    assert main(["simulate", "--list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in listed] == list(SCENARIOS)
    assert "demo" in SCENARIOS and "healthy" in SCENARIOS
    assert all(description and "\n" not in description for description in SCENARIOS.values())
    assert main(["simulate"]) == 2
    assert "--output" in capsys.readouterr().err
    assert main(["simulate", "--output", str(tmp_path / "x.jsonl"), "--scenario", "nope"]) == 2
    assert "unknown scenario" in capsys.readouterr().err
