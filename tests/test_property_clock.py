"""One record stamped by a wrong clock, far ahead or far behind, changes no decision."""

from __future__ import annotations

from functools import lru_cache

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specwatch.simulation.simulator import Simulator
from specwatch.schemas import Policy

from telemetry_log import replayed

# baselines learned in 15 s, so that a 54 s scenario reaches its decisions
_POLICY = Policy.model_validate({"baseline": {"learn_seconds": 15}})
_SKEW_BOUND = _POLICY.windows.max_ahead_seconds
_SCENARIOS = ("acceptance_drop",)
_PROPERTY = settings(max_examples=6, derandomize=True, deadline=None, database=None,
                     suppress_health_check=[HealthCheck.too_slow])


@lru_cache(maxsize=None)
def _scenario(name: str) -> tuple[tuple, tuple[str, ...]]:
    sim = Simulator(name, seed=11, workers=2, minutes=0.9, incident_at=25.0)
    records = tuple(sim.records())
    pipeline = replayed(records, _POLICY)
    assert pipeline.decisions
    return records, tuple(d.to_json_line() for d in pipeline.decisions)


def _rogue(record, ts: float):
    """A copy of ``record`` at ``ts`` that no deduplication would drop, as extreme as its kind allows."""
    if record.kind == "step":
        requests = [r.model_copy(update={"accepted": 0}) for r in record.requests]
        return record.model_copy(update={"ts": ts, "seq": record.seq + 10**9, "requests": requests})
    return record.model_copy(update={"ts": ts, "id": f"{record.id}-skewed", "finish_reason": "error",
                                     "error": "clock", "e2e_ms": 1e9})


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
