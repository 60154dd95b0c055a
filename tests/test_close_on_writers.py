"""``windows.close_on_writers``: slices closed once every writer has passed them in order, on seeded
fleets whose writers arrive late, go quiet, restart or turn over; the compiled clock against the reference."""

from __future__ import annotations

import json
import random

import pytest

from specwatch.lab.simulation.simulator import Simulator
from specwatch.schemas import Policy, Rejection
from specwatch.schemas.codec import encode_record
from specwatch.streams.combine import Stage1
from specwatch.streams.embedded import EmbeddedPipeline
from specwatch.streams.intake import EventClock, NativeEventClock

from test_native_admission import _writer_stream
from test_native_decoder import pytestmark  # noqa: F401  (built wherever cargo is; skipped only without it)
from test_scenarios import EXPECTED, SEED

_ON = Policy.model_validate({"windows": {"close_on_writers": True}})


def _fleet():
    sim = Simulator("acceptance_drop", seed=SEED, workers=4, minutes=4.0, incident_at=120.0)
    return sim, list(sim.records())


_SIM, _RECORDS = _fleet()
_START = _SIM.start_ts


def _worker(record) -> str | None:
    return getattr(record, "worker", None)


def _at(record) -> float:
    return record.ts - _START


def _delivered(records, delay) -> list:
    """``records`` in the order they arrive when ``delay(record)`` seconds pass between stamp and delivery."""
    return [r for _, _, r in sorted((r.ts + delay(r), i, r) for i, r in enumerate(records))]


def _turned_over(record):
    """w4 restarted under a new name (w5) at 150.7 s."""
    if _worker(record) == "w4" and _at(record) >= 150.7:
        return record.model_copy(update={"worker": "w5"})
    return record


def _resent(records, since: float, until: float, worker: str) -> list:
    """``worker``'s records of ``since``-``until`` s delivered a second time at ``until`` (a restart redelivering)."""
    cut = next(i for i, r in enumerate(records) if _at(r) >= until)
    again = [r for r in records[:cut] if _worker(r) == worker and since <= _at(r)]
    return records[:cut] + again + records[cut:]


# name -> (records as delivered, late records with the lateness rule, late records closing on writers,
# rejections by reason (the same either way))
_CASES = {
    "in order": (lambda: _RECORDS, 0, 0, {}),
    # a writer always 0.5 s behind the others: its lag is measured from its first records, so
    # slices wait for it (never longer than the lateness)
    "w3 always 0.5 s late": (lambda: _delivered(_RECORDS, lambda r: 0.5 if _worker(r) == "w3" else 0.0), 0, 0, {}),
    # quiet for 20 s, then in order again: a writer that has shown its lag holds nothing back meanwhile
    "w3 quiet 150-170 s": (lambda: [r for r in _RECORDS if not (_worker(r) == "w3" and 150 <= _at(r) < 170)],
                           0, 0, {}),
    # quiet past the minute a writer counts as heard from, then back
    "w3 quiet 150-240 s": (lambda: [r for r in _RECORDS if not (_worker(r) == "w3" and 150 <= _at(r) < 240)],
                           0, 0, {}),
    # a restart redelivers w2's last 2 s: refused as duplicates either way, and out of order
    "w2 redelivers 148-150 s": (lambda: _resent(_RECORDS, 148.0, 150.0, "w2"), 0, 0, {"duplicate": 146}),
    # the trade: a writer later than it has ever been has its records of the slice that already
    # closed (150.7-151 s) folded into the next one and counted late, then the lateness rule holds
    "w3 0.5 s late from 150.7 s": (
        lambda: _delivered(_RECORDS, lambda r: 0.5 if _worker(r) == "w3" and _at(r) >= 150.7 else 0.0), 0, 21, {}),
    # and so does a writer new to the source, behind the others from its first record
    "w4 back as w5 at 150.7 s, 0.5 s late": (
        lambda: _delivered(list(map(_turned_over, _RECORDS)), lambda r: 0.5 if _worker(r) == "w5" else 0.0),
        0, 24, {}),
    # a backlog of 20 s delivered at once: late either way; one slice more of it closing on writers
    "w3 backlog of 150-170 s delivered at 170 s": (
        lambda: _delivered(_RECORDS, lambda r: 170 - _at(r) if _worker(r) == "w3" and 150 <= _at(r) < 170 else 0.0),
        1373, 1446, {}),
}


def _decide(records, policy: Policy, reference_clock: bool = False) -> tuple:
    pipeline = EmbeddedPipeline(policy)
    if reference_clock:
        pipeline.stage1.clock = EventClock(policy.windows.max_ahead_seconds,
                                           close_on_writers=policy.windows.close_on_writers)
    pipeline.feed_many(records)
    pipeline.finish()
    decided = [(round(d.ts - _START, 2), d.action, d.reason, d.bucket, d.cohort) for d in pipeline.decisions]
    return decided, pipeline.stage1.late_records, pipeline.counters.rejected.as_dict(), pipeline.decisions


@pytest.mark.parametrize("case", sorted(_CASES))
def test_closing_on_writers_decides_as_the_lateness_rule_and_folds_late_only_what_it_must(case):
    delivered, late_off, late_on, rejected = _CASES[case]
    records = delivered()
    off, on = _decide(records, Policy()), _decide(records, _ON)
    expected = [(ts, action, reason, bucket, cohort) for ts, action, reason, bucket, cohort in EXPECTED[
        "acceptance_drop"]]
    assert off[0] == expected and on[0] == expected  # reason, scope and event time of every decision
    assert [d.to_json_line() for d in on[3]] == [d.to_json_line() for d in off[3]]
    assert (off[1], on[1]) == (late_off, late_on)
    assert off[2] == on[2] == rejected


@pytest.mark.parametrize("case", ["in order", "w3 0.5 s late from 150.7 s", "w4 back as w5 at 150.7 s, 0.5 s late"])
def test_the_compiled_clock_closes_on_writers_as_the_reference(case):
    records = _CASES[case][0]()
    native, reference = _decide(records, _ON), _decide(records, _ON, reference_clock=True)
    assert native[:3] == reference[:3]


def _closed_after(records, policy: Policy) -> dict[int, float]:
    """Each slice's index -> how far past its end the source's time was when it closed."""
    stage = Stage1(policy)
    out = {}
    for record in records:
        assert stage.add(record) is None
        for batch in stage.close_ready():
            if batch.slice_index not in out:
                out[batch.slice_index] = stage.clock.now - (batch.slice_index + 1) * policy.windows.slice_seconds
    return out


def test_in_order_slices_close_a_lateness_sooner():
    off, on = _closed_after(_RECORDS, Policy()), _closed_after(_RECORDS, _ON)
    # the last slice too closes once every writer passed it, not only at the end of the input
    assert sorted(off) == sorted(on)[:-1] and len(on) == 241
    # with the lateness rule each slice waits its second; closing on writers, once every writer
    # (the shadow checker too: in order, so trusted once it has sent 16) has passed it
    assert min(off.values()) >= 1.0
    trusted = [index for index in off if index * 1.0 >= _RECORDS[0].ts + 60.0]
    assert max(on[index] for index in trusted) < 0.1 < 1.0 <= min(off[index] for index in trusted)


def _close_limits(clock, stream) -> list:
    out = []
    for writer, ts in stream:
        admitted = clock.admit(ts, writer)
        out.append((admitted.reason if type(admitted) is Rejection else admitted, clock.close_limit(1.0, 1.0, -1)))
    return out


@pytest.mark.parametrize("make", [EventClock, NativeEventClock])
def test_a_new_writer_holds_slices_until_it_passes_them_and_disorder_keeps_the_lateness_rule(make):
    held, free = make(300.0, close_on_writers=True), make(300.0, close_on_writers=True)
    # a minute in order first: the first minute of a source keeps the lateness rule
    stream = [(w, 40.0 + i * 0.05) for i in range(1240) for w in ("w1", "w2")]  # to 101.95
    assert _close_limits(held, stream)[-1][1] == _close_limits(free, stream)[-1][1] == 100
    assert held.now == pytest.approx(101.8) and int((held.now - 1.0) // 1.0) - 1 == 99  # the lateness rule's
    # w3 is new at 101.9 s: slice 101 waits for it while w1 and w2 go on to 102.95 s
    more = [(w, 102.0 + i * 0.05) for i in range(20) for w in ("w1", "w2")]
    assert _close_limits(held, [("w3", 101.9)] + more)[-1][1] == 100
    assert _close_limits(free, more)[-1][1] == 101
    assert _close_limits(held, [("w3", 102.96)])[-1][1] == 101  # it has passed slice 101
    # w1 steps back behind its own newest: the lateness rule for the next minute of source time
    # (the stage keeps slice 101 closed; nothing more closes until the lateness rule passes it)
    assert _close_limits(held, [("w1", 102.5)])[-1][1] == 100
    after = [(w, 103.0 + i * 0.05) for i in range(40) for w in ("w1", "w2", "w3")]
    assert [limit for _, limit in _close_limits(held, after)] == [
        int((now - 1.0) // 1.0) - 1 for now in _nows(make, [*stream, ("w3", 101.9), *more, ("w3", 102.96),
                                                           ("w1", 102.5)], after)]
    assert _close_limits(free, after)[-1][1] == 103  # without the disorder: 1 s sooner


def _nows(make, before, stream) -> list[float]:
    """The source's time after each record of ``stream`` (``before`` admitted first)."""
    clock = make(300.0)
    for writer, ts in before:
        clock.admit(ts, writer)
    out = []
    for writer, ts in stream:
        clock.admit(ts, writer)
        out.append(clock.now)
    return out


def _fleet_stream(seed: int, records: int) -> list[tuple[str, float]]:
    """(writer, ts) of a fleet in order for long stretches: four workers (w3's clock 420 s ahead,
    corrected), a checker every 2 s, w2 0.3 s late from a third on, w4 quiet for 80 s, w5 new at
    the half, a stamp far off (refused) and one out of line at three quarters."""
    rng = random.Random(seed)
    offsets = {"w1": 0.0, "w2": 0.0, "w3": 420.0, "w4": 0.0}
    t, out, pending, check = 1000.0, [], [], 1000.0
    for i in range(records):
        t += rng.expovariate(60.0)
        if i == records // 2:
            offsets["w5"] = 0.0
        writer = rng.choice(sorted(offsets))
        if writer == "w4" and 1100.0 < t < 1180.0:
            continue
        delay = 0.3 if writer == "w2" and i > records // 3 else 0.0
        ts = t + offsets[writer]
        if i == 3 * records // 4:
            ts += 3600.0  # refused
        elif i == 3 * records // 4 + 100:
            ts -= 200.0  # out of line: folded at the source's time
        pending.append((t + delay, writer, ts))
        if t >= check:
            pending.append((t, "checker", t))
            check += 2.0
        ready = sorted(p for p in pending if p[0] <= t)
        pending = [p for p in pending if p[0] > t]
        out += [(writer, ts) for _, writer, ts in ready]
    return out


@pytest.mark.parametrize("seed", [1, 2])
def test_the_compiled_clock_gives_the_reference_close_limits_record_by_record(seed):
    """In-order stretches, a late writer, a quiet one, a new one, and stretches of clocks off by
    minutes, bursts and refusals: every admission, every close limit and the state alike."""
    stream = _fleet_stream(seed, 12_000)
    native, reference = NativeEventClock(300.0, close_on_writers=True), EventClock(300.0, close_on_writers=True)
    native.prime(stream[:600])
    reference.prime(stream[:600])
    watermark, sooner = -1, 0
    for i, (writer, ts) in enumerate(stream):
        expected = reference.admit(ts, writer)
        got = native.admit(ts, writer)
        assert (got.reason if type(got) is Rejection else got) == (
            expected.reason if type(expected) is Rejection else expected), i
        limit = reference.close_limit(1.0, 1.0, watermark)
        assert native.close_limit(1.0, 1.0, watermark) == limit, i
        watermark = max(watermark, limit)
        if reference.now != float("-inf") and watermark > int((reference.now - 1.0) // 1.0) - 1:
            sooner += 1  # a slice closed that the lateness rule still holds open
        if i % 997 == 0:
            assert json.dumps(native.to_state()) == json.dumps(reference.to_state()), i
    assert json.dumps(native.to_state()) == json.dumps(reference.to_state())
    assert sooner > 2000, sooner  # the comparison covers closes on writers, not only the lateness rule


def test_a_checkpointed_clock_goes_on_closing_on_writers_as_one_never_stopped():
    stream = _writer_stream(4, 6000)
    whole = EventClock(300.0, close_on_writers=True)
    _close_limits(whole, stream[:3000])
    state = json.loads(json.dumps(whole.to_state()))  # as a checkpoint holds it
    rest = _close_limits(whole, stream[3000:])
    for clock in (EventClock(300.0, close_on_writers=True), NativeEventClock(300.0, close_on_writers=True)):
        clock.load_state(state)
        assert _close_limits(clock, stream[3000:]) == rest
    # a state from a clock without the rule: every writer has yet to pass a slice in order
    off = EventClock(300.0)
    _close_limits(off, stream[:3000])
    on = EventClock(300.0, close_on_writers=True)
    on.load_state(json.loads(json.dumps(off.to_state())))
    writers = on.to_state()["writers"]
    assert writers and all(newest == lag == float("-inf") for *_, newest, lag in writers)


def test_blocks_close_on_writers_as_records_one_at_a_time():
    records = _CASES["w3 0.5 s late from 150.7 s"][0]()
    lines = [encode_record(r) for r in records]
    by_record = _decide(records, _ON)
    for reference_clock in (False, True):
        pipeline = EmbeddedPipeline(_ON)
        if reference_clock:
            pipeline.stage1.clock = EventClock(300.0, close_on_writers=True)
        for start in range(0, len(lines), 4096):
            pipeline.feed_lines(lines[start:start + 4096])
        pipeline.finish()
        assert [d.to_json_line() for d in pipeline.decisions] == [d.to_json_line() for d in by_record[3]]
        assert pipeline.stage1.late_records == by_record[1] == 21
