"""A replay refuses records stamped far from the file's own event time, names them by line, and folds each record once."""

from __future__ import annotations

import io
import json
from functools import lru_cache

import pytest

from specwatch.lab.simulation.simulator import Simulator
from specwatch.schemas.codec import encode_record
from specwatch.commands.replay import replay_file
from specwatch.streams.embedded import EmbeddedPipeline

from machine import specwatch

SEED = 11


@lru_cache(maxsize=None)
def _lines(scenario: str, minutes: float = 4.0, workers: int = 4) -> tuple[str, ...]:
    sim = Simulator(scenario, seed=SEED, workers=workers, minutes=minutes, incident_at=120.0)
    return tuple(encode_record(r) for r in sim.records())


def _replay(lines) -> tuple[bytes, dict]:
    out = io.StringIO()
    summary = replay_file(io.BytesIO("".join(line + "\n" for line in lines).encode()), out, EmbeddedPipeline())
    return out.getvalue().encode(), summary


def _shifted(line: str, seconds: float, seq_offset: int = 0) -> str:
    body = json.loads(line)
    body["ts"] += seconds
    body["seq"] += seq_offset
    return json.dumps(body)


def _middle_step(lines) -> int:
    middle = len(lines) // 2
    return next(i for i in range(middle, len(lines)) if '"kind":"step"' in lines[i].replace(" ", ""))


@pytest.fixture(scope="module")
def acceptance_drop():
    lines = _lines("acceptance_drop")
    decisions, summary = _replay(lines)
    assert decisions.count(b"\n") == 4 and summary["rejected"] == 0 and summary["late_records"] == 0
    return lines, decisions


@pytest.mark.parametrize("seconds,reason", [(3600.0, "clock_ahead"), (-3600.0, "clock_behind")])
def test_one_record_an_hour_off_is_refused_by_line_and_changes_no_decision(acceptance_drop, seconds, reason):
    lines, expected = acceptance_drop
    at = _middle_step(lines)
    # one more step, a copy of a real one under a new seq, stamped an hour off
    rogue = list(lines)
    rogue.insert(at, _shifted(lines[at], seconds, seq_offset=10**9))
    decisions, summary = _replay(rogue)
    assert decisions == expected
    assert summary["rejected_by_reason"] == {reason: 1} and summary["late_records"] == 0
    assert [(f["line"], f["reason"]) for f in summary["flagged"]] == [(at + 1, reason)]
    assert summary["records"] == len(lines)


def test_a_late_record_is_folded_and_named_by_its_line(acceptance_drop):
    lines, _ = acceptance_drop
    at = _middle_step(lines)
    late = list(lines)
    late[at] = _shifted(lines[at], -30.0)  # behind the closed slices, well within the skew bound
    _, summary = _replay(late)
    assert summary["rejected"] == 0 and summary["late_records"] == 1
    assert [(f["line"], f["reason"]) for f in summary["flagged"]] == [(at + 1, "late")]


@pytest.mark.parametrize("scenario", ["acceptance_drop", "quality_mismatch"])
def test_every_line_twice_gives_the_same_decisions_byte_for_byte(scenario):
    lines = _lines(scenario)
    once, summary_once = _replay(lines)
    twice, summary_twice = _replay([line for line in lines for _ in (0, 1)])
    assert once == twice and once
    copies = sum(1 for line in lines if '"kind":"bundle"' not in line.replace(" ", ""))
    assert summary_twice["rejected_by_reason"] == {"duplicate": copies}
    assert summary_twice["records"] == summary_once["records"] + len(lines) - copies  # bundle cards fold twice, harmlessly


def test_duplicates_arriving_later_in_the_stream_are_still_caught():
    lines = list(_lines("quality_mismatch"))
    once, _ = _replay(lines)
    # every step re-sent 200 lines later, as a retrying exporter would after a timeout
    resent = []
    for i, line in enumerate(lines):
        resent.append(line)
        if i >= 200 and '"kind":"step"' in lines[i - 200].replace(" ", ""):
            resent.append(lines[i - 200])
    twice, summary = _replay(resent)
    assert twice == once
    assert summary["rejected_by_reason"] == {"duplicate": len(resent) - len(lines)}


def test_replay_cli_prints_the_refused_line(tmp_path):
    lines = list(_lines("healthy", minutes=0.5, workers=2))
    at = _middle_step(lines)
    lines[at] = _shifted(lines[at], 3600.0)
    telemetry = tmp_path / "t.jsonl"
    telemetry.write_text("".join(line + "\n" for line in lines))
    proc = specwatch("replay", str(telemetry), "--output", str(tmp_path / "d.jsonl"), timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "rejected clock_ahead: 1" in proc.stdout
    assert f"line {at + 1}: clock_ahead: ts " in proc.stdout
