"""The batch mode of the ingest step gives exactly what folding one record at a time gives."""

from __future__ import annotations

import json
import random
from functools import lru_cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specwatch.schemas import Policy, decode_line
from specwatch.schemas.codec import encode_record
from specwatch.schemas.lines_block import decode_lines_block
from specwatch.schemas.otlp import decode_request, encode_records
from specwatch.schemas.otlp_block import request_block
from specwatch.lab.simulation.simulator import Simulator
from specwatch.streams.embedded import EmbeddedPipeline
from specwatch.streams.sources import Ingest
from specwatch.streams.combine import Stage1

from test_bad_input import BAD_LINES
from test_fastpath import ODD_LINES, batches_json, pipeline_run
from test_scenarios import EXPECTED, SEED


def _shuffled_in(lines: list[str], seed: int) -> list[str]:
    """``lines`` with trouble mixed in: copies (duplicates), records late by 30 s and 3 s, a clock hours
    ahead, and every bad line of the codec tests."""
    rng = random.Random(seed)
    out = list(lines)
    for _ in range(60):
        out.insert(rng.randrange(len(out)), rng.choice(lines))  # delivered twice
    for shift in (-30.0, -3.0, 7200.0):
        for _ in range(25):
            body = json.loads(rng.choice(lines))
            body["ts"] += shift
            body["seq"] = body.get("seq", 0) + 10**6 if body["kind"] == "step" else None
            if body["seq"] is None:
                del body["seq"]
            out.insert(rng.randrange(len(out)), json.dumps(body))
    for bad in ODD_LINES + [line for group in BAD_LINES.values() for line in group]:
        out.insert(rng.randrange(len(out)), bad)
    return out


@lru_cache(maxsize=None)
def _lines(scenario: str = "acceptance_drop", minutes: float = 2.0) -> tuple[str, ...]:
    sim = Simulator(scenario, seed=13, minutes=minutes, workers=2, concurrency=12, incident_at=40.0)
    return tuple(_shuffled_in([encode_record(r) for r in sim.records()], seed=3))


def _fold_one_at_a_time(lines, now=None) -> tuple:
    ingest = Ingest(Stage1(Policy(), source="w"))
    rejected, late, closed = [], [], []
    for position, line in enumerate(lines):
        done = ingest(line, now)
        rejected += [(position, r.reason, r.detail) for r in done.rejections]
        late += [(position, ts) for ts in done.late]
        closed += done.closed
    return _outcome(ingest, rejected, late, closed)


def _fold_in_blocks(lines, cuts, now=None) -> tuple:
    ingest = Ingest(Stage1(Policy(), source="w"))
    rejected, late, closed = [], [], []
    bounds = [0, *sorted(set(cuts)), len(lines)]
    for start, end in zip(bounds, bounds[1:]):
        done = ingest.block(decode_lines_block(lines[start:end]), now)
        rejected += [(start + at, r.reason, r.detail) for at, r in zip(done.rejected_at, done.rejections)]
        late += [(start + at, ts) for at, ts in zip(done.late_at, done.late)]
        closed += done.closed
    return _outcome(ingest, sorted(rejected), sorted(late), closed)


def _outcome(ingest: Ingest, rejected, late, closed) -> tuple:
    stage = ingest.stage
    closed = closed + stage.close_ready(final=True)
    return (batches_json(closed), rejected, late, ingest.rejected.as_dict(), stage.records,
            stage.late_records, stage.watermark)


def test_blocks_fold_as_records_one_at_a_time():
    lines = list(_lines())
    reference = _fold_one_at_a_time(lines)
    batches, rejected, late, reasons, records, late_records, _ = reference
    # the run holds every kind of trouble the batch mode must decide as the reference does
    assert {"duplicate", "clock_ahead", "invalid_json", "accepted_exceeds_drafted"} <= set(reasons)
    # (17 late: refused records, two hours off, no longer count among the times the watermark follows)
    assert late_records == len(late) > 10 and records > 5000 and len(batches) > 100
    for size in (1, 2, 3, 64, 1000, len(lines)):
        assert _fold_in_blocks(lines, range(size, len(lines), size)) == reference, size
    block = decode_lines_block(lines)
    assert len(block) > 5000 and len(block.round_step) > 50_000 and len(block.others) > 100


def test_a_valid_step_outside_the_columns_folds_in_its_place(monkeypatch):
    """A step only the reference codec reads (here: every step of another layout) folds
    after the column steps before it, as one record at a time would fold it."""
    from specwatch.schemas import lines_block

    lines = list(_lines(minutes=0.5))
    reference = _fold_one_at_a_time(lines)
    monkeypatch.setattr(lines_block, "_any_layout", lambda raw, pairs: None)
    assert len([1 for _, item in decode_lines_block(lines).others if getattr(item, "kind", None) == "step"]) > 10
    for size in (7, 64, len(lines)):
        assert _fold_in_blocks(lines, range(size, len(lines), size)) == reference, size


@settings(max_examples=20, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=len(_lines(minutes=0.5)) - 1), max_size=40))
def test_blocks_cut_anywhere_fold_as_records_one_at_a_time(cuts):
    lines = list(_lines(minutes=0.5))
    assert _fold_in_blocks(lines, cuts) == _fold_one_at_a_time(lines)


def test_an_otlp_request_as_a_block_folds_as_its_records():
    records = [decode_line(line) for line in _lines(minutes=1.0)]
    records = [r for r in records if r is not None and not hasattr(r, "reason")]
    payloads = [encode_records(records[i:i + 97]) for i in range(0, len(records), 97)]
    reference, batched = EmbeddedPipeline(), EmbeddedPipeline()
    expected = [d.to_json_line() for payload in payloads for d in reference.feed_many(decode_request(payload))]
    got = [d.to_json_line() for payload in payloads for d in batched.feed_block(request_block(payload))]
    assert got + [d.to_json_line() for d in batched.finish()] == expected + [
        d.to_json_line() for d in reference.finish()]
    assert batched.counters.as_dict() == reference.counters.as_dict()
    assert reference.counters.rejected.as_dict()["duplicate"] > 10


def test_pipeline_in_blocks_decides_and_flags_as_line_by_line():
    lines = list(_lines(minutes=2.0))
    reference = pipeline_run(lines)
    assert pipeline_run(lines, 333) == reference
    assert len(reference[0]) > 0 and reference[2]["flagged"][0]["line"] > 1


@pytest.mark.parametrize("scenario", sorted(EXPECTED))
def test_pinned_scenarios_decide_alike_in_blocks(scenario):
    sim = Simulator(scenario, seed=SEED, workers=4, minutes=4.0, incident_at=120.0)
    lines = [encode_record(r) for r in sim.records()]
    pipeline = EmbeddedPipeline()
    for start in range(0, len(lines), 4096):
        pipeline.feed_lines(lines[start:start + 4096])
    pipeline.finish()
    assert [(round(d.ts - sim.start_ts, 2), d.action, d.reason, d.bucket, d.cohort)
            for d in pipeline.decisions] == EXPECTED[scenario]


def test_blocks_of_steps_that_draft_nothing_fold_as_records_one_at_a_time():
    def step(seq: int) -> str:
        rounds = [] if seq % 3 == 0 else [{"id": f"r{seq}", "bucket": "chat", "cohort": "baseline", "drafted": 0,
                                           "accepted": 0}]
        return json.dumps({"kind": "step", "v": 1, "ts": 100.0 + seq * 0.7, "worker": "w1", "seq": seq,
                           "bundle_id": "b", "draft_ms": 0.0, "verify_ms": 2.0, "kv_usage": 0.5,
                           "requests": rounds})

    lines = [step(seq) for seq in range(40)]
    reference = _fold_one_at_a_time(lines)
    assert len(reference[0]) == 30 and reference[4] == 40
    assert _fold_in_blocks(lines, range(5, 40, 5)) == reference


def test_a_live_source_rejects_records_from_the_future_in_blocks_as_one_at_a_time():
    lines = list(_lines(minutes=0.5))
    times = sorted(record.ts for record in map(decode_line, lines) if hasattr(record, "ts"))
    now = times[len(times) // 2]  # the wall clock in the middle of the run
    reference = _fold_one_at_a_time(lines, now)
    assert reference[3]["ts_in_future"] >= 25  # the records stamped two hours ahead, at least
    assert _fold_in_blocks(lines, range(100, len(lines), 100), now) == reference
