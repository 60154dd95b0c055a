"""Property: one extreme but contract-valid record, inserted into a short seeded run, changes no
other key's decisions and gives its own keys no fallback (SPECWATCH_OUTLIER_EXAMPLES runs more)."""

from __future__ import annotations

import bisect
import os
from functools import lru_cache

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from specwatch.lab.simulation.simulator import BUCKETS, Simulator
from specwatch.schemas.contract import RequestRecord, StepRecord

from telemetry_log import replayed

_EXAMPLES = int(os.environ.get("SPECWATCH_OUTLIER_EXAMPLES", "8"))
_PROPERTY = settings(max_examples=_EXAMPLES, derandomize=True, deadline=None, print_blob=True,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
_SEED = 11
# (scenario, incident start s, minutes): a healthy run and one whose incident is decided.
_RUNS = {"healthy": (None, 3.0), "acceptance_drop": (100.0, 3.0)}
_COHORTS = ("main", "canary", "baseline")


@lru_cache(maxsize=None)
def _run(scenario: str):
    incident_at, minutes = _RUNS[scenario]
    sim = Simulator(scenario, seed=_SEED, workers=2, minutes=minutes, incident_at=incident_at)
    records = list(sim.records())
    return sim.start_ts, records, tuple(_decisions(records))


def _decisions(records) -> list[tuple]:
    pipeline = replayed(records)
    assert pipeline.counters.rejected.total == 0
    return [(d.ts, d.action, d.reason, d.bundle_id, d.bucket, d.cohort) for d in pipeline.decisions]


_step_changes = st.one_of(
    st.fixed_dictionaries({"draft_ms": st.sampled_from([5000.0, 1e6, 1e9, 0.0])}),
    st.fixed_dictionaries({"verify_ms": st.sampled_from([1e6, 1e-3, 0.0])}),
    st.fixed_dictionaries({"kv_usage": st.just(1.0)}),
    st.fixed_dictionaries({"rounds": st.sampled_from([512, 4096]), "drafted": st.sampled_from([4, 64])}),
)
_request_changes = st.one_of(
    st.fixed_dictionaries({"e2e_ms": st.sampled_from([1e9, 0.0]), "tpot_ms": st.sampled_from([1e7, 0.0])}),
    st.fixed_dictionaries({"ttft_ms": st.just(1e9)}),
    st.fixed_dictionaries({"finish_reason": st.sampled_from(["error", "timeout"])}),
)


def _outlier(template, changes: dict, bucket: str, cohort: str):
    """A contract-valid record like ``template`` with ``changes``; its own keys."""
    data = template.model_dump(mode="json")
    if isinstance(template, StepRecord):
        rounds = changes.pop("rounds", None)
        drafted = changes.pop("drafted", 4)
        if rounds is not None:
            data["requests"] = [{"id": f"outlier-{i}", "bucket": bucket, "cohort": cohort, "drafted": drafted,
                                 "accepted": 0} for i in range(rounds)]
        data.update(changes)
        data["seq"] = data["seq"] + 10_000_000  # its own engine step, not a copy of a real one
        record = StepRecord.model_validate(data)
        keys = {(record.bundle_id, e.bucket, e.cohort) for e in record.requests} | {(record.bundle_id, None, None)}
    else:
        data.update(changes, id="outlier-request", bucket=bucket, cohort=cohort, speculative=True)
        if data["finish_reason"] in ("error", "timeout"):
            data["error"] = "outlier"
        record = RequestRecord.model_validate(data)
        keys = {(record.bundle_id, bucket, cohort)}
    return record, keys


def _check(scenario: str, at: float, kind: str, changes: dict, bucket: str, cohort: str) -> None:
    start_ts, records, clean = _run(scenario)
    times = [r.ts for r in records]
    index = bisect.bisect_left(times, start_ts + at)
    template = next(r for r in records[index:] if isinstance(r, StepRecord if kind == "step" else RequestRecord))
    record, own = _outlier(template, dict(changes), bucket, cohort)
    dirty = _decisions(records[:index] + [record] + records[index:])

    def others(decisions):
        return [d for d in decisions if (d[3], d[4], d[5]) not in own]

    assert others(dirty) == others(clean)
    clean_own = {(d[1], d[4], d[5]) for d in clean if (d[3], d[4], d[5]) in own}
    new_own = [d for d in dirty if (d[3], d[4], d[5]) in own and (d[1], d[4], d[5]) not in clean_own]
    assert not [d for d in new_own if d[1] in ("disable_speculation", "reduce_draft_length")], new_own


@_PROPERTY
@given(scenario=st.sampled_from(sorted(_RUNS)), at=st.floats(5.0, 170.0), changes=_step_changes,
       bucket=st.sampled_from([b.name for b in BUCKETS]), cohort=st.sampled_from(_COHORTS))
# rejected rounds in a cohort that otherwise has none, and in a quiet canary: once, the
# window's speedup rested on that one step
@example(scenario="healthy", at=30.0, changes={"rounds": 512, "drafted": 4}, bucket="coding", cohort="baseline")
@example(scenario="acceptance_drop", at=149.85, changes={"rounds": 4096, "drafted": 64}, bucket="coding",
         cohort="canary")
def test_one_extreme_step_decides_nothing(scenario, at, changes, bucket, cohort):
    _check(scenario, at, "step", changes, bucket, cohort)


@_PROPERTY
@given(scenario=st.sampled_from(sorted(_RUNS)), at=st.floats(5.0, 170.0), changes=_request_changes,
       bucket=st.sampled_from([b.name for b in BUCKETS]), cohort=st.sampled_from(_COHORTS))
def test_one_extreme_request_decides_nothing(scenario, at, changes, bucket, cohort):
    _check(scenario, at, "request", changes, bucket, cohort)
