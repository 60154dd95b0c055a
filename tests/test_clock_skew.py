"""Clocks that run wrong, at the start, in a burst or for a whole worker, and time that jumps: the incident
in the file is still decided, with the clean file's reason and scope, and a jump raises nothing."""

from __future__ import annotations

import io
import json
from functools import lru_cache

import pytest

from specwatch.commands.replay import replay_file
from specwatch.schemas import Policy
from specwatch.schemas.codec import encode_record
from specwatch.lab.simulation.simulator import Simulator
from specwatch.streams.embedded import EmbeddedPipeline

# baselines learned in 15 s, so that a 54 s file reaches its decisions
POLICY = Policy.model_validate({"baseline": {"learn_seconds": 15}})
HOUR = 3600.0


@lru_cache(maxsize=None)
def _lines(scenario: str) -> tuple[str, ...]:
    sim = Simulator(scenario, seed=11, workers=4, minutes=0.9, incident_at=25.0)
    return tuple(encode_record(record) for record in sim.records())


def _replay(lines) -> tuple[list[tuple], dict]:
    """(ts, action, reason, bucket, cohort) of each decision of ``lines`` replayed in blocks, and the counters."""
    out = io.StringIO()
    summary = replay_file(io.BytesIO("".join(line + "\n" for line in lines).encode()), out,
                          EmbeddedPipeline(POLICY))
    decisions = [json.loads(line) for line in out.getvalue().splitlines()]
    return [(d["ts"], d["action"], d["reason"], d.get("bucket"), d.get("cohort")) for d in decisions], summary


def _shifted(line: str, seconds: float, copy: int = 0) -> str:
    """``line`` stamped ``seconds`` off; ``copy`` > 0 makes it a further record (a new seq or id), not a duplicate."""
    body = json.loads(line)
    body["ts"] += seconds
    if copy and "seq" in body:
        body["seq"] += 10**9 + copy
    elif copy and "id" in body:
        body["id"] += f"-copy{copy}"
    return json.dumps(body)


def _kind(line: str) -> str:
    return json.loads(line)["kind"]


@pytest.fixture(scope="module")
def clean():
    lines = _lines("acceptance_drop")
    decisions, summary = _replay(lines)
    assert [d[1:] for d in decisions] == [
        ("reduce_draft_length", "acceptance_drop", "coding", "main"),
        ("disable_speculation", "acceptance_drop", "coding", "main"),
    ]
    assert summary["rejected"] == 0 and summary["late_records"] == 0
    return lines, decisions


def test_two_copies_of_a_step_an_hour_ahead_before_line_1_are_refused_and_change_nothing(clean):
    lines, expected = clean
    step = next(line for line in lines if _kind(line) == "step")
    decisions, summary = _replay([_shifted(step, HOUR, copy=1)] * 2 + list(lines))
    assert decisions == expected
    assert summary["rejected_by_reason"] == {"clock_ahead": 2} and summary["late_records"] == 0
    assert [(f["line"], f["reason"]) for f in summary["flagged"]] == [(1, "clock_ahead"), (2, "clock_ahead")]


def test_five_records_290_s_ahead_at_the_start_change_no_decision(clean):
    lines, expected = clean
    decisions, summary = _replay([_shifted(line, 290.0) for line in lines[:5]] + list(lines[5:]))
    # within the skew bound: folded at the fleet's time (the first bundle cards here), never moving the watermark
    assert decisions == expected
    assert summary["rejected"] == 0 and summary["late_records"] == 0


def test_twenty_records_an_hour_ahead_mid_file_are_refused_and_change_no_decision(clean):
    lines, expected = clean
    at = len(lines) // 3
    decisions, summary = _replay(list(lines[:at]) + [_shifted(line, HOUR, copy=1) for line in lines[at:at + 20]]
                                 + list(lines[at:]))
    assert decisions == expected
    assert summary["rejected_by_reason"] == {"clock_ahead": 20} and summary["late_records"] == 0
    assert [f["line"] for f in summary["flagged"]] == list(range(at + 1, at + 21))


@pytest.mark.parametrize("seconds", [200.0, -200.0])
def test_one_worker_of_four_with_its_clock_200_s_off_still_counts(clean, seconds):
    lines, expected = clean
    worker = '"worker":"w3"'
    decisions, summary = _replay([_shifted(line, seconds) if worker in line else line for line in lines])
    # its records are taken back to the fleet's time: none refused, none late, the same decisions
    assert [d[1:] for d in decisions] == [d[1:] for d in expected]
    assert summary["rejected"] == 0 and summary["late_records"] == 0 and summary["records"] == len(lines)
    for (ts, *_), (clean_ts, *_) in zip(decisions, expected):
        assert abs(ts - clean_ts) < POLICY.windows.slice_seconds


def test_a_healthy_file_whose_second_half_is_shifted_600_s_raises_nothing():
    lines = _lines("healthy")
    assert _replay(lines)[0] == []
    half = len(lines) // 2
    decisions, summary = _replay(list(lines[:half]) + [_shifted(line, 600.0) for line in lines[half:]])
    assert decisions == []
    # the fleet's time jumps once most workers agree; only their first records after it are refused
    assert set(summary["rejected_by_reason"]) == {"clock_ahead"} and summary["late_records"] == 0
    assert summary["records"] >= len(lines) - 100
