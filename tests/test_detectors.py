"""Golden-sequence tests: a fixed seeded stream into each detector, exact detection points."""

import random

from specwatch.detectors.gates import ConsecutiveGate, DropDetector
from specwatch.detectors.monitor import BundleMonitor, KeyMonitor
from specwatch.detectors.window import SliceStats
from specwatch.schemas import Policy


def detections(detector, stream):
    """Indexes at which ``detector`` reports, feeding ``stream`` one value at a time."""
    hits = []
    for i, x in enumerate(stream):
        detector.update(x)
        if detector.drift_detected:
            hits.append(i)
    return hits


def test_consecutive_gate_golden():
    rng = random.Random(3)
    stream = [rng.random() < (0.05 if i < 100 else 0.9) for i in range(140)]
    assert detections(ConsecutiveGate(3), stream) == [102, 107, 113, 116, 119, 122, 125, 128, 132, 135, 138]


def test_drop_detector_ignores_stationary_and_upward_drift():
    rng = random.Random(5)
    stationary = [1.0 + rng.gauss(0, 0.05) for _ in range(5000)]
    assert detections(DropDetector(0.15), stationary) == []
    upward = [1.0 + rng.gauss(0, 0.05) for _ in range(200)] + [1.5 + rng.gauss(0, 0.05) for _ in range(200)]
    assert detections(DropDetector(0.15), upward) == []


def test_drop_detector_golden_drop():
    rng = random.Random(9)
    stream = [(1.0 if i < 300 else 0.7) + rng.gauss(0, 0.05) for i in range(400)]
    hits = detections(DropDetector(0.15), stream)
    assert hits[0] == 334


def _slice(rng, alpha, rounds=300, draft_length=4, e2e=1000.0, tail=0.0, kv=0.5, errors=0, requests=20):
    stats = SliceStats()
    for _ in range(rounds):
        accepted = 0
        while accepted < draft_length and rng.random() < alpha:
            accepted += 1
        stats.add_round(draft_length, accepted)
    for _ in range(10):
        stats.add_step_time(1.0, 10.0, kv, 0.0)
    for i in range(requests):
        slow = rng.random() < tail
        stats.add_request(50.0, 10.0 * (5 if slow else 1), e2e * (5 if slow else 1) * (0.8 + 0.4 * rng.random()),
                          True, "error" if i < errors else "stop", 0.0)
    return stats


def _run(monitor, slices):
    hits = []
    for t, stats in enumerate(slices):
        stats.max_ts = float(t)
        for finding in monitor.update(stats, float(t + 1)):
            hits.append((t, finding.reason, finding.detector))
    return hits


def test_key_monitor_acceptance_drop_golden():
    rng = random.Random(11)
    slices = [_slice(rng, 0.8 if t < 120 else 0.55) for t in range(150)]
    hits = _run(KeyMonitor(Policy(), "coding"), slices)
    assert hits[0] == (124, "acceptance_drop", "acceptance_gate")
    assert all(reason == "acceptance_drop" for _, reason, _ in hits)


def test_key_monitor_latency_tail_golden():
    rng = random.Random(12)
    slices = [_slice(rng, 0.8, tail=0.0 if t < 120 else 0.10) for t in range(200)]
    hits = _run(KeyMonitor(Policy(), "reasoning"), slices)
    # a breach also needs 3% of the window's requests past the limit, not only its p99
    assert hits[0] == (149, "latency_slo", "latency_p99_gate")


def test_key_monitor_quiet_on_stationary_stream():
    rng = random.Random(13)
    slices = [_slice(rng, 0.7, tail=0.002) for _ in range(600)]
    assert _run(KeyMonitor(Policy(), "coding"), slices) == []


def test_bundle_monitor_kv_watermark_golden():
    rng = random.Random(14)
    slices = [_slice(rng, 0.8, kv=0.6 if t < 80 else 0.97) for t in range(90)]
    hits = _run(BundleMonitor(Policy()), slices)
    assert hits[0] == (82, "kv_pressure", "kv_watermark_gate")
