"""One ingest step and one stage-1 fold serve every path: reference, batch, Faust and the bench's per-round processor."""

from __future__ import annotations

import json
from collections import Counter
from functools import lru_cache

from specwatch.lab.bench.figures import NaiveRoundPipeline, per_round_lines
from specwatch.schemas import Policy, decode_line
from specwatch.schemas.codec import encode_record
from specwatch.schemas.lines_block import decode_lines_block
from specwatch.schemas.otlp import decode_request, encode_records
from specwatch.lab.simulation.simulator import Simulator
from specwatch.streams.embedded import EmbeddedPipeline
from specwatch.streams.stage_tasks import Stage1Task, decode_checkpoint, encode_checkpoint
from specwatch.streams.sources import Ingest
from specwatch.streams.combine import Stage1

from test_bad_input import BAD_LINES
from test_fastpath import batches_json


@lru_cache(maxsize=None)
def _records(scenario: str = "acceptance_drop", minutes: float = 3.0) -> tuple:
    return tuple(Simulator(scenario, seed=7, minutes=minutes, workers=2, concurrency=12, incident_at=60.0).records())


def test_stage1_folds_a_block_as_it_folds_reference_steps():
    records = _records()
    lines = [encode_record(r) for r in records]
    stage = Stage1(Policy(), source="w")
    reference = []
    for line in lines:
        assert stage.add(decode_line(line)) is None
        reference += stage.close_ready()
    reference += stage.close_ready(final=True)
    block = decode_lines_block(lines)
    ingest = Ingest(Stage1(Policy(), source="w"))
    folded = ingest.block(block)
    assert len(block) > 1000 and not folded.rejections and not folded.late
    folded = folded.closed + ingest.release()
    assert batches_json(folded) == batches_json(reference)
    # every round of every step is in a partial of its key
    entries = sum(stats.rounds + stats.plain_entries for batch in folded
                  for key, stats in batch.partials.items() if key[1] is not None)
    assert entries == sum(len(r.requests) for r in records if r.kind == "step") > 10_000


def _bad_payloads() -> list[bytes]:
    records = list(_records(minutes=1.0))
    payloads = [encode_records(records[i:i + 50]) for i in range(0, len(records), 50)]
    again = encode_records(records[100:103])  # delivered twice: three duplicates
    return payloads[:3] + [again, b"\x00 not protobuf"] + payloads[3:]


def test_every_path_counts_rejections_in_one_counter_by_reason():
    payloads = _bad_payloads()
    task = Stage1Task(Policy(), "t/0")
    for offset, payload in enumerate(payloads):
        task.fold(offset, payload)
    embedded = EmbeddedPipeline()
    for payload in payloads:
        embedded.feed_many(decode_request(payload))
    assert task.rejected.as_dict() == embedded.counters.rejected.as_dict() == {"duplicate": 3, "invalid_otlp": 1}
    lines = [line for lines in BAD_LINES.values() for line in lines]
    one_at_a_time, in_a_block = Ingest(Stage1(Policy(), source="w")), Ingest(Stage1(Policy(), source="w"))
    for line in lines:
        one_at_a_time(line)
    in_a_block.block(decode_lines_block(lines))
    for ingest in (one_at_a_time, in_a_block):
        assert ingest.rejected.as_dict() == dict(sorted(Counter(
            {reason: len(bad) for reason, bad in BAD_LINES.items()}).items()))


def _folded_alike(payloads) -> tuple[Stage1Task, Stage1Task]:
    """Two tasks that folded the first four payloads: one to checkpoint, one to go on as it is."""
    old, fresh = Stage1Task(Policy(), "t/0"), Stage1Task(Policy(), "t/0")
    for offset, payload in enumerate(payloads[:4]):
        old.fold(offset, payload)
        fresh.fold(offset, payload)
    return old, fresh


def _assert_folds_on_alike(restored, fresh, payloads) -> None:
    for offset, payload in enumerate(payloads[4:], start=4):
        assert batches_json(restored.fold(offset, payload)[1]) == batches_json(
            fresh.fold(offset, payload)[1])
    assert restored.rejected.as_dict() == fresh.rejected.as_dict()
    assert fresh.rejected.as_dict() == {"duplicate": 3, "invalid_otlp": 1}
    assert restored.records == fresh.records and restored.ingest.stage is restored.stage


def test_a_stage1_checkpoint_keeps_its_rejection_counts_and_folds_on_alike():
    payloads = _bad_payloads()
    old, fresh = _folded_alike(payloads)
    restored = decode_checkpoint(encode_checkpoint(old))
    assert restored.rejected.as_dict() == old.rejected.as_dict() == {"duplicate": 3}
    assert restored.ingest.decode is decode_request and restored.ingest.stage is restored.stage
    _assert_folds_on_alike(restored, fresh, payloads)


def _run(pipeline, feed, items) -> tuple:
    slices = []
    pipeline.sinks.append(lambda out: slices.append(json.dumps(
        (out.slice_index, out.window_rows, [a.decision.to_json_line() for a in out.actions]),
        sort_keys=True, default=repr)))
    for item in items:
        feed(pipeline, item)
    pipeline.finish()
    return [d.to_json_line() for d in pipeline.decisions], slices


def test_the_per_round_processor_folds_through_stage1_and_decides_as_the_reference():
    records = _records()
    lines = [encode_record(r).encode() for r in records]
    naive_lines = [line for record, encoded in zip(records, lines)
                   for line in (per_round_lines(record) if record.kind == "step" else [encoded])]
    assert len(naive_lines) > 2 * len(lines)
    reference = _run(EmbeddedPipeline(), EmbeddedPipeline.feed_line, lines)
    per_round = _run(NaiveRoundPipeline(), NaiveRoundPipeline.feed_round_line, naive_lines)
    assert len(reference[0]) > 0
    assert per_round == reference
