"""The end-to-end benchmark runs against the real broker and reads its decisions back."""

from __future__ import annotations

import pytest

from specwatch.bench.kafka_path import run_kafka_bench


@pytest.mark.kafka
def test_paced_smoke_run_drains_and_times_every_decision(kafka_bootstrap):
    report = run_kafka_bench(kafka_bootstrap, smoke=True, rate=20_000.0)
    assert report["drained"] and report["decisions"] > 0
    # heartbeats share the decisions topic; only decisions are counted and timed
    assert report["evidence_latency_p50_s"] is not None and report["evidence_latency_max_s"] >= 0
    assert report["paced_rounds_per_s"] == 20_000.0
    assert report["producer_rounds_per_s"] <= 20_000.0 * 1.05
