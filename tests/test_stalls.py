"""Stalled requests: the simulator lists them while they stall, stage 1 reports them, the tail test counts them once."""

import json
import math
import random

import pytest

from specwatch.detectors.monitor import KeyMonitor
from specwatch.detectors.stalls import StalledRequests
from specwatch.schemas.slice_stats import SliceStats, merge_all
from specwatch.schemas import Policy, RequestRecord, decode_line
from specwatch.schemas.codec import encode_record
from specwatch.schemas.lines_block import decode_lines_block
from specwatch.schemas.otlp import decode_request, encode_records
from specwatch.schemas.otlp_block import request_block
from specwatch.lab.simulation.simulator import Simulator
from specwatch.streams.embedded import EmbeddedPipeline
from specwatch.streams.sources import Ingest
from specwatch.streams.running_requests import LOST_AFTER_SECONDS
from specwatch.streams.combine import Stage1

SEED = 11
INCIDENT_AT = 120.0


def _stall(intensity=50.0, workers=2, concurrency=8, minutes=6.0):
    sim = Simulator("latency_tail", seed=SEED, workers=workers, concurrency=concurrency, minutes=minutes,
                    incident_at=INCIDENT_AT, intensity=intensity)
    return sim, list(sim.records())


@pytest.fixture(scope="module")
def stall_run():
    return _stall()


def _stalled_ids(records) -> set[str]:
    """Requests a speculative cohort's steps list without drafting: done with their tokens, stuck."""
    return {e.id for r in records if r.kind == "step" for e in r.requests
            if e.drafted == 0 and (e.bucket, e.cohort) == ("reasoning", "main")}


def test_simulator_lists_a_stalled_request_in_every_step_until_its_record(stall_run):
    sim, records = stall_run
    stalled = _stalled_ids(records)
    assert len(stalled) == 40
    ends = {r.id: r.ts for r in records if isinstance(r, RequestRecord) and r.id in stalled}
    listed: dict[str, list[float]] = {}
    for r in records:
        if r.kind == "step":
            for e in r.requests:
                if e.id in stalled:
                    listed.setdefault(e.id, []).append(r.ts)
    for rid, times in listed.items():
        assert max(times) < ends.get(rid, float("inf"))  # never listed after its record
        worker = rid.split("-")[0]
        # listed by every step of its worker from the first to the last sighting: no gaps
        steps = [r.ts for r in records if r.kind == "step" and r.worker == worker and times[0] <= r.ts <= times[-1]]
        assert steps == times
    # a stall of x50 outlasts the run for most: minutes, not seconds
    assert sum(1 for rid in stalled if rid not in ends) == 34


def test_a_stall_is_decided_before_any_stalled_request_finishes(stall_run):
    sim, records = stall_run
    pipeline = EmbeddedPipeline()
    pipeline.feed_many(records)
    pipeline.finish()
    [decision] = pipeline.decisions
    assert (round(decision.ts - sim.start_ts, 2), decision.reason, decision.bucket, decision.cohort) == (
        205.0, "latency_slo", "reasoning", "main")
    assert decision.evidence["metric"] == "e2e_tail_share"
    assert decision.evidence["requests_running_past_limit"] == 12
    stalled = _stalled_ids(records)
    first_end = min(r.ts for r in records if isinstance(r, RequestRecord) and r.id in stalled)
    assert decision.ts < first_end


def _heavy_tailed_traffic(seed: int, seconds: float, workers: int = 4, running: int = 12) -> list[str]:
    """Steps every 0.25 s listing each worker's running requests, and a record as each ends;
    log-normal durations (sigma 1.5): one request in 400 runs past twice the p99, no incident."""
    rng = random.Random(seed)
    lines = []
    for w in range(workers):
        worker = f"w{w}"
        ends: dict[str, tuple[float, float]] = {}  # id -> (start, end)
        n = seq = 0
        t = 0.0
        while t < seconds:
            while len(ends) < running:
                ends[f"{worker}-{n}"] = (t, t + min(600.0, 2.0 * math.exp(1.5 * rng.gauss(0.0, 1.0))))
                n += 1
            lines.append((1000.0 + t, _step(1000.0 + t, seq, sorted(ends), worker)))
            seq += 1
            t = round(t + 0.25, 2)
            for rid, (start, end) in sorted(ends.items()):
                if end <= t:
                    del ends[rid]
                    lines.append((1000.0 + end, _request(1000.0 + end, rid, (end - start) * 1000.0 + 50.0, worker)))
    lines.sort(key=lambda pair: pair[0])
    return [line for _, line in lines]


def test_long_healthy_requests_are_counted_once_and_decide_nothing():
    # Counted while they run, long requests at their usual rate are one trial each of the
    # tail test, not two: no alarm, and every one that finished was taken back off the record.
    pipeline = EmbeddedPipeline()
    lines = _heavy_tailed_traffic(seed=3, seconds=3600.0)
    for start in range(0, len(lines), 4096):
        pipeline.feed_lines(lines[start:start + 4096])
    pipeline.finish()
    assert pipeline.counters.rejected.total == 0
    assert pipeline.decisions == []
    [monitor] = [m for m in pipeline.stage2.decider.monitors.values() if isinstance(m, KeyMonitor)]
    assert monitor.stalls.counted_total == 154


def _tracked(decode, payloads, block=None) -> list[tuple[int, dict, dict]]:
    """Every key's running-request reports, by slice, from one source fed through ``decode``
    (or, with ``block``, a block decoder: the batch mode, one block per payload)."""
    ingest = Ingest(Stage1(Policy(), source="w"), decode)
    out, batches = [], []
    for payload in payloads:
        batches += (ingest(payload) if block is None else ingest.block(block(payload))).closed
    batches += ingest.stage.close_ready(final=True)
    for batch in batches:
        for key, stats in sorted(batch.partials.items(), key=lambda kv: str(kv[0])):
            if stats.running_long or stats.running_done:
                out.append((batch.slice_index, key, dict(stats.running_long), dict(stats.running_done)))
    return out


def test_the_batch_mode_tracks_the_running_requests_the_reference_tracks():
    sim, records = _stall(workers=2, minutes=4.0)  # stalls from 120 s: reported from 130 s
    lines = [encode_record(r) for r in records]
    reference = _tracked(decode_line, lines)
    otlp = [encode_records(records[i:i + 50]) for i in range(0, len(records), 50)]
    assert reference == _tracked(decode_request, otlp)
    # the batch mode: blocks of lines cut where they fall, and each OTLP request as one block
    assert reference == _tracked(None, [lines[i:i + 333] for i in range(0, len(lines), 333)], decode_lines_block)
    assert reference == _tracked(None, otlp, request_block)
    reported = sum(len(long) for _, _, long, _ in reference)
    ended = [done for _, _, _, dones in reference for done in dones.values()]
    assert (reported, ended.count(True), ended.count(False)) == (40, 33, 0)


def _step(ts: float, seq: int, ids: list[str], worker: str = "w1") -> str:
    return json.dumps({"kind": "step", "v": 1, "ts": ts, "worker": worker, "seq": seq, "bundle_id": "b",
                       "draft_ms": 1.0, "verify_ms": 9.0, "kv_usage": 0.5,
                       "requests": [{"id": rid, "bucket": "chat", "cohort": "main", "drafted": 4, "accepted": 3}
                                    for rid in ids]})


def _request(ts: float, rid: str, e2e_ms: float, worker: str = "w1") -> str:
    return json.dumps({"kind": "request", "v": 1, "ts": ts, "worker": worker, "bundle_id": "b", "id": rid,
                       "bucket": "chat", "cohort": "main", "speculative": True, "ttft_ms": 50.0,
                       "tpot_ms": 10.0, "e2e_ms": e2e_ms, "output_tokens": 100, "finish_reason": "stop"})


def test_stage1_reports_long_requests_once_and_tells_finished_from_lost():
    # r1 runs 30 s and finishes; r2 stops being listed at 15 s and never reports: lost; r3 is short.
    lines = []
    for seq, t in enumerate(range(100, 131)):
        ids = ["r1"] + (["r2"] if t <= 115 else []) + (["r3"] if t <= 103 else [])
        lines.append(_step(float(t), seq, ids))
        if t == 104:
            lines.append(_request(104.0, "r3", 4000.0))
    lines.append(_request(130.5, "r1", 30500.0))
    lines.append(_step(140.0, 99, ["r9"]))
    reports = _tracked(decode_line, lines)
    key = ("b", "chat", "main")
    # slices close behind the event clock; r2 is lost once no step listed it for LOST_AFTER_SECONDS
    assert LOST_AFTER_SECONDS == 10.0
    assert reports == [
        (109, key, {"w1/r1": 100.0, "w1/r2": 100.0}, {}),
        (130, key, {}, {"w1/r1": True}),
        (140, key, {}, {"w1/r2": False}),
    ]


def test_a_request_seen_by_two_sources_counts_once():
    # Unkeyed telemetry spreads a worker's steps over sources: both report the request, one
    # loses sight of it, and the record reaches a third. Merged, it is still one trial.
    def part(long=None, done=None):
        stats = SliceStats()
        stats.running_long, stats.running_done = dict(long or {}), dict(done or {})
        return stats

    ledger = StalledRequests()
    assert ledger.update(merge_all([part({"w1/r1": 101.0}), part({"w1/r1": 100.0})]), 140.0, 30_000.0) == (1, 0)
    assert ledger.update(part({"w1/r1": 105.0}), 141.0, 30_000.0) == (0, 0)  # reported again: counted already
    assert ledger.update(merge_all([part(done={"w1/r1": False}), part(done={"w1/r1": True})]), 150.0,
                         30_000.0) == (0, 1)
    assert ledger.counted == {} and ledger.waiting == {} and ledger.counted_total == 1
