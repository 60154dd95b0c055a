"""Records too far from their source's event time are refused, live (wall clock too) and in replays alike."""

from __future__ import annotations

from specwatch.simulation.simulator import Simulator
from specwatch.schemas import Policy, decode_line
from specwatch.schemas.codec import encode_record
from specwatch.schemas.fastdecode import decode_line_fast
from specwatch.schemas.otlp import encode_records
from specwatch.streams.embedded import EmbeddedPipeline
from specwatch.streams.faust_tasks import Stage1Task


def _records(minutes: float = 0.5):
    return list(Simulator("healthy", seed=3, workers=2, minutes=minutes).records())


def _shifted(record, seconds: float):
    return record.model_copy(update={"ts": record.ts + seconds})


def test_embedded_and_fast_pipelines_reject_only_the_far_future_record():
    records = _records()
    now = records[-1].ts + 1.0  # the clock of a live run that has just received the last record
    rogue = _shifted(records[len(records) // 2], 3600.0)
    for decode in (decode_line, decode_line_fast):
        checked, plain = EmbeddedPipeline(clock=lambda: now, decode=decode), EmbeddedPipeline(decode=decode)
        for record in records[: len(records) // 2] + [rogue] + records[len(records) // 2:]:
            checked.feed(record)
            plain.feed(record)
        assert checked.counters.rejected.as_dict() == {"ts_in_future": 1}
        assert checked.counters.records == len(records)
        assert checked.stage1.late_records == 0  # the rogue record did not drag event time ahead
        # without a wall clock the source's own event time refuses it, and nothing turns late
        assert plain.counters.rejected.as_dict() == {"clock_ahead": 1}
        assert plain.counters.records == len(records) and plain.stage1.late_records == 0


def test_fast_pipeline_checks_json_lines_too():
    records = _records(0.2)
    pipeline = EmbeddedPipeline(clock=lambda: records[-1].ts, decode=decode_line_fast)
    rogue = _shifted(records[0], 301.0 + records[-1].ts - records[0].ts)
    for record in [rogue] + records:
        pipeline.feed_line(encode_record(record))
    assert pipeline.counters.rejected.as_dict() == {"ts_in_future": 1}
    assert pipeline.counters.records == len(records)


def test_stage1_task_rejects_by_the_clock_it_is_given_and_by_event_time_without_one():
    records = _records(0.2)
    payload = encode_records(records[:5] + [_shifted(records[5], 600.0)] + records[6:10])
    rejections, _ = Stage1Task(Policy(), "t/0").fold(0, payload, now=records[9].ts)
    assert [r.reason for r in rejections] == ["ts_in_future"]
    task = Stage1Task(Policy(), "t/0")
    rejections, _ = task.fold(0, payload)
    assert [r.reason for r in rejections] == ["clock_ahead"] and task.records == 9
