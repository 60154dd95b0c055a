"""A decision's samples show its problem (failures, lowest acceptance, slowest) beside healthy
controls, checked against the seeded records, whatever order they arrived in."""

from __future__ import annotations

import random

import pytest

from specwatch.lab.simulation.simulator import Simulator

from telemetry_log import replayed

SEED = 11


def _actions(scenario: str, workers: int = 4, shuffle_seed: int | None = None):
    sim = Simulator(scenario, seed=SEED, workers=workers, minutes=4.0, incident_at=120.0)
    records = list(sim.records())
    if shuffle_seed is not None:
        # reorder records within each second of event time: well inside the allowed lateness
        rng = random.Random(shuffle_seed)
        keyed = [(int(r.ts), rng.random(), i) for i, r in enumerate(records)]
        records = [records[i] for _, _, i in sorted(keyed)]
    actions = []
    replayed(records, sinks=[lambda output: actions.extend(output.actions)])
    return actions


def _acceptance(step: dict, bucket: str, cohort: str) -> float:
    rounds = [r for r in step["requests"] if r["bucket"] == bucket and r["cohort"] == cohort and r["drafted"]]
    return sum(r["accepted"] for r in rounds) / sum(r["drafted"] for r in rounds)


def _sample_id(sample: dict) -> str:
    return f"{sample['worker']}:{sample['seq']}" if sample["kind"] == "step" else sample["id"]


def test_error_rate_samples_are_the_failed_requests_and_healthy_controls():
    (action,) = _actions("error_burst", workers=8)
    decision = action.decision
    reasons = decision.evidence["sample_reasons"]
    by_id = {_sample_id(s): s for s in action.samples}
    assert sorted(by_id) == sorted(decision.sample_ids) == sorted(reasons)
    failures = [i for i, why in reasons.items() if why in ("error", "timeout")]
    controls = [i for i, why in reasons.items() if why == "control"]
    # every failed request of the key in the finding's window, up to the 9 a decision keeps
    sim = Simulator("error_burst", seed=SEED, workers=8, minutes=4.0, incident_at=120.0)
    window = (decision.evidence["window_start"], decision.evidence["window_end"])
    failed = [r for r in sim.records() if r.kind == "request" and (r.bucket, r.cohort) == (decision.bucket, decision.cohort)
              and window[0] <= r.ts < window[1] and r.finish_reason in ("error", "timeout")]
    assert len(failures) == min(9, len(failed)) and len(failed) >= 5 and len(controls) == 3
    for ident in failures:
        assert by_id[ident]["finish_reason"] == reasons[ident]
    for ident in controls:
        assert by_id[ident]["finish_reason"] in ("stop", "length")
    for sample in action.samples:
        assert (sample["bucket"], sample["cohort"]) == (decision.bucket, decision.cohort)


def test_acceptance_samples_are_the_steps_that_accepted_least():
    actions = _actions("acceptance_drop")
    assert len(actions) == 4
    for action in actions:
        decision = action.decision
        reasons = decision.evidence["sample_reasons"]
        by_id = {_sample_id(s): s for s in action.samples}
        lowest = [_acceptance(by_id[i], decision.bucket, decision.cohort)
                  for i, why in reasons.items() if why == "lowest_acceptance"]
        controls = [i for i, why in reasons.items() if why == "control"]
        served = [i for i, why in reasons.items() if why == "served_request"]
        assert 0 < len(lowest) <= 9 and 0 < len(controls) <= 3 and 0 < len(served) <= 3
        assert all(by_id[i]["kind"] == ("request" if reasons[i] == "served_request" else "step") for i in reasons)
        # the requests to re-run are of the decision's own scope
        assert all((by_id[i]["bucket"], by_id[i]["cohort"]) == (decision.bucket, decision.cohort) for i in served)
        assert max(lowest) <= min(_acceptance(by_id[i], decision.bucket, decision.cohort) for i in controls)


def test_latency_samples_are_the_slowest_requests():
    (action,) = _actions("latency_tail")
    reasons = action.decision.evidence["sample_reasons"]
    by_id = {_sample_id(s): s for s in action.samples}
    slowest = sorted((by_id[i]["e2e_ms"] for i, why in reasons.items() if why == "slowest"), reverse=True)
    controls = [by_id[i]["e2e_ms"] for i, why in reasons.items() if why == "control"]
    assert 0 < len(slowest) <= 9 and len(controls) == 3
    assert min(slowest) >= max(controls)


@pytest.mark.parametrize("scenario,workers", [("error_burst", 8), ("acceptance_drop", 4)])
def test_samples_do_not_depend_on_arrival_order(scenario, workers):
    straight = [(a.decision.id, a.samples) for a in _actions(scenario, workers)]
    shuffled = [(a.decision.id, a.samples) for a in _actions(scenario, workers, shuffle_seed=5)]
    assert shuffled == straight


def test_an_acceptance_window_without_finished_requests_keeps_the_latest_served_requests_of_its_scope():
    # Requests longer than the evidence window: from the drop on, no request of the fleet finishes.
    # A step is not what `specwatch reproduce` re-runs, so the decision keeps the scope's latest
    # finished requests from the slices before its window.
    sim = Simulator("acceptance_drop", seed=SEED, workers=4, minutes=4.0, incident_at=120.0)
    start = sim.incidents[0].start_ts
    kept = [r for r in sim.records() if not (r.kind == "request" and r.ts >= start)]
    actions = []
    replayed(kept, sinks=[lambda output: actions.extend(output.actions)])
    decided = [a for a in actions if a.decision.reason == "acceptance_drop"]
    assert [(a.decision.bucket, a.decision.cohort) for a in decided] == [("coding", "main"), ("coding", "main")]
    served_counts = []
    for action in decided:
        decision = action.decision
        reasons = decision.evidence["sample_reasons"]
        by_id = {_sample_id(s): s for s in action.samples}
        served = [by_id[i] for i, why in reasons.items() if why == "served_request"]
        served_counts.append(len(served))
        assert all(s["kind"] == "request" and s["ts"] < start for s in served)
        assert all((s["bucket"], s["cohort"]) == (decision.bucket, decision.cohort) for s in served)
        assert sorted(by_id) == sorted(decision.sample_ids)
    assert served_counts == [2, 2]  # two of the scope's requests finished in the ten slices before
