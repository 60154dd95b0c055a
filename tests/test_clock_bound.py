"""Records too far from their source's event time are refused, live (wall clock too) and in replays alike."""

from __future__ import annotations

from specwatch.lab.simulation.simulator import Simulator
from specwatch.schemas import Policy
from specwatch.schemas.codec import encode_record
from specwatch.schemas.otlp import encode_records
from specwatch.streams.embedded import EmbeddedPipeline
from specwatch.streams.stage_tasks import Stage1Task


def _records(minutes: float = 0.5):
    return list(Simulator("healthy", seed=3, workers=2, minutes=minutes).records())


def _shifted(record, seconds: float):
    return record.model_copy(update={"ts": record.ts + seconds})


def test_the_embedded_pipeline_rejects_only_the_far_future_record():
    records = _records()
    now = records[-1].ts + 1.0  # the clock of a live run that has just received the last record
    rogue = _shifted(records[len(records) // 2], 3600.0)
    checked, plain = EmbeddedPipeline(clock=lambda: now), EmbeddedPipeline()
    for record in records[: len(records) // 2] + [rogue] + records[len(records) // 2:]:
        checked.feed(record)
        plain.feed(record)
    assert checked.counters.rejected.as_dict() == {"ts_in_future": 1}
    assert checked.counters.records == len(records)
    assert checked.stage1.late_records == 0  # the rogue record did not drag event time ahead
    # without a wall clock the source's own event time refuses it, and nothing turns late
    assert plain.counters.rejected.as_dict() == {"clock_ahead": 1}
    assert plain.counters.records == len(records) and plain.stage1.late_records == 0


def test_json_lines_are_checked_too_one_at_a_time_and_in_blocks():
    records = _records(0.2)
    rogue = _shifted(records[0], 301.0 + records[-1].ts - records[0].ts)
    lines = [encode_record(record) for record in [rogue] + records]
    one_at_a_time, in_blocks = (EmbeddedPipeline(clock=lambda: records[-1].ts) for _ in range(2))
    for line in lines:
        one_at_a_time.feed_line(line)
    for start in range(0, len(lines), 50):
        in_blocks.feed_lines(lines[start:start + 50])
    for pipeline in (one_at_a_time, in_blocks):
        assert pipeline.counters.rejected.as_dict() == {"ts_in_future": 1}
        assert pipeline.counters.records == len(records)
    assert in_blocks.counters.as_dict() == one_at_a_time.counters.as_dict()


def test_stage1_task_rejects_by_the_clock_it_is_given_and_by_event_time_without_one():
    records = _records(0.2)
    payload = encode_records(records[:5] + [_shifted(records[5], 600.0)] + records[6:10])
    rejections, _ = Stage1Task(Policy(), "t/0").fold(0, payload, now=records[9].ts)
    assert [r.reason for r in rejections] == ["ts_in_future"]
    task = Stage1Task(Policy(), "t/0")
    rejections, _ = task.fold(0, payload)
    assert [r.reason for r in rejections] == ["clock_ahead"] and task.records == 9
