"""The JSON Lines block decoder reads round columns from the bytes and gives what decoding each line gives."""

import json
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from specwatch.schemas.codec import decode_line, encode_record
from specwatch.schemas.contract import MAX_REQUESTS_PER_STEP
from specwatch.schemas.lines_block import decode_lines_block
from specwatch.lab.simulation.simulator import Simulator

from test_bad_input import BAD_LINES
from test_fastpath import ODD_LINES, assert_block_is_the_reference


def _step(seq: int, requests, worker: str = "w1", ascii_only: bool = True) -> bytes:
    return json.dumps({"v": 1, "ts": 100.0 + seq, "kind": "step", "worker": worker, "seq": seq, "bundle_id": "b",
                       "draft_ms": 1.5, "verify_ms": 9.0, "kv_usage": 0.5, "requests": requests},
                      separators=(",", ":"), ensure_ascii=ascii_only).encode()


def _round(rid="r1", bucket="chat", cohort="main", drafted=4, accepted=3) -> dict:
    return {"id": rid, "bucket": bucket, "cohort": cohort, "drafted": drafted, "accepted": accepted}


def _check(lines: list[bytes]):
    """Assert the block decodes as its lines one by one with the reference codec; the block, for further checks."""
    block = decode_lines_block(lines)
    assert_block_is_the_reference(block, [decode_line(line) for line in lines])
    return block


# Layouts other than the writer's, and values at the edges of what the contract takes.
_EDGES = [
    _step(1, [_round(drafted=12, accepted=10), _round("r2", drafted=64, accepted=64),
              _round("r3", drafted=0, accepted=0)]),
    _step(2, [_round(drafted=65, accepted=1)]), _step(3, [_round(drafted=99, accepted=9)]),
    _step(4, [_round(accepted=5)]), _step(5, []), _step(6, [_round("x" * 256)]), _step(7, [_round("x" * 257)]),
    _step(8, [_round("r\u00e9")]), _step(9, [_round("r\x7f")]), _step(10, [_round("r\u2028")]),
    _step(11, [_round(bucket="*")]), _step(12, [_round(cohort="a/b")]), _step(13, [_round(bucket="")]),
    _step(14, [_round('r"1')]), _step(15, [_round("r\\1")]), _step(16, [_round("r}1,{")]),
    _step(17, [{"bucket": "chat", "id": "r1", "cohort": "main", "drafted": 4, "accepted": 3}]),
    _step(18, [{**_round(), "extra": "x"}]), _step(19, [{**_round(), "extra": "a\"b\"c\"d\"e\"f\"g\"h\""}]),
    _step(20, [_round(drafted=4.0)]), _step(21, [_round(accepted=True)]), _step(22, [_round(accepted=-1)]),
    _step(23, [_round()] * (MAX_REQUESTS_PER_STEP + 1)), _step(24, [_round(f"r{i}") for i in range(40)]),
    _step(25, [_round(rid='","bucket":"x","cohort":"y","drafted":4,"accepted":3}')]),
    json.dumps(json.loads(_step(26, [_round()])), indent=None).encode(),  # ", " and ": " between fields
    _step(27, [_round()]).replace(b'"drafted":4', b'"drafted":04'),
    _step(28, [_round()]).replace(b'"id":"r1"', b'"id":"r\\u0031"'),
    _step(29, [_round()]).replace(b'"accepted":3}', b'"accepted":3,"accepted":1}'),
    _step(30, [_round()]).replace(b'"accepted":3}', b'"accepted":3 }'),
    _step(31, [_round(), _round("r2")]).replace(b'},{', b'}, {'),
    _step(32, 5), _step(33, "0123456789abcdef"), _step(34, [_round()]).replace(b'"drafted":4,', b'"drafted":4 ,'),
]


def _simulated(workers: int = 2, concurrency: int = 12) -> list[bytes]:
    sim = Simulator("acceptance_drop", seed=5, minutes=0.5, workers=workers, concurrency=concurrency, incident_at=10.0)
    return [encode_record(record).encode() for record in sim.records()]


def test_simulated_blocks_read_every_step_as_columns_and_share_repeated_ids():
    lines = _simulated()
    steps = [position for position, line in enumerate(lines) if b'"kind":"step"' in line]
    for start in range(0, len(lines), 500):
        _check(lines[start:start + 500])
    block = decode_lines_block(lines)
    assert block.at == steps and [type(item).__name__ for _, item in block.others].count("StepRecord") == 0
    # a worker that runs the same requests step after step: one tuple of ids for all those steps
    before: dict[str, int] = {}
    same = []
    for row, worker in enumerate(block.workers):
        if worker in before and block.step_ids[row] == block.step_ids[before[worker]]:
            same.append((row, before[worker]))
        before[worker] = row
    assert len(same) > len(block) // 2
    assert all(block.step_ids[row] is block.step_ids[previous] for row, previous in same)


def test_other_layouts_and_edge_values_decode_as_line_by_line():
    good = _step(0, [_round(), _round("r2", "coding", "canary", 4, 0)])
    block = _check([good, *_EDGES, good.replace(b'"seq":0', b'"seq":99')])
    # every step the contract takes is a row of the columns (read by position, or round by
    # round in another layout); the rest are what decoding the line alone gives
    assert [position for position, _ in block.others] == [2, 3, 4, 7, 9, 10, 11, 12, 13, 20, 21, 22, 23, 27,
                                                           32, 33]
    assert block.seqs == [0, 1, 5, 6, 8, 14, 15, 16, 17, 18, 19, 24, 25, 26, 28, 29, 30, 31, 34, 99]


def test_bad_and_odd_lines_among_steps_decode_as_line_by_line():
    lines = _simulated()[:300]
    rng = random.Random(7)
    for bad in ODD_LINES + [line for group in BAD_LINES.values() for line in group] + _EDGES:
        lines.insert(rng.randrange(len(lines)), bad if type(bad) is bytes else bad.encode())
    for size in (1, 7, 64, len(lines)):
        for start in range(0, len(lines), size):
            _check(lines[start:start + size])


_NAME = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=0, max_size=6) | st.sampled_from(
    ["chat", "main", "*", "a/b", "r\x7f", "r\u00e9", '"', "\\", "x" * 256, "x" * 257])


@st.composite
def _steps(draw) -> list[bytes]:
    """Steps in the writer's layout with names and counts at and past the contract's edges, some re-spaced."""
    lines = []
    rounds: list[dict] = []
    for seq in range(draw(st.integers(1, 6))):
        if rounds and draw(st.booleans()):  # the same requests again, their counts drawn anew
            rounds = [dict(r, drafted=draw(st.integers(0, 64)), accepted=draw(st.integers(0, 64))) for r in rounds]
        else:
            rounds = draw(st.lists(st.builds(_round, _NAME, _NAME, _NAME, st.integers(0, 100), st.integers(0, 100)),
                                   max_size=5))
        line = _step(seq, rounds, worker=draw(st.sampled_from(["w1", "w2"])), ascii_only=draw(st.booleans()))
        if draw(st.integers(0, 4)) == 0:
            line = line.replace(b',"accepted":', b', "accepted":')
        lines.append(line)
    return lines


@settings(max_examples=300, deadline=None)
@given(_steps())
def test_random_steps_decode_as_line_by_line(lines):
    _check(lines)


def test_a_line_of_two_records_and_a_comma_shifts_no_other_line():
    """The block is parsed as one JSON array of its lines: a line holding two objects would
    give one more element than there are lines, and every later line the wrong position."""
    lines = _simulated()[:40]
    requests = [line for line in lines if b'"kind":"request"' in line][:2]
    block = _check([requests[0] + b"," + requests[1], *lines])
    assert block.at == [position + 1 for position, line in enumerate(lines) if b'"kind":"step"' in line]
