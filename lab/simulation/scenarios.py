"""The scripted scenarios: incident kinds with their intensities and the decision each should
draw, the scenario table, and the ground truth (`Incident`) a run is scored against."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

from specwatch.schemas import BundleCard
from specwatch.lab.simulation.engine_model import BUCKET_INDEX, MAX_ERROR_FACTOR, COHORTS

__all__ = ["EXPECTED_REASON", "INTENSITY", "SCENARIOS", "SCENARIO_SPECS", "SHIFTED_WEIGHTS", "Incident",
           "IncidentPlan", "changed_card", "checked_plan", "kv_pressure_workers"]

# What the scripted card changes switch to: a retrained target the drafter never saw, and a
# tokenizer fix (special tokens) that leaves acceptance alone but still voids the evidence.
_UPDATED_REVISION = "5f0b02c7"
_UPDATED_TOKENIZER_DIGEST = "sha256:a4e27d1c95f3086b"

# Where the mix shift ends up: harder buckets take traffic from the easy ones.
SHIFTED_WEIGHTS = MappingProxyType({
    "coding": 0.15, "summarization": 0.10, "structured": 0.10,
    "reasoning": 0.35, "extraction": 0.10, "long_context": 0.20,
})

# What a correct monitor decides for each incident kind.
EXPECTED_REASON = MappingProxyType({
    "acceptance_drop": "acceptance_drop", "target_update": "bundle_changed",
    "draft_regression": "draft_overhead", "latency_tail": "latency_slo",
    "kv_pressure": "kv_pressure", "bundle_change": "bundle_changed",
    "quality_mismatch": "quality_regression", "error_burst": "error_rate",
    "canary_tail": "canary_judgement", "canary_mismatch": "canary_judgement",
    "draft_cost_doubles": "draft_overhead", "late_acceptance_decay": "acceptance_drop",
    "context_shift": "draft_overhead",
})
# Default intensity per incident kind, with the range that keeps its meaning.
INTENSITY = MappingProxyType({
    "acceptance_drop": (0.4, 0.0, 1.0, "fraction by which the bucket's acceptance length drops"),
    "target_update": (0.5, 0.0, 1.0, "fraction by which acceptance length drops on the new target"),
    "draft_regression": (3.0, 1.0, 100.0, "multiplier on draft time"),
    "latency_tail": (5.0, 1.0, 100.0, "multiplier on e2e and TPOT of the tail requests"),
    "kv_pressure": (0.6, 0.0, 1.0, "share of long-context traffic on the affected workers"),
    "bundle_change": (1.0, 0.0, math.inf, "unused: the card changes, acceptance does not"),
    "quality_mismatch": (0.5, 0.0, 1.0, "fraction of shadow checks that mismatch"),
    "error_burst": (20.0, 1.0, float(MAX_ERROR_FACTOR), "multiplier on the error and timeout rate"),
    "canary_tail": (5.0, 1.0, 100.0, "multiplier on e2e and TPOT of the tail requests"),
    "canary_mismatch": (0.2, 0.0, 1.0, "fraction of shadow checks that mismatch"),
    "draft_cost_doubles": (2.0, 1.0, 100.0, "multiplier on draft time"),
    "late_acceptance_decay": (0.3, 0.0, 1.0, "multiplier on acceptance at the third draft position and later"),
    "context_shift": (10.0, 1.0, 20.0, "multiplier on the bucket's prompt lengths"),
})
_DEFAULT_INCIDENT_AT = 240.0


@dataclass(frozen=True)
class Incident:
    """Ground truth of one scripted incident: what a correct monitor should decide, and where
    (None or empty: every bucket, cohort or worker; for card changes, the new bundle)."""

    kind: str
    start_ts: float
    bundle_id: str
    bucket: str | None
    cohort: str | None
    expected_reason: str
    workers: tuple[str, ...] = ()


@dataclass(frozen=True)
class IncidentPlan:
    """One incident of a scenario: where, and when (seconds after the scenario's incident start);
    ``intensity`` None: the run's (or the kind's default)."""

    kind: str
    bucket: str | None = None
    cohort: str | None = None
    offset: float = 0.0
    intensity: float | None = None


_Plan = IncidentPlan


@dataclass(frozen=True)
class _Scenario:
    description: str
    minutes: float
    plans: tuple[_Plan, ...] = ()
    incident_at: float = _DEFAULT_INCIDENT_AT
    mix_shift: bool = False
    diurnal: bool = False
    bucket_weights: Mapping[str, float] = field(default_factory=dict)  # weights that differ from BUCKETS'


# Bucket weights that make one bucket quiet (3 % of new requests before the others' weights
# are scaled to fill the rest: 3.4-3.9 % of all), the others as in BUCKETS.
_QUIET_SHARE = 0.03
_QUIET_CODING = MappingProxyType({"coding": _QUIET_SHARE})
_QUIET_EXTRACTION = MappingProxyType({"extraction": _QUIET_SHARE})
_QUIET_REASONING = MappingProxyType({"reasoning": _QUIET_SHARE})

SCENARIO_SPECS: Mapping[str, _Scenario] = MappingProxyType({
    "healthy": _Scenario("no incident: steady mix and load", 5.0),
    "acceptance_drop": _Scenario(
        "the coding drafter misaligns: coding AL drops by intensity (default 0.4) in every cohort", 8.0,
        (_Plan("acceptance_drop", bucket="coding"),)),
    "target_update": _Scenario(
        "a new target revision rolls over the fleet in 10 s; the old drafter's AL drops by intensity (0.5)", 8.0,
        (_Plan("target_update"),)),
    "draft_regression": _Scenario(
        "draft time x intensity (default 3) on every worker", 8.0,
        (_Plan("draft_regression"),)),
    "latency_tail": _Scenario(
        "10% of reasoning/main requests stall: e2e and TPOT x intensity (default 5)", 8.0,
        (_Plan("latency_tail", bucket="reasoning", cohort="main"),)),
    "kv_pressure": _Scenario(
        "long-context surge (intensity = its traffic share, 0.6) on a quarter of the workers: KV above 0.95", 8.0,
        (_Plan("kv_pressure"),)),
    "bundle_change": _Scenario(
        "the tokenizer digest changes over the fleet in 10 s; acceptance unchanged", 8.0,
        (_Plan("bundle_change"),)),
    "quality_mismatch": _Scenario(
        "shadow checks of structured requests mismatch (intensity = mismatching share, default 0.5)", 8.0,
        (_Plan("quality_mismatch", bucket="structured"),)),
    "error_burst": _Scenario(
        "errors and timeouts x intensity (default 20) for speculative extraction requests", 8.0,
        (_Plan("error_burst", bucket="extraction"),)),
    # Quiet keys inside a big fleet: a bucket with 3 % of the traffic, a cohort with 5 %.
    "error_burst_quiet_bucket": _Scenario(
        "extraction carries about 3% of requests; errors and timeouts x intensity (default 20) for its speculative "
        "requests", 8.0, (_Plan("error_burst", bucket="extraction"),), bucket_weights=_QUIET_EXTRACTION),
    "error_burst_quiet_cohort": _Scenario(
        "errors and timeouts x intensity (default 20) for speculative extraction requests of the canary "
        "cohort (5% of traffic)", 8.0, (_Plan("error_burst", bucket="extraction", cohort="canary"),)),
    "latency_tail_quiet_bucket": _Scenario(
        "reasoning carries about 3% of requests; 10% of reasoning/main requests stall: e2e and TPOT x intensity "
        "(default 5)", 8.0, (_Plan("latency_tail", bucket="reasoning", cohort="main"),),
        bucket_weights=_QUIET_REASONING),
    "latency_tail_quiet_cohort": _Scenario(
        "10% of reasoning/canary requests (the canary cohort carries 5% of traffic) stall: e2e and TPOT x "
        "intensity (default 5)", 8.0, (_Plan("latency_tail", bucket="reasoning", cohort="canary"),)),
    "acceptance_drop_quiet_bucket": _Scenario(
        "coding carries about 3% of requests; its drafter misaligns: coding AL drops by intensity (default 0.4) "
        "in every cohort", 8.0, (_Plan("acceptance_drop", bucket="coding"),), bucket_weights=_QUIET_CODING),
    "mix_shift": _Scenario(
        "benign: traffic moves from easy buckets toward reasoning and long_context over the run", 10.0,
        mix_shift=True),
    "diurnal": _Scenario(
        "benign: offered load follows one day-shaped cycle (x0.65 to x1.35) over the run", 60.0, diurnal=True),
    "demo": _Scenario(
        "five incidents 35 s apart from 150 s: coding AL, structured shadow, reasoning tail, extraction "
        "errors, KV", 6.0,
        (_Plan("acceptance_drop", "coding"),
         _Plan("quality_mismatch", "structured", offset=35.0),
         _Plan("latency_tail", "reasoning", "main", offset=70.0),
         _Plan("error_burst", "extraction", offset=105.0),
         _Plan("kv_pressure", offset=140.0)),
        incident_at=150.0),
    # Admission scenarios run closed loop under a policy with [admission] enforce = true: the
    # fleet deploys a bundle nobody admitted, and the flag source's stage routes its traffic.
    "admission": _Scenario(
        "a new bundle, healthy everywhere: it should go shadow -> canary -> admitted by itself", 8.0),
    "canary_tail": _Scenario(
        "a new bundle whose structured requests stall on the canary path (10% with e2e and TPOT x intensity, "
        "default 5) while every other bucket is healthy", 8.0,
        (_Plan("canary_tail", bucket="structured", cohort="canary"),), incident_at=0.0),
    "canary_mismatch": _Scenario(
        "a new bundle whose structured output starts to differ from standard decoding on the canary path "
        "(intensity = mismatching share of shadow checks, default 0.2)", 8.0,
        (_Plan("canary_mismatch", bucket="structured", cohort="canary"),), incident_at=0.0),
    # Draft-length scenarios: the best D moves (`specwatch.lab.evaluation.draft_length` scores the advice).
    "draft_cost_doubles": _Scenario(
        "draft time x intensity (default 2) on every worker: shorter drafts pay better", 6.0,
        (_Plan("draft_cost_doubles"),)),
    "late_acceptance_decay": _Scenario(
        "coding drafts stay good at positions 1-2; later positions are accepted x intensity (default 0.3) "
        "as often", 6.0, (_Plan("late_acceptance_decay", bucket="coding"),)),
    "context_shift": _Scenario(
        "summarization prompts grow x intensity (default 10): more KV per step, slower verify passes", 6.0,
        (_Plan("context_shift", bucket="summarization"),)),
    "admission_change": _Scenario(
        "a new bundle in admission; the tokenizer digest changes over the fleet in 10 s at 330 s", 8.0,
        (_Plan("bundle_change"),), incident_at=330.0),
})

SCENARIOS: Mapping[str, str] = MappingProxyType({name: s.description for name, s in SCENARIO_SPECS.items()})


def checked_plan(plan: IncidentPlan) -> IncidentPlan:
    """``plan`` if the simulator can run it, else a `ValueError` naming what is wrong.

    >>> checked_plan(IncidentPlan("error_burst", "extraction", intensity=99.0))
    Traceback (most recent call last):
    ...
    ValueError: intensity for error_burst is the multiplier on the error and timeout rate; it must be in [1.0, 48.0], got 99.0
    """
    if plan.kind not in INTENSITY:
        raise ValueError(f"unknown incident kind {plan.kind!r}; choose one of: {', '.join(INTENSITY)}")
    if plan.bucket is not None and plan.bucket not in BUCKET_INDEX:
        raise ValueError(f"unknown bucket {plan.bucket!r}")
    if plan.cohort is not None and plan.cohort not in COHORTS:
        raise ValueError(f"unknown cohort {plan.cohort!r}")
    if not (plan.offset >= 0 and math.isfinite(plan.offset)):
        raise ValueError(f"offset must be seconds >= 0, got {plan.offset!r}")
    if plan.intensity is not None:
        _, low, high, meaning = INTENSITY[plan.kind]
        if not low <= plan.intensity <= high:
            raise ValueError(f"intensity for {plan.kind} is the {meaning}; it must be in [{low}, {high}], "
                             f"got {plan.intensity!r}")
    return plan


def kv_pressure_workers(workers: int) -> tuple[int, ...]:
    """The last quarter of the fleet (at least one worker) takes the long-context surge."""
    count = max(1, workers // 4)
    return tuple(range(workers - count, workers))


def changed_card(card: BundleCard, kind: str) -> BundleCard:
    """``card`` after a scripted card change: a retrained target, or a tokenizer fix."""
    change = {"revision": _UPDATED_REVISION} if kind == "target_update" else {
        "tokenizer_digest": _UPDATED_TOKENIZER_DIGEST}
    return card.model_copy(update={"target": card.target.model_copy(update=change)})
