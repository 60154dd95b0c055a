"""Stage 1's compiled admission (`NativeEventClock`, `ClockCore.admit_steps`) against the reference
(`EventClock`, the Python step loop): record by record, block by block, state by state, decision by decision."""

from __future__ import annotations

import json
import pickle
import random

import pytest

from specwatch.schemas import Policy, Rejection, decode_line
from specwatch.schemas.codec import encode_record
from specwatch.schemas.lines_block import decode_lines_block
from specwatch.schemas.otlp_block import request_block
from specwatch.schemas.otlp import encode_records
from specwatch.lab.simulation.simulator import Simulator
from specwatch.streams import intake
from specwatch.streams.combine import Stage1
from specwatch.streams.embedded import EmbeddedPipeline
from specwatch.streams.intake import EventClock, NativeEventClock
from specwatch.streams.sources import Ingest

from test_columnar import _lines, _outcome
from test_native_decoder import pytestmark  # noqa: F401  (built wherever cargo is; skipped only without it)
from test_scenarios import EXPECTED, SEED

_MAX_SKEW = 300.0


def test_stage1_takes_the_compiled_clock_where_it_is_built():
    assert intake.NATIVE_ADMISSION
    assert type(Stage1(Policy()).clock) is NativeEventClock


def _writer_stream(seed: int, records: int) -> list[tuple[str, float]]:
    """(writer, ts) of a fleet whose clocks misbehave: steady offsets ahead and behind, jitter,
    stamps far off, a burst from one writer, a writer that stops and comes back, the whole
    fleet stepping forward, and a writer turned over (a new name)."""
    rng = random.Random(seed)
    offsets = {"w1": 0.0, "w2": 0.4, "w3": 420.0, "w4": -250.0, "w5": 0.0}
    t, out = 1000.0, []
    for i in range(records):
        t += rng.expovariate(40.0)
        if i == records // 3:
            offsets = {w: o + 1800.0 for w, o in offsets.items()}  # the fleet back from a pause, clocks stepped
        if i == records // 2:
            offsets["w6"] = offsets.pop("w5")  # a worker turned over
        writer = rng.choice(sorted(offsets))
        if writer == "w2" and records // 4 < i < records // 4 + 300:
            continue  # w2 quiet for a while
        ts = t + offsets[writer] + rng.gauss(0.0, 0.3)
        roll = rng.random()
        if roll < 0.01:
            ts += rng.choice((-1.0, 1.0)) * rng.uniform(_MAX_SKEW, 5000.0)  # far off: refused
        elif roll < 0.03:
            ts += rng.uniform(-_MAX_SKEW, _MAX_SKEW)  # off, within the bound: folded at the source's time
        elif roll < 0.035:
            out += [(writer, ts + 90.0 + k * 0.01) for k in range(15)]  # a burst of 15 from one clock
        out.append((writer, ts))
    return out


def _state(clock) -> str:
    return json.dumps(clock.to_state())  # as a checkpoint holds it (NaN never equals itself in a dict)


def _same(native, reference) -> bool:
    if type(reference) is Rejection:
        return type(native) is Rejection and (native.reason, native.detail) == (reference.reason, reference.detail)
    return type(native) is float and native == reference


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_compiled_clock_admits_as_the_reference_record_by_record(seed):
    stream = _writer_stream(seed, 12_000)
    native, reference = NativeEventClock(_MAX_SKEW), EventClock(_MAX_SKEW)
    native.prime(stream[:600])
    reference.prime(stream[:600])
    assert _state(native) == _state(reference)
    outcomes = []
    for i, (writer, ts) in enumerate(stream):
        expected = reference.admit(ts, writer)
        got = native.admit(ts, writer)
        assert _same(got, expected), (i, writer, ts, got, expected)
        outcomes.append(expected.reason if type(expected) is Rejection else
                        "corrected" if expected != ts and abs(expected - ts) > 1.0 else "as stamped")
        assert native.now == reference.now
        if i % 997 == 0:
            assert _state(native) == _state(reference), i
    # the stream holds every outcome the comparison must cover, and 8192 in-line records (writers forgotten)
    counts = {outcome: outcomes.count(outcome) for outcome in set(outcomes)}
    assert counts["clock_ahead"] > 30 and counts["clock_behind"] > 30 and counts["corrected"] > 5000, counts
    assert reference.to_state()["seen"] > 8192


def test_a_clock_restarted_from_either_state_goes_on_as_the_reference():
    stream = _writer_stream(5, 6000)
    reference = EventClock(_MAX_SKEW)
    for writer, ts in stream[:2500]:
        reference.admit(ts, writer)
    state = json.loads(json.dumps(reference.to_state()))  # as a checkpoint holds it
    native = NativeEventClock(_MAX_SKEW)
    native.load_state(state)
    assert _state(native) == _state(reference)
    back = EventClock(_MAX_SKEW)  # and a compiled clock's state read by the reference
    for writer, ts in stream[2500:4000]:
        assert _same(native.admit(ts, writer), reference.admit(ts, writer))
    back.load_state(json.loads(json.dumps(native.to_state())))
    for writer, ts in stream[4000:]:
        assert _same(native.admit(ts, writer), back.admit(ts, writer))
    assert _state(native) == _state(back)
    # a state from before writers were told apart, and one the clock cannot hold, as the reference takes them
    old = {k: v for k, v in state.items() if k not in ("writers", "primed", "start")}
    native.load_state(old)
    reference.load_state(old)
    assert _state(native) == _state(reference) and native.to_state()["writers"] == []
    copied = pickle.loads(pickle.dumps(native))  # a stage handed to another process takes its clock along
    assert type(copied) is NativeEventClock and _state(copied) == _state(native)
    with pytest.raises(ValueError, match="cannot hold"):
        native.load_state({**state, "recent": [1.0] * 16})


def _stage(native: bool) -> Stage1:
    stage = Stage1(Policy(), source="w")
    if not native:
        stage.clock = EventClock(stage.policy.windows.max_ahead_seconds)
    return stage


def _fold(lines, cuts, native: bool, now=None, state: dict | None = None) -> tuple:
    ingest = Ingest(_stage(native))
    if state is not None:  # a copy: a stage takes up the lists of the state it loads
        ingest.stage.load_state(json.loads(json.dumps(state)))
    rejected, late, closed = [], [], []
    bounds = [0, *sorted(set(cuts)), len(lines)]
    for start, end in zip(bounds, bounds[1:]):
        done = ingest.block(decode_lines_block(lines[start:end]), now)
        rejected += [(start + at, r.reason, r.detail) for at, r in zip(done.rejected_at, done.rejections)]
        late += [(start + at, ts) for ts, at in zip(done.late, done.late_at)]
        closed += done.closed
    state = json.dumps(ingest.stage.to_state(), sort_keys=True)
    return (*_outcome(ingest, rejected, late, closed), state)


@pytest.mark.parametrize("size", [1, 7, 100, 4096])
def test_blocks_admit_as_the_reference_loop(size):
    """Duplicates, records late by 3 and 30 s, a clock hours ahead, every bad line of the codec
    tests: rejections (reason and detail), late records, closed slices and the stage's whole
    state (clock, duplicate filter, running requests) alike, blocks cut every ``size`` lines."""
    lines = list(_lines())
    cuts = range(size, len(lines), size)
    native = _fold(lines, cuts, native=True)
    assert native == _fold(lines, cuts, native=False)
    batches, rejected, late, reasons = native[:4]
    assert {"duplicate", "clock_ahead", "invalid_json"} <= set(reasons) and reasons["duplicate"] >= 40
    assert len(late) > 10 and len(batches) > 100
    assert json.loads(native[-1])["running"]["workers"]  # the tracker's state is among what is compared


def test_blocks_from_a_live_source_refuse_records_from_the_future_as_the_reference():
    lines = list(_lines(minutes=0.5))
    times = sorted(record.ts for record in map(decode_line, lines) if hasattr(record, "ts"))
    now = times[len(times) // 2]  # the wall clock in the middle of the run
    native = _fold(lines, range(100, len(lines), 100), native=True, now=now)
    assert native == _fold(lines, range(100, len(lines), 100), native=False, now=now)
    assert native[3]["ts_in_future"] >= 25


def test_a_stage_restarted_from_its_checkpoint_state_admits_as_the_reference():
    lines = list(_lines())
    half = len(lines) // 2
    ingest = Ingest(_stage(native=False))
    for start in range(0, half, 500):
        ingest.block(decode_lines_block(lines[start:min(start + 500, half)]))
    state = json.loads(json.dumps(ingest.stage.to_state()))
    rest = lines[half:]
    cuts = range(500, len(rest), 500)
    assert _fold(rest, cuts, native=True, state=state) == _fold(rest, cuts, native=False, state=state)


def _decisions(records, native: bool, otlp: bool) -> list[str]:
    pipeline = EmbeddedPipeline()
    if not native:
        pipeline.stage1.clock = EventClock(pipeline.policy.windows.max_ahead_seconds)
    if otlp:
        for start in range(0, len(records), 200):
            pipeline.feed_block(request_block(encode_records(records[start:start + 200])))
    else:
        lines = [encode_record(r) for r in records]
        for start in range(0, len(lines), 4096):
            pipeline.feed_lines(lines[start:start + 4096])
    return [d.to_json_line() for d in pipeline.decisions + pipeline.finish()]


@pytest.mark.parametrize("scenario", sorted(EXPECTED))
def test_pinned_scenarios_decide_the_same_bytes_with_the_compiled_admission_on_and_off(scenario):
    records = list(Simulator(scenario, seed=SEED, workers=4, minutes=4.0, incident_at=120.0).records())
    for otlp in (False, True):
        decided = _decisions(records, native=True, otlp=otlp)
        assert decided == _decisions(records, native=False, otlp=otlp), (scenario, otlp)
        # what they agree on is the pinned outcome: the scenario's decisions, in order
        assert [(json.loads(d)["action"], json.loads(d)["reason"]) for d in decided][:len(EXPECTED[scenario])] == [
            (action, reason) for _, action, reason, _, _ in EXPECTED[scenario]]
