"""`specwatch bench` lists every target of the performance issue, each beside its alternative."""

from __future__ import annotations

import pytest

from specwatch.lab.bench.figures import TARGETS, judge_targets, run_bench

# One row per figure the issue sets a goal for, in its table's order, and the extra rows kept.
_ROWS = [
    ("stream rounds/s per core at 16 requests/step (JSON Lines)", "stream"),
    ("stream rounds/s per core at 16 requests/step (OTLP)", "stream"),
    ("Kafka end to end, rounds/s with 2 workers (capacity)", "kafka"),
    ("Kafka decision p99 (s after the evidence) at 80 % of capacity", "kafka"),
    ("Kafka CPU us per telemetry message, producing (stated)", "kafka"),
    ("Kafka CPU us per telemetry message, consuming (stated)", "kafka"),
    ("us per key-slice at the most keys (1 round per key-slice)", "keys"),
    ("stage 2 us per slice knowing idle keys, over knowing none", "keys"),
    ("archive sink rows/s into chDB (wall)", "archive"),
    ("archive insert alone rows/s into chDB, in memory (wall)", "archive"),
    ("replay wall seconds, over a plain json.loads loop of the same file", "replay"),
    ("start-up: wall seconds of `specwatch replay` of one record", "startup"),
    ("collector inside vLLM, engine-thread CPU us per step (hook path)", "engine"),
    ("vLLM step time median (ms), collector on", "engine"),
    ("vLLM step time mean (ms), collector on", "engine"),
    ("vLLM step time p99 (ms), collector on", "engine"),
    ("emit through the OpenTelemetry SDK, caller's CPU us per step", "collector"),
    ("export through OpenTelemetry's OTLP/HTTP exporter, CPU us per step", "export"),
    ("engine-thread us per step, direct emit", "collector"),
    ("sealed capture share of the collector's time per step", "engine"),
    ("state bytes per key (worst, >= 10 keys)", "growth"),
    ("gateway e2e p50, ms through the gateway", "gateway"),
    ("gateway e2e p99, ms through the gateway", "gateway"),
    ("gateway TTFT p50, ms through the gateway", "gateway"),
    ("gateway TTFT p99, ms through the gateway", "gateway"),
]


def _stream(encoding: str, columnar: float, reference: float) -> dict:
    return {"encoding": encoding, "concurrency": 16, "requests_per_step": 16.4, "columnar_rounds_per_s": columnar,
            "reference_rounds_per_s": reference, "parse_floor_rounds_per_s": 4e6}


def _kafka_run(rounds_per_s: float, p99: float, paced: float | None = None) -> dict:
    return {"rounds_per_s": rounds_per_s, "embedded_fast_rounds_per_s": 400_000.0, "evidence_latency_p99_s": p99,
            "paced_rounds_per_s": paced}


def _report() -> dict:
    """Every section, with figures chosen so that each row's ratio and verdict are exact."""
    return {
        "stream": [_stream("jsonl", 500_000.0, 400_000.0), _stream("otlp", 1_200_000.0, 600_000.0),
                   {**_stream("jsonl", 9.0, 9.0), "concurrency": 64}],
        "kafka": {"flat_out": _kafka_run(120_000.0, 9.0), "two_workers": _kafka_run(200_000.0, 12.0),
                  "paced": _kafka_run(150_000.0, 4.0, paced=160_000.0), "capacity_rounds_per_s": 200_000.0,
                  "paced_share_of_capacity": 0.8,
                  "clients": {"records_per_message": 50, "bytes_per_message": 56_000.0,
                              "produce": {"default": {"cpu_us_per_message": 200.0},
                                          "linger 5 ms, batch 16 KiB": {"cpu_us_per_message": 800.0}},
                              "consume": {"default": {"cpu_us_per_message": 30.0},
                                          "max_poll_records 100": {"cpu_us_per_message": 60.0}}}},
        "keys": {"curve": [{"keys": 1, "us_per_key_slice": 5.0, "us_per_key_slice_default_collector": 6.0},
                           {"keys": 10_000, "us_per_key_slice": 32.0, "us_per_key_slice_default_collector": 64.0}],
                 "idle_keys": {"idle_keys": 10_000, "us_per_slice_with_idle_keys": 42.0, "us_per_slice_without": 40.0,
                               "key_updates_with_idle_keys": 40, "key_updates_without": 40}},
        "archive": {"sink_rows_per_s": 250_000.0, "row_path_rows_per_s": 100_000.0, "sink_rows_per_s_cpu": 300_000.0,
                    "insert_memory_rows_per_s": 1_000_000.0, "insert_file_rows_per_s": 500_000.0,
                    "insert_memory_rows_per_s_cpu": 1_200_000.0},
        "replay": {"replay_s": 3.0, "json_loads_s": 1.5, "bytes": 66 << 20},
        "startup": {"replay_one_record_s": 0.4, "bare_interpreter_s": 0.1},
        "engine": {"hook_path_us_per_step": 12.0, "hook_path_off_us_per_step": 2.0, "requests_per_step": 3.0,
                   "collector_us_per_step": 16.0, "load_average_before": [0.5], "load_average_after": [0.6],
                   "step_ms_median_on": 10.1, "step_ms_median_off": 10.0, "step_ms_mean_on": 12.5,
                   "step_ms_mean_off": 10.0, "step_ms_p99_on": 20.0, "step_ms_p99_off": 20.0,
                   "capture_us_per_step": 0.4, "capture_rate": 0.01},
        "collector": {"sdk_us_per_step": 30.0, "direct_us_per_step": 0.25, "sdk_floor_us_per_step": 22.0,
                      "sdk_minimal_record_us_per_step": 3.0, "engine_step_ms_simulated": 14.0},
        "export": {"otlp_http_us_per_step": 120.0, "kafka_us_per_step": 40.0, "kafka_encode_us_per_step": 25.0},
        "gateway": {"requests_per_side": 30, "gateway_e2e_p50_ms": 105.0, "direct_e2e_p50_ms": 100.0,
                    "gateway_e2e_p99_ms": 150.0, "direct_e2e_p99_ms": 120.0, "gateway_ttft_p50_ms": 22.0,
                    "direct_ttft_p50_ms": 20.0, "gateway_ttft_p99_ms": 40.0, "direct_ttft_p99_ms": 40.0},
        "growth": [{"keys": 1, "state_bytes_per_key": 95_000.0}, {"keys": 10, "state_bytes_per_key": 18_000.0},
                   {"keys": 100, "state_bytes_per_key": 13_000.0}],
    }


def test_each_row_carries_its_alternative_its_ratio_and_whether_it_is_met():
    rows = {row["target"]: row for row in judge_targets(_report())}
    expected = {  # target: (measured, alternative's value, ratio, met)
        "stream rounds/s per core at 16 requests/step (JSON Lines)": (500_000.0, 400_000.0, 1.25, False),
        "stream rounds/s per core at 16 requests/step (OTLP)": (1_200_000.0, 600_000.0, 2.0, True),
        "Kafka end to end, rounds/s with 2 workers (capacity)": (200_000.0, 400_000.0, 0.5, True),
        "Kafka decision p99 (s after the evidence) at 80 % of capacity": (4.0, 12.0, 4.0 / 12.0, False),
        "Kafka CPU us per telemetry message, producing (stated)": (200.0, 800.0, 0.25, True),
        "Kafka CPU us per telemetry message, consuming (stated)": (30.0, 60.0, 0.5, True),
        "us per key-slice at the most keys (1 round per key-slice)": (32.0, 64.0, 0.5, False),
        "stage 2 us per slice knowing idle keys, over knowing none": (42.0, 40.0, 1.05, True),
        "archive sink rows/s into chDB (wall)": (250_000.0, 100_000.0, 2.5, False),
        "archive insert alone rows/s into chDB, in memory (wall)": (1_000_000.0, 500_000.0, 2.0, True),
        "replay wall seconds, over a plain json.loads loop of the same file": (3.0, 1.5, 2.0, False),
        "start-up: wall seconds of `specwatch replay` of one record": (0.4, 0.1, 4.0, True),
        "collector inside vLLM, engine-thread CPU us per step (hook path)": (12.0, 2.0, 6.0, True),
        "vLLM step time median (ms), collector on": (10.1, 10.0, 1.01, True),
        "vLLM step time mean (ms), collector on": (12.5, 10.0, 1.25, False),
        "vLLM step time p99 (ms), collector on": (20.0, 20.0, 1.0, True),
        "emit through the OpenTelemetry SDK, caller's CPU us per step": (30.0, 0.25, 120.0, False),
        "export through OpenTelemetry's OTLP/HTTP exporter, CPU us per step": (120.0, 40.0, 3.0, True),
        "engine-thread us per step, direct emit": (0.25, 14_000.0, 0.25 / 14_000.0, True),
        "sealed capture share of the collector's time per step": (0.4, 16.0, 0.025, True),
        "state bytes per key (worst, >= 10 keys)": (18_000.0, 95_000.0, 18_000.0 / 95_000.0, True),
        "gateway e2e p50, ms through the gateway": (105.0, 100.0, 1.05, True),
        "gateway e2e p99, ms through the gateway": (150.0, 120.0, 1.25, False),
        "gateway TTFT p50, ms through the gateway": (22.0, 20.0, 1.1, True),
        "gateway TTFT p99, ms through the gateway": (40.0, 40.0, 1.0, True),
    }
    assert set(rows) == set(expected)
    for target, (measured, alternative, ratio, met) in expected.items():
        row = rows[target]
        assert row["measured"] == measured, target
        assert row["alternative_value"] == alternative and row["alternative"], target
        assert row["ratio"] == pytest.approx(ratio, rel=1e-12), target
        assert row["met"] is met, target
    stated = [row for row in rows.values() if row["goal_is"] == "stated"]
    assert len(stated) == 2 and all(row["goal"] is None for row in stated)
    assert rows["Kafka decision p99 (s after the evidence) at 80 % of capacity"]["note"] == \
        "paced at 160,000 rounds/s, 80% of 200,000"


def test_a_failed_or_incomplete_section_leaves_its_rows_not_measured_and_the_others_judged():
    report = _report()
    report["kafka"] = {"error": "no broker: deploy/kafka/broker.sh did not start"}
    del report["engine"]["step_ms_p99_on"]
    report["export"] = {"otlp_http_us_per_step": 120.0, "kafka_us_per_step": None, "kafka_encode_us_per_step": 30.0}
    rows = {row["target"]: row for row in judge_targets(report)}
    kafka = [row for row in rows.values() if row["section"] == "kafka"]
    assert len(kafka) == 4
    assert {row["note"] for row in kafka} == {"not measured: error: no broker: deploy/kafka/broker.sh did not start"}
    p99 = rows["vLLM step time p99 (ms), collector on"]
    assert p99["met"] is None and p99["note"].startswith("not measured: the engine section has no figure for it")
    assert rows["vLLM step time median (ms), collector on"]["met"] is True
    # without a broker the export section's direct figure is its encoding alone, and says so
    export = rows["export through OpenTelemetry's OTLP/HTTP exporter, CPU us per step"]
    assert (export["alternative"], export["ratio"], export["met"]) == ("direct Kafka encoding alone", 4.0, False)


def test_a_run_of_one_section_reports_every_target_with_that_sections_rows_measured():
    report = run_bench(smoke=True, sections=("startup",))
    rows = report["targets"]
    assert [(row["target"], row["section"]) for row in rows] == _ROWS
    measured = [row for row in rows if row["met"] is not None]
    assert [row["section"] for row in measured] == ["startup"]
    others = [row for row in rows if row["section"] != "startup"]
    assert all(row["measured"] is None and row["ratio"] is None for row in others)
    assert {row["note"] for row in others} == {"not measured: skipped: not selected"}
    (startup,) = measured
    assert startup["measured"] == report["startup"]["replay_one_record_s"]
    assert startup["alternative_value"] == report["startup"]["bare_interpreter_s"]
    assert startup["met"] is (startup["measured"] <= TARGETS["startup_s"])
    assert report["stream"] == {"skipped": "not selected"}


def test_a_section_that_raises_is_reported_as_its_error_and_the_next_section_still_runs(monkeypatch):
    import specwatch.lab.bench.figures as figures

    def broken(quick, smoke):
        raise TypeError("'>' not supported between instances of 'float' and 'NoneType'")

    monkeypatch.setattr(figures, "bench_replay", lambda quick, smoke, folder: broken(quick, smoke))
    report = run_bench(smoke=True, sections=("replay", "startup"))
    assert report["failed_sections"] == ["replay"]
    assert report["replay"] == {"error": "TypeError: '>' not supported between instances of 'float' and 'NoneType'"}
    assert report["startup"]["replay_one_record_s"] > 0  # measured after the failure
    rows = {row["target"]: row for row in report["targets"]}
    replay = next(row for name, row in rows.items() if row["section"] == "replay")
    assert replay["met"] is None and replay["measured"] is None
