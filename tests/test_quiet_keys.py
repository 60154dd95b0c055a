"""Quiet keys and outliers, end to end: seeded small fleets through the embedded pipeline.

A 2-worker fleet gives each bucket/cohort key a fraction of the default fleet's traffic
(extraction/main about 140 finished requests a minute, a canary cohort under 10). The
sequential gates must still decide there, and one absurd record must decide nothing.
"""

import pytest

from specwatch.lab.simulation.simulator import Simulator
from specwatch.schemas import StepRecord

from telemetry_log import replayed

SEED = 11


def _decisions(records, sim):
    pipeline = replayed(records)
    return [(round(d.ts - sim.start_ts, 2), d.action, d.reason, d.bucket, d.cohort) for d in pipeline.decisions], \
        pipeline


@pytest.mark.parametrize("scenario,intensity,expected", [
    # errors x20 in extraction: before, no decision in ten minutes (the gate needed 100
    # requests in its 60 s window); 158.99 with the key's own failures shrunk toward the
    # bundle, 163.85 with the bundle's rate its failures are consistent with
    ("error_burst", 20.0, [(163.85, "disable_speculation", "error_rate", "extraction", "main")]),
    # one reasoning/main request in ten runs x5 slower: before, the latency gate needed 200;
    # the test tuned to 3 % past the limit alone decided at 197 s, its burst test at 182 s
    ("latency_tail", 5.0, [(181.99, "disable_speculation", "latency_slo", "reasoning", "main")]),
])
def test_two_worker_fleet_decides(scenario, intensity, expected):
    sim = Simulator(scenario, seed=SEED, workers=2, minutes=6.0, intensity=intensity, incident_at=120.0)
    got, pipeline = _decisions(sim.records(), sim)
    assert got == expected
    finding = pipeline.decisions[0].evidence
    assert finding["evidence_nats"] >= finding["evidence_threshold_nats"]


def _with_outlier(sim, at, **changes):
    """The run's records with the first step at or after ``at`` s changed (contract-valid)."""
    done = False
    for record in sim.records():
        if not done and isinstance(record, StepRecord) and record.ts - sim.start_ts >= at:
            record = record.model_copy(update=changes)
            done = True
        yield record


@pytest.mark.parametrize("draft_ms", [5000.0, 1e6])
def test_one_absurd_draft_time_disables_nothing(draft_ms):
    # before: one step drafting 5 s added no_speedup and draft_overhead decisions for
    # several buckets, and at 1e6 ms five buckets went off
    sim = Simulator("healthy", seed=SEED, workers=2, minutes=4.0)
    got, _ = _decisions(_with_outlier(sim, 150.0, draft_ms=draft_ms), sim)
    assert got == []
