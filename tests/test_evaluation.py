"""Detection quality: a small seeded subset of `specwatch evaluate` (short runs, two workers),
with exact expected outcomes; the full suite's numbers are in docs/EVALUATION.md."""

import json
import math

import pytest

from specwatch.lab.evaluation import (LEVELS, AcceptanceKillSwitch, BaselineSettings, Case, PrometheusRatioAlert, calibrate,
                                  bernoulli_kl, format_report, full_suite, information_bound, plot_sweep, quick_suite,
                                  run_case, run_suite, summarize)
from specwatch.lab.evaluation.suite import _incident_case, _kv_evidence, _watch_seconds, incident_kind

from machine import specwatch

SETTINGS = BaselineSettings.from_healthy_rate(0.348)  # what `specwatch evaluate` calibrates: thresholds 0.25
START = 1_767_225_600.0

CASES = [
    Case("acceptance_drop", 0.4, "coding AL -40%", 2.5, workers=2),
    Case("target_update", 0.5, "new target, AL -50%", 2.0, workers=2),
    Case("quality_mismatch", 1.0, "every shadow check mismatches", 2.5, workers=2),
    Case("healthy", None, "steady load and mix", 3.0, workers=2),
]


@pytest.fixture(scope="module")
def results():
    return {r["scenario"]: r for r in run_suite(CASES, SETTINGS, processes=1)}


def _outcome(result, detector):
    (row,) = result["incidents"]
    verdict = row[detector]
    alarm = verdict["alarm"] or {}
    return verdict["verdict"], verdict["delay_s"], alarm.get("action"), alarm.get("bucket"), alarm.get(
        "cohort"), alarm.get("worker")


def _alarms(result, detector):
    return [(round(a["ts"] - START, 2), a["action"], a["bucket"], a["cohort"], a["worker"])
            for a in result["alarms"][detector]]


def test_acceptance_drop_in_one_bucket(results):
    r = results["acceptance_drop"]
    # specwatch lowers D for the coding bucket, in its own scope, within seconds (a slice
    # later than with whole windows: the window leaves out its most damaging slice)
    assert _outcome(r, "specwatch") == ("right", 6.0, "reduce_draft_length", "coding", "main", None)
    # the quiet canary cohort (a few requests a minute here) is not judged on so little evidence
    assert _alarms(r, "specwatch") == [
        (96.0, "reduce_draft_length", "coding", "main", None),
        (111.0, "disable_speculation", "coding", "main", None),
    ]
    # all traffic mixed, a quarter of it degraded stays above both acceptance thresholds
    assert _outcome(r, "kill_switch")[0] == "missed"
    assert _outcome(r, "prometheus")[0] == "missed"
    assert all(not fa["alarms"] for fa in r["false_alarms"].values())


def test_target_update_is_caught_by_its_card_before_acceptance_falls(results):
    r = results["target_update"]
    assert _outcome(r, "specwatch") == ("right", 2.0, "invalidate_bundle", None, None, None)
    # the kill switch sees acceptance collapse on each worker a few seconds later; the alert
    # rule cannot fire inside its 2-minute 'for'
    assert _outcome(r, "kill_switch") == ("right", 5.189, "disable_speculation", None, None, "w1")
    assert _alarms(r, "kill_switch") == [(95.19, "disable_speculation", None, None, "w1"),
                                         (100.71, "disable_speculation", None, None, "w2")]
    assert _outcome(r, "prometheus")[0] == "missed"


def test_strict_shadow_mismatch_is_measured_from_the_first_mismatch_record(results):
    r = results["quality_mismatch"]
    (row,) = r["incidents"]
    assert row["measured_from"] == "first_mismatch_record"
    assert _outcome(r, "specwatch") == ("right", 1.559, "disable_speculation", "structured", None, None)
    assert _outcome(r, "kill_switch")[0] == _outcome(r, "prometheus")[0] == "missed"


def test_no_alarm_without_incident(results):
    r = results["healthy"]
    assert r["incidents"] == []
    assert {d: r["alarms"][d] for d in r["alarms"]} == {"specwatch": [], "kill_switch": [], "prometheus": []}


def test_summary_is_one_json_object_and_a_table(results):
    summary = summarize([results[c.scenario] for c in CASES], SETTINGS.to_dict(), "test")
    text = json.dumps(summary, allow_nan=False)
    assert json.loads(text)["mode"] == "test"
    assert [(e["scenario"], e["specwatch"]["verdict"]) for e in summary["table"]] == [
        ("acceptance_drop", "right"), ("target_update", "right"), ("quality_mismatch", "right")]
    # faster than the only baseline that alarmed at all; nothing to compare where none did
    assert [e["faster_than_baselines"] for e in summary["table"]] == [None, True, None]
    fa = summary["false_alarms"]
    assert fa["incident_free_hours"] == 0.05 and fa["incident_free_bucket_hours"] == 0.3
    assert all(fa[d]["per_hour"] == 0.0 for d in ("specwatch", "kill_switch", "prometheus"))
    report = format_report(summary)
    assert "kill switch: rolling mean of per-iteration acceptance over 1000 iterations < 0.25" in report
    assert [line.rstrip() for line in report.splitlines() if line.startswith("target_update")] == [
        "target_update     new target, AL -50%          2x16       0      2.0s right                  -     -"
        "      5.2s right        missed"]
    # acceptance evidence grows with the rounds of the coding/main key: its bound is far under a slice
    (acceptance,) = [e for e in summary["table"] if e["scenario"] == "acceptance_drop"]
    assert acceptance["bound"]["seconds"] < 1.0 and acceptance["within_bound"] is None


def test_plot_of_delay_against_traffic(results, tmp_path):
    summary = summarize([results[c.scenario] for c in CASES], SETTINGS.to_dict(), "test")
    path = tmp_path / "sweep.png"
    plot_sweep(summary, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_information_bound_of_an_error_burst():
    # errors x5 (0.2% to 1%) on a key finishing 2 requests a second: an ideal CUSUM with a
    # false alarm per 1000 key-hours needs ln(7.2e6) / KL = 1943 requests, 16 minutes
    bound = information_bound("error_burst", 5.0, 2.0, 1e-3)
    assert bound == {"kl_per_observation": 0.00813, "observations": 1943.0, "observations_per_second": 2.0,
                     "seconds": 971.5}
    assert information_bound("kv_pressure", 0.6, 2.0, 1e-3) is None  # decided by one slice
    assert math.isclose(bernoulli_kl(0.04, 0.002), 0.0826, abs_tol=1e-4)


def test_information_bound_of_a_tail_counts_records_when_they_arrive():
    # 10% of a key's requests (10 a second) stall x5. Were every slow record seen at once, an
    # ideal CUSUM with a false alarm per 1000 key-hours would need ln(3.6e7) / (10 x 0.2233
    # nats) = 7.8 s; a stall holds each record back by 4 times its decode time, so with decodes
    # of 2 s and 8 s half the slow records arrive after 8 s and the rest after 32 s.
    at_once = information_bound("latency_tail", 5.0, 10.0, 1e-3)
    held_back = information_bound("latency_tail", 5.0, 10.0, 1e-3, decode_seconds=[2.0, 8.0])
    assert (at_once["kl_per_observation"], at_once["seconds"]) == (0.2233, 7.8)
    assert held_back["seconds"] == 27.8  # 0.4 nats by 8 s, then 0.86 nats a second
    assert held_back["median_decode_s"] == 8.0


def test_information_bound_of_an_acceptance_drop_counts_rounds_of_one_request_as_correlated():
    # coding's rounds share their request's difficulty level: correlation 0.0172 between two
    # rounds of one request, so 90 rounds a request carry the evidence of 90 / 2.53 independent
    # ones, and the bound at 80 rounds a second grows from 1.5 s to 3.8 s
    independent = information_bound("acceptance_drop", 0.25, 80.0, 1e-2, "coding")
    bound = information_bound("acceptance_drop", 0.25, 80.0, 1e-2, "coding", rounds_per_request=90.0)
    assert independent["seconds"] == bound["seconds_independent_rounds"] == 1.5
    assert (bound["within_request_correlation"], bound["design_effect"], bound["seconds"]) == (0.01721, 2.531, 3.8)


def test_suites_cover_every_row_of_the_fallback_table():
    full, quick = full_suite(), quick_suite()
    incident_kinds = {incident_kind(c.scenario) for c in full if not c.healthy and not c.rollout}
    assert incident_kinds == {"acceptance_drop", "target_update", "bundle_change", "draft_regression",
                              "latency_tail", "kv_pressure", "quality_mismatch", "error_burst"}
    assert {c.scenario for c in quick if not c.healthy and not c.rollout} == incident_kinds
    # quiet keys inside the big fleet: a bucket with about 3 % of the traffic, the canary cohort
    quiet = {(c.scenario, c.intensity) for c in full if (c.workers, c.concurrency) == (32, 16)}
    for kind in ("error_burst", "latency_tail"):
        for where in ("quiet_bucket", "quiet_cohort"):
            assert len({i for s, i in quiet if s == f"{kind}_{where}"}) == 2
    # rollouts under admission: at least 20 healthy ones and 20 card changes across seeds
    rollouts = [(c.scenario, c.seed) for c in full if c.rollout]
    assert sum(s == "admission" for s, _ in rollouts) >= 20 and sum(s == "admission_change" for s, _ in rollouts) >= 20
    assert {"canary_tail", "canary_mismatch"} <= {s for s, _ in rollouts}
    assert {c.scenario for c in full if c.healthy} == {"healthy", "diurnal", "mix_shift"}
    for level in LEVELS:
        # at every fleet size: every incident kind, errors x5 among them, and 24 key-hours
        # (18 bucket/cohort keys) of incident-free traffic
        here = [c for c in full if (c.workers, c.concurrency) == level and not c.rollout]
        assert {incident_kind(c.scenario) for c in here if not c.healthy} == incident_kinds
        assert ("error_burst", 5.0) in {(c.scenario, c.intensity) for c in here}
        assert sum(c.minutes for c in here if c.healthy) / 60 * 18 >= 24
    assert {(1, 4), (2, 8), (8, 16), (32, 16)} <= set(LEVELS)
    # stalls that last minutes, on a small fleet and the default one
    assert {(c.workers, c.concurrency) for c in full if (c.scenario, c.intensity) == ("latency_tail", 50.0)} == {
        (2, 8), (8, 16)}
    # targets and the baselines are judged at the default fleet
    assert all(c.workers == 8 for c in full if c.target_intensity or (c.compare_baselines and not c.healthy))
    assert all(not c.compare_baselines for c in full if c.rollout)


def test_calibration_measures_the_healthy_fleet():
    settings = calibrate(minutes=0.5, workers=2)
    assert 0.3 < settings.healthy_rate < 0.4
    assert settings.kill_switch_threshold == settings.alert_threshold == round(settings.healthy_rate - 0.10, 2)


def test_kill_switch_counts_only_speculating_iterations_and_never_rearms():
    switch = AcceptanceKillSwitch(window=3, threshold=0.5)
    for accepted, drafted in ((1, 4), (0, 0), (1, 4)):
        switch.update(accepted, drafted)
    assert not switch.disabled and math.isclose(switch.rolling_rate, 0.25)
    switch.update(1, 4)
    assert switch.drift_detected and switch.disabled
    switch.update(4, 4)
    assert switch.disabled and not switch.drift_detected
    with pytest.raises(ValueError, match="acceptance rate"):
        AcceptanceKillSwitch(window=3, threshold=1.5)


def test_alert_rule_needs_its_for_duration_and_resolves():
    alert = PrometheusRatioAlert(threshold=0.5, range_seconds=30, for_seconds=20, interval_seconds=10)
    events = []
    for second in range(200):
        low = 40 <= second < 90  # acceptance low for 50 s, then healthy again
        alert.update(float(second), 30 if low else 70, 100)
        events.append(alert.firing)
        if alert.drift_detected:
            fired = alert.fired_at
    assert fired == 80.0  # pending from the 60 s evaluation, firing 20 s later
    assert events.index(True) == 80 and not events[-1]
    with pytest.raises(ValueError, match="range_seconds"):
        PrometheusRatioAlert(threshold=0.5, range_seconds=5, interval_seconds=10)


def test_cli_rejects_bad_arguments():
    proc = specwatch("evaluate", "--processes", "0", timeout=300)
    assert proc.returncode == 2 and "--processes" in proc.stderr


def test_a_small_fleet_is_watched_until_its_shadow_checks_and_kv_peaks_arrive():
    """With one worker the first mismatch and a KV surge come minutes late: the watch grows as the
    fleet shrinks (fixed watches of 180 s and 40 s missed both)."""
    assert _watch_seconds("quality_mismatch", 0.5, 8, 16) == 180.0
    assert _watch_seconds("quality_mismatch", 0.5, 1, 4) == 1800.0
    assert _watch_seconds("kv_pressure", 0.6, 1, 4) == 1280.0
    small = {"level": (1, 4), "compare_baselines": False}
    quality = run_case(_incident_case("quality_mismatch", 0.5, **small), SETTINGS)["incidents"][0]
    assert quality["measured_from"] == "first_mismatch_record"
    assert round(quality["reference_ts"] - quality["start_ts"], 1) == 351.2
    assert (quality["specwatch"]["verdict"], quality["specwatch"]["delay_s"]) == ("right", 1.772)
    kv = run_case(_incident_case("kv_pressure", 0.6, **small), SETTINGS)["incidents"][0]
    assert (kv["specwatch"]["verdict"], kv["specwatch"]["delay_s"]) == ("right", 450.0)
    assert kv["kv_over_watermark"] == {"slices": 19, "longest_run_slices": 4, "slices_needed": 3,
                                       "sustained_from_s": 446.0}


def test_a_kv_spike_shorter_than_the_gate_needs_is_not_reached_not_missed():
    row = {"start_ts": 100.0, "specwatch": {"verdict": "missed", "delay_s": None}}
    _kv_evidence(row, {130, 131, 140}, 3, 1.0)
    assert row["kv_over_watermark"] == {"slices": 3, "longest_run_slices": 2, "slices_needed": 3,
                                        "sustained_from_s": None}
    assert row["specwatch"]["verdict"] == "not_reached"
    row = {"start_ts": 100.0, "specwatch": {"verdict": "missed", "delay_s": None}}
    _kv_evidence(row, {130, 131, 132}, 3, 1.0)
    assert (row["kv_over_watermark"]["sustained_from_s"], row["specwatch"]["verdict"]) == (30.0, "missed")


# -- the overlap suite -------------------------------------------------------------------------

from specwatch.lab.evaluation.overlap import (OverlapRun, format_overlap, overlap_runs, quick_overlap_runs,  # noqa: E402
                                          run_overlap, summarize_overlap)

# Each incident of the quick overlap runs: its verdict, its own decision's reason and scope.
_OVERLAP_EXPECTED = {
    # the demo's pair, closed loop: a fleet-wide KV surge comes 20 s into an error burst of
    # speculated extraction requests; the burst is still decided with its own reason
    "error_burst+kv_pressure/staggered/closed/w8c16/s7": [
        ("error_burst", "right", "error_rate", "extraction/main"),
        ("kv_pressure", "right", "kv_pressure", "*/*"),
    ],
    "latency_tail+acceptance_drop/together/open/w8c16/s8": [
        ("latency_tail", "right", "latency_slo", "reasoning/main"),
        ("acceptance_drop", "right", "acceptance_drop", "coding/main"),
    ],
}


@pytest.fixture(scope="module")
def overlap_results():
    return {run.name: run_overlap(run) for run in quick_overlap_runs()}


def test_overlapping_incidents_are_each_decided_with_their_own_reason_and_scope(overlap_results):
    for name, expected in _OVERLAP_EXPECTED.items():
        result = overlap_results[name]
        got = [(row["kind"], row["verdict"], row["reason"], row["scope"]) for row in result["incidents"]]
        assert sorted(got) == sorted(expected), name
        assert result["unexplained"] == [], name  # no decision whose reason matches no incident


def test_overlap_runs_are_seeded_and_cover_patterns_loops_and_fleets():
    runs = overlap_runs()
    assert runs == overlap_runs() and len(runs) == 40
    assert {r.pattern for r in runs} == {"together", "staggered", "during_fallback"}
    assert {r.closed_loop for r in runs} == {True, False}
    assert {r.level for r in runs} == {(8, 16), (2, 8)}
    assert {len(r.kinds) for r in runs} == {2, 3, 4}
    # during another's fallback: the first incident is one decided within seconds
    assert all(r.kinds[0] in ("acceptance_drop", "quality_mismatch", "kv_pressure")
               for r in runs if r.pattern == "during_fallback")
    staggered = OverlapRun(1, ("error_burst", "kv_pressure", "latency_tail"), "staggered", False)
    assert [p.offset for p in staggered.plans()] == [0.0, 20.0, 40.0]


def test_overlap_summary_counts_right_decisions_and_unexplained_ones(overlap_results):
    summary = summarize_overlap(list(overlap_results.values()))
    assert (summary["runs"], summary["incidents"], summary["right"], summary["unexplained_decisions"]) == (2, 4, 4, 0)
    assert "| error_burst | 1/1 |" in format_overlap(summary)


def test_an_incident_a_wider_fallback_covers_keeps_what_its_gate_held():
    # closed loop, 2 x 8: a fleet-wide KV surge and a reasoning tail together. KV lowers D 9 s in
    # and switches the bundle off 25 s in; the tail's tests hold nothing yet, far under the 11.2
    # nats a last look over the 18 covered keys needs, and no request of it drafts afterwards.
    run = OverlapRun(126, ("kv_pressure", "latency_tail"), "together", True, 2, 8)
    result = run_overlap(run)
    rows = {row["kind"]: row for row in result["incidents"]}
    assert (rows["kv_pressure"]["verdict"], rows["kv_pressure"]["reason"], rows["kv_pressure"]["scope"]) == \
        ("right", "kv_pressure", "*/*")
    assert rows["kv_pressure"]["covered"] is None
    tail = rows["latency_tail"]
    assert (tail["verdict"], tail["reason"], tail["scope"]) == ("wrong reason", "kv_pressure", "*/*")
    assert tail["covered"] == {"by": "kv_pressure", "scope": "*/*", "after_s": 25.0, "evidence_nats": 0.0,
                               "evidence_threshold_nats": 17.736, "look_threshold_nats": 11.184,
                               "hits": 0.0, "trials": 0}
    assert result["unexplained"] == []
    table = format_overlap(summarize_overlap([result]))
    assert "| latency_tail | kv_pressure */* | 25.0 s | 0.00 nats | 17.7 / 11.2 nats | 0 of 0 requests |" in table


def test_a_fallback_archives_the_covered_keys_whose_own_tests_held_evidence():
    # closed loop, 2 x 8: a reasoning tail, a KV surge and an extraction burst start together at
    # 300 s. The KV fallback switches the bundle off 40 s in: the burst's error test holds 5.6
    # nats, more than half the 8.2 its last look needs, and is archived beside the fallback;
    # the tail's 4.7 nats are under half of its 11.2 and are not.
    from specwatch.actions.flags import FlagStore
    from specwatch.lab.simulation.simulator import Simulator
    from specwatch.streams.embedded import EmbeddedPipeline

    run = OverlapRun(127, ("latency_tail", "kv_pressure", "error_burst"), "together", True, 2, 8)
    flags = FlagStore()
    actions = []
    pipeline = EmbeddedPipeline(flags=flags, sinks=[lambda out: actions.extend(out.actions)])
    sim = Simulator("healthy", seed=run.seed, minutes=6.0, workers=2, concurrency=8, flags=flags,
                    incident_at=300.0, plans=run.plans())
    for record in sim.records():
        pipeline.feed(record)
    pipeline.finish()
    kv = [a for a in actions if a.decision.reason == "kv_pressure" and a.decision.action == "disable_speculation"]
    assert [(a.decision.bucket, a.decision.cohort, round(a.decision.ts - sim.start_ts, 1)) for a in kv] == \
        [(None, None, 340.0)]
    assert [{**c, "scope": c["scope"].split("/", 1)[1]} for c in kv[0].audit["covered"]] == [
        {"scope": "extraction/main", "gate": "error_rate", "evidence_nats": 5.602, "evidence_threshold_nats": 15.098,
         "look_threshold_nats": 8.189, "hits": 2.0, "trials": 21}]
