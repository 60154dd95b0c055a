"""The batch mode (block decoders, `Stage1.fold_block`) gives exactly what the reference per-record path gives."""

import json
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest

from specwatch.lab.simulation.simulator import Simulator
from specwatch.schemas import Policy, Rejection, StepRecord, decode_line
from specwatch.schemas.codec import encode_record
from specwatch.schemas.lines_block import decode_lines_block
from specwatch.schemas.native_walks import DECODERS
from specwatch.schemas.otlp import decode_request, encode_records
from specwatch.schemas.otlp_block import request_block
from specwatch.streams.embedded import EmbeddedPipeline
from specwatch.streams.stage_tasks import Stage1Task
from specwatch.streams.combine import Stage1

from test_bad_input import BAD_LINES, _round, _step


def _lines(scenario="acceptance_drop", seed=11, minutes=5.0, workers=2):
    sim = Simulator(scenario, seed=seed, minutes=minutes, workers=workers, concurrency=12)
    return [encode_record(r) for r in sim.records()]


def batches_json(batches) -> list[str]:
    """Slice batches as text that is equal when the batches are."""
    return [json.dumps(b.to_dict(), sort_keys=True) for b in batches]


def as_columns(item):
    """A reference `StepRecord` as the columns a block holds for it; any other outcome as it is."""
    if not isinstance(item, StepRecord):
        return item
    requests = item.requests
    return (item.ts, item.worker, item.seq, item.bundle_id, item.draft_ms, item.verify_ms, item.kv_usage,
            tuple(e.id for e in requests), tuple(e.bucket for e in requests), tuple(e.cohort for e in requests),
            tuple(e.drafted for e in requests), tuple(e.accepted for e in requests))


def block_outcomes(block) -> dict:
    """Each position of a block: its step row as columns, or what ``others`` holds there (a step as columns)."""
    out = {}
    bounds = block.round_step.searchsorted(np.arange(len(block) + 1)).tolist()
    for row, position in enumerate(block.at):
        start, end = bounds[row], bounds[row + 1]
        bundle, *whole = block.keys[block.bundle_key[row]]
        keys = [block.keys[k] for k in block.round_key[start:end].tolist()]
        assert whole == [None, None] and {key[0] for key in keys} <= {bundle}
        assert block.count[start:end].tolist() == [1] * (end - start)
        floats = [float(column[row]) for column in (block.ts, block.draft_ms, block.verify_ms, block.kv_usage)]
        out[position] = (floats[0], block.workers[row], block.seqs[row], bundle, *floats[1:],
                         tuple(block.step_ids[row]), tuple(key[1] for key in keys), tuple(key[2] for key in keys),
                         tuple(block.drafted[start:end].tolist()), tuple(block.accepted[start:end].tolist()))
    for position, item in block.others:
        assert position not in out
        out[position] = as_columns(item)
    return out


def assert_block_is_the_reference(block, reference: list) -> None:
    """The block holds, position by position, what the reference decoder gave (None: nothing, a blank line)."""
    assert block_outcomes(block) == {position: as_columns(item) for position, item in enumerate(reference)
                                     if item is not None}
    for row, position in enumerate(block.at):  # a kept sample is built as the reference decodes it
        assert block.record(row) == reference[position]


ODD_LINES = [
    _step(1, ts=5), _step(2, kv_usage=1), _step(3, draft_ms=True),
    json.dumps({**json.loads(_step(4)), "seq": 1.0}), _step(5, v=True),
    _step(6, requests=[]), _step(7, requests=[_round(drafted=True)]),
    _step(8, requests=[_round(drafted=2.0)]), _step(9, requests=[_round(id="")]),
    _step(10, requests=[_round(bucket="b" * 257)]), _step(11, requests=[_round(drafted=65)]),
    _step(12, requests=[_round(accepted=-1)]), _step(16, requests=[_round(bucket=["b"])]),
    _step(13, requests=[["r", "b", "c", 2, 1]]), _step(14, requests=["r"]), _step(15, requests={"a": 1}),
    _step(17, requests=[{"id": "r", "bucket": "b", "cohort": "c", "drafted": 2}]),
    _step(18, ts=2 ** 60), _step(19, ts="5"), _step(20, worker=""), _step(21, extra={"x": [1]}),
    '{"kind": "step", "v": 1, "ts": NaN}', '{"kind": "step", "ts": 1e999}', "", "   ", "\ufeff{}",
    '{"kind": "step", "v": 1, "ts": 123456789012345678901234567890}', '{"a": "\\ud800"}',
    json.dumps({"kind": "request", "v": 1, "ts": 1.0}),
    _step(22, v=1.0), _step(23, worker="w\x1b[31m"), _step(24, bundle_id="b\u2028"), _step(25, worker="w\u00e9\u2764"),
    _step(26, requests=[_round(bucket="*")]), _step(27, requests=[_round(cohort="c/d")]),
    _step(28, requests=[_round(id="r\x00")]),
    _step(29, requests=[_round(bucket="**", cohort="c*")]),
]


def test_json_lines_in_a_block_decode_as_the_reference_on_seeded_data_and_bad_input():
    corpus = _lines(minutes=1.0) + [line for lines in BAD_LINES.values() for line in lines] + ODD_LINES
    for lines in (corpus, [line.encode() for line in corpus]):
        block = decode_lines_block(lines)
        assert_block_is_the_reference(block, [decode_line(line) for line in lines])
        kinds = Counter(type(item).__name__ for _, item in block.others)
        assert len(block) > 1000 and kinds["Rejection"] > 20


def test_otlp_requests_as_blocks_decode_as_the_reference():
    records = [decode_line(line) for line in _lines(minutes=0.5)]
    steps = 0
    for i in range(0, len(records), 500):
        payload = encode_records(records[i:i + 500])
        block = request_block(payload)
        assert_block_is_the_reference(block, decode_request(payload))
        steps += len(block)
    assert steps > 100
    for bad in (b"\xff\xff not protobuf", b"", payload[:-3]):
        assert_block_is_the_reference(request_block(bad), decode_request(bad))


@pytest.mark.parametrize("field, value", [
    ("worker", "w\x1b[2J"), ("bundle_id", "b\u202e"), ("id", "r\x9b"), ("bucket", "*"), ("bucket", "a/b"),
    ("cohort", "*"), ("cohort", "c\n"), ("bucket", "b\u00e9"), ("cohort", "**"), ("seq", 2.0), ("v", True),
])
def test_otlp_names_and_types_decode_as_the_reference(field, value):
    """A name or type the reference rejects is never let through by the wire reader, in either layout."""
    from specwatch.schemas.contract import RoundEntry

    rounds = [RoundEntry.model_construct(id="r1", bucket="coding", cohort="main", drafted=4, accepted=3),
              RoundEntry.model_construct(id="r2", bucket="chat", cohort="main", drafted=4, accepted=4)]
    fields = dict(v=1, ts=10.0, worker="w1", seq=3, bundle_id="b1", draft_ms=1.0, verify_ms=9.0, kv_usage=0.5)
    if field in fields:
        fields[field] = value
    else:
        rounds[1] = rounds[1].model_copy(update={field: value})
    step = StepRecord.model_construct(**fields, requests=rounds)
    good = StepRecord.model_construct(**dict(fields, worker="w1", bundle_id="b1", seq=3, v=1), requests=rounds[:1])
    payload = encode_records([good, step, good])
    reference = decode_request(payload)
    assert len(reference) == 3
    assert_block_is_the_reference(request_block(payload), reference)
    valid = value in ("b\u00e9", "**")
    assert isinstance(reference[1], Rejection) is not valid
    if not valid:
        assert reference[1].reason == ("unsupported_version" if field == "v" else "invalid_value")


def pipeline_run(lines, block: int = 0) -> tuple:
    """Decisions, every final slice (rows, audits, samples) and the counters of a pipeline fed
    ``lines`` one at a time (``block`` 0) or in blocks of ``block`` lines."""
    pipeline, slices = EmbeddedPipeline(Policy()), []
    pipeline.sinks.append(lambda out: slices.append(json.dumps(  # NaN-safe comparison
        (out.slice_index, out.window_rows, [a.audit for a in out.actions], [a.samples for a in out.actions]),
        sort_keys=True, default=repr)))
    if block:
        decided = [d for i in range(0, len(lines), block) for d in pipeline.feed_lines(lines[i:i + block])]
    else:
        decided = [d for line in lines for d in pipeline.feed_line(line)]
    decided += pipeline.finish()
    return [d.to_json_line() for d in decided], slices, pipeline.counters.as_dict()


@pytest.mark.parametrize("scenario", ["acceptance_drop", "demo"])
def test_pipeline_decisions_are_byte_identical(scenario):
    lines = _lines(scenario, seed=5, minutes=6.0) + ODD_LINES
    reference = pipeline_run(lines)
    assert pipeline_run(lines, 4096) == pipeline_run(lines, 77) == reference
    assert len(reference[0]) > 0 and reference[2]["rejected"] > 20


def _reference_fold(stage, payload):
    reasons, closed = [], []
    for item in decode_request(payload):
        if isinstance(item, Rejection):
            reasons.append(item.reason)
            continue
        stage.add(item)
        closed.extend(stage.close_ready())
    return reasons, closed


def test_stage1_task_gives_the_partials_of_the_reference_fold():
    records = [decode_line(line) for line in _lines("acceptance_drop", seed=2, minutes=3.0)]
    payloads = [encode_records(records[i:i + 40]) for i in range(0, len(records), 40)] + [b"\x00junk"]
    task, reference = Stage1Task(Policy(), "t/0"), Stage1(Policy(), source="t/0")
    for offset, payload in enumerate(payloads):
        rejections, batches = task.fold(offset, payload)
        reasons, expected = _reference_fold(reference, payload)
        assert [r.reason for r in rejections] == reasons
        assert batches_json(batches) == batches_json(expected)
    final = task.stage.close_ready(final=True)
    assert batches_json(final) == batches_json(reference.close_ready(final=True))
    assert task.records == reference.records and task.next_offset == len(payloads)


def test_bench_quick_json_shape():
    run = subprocess.run([sys.executable, "-m", "specwatch.cli", "bench", "--quick", "--json", "--smoke"],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["failed_sections"] == []
    assert set(report) >= {"machine", "stream", "kafka", "collector", "archive", "replay", "growth", "keys", "targets"}
    assert [row["keys"] for row in report["keys"]["curve"]] == [1, 10, 100]
    for row in report["stream"]:
        assert {"encoding", "requests_per_step", "rounds", "columnar_rounds_per_s", "naive_rounds_per_s",
                "reference_rounds_per_s", "speedup_vs_naive", "speedup_vs_reference"} <= set(row)
        assert row["same_decisions_as_reference"] is True
        # where the compiled step walk ran, the batch mode without it decides the same
        compiled = report["machine"]["decoders"][row["encoding"]] == "native"
        assert row["decoder"] == ("native" if compiled else "reference")
        assert ("native_over_reference" in row, row.get("native_same_decisions")) == (compiled, True if compiled else None)
    assert report["machine"]["decoders"] == DECODERS
    # replay and keys name the path they took and give the figure without the compiled walk beside it
    assert report["replay"]["decoder"] == DECODERS["jsonl"]
    assert report["replay"]["same_decisions_without_native"] is True
    assert report["replay"]["replay_s_without_native"] > 0
    assert all(row["us_per_key_slice_without_native"] > 0 for row in report["keys"]["curve"])
    assert {"met", "target", "measured"} <= set(report["targets"][0])
