"""Clocks stamped wrong by any amount, in any number up to a burst, anywhere, and time that jumps by any
amount: the incident in the file is still decided, and a healthy file decides nothing."""

from __future__ import annotations

from functools import lru_cache

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from specwatch.lab.simulation.simulator import Simulator
from specwatch.schemas import Policy

from telemetry_log import replayed

# baselines learned in 15 s, so that a 54 s scenario reaches its decisions
_POLICY = Policy.model_validate({"baseline": {"learn_seconds": 15}})
_SKEW_BOUND = _POLICY.windows.max_ahead_seconds
_SCENARIOS = ("acceptance_drop",)
_PROPERTY = settings(max_examples=6, derandomize=True, deadline=None, database=None,
                     suppress_health_check=[HealthCheck.too_slow])
# The most records of one burst: a writer's clock is taken to have moved once 16 of its last 31
# records agree, so a longer run of one worker's records is that worker's clock moving.
_BURST = 15
# any size of skew, either way: within the tolerance, within the bound, and far beyond it
_SKEW = st.one_of(st.floats(0.5, 1e8), st.floats(-1e8, -0.5))


@lru_cache(maxsize=None)
def _scenario(name: str, workers: int = 2) -> tuple[tuple, tuple[str, ...]]:
    sim = Simulator(name, seed=11, workers=workers, minutes=0.9, incident_at=25.0)
    records = tuple(sim.records())
    pipeline = replayed(records, _POLICY)
    assert pipeline.decisions or name == "healthy"
    return records, tuple(d.to_json_line() for d in pipeline.decisions)


@lru_cache(maxsize=None)
def _clean(name: str, workers: int = 2) -> tuple[tuple, list]:
    records, _ = _scenario(name, workers)
    return records, replayed(records, _POLICY).decisions


def _rogue(record, ts: float):
    """A copy of ``record`` at ``ts`` that no deduplication would drop, as extreme as its kind allows."""
    if record.kind == "step":
        requests = [r.model_copy(update={"accepted": 0}) for r in record.requests]
        return record.model_copy(update={"ts": ts, "seq": record.seq + 10**9, "requests": requests})
    return record.model_copy(update={"ts": ts, "id": f"{record.id}-skewed", "finish_reason": "error",
                                     "error": "clock", "e2e_ms": 1e9})


def _copy(record, seconds: float, n: int):
    """Record ``record`` stamped ``seconds`` off, as a further record (a new seq or id) with the same values."""
    update = {"ts": max(record.ts + seconds, 0.0)}
    if record.kind == "step":
        update["seq"] = record.seq + 10**9 + n
    elif record.kind in ("request", "shadow"):
        update["id"] = f"{record.id}-copy{n}"
    return record.model_copy(update=update)


def _still_decided(decisions, clean) -> None:
    """Each clean decision again (action, reason, scope), no later than its clean time plus the skew bound,
    and no decision for a reason the clean file has none for."""
    got = {}
    for d in decisions:
        got.setdefault((d.action, d.reason, d.bundle_id, d.bucket, d.cohort), d.ts)
    for d in clean:
        key = (d.action, d.reason, d.bundle_id, d.bucket, d.cohort)
        assert key in got, (key, sorted(got))
        assert got[key] <= d.ts + _SKEW_BOUND, (key, got[key] - d.ts)
    assert {d.reason for d in decisions} <= {d.reason for d in clean}


@_PROPERTY
@given(scenario=st.sampled_from(_SCENARIOS), position=st.floats(0.02, 0.98),
       seconds=st.one_of(st.floats(_SKEW_BOUND + 1.0, 1e8), st.floats(-1e8, -_SKEW_BOUND - 1.0)))
def test_one_skewed_record_changes_no_decision(scenario, position, seconds):
    records, expected = _scenario(scenario)
    at = int(position * len(records))
    original = next(r for r in records[at:] if r.kind in ("step", "request"))
    rogue = _rogue(original, original.ts + seconds)  # unix times: never below zero
    pipeline = replayed(records[:at] + (rogue,) + records[at:], _POLICY)
    reason = "clock_ahead" if rogue.ts > original.ts else "clock_behind"
    assert pipeline.counters.rejected.as_dict() == {reason: 1}
    assert pipeline.counters.late_records == 0
    assert tuple(d.to_json_line() for d in pipeline.decisions) == expected


@_PROPERTY
@given(position=st.one_of(st.just(0.0), st.floats(0.0, 0.98)), count=st.integers(1, _BURST), seconds=_SKEW,
       spread=st.booleans())
@example(position=0.0, count=2, seconds=3600.0, spread=False)  # the measured cases: before line 1,
@example(position=0.0, count=5, seconds=290.0, spread=False)  # within the bound at the start,
@example(position=0.4, count=_BURST, seconds=3600.0, spread=False)  # and a burst mid-file
def test_a_burst_of_skewed_records_anywhere_still_decides_the_incident(position, count, seconds, spread):
    """``count`` copies of records stamped ``seconds`` off, together at one place (the start, or anywhere),
    or spread one in every 50 records from there."""
    records, clean = _clean("acceptance_drop")
    at = int(position * len(records))
    step = 50 if spread else 1
    chosen = set(range(at, min(at + count * step, len(records)), step))
    skewed = []
    for i, record in enumerate(records):
        if i in chosen:
            skewed.append(_copy(record, seconds, i))
        skewed.append(record)
    pipeline = replayed(skewed, _POLICY)
    _still_decided(pipeline.decisions, clean)
    assert pipeline.counters.records + pipeline.counters.rejected.total == len(skewed)


@_PROPERTY
@given(workers=st.sampled_from((2, 4)), worker=st.integers(0, 3), seconds=_SKEW, position=st.floats(0.0, 0.9))
def test_one_worker_whose_clock_is_off_still_counts(workers, worker, seconds, position):
    """One worker's clock off by ``seconds`` from ``position`` in the file to its end (0: from its first record)."""
    records, clean = _clean("acceptance_drop", workers)
    name = f"w{worker % workers + 1}"
    at = int(position * len(records))
    skewed = records[:at] + tuple(_copy(r, seconds, 0) if getattr(r, "worker", None) == name else r
                                  for r in records[at:])
    pipeline = replayed(skewed, _POLICY)
    _still_decided(pipeline.decisions, clean)


@_PROPERTY
@given(position=st.floats(0.05, 0.95), seconds=st.floats(1.0, 1e7))
@example(position=0.5, seconds=600.0)  # the measured case: the second half shifted +600 s (a paused worker)
def test_a_healthy_file_whose_time_jumps_anywhere_by_any_amount_decides_nothing(position, seconds):
    records, clean = _clean("healthy")
    assert clean == []
    at = int(position * len(records))
    pipeline = replayed(records[:at] + tuple(_copy(r, seconds, 0) for r in records[at:]), _POLICY)
    assert pipeline.decisions == []
    assert pipeline.counters.late_records == 0
