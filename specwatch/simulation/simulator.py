"""A seeded fleet of speculative-decoding engine workers with scripted incidents: contract-v1
records in event-time order plus the ground truth, a pure function of the seed."""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Callable, Iterator, Mapping, Protocol, Sequence

import numpy as np

from specwatch.collectors.capture import SampleCapture
from specwatch.schemas.sealed import token_digest

from specwatch.schemas import (BundleCard, BundleRecord, DrafterCard, RequestRecord, RoundEntry,
                              RuntimeCard, Sample, Sampling, ShadowRecord, StepRecord, TargetCard,
                              TelemetryRecord, bundle_digest)

__all__ = ["BUCKETS", "COHORTS", "DEFAULT_CARD", "DEFAULT_START_TS", "SCENARIOS", "BucketProfile",
           "FlagSource", "Incident", "IncidentPlan", "Simulator", "acceptance_length", "bucket_acceptance_length",
           "step_timing", "true_speedup"]

DEFAULT_START_TS = 1_767_225_600.0  # 2026-01-01T00:00:00Z

# -- the deployment every simulated worker starts from ------------------------------------

DEFAULT_CARD = BundleCard(
    target=TargetCard(
        model_id="llama-3.1-8b-instruct",
        revision="0e9e39f2",
        tokenizer_digest="sha256:6b1f3c9d0e2a4b58",
        quantization="fp8",
    ),
    drafter=DrafterCard(mechanism="eagle3", revision="eagle3-llama31-8b-r1", draft_length=4),
    runtime=RuntimeCard(engine="vllm-0.32.0", gpu="H100-80GB", parallelism="tp1"),
)
# What the scripted card changes switch to: a retrained target the drafter never saw, and a
# tokenizer fix (special tokens) that leaves acceptance alone but still voids the evidence.
_UPDATED_REVISION = "5f0b02c7"
_UPDATED_TOKENIZER_DIGEST = "sha256:a4e27d1c95f3086b"
# Token ids of captured requests are drawn from a vocabulary of this size.
_CAPTURE_VOCAB = 32_000


# -- task buckets and cohorts ------------------------------------------------------------------


@dataclass(frozen=True)
class BucketProfile:
    """How one task bucket behaves under speculation and what its traffic looks like.

    The first drafted token is accepted with ``position_acceptance``, later positions decay by
    ``acceptance_decay`` each; prompt and output lengths are log-normal, outputs cut at
    ``max_tokens``; ``weight`` is the bucket's share of new requests.
    """

    name: str
    position_acceptance: float
    weight: float
    prompt_median: float
    prompt_sigma: float
    output_median: float
    output_sigma: float
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    acceptance_decay: float = 0.97


# Per-position acceptance follows what EAGLE-style drafters show on an 8B target: templated
# output (structured, code) is easy to predict, open reasoning and long-context answers are not.
BUCKETS: tuple[BucketProfile, ...] = (
    BucketProfile("coding", 0.80, 0.25, 5000, 0.7, 280, 0.6, 1024),
    BucketProfile("summarization", 0.65, 0.15, 8000, 0.5, 180, 0.4, 512, temperature=0.3, top_p=0.95),
    BucketProfile("structured", 0.85, 0.15, 2500, 0.5, 120, 0.5, 512),
    BucketProfile("reasoning", 0.55, 0.20, 2500, 0.6, 700, 0.5, 2048, temperature=0.6, top_p=0.95),
    BucketProfile("extraction", 0.75, 0.15, 6000, 0.6, 60, 0.6, 256),
    BucketProfile("long_context", 0.50, 0.10, 24000, 0.3, 220, 0.5, 1024),
)
_BUCKET_INDEX = MappingProxyType({b.name: i for i, b in enumerate(BUCKETS)})

# The shadow cohort gets traffic only while admission mirrors it there (its default share is 0).
COHORTS: tuple[str, ...] = ("main", "canary", "baseline", "shadow")
_COHORT_SHARES = (0.90, 0.05, 0.05, 0.0)
_MAIN = COHORTS.index("main")
_BASELINE = COHORTS.index("baseline")
_SHADOW_COHORT = COHORTS.index("shadow")
_COHORT_INDEX = MappingProxyType({name: i for i, name in enumerate(COHORTS)})
_CUMULATIVE_COHORT_SHARES = tuple(float(x) for x in np.cumsum(_COHORT_SHARES)[:-1])

# Requests differ in how predictable they are even inside one bucket; a few difficulty levels
# (multipliers on per-position acceptance) give per-request spread at table-lookup cost.
_DIFFICULTY_LEVELS = (0.94, 0.97, 1.0, 1.03, 1.06)

# Where the mix shift ends up: harder buckets take traffic from the easy ones.
_SHIFTED_WEIGHTS = MappingProxyType({
    "coding": 0.15, "summarization": 0.10, "structured": 0.10,
    "reasoning": 0.35, "extraction": 0.10, "long_context": 0.20,
})


# Positions from this one on (counting from 0) are the "late" ones a late-decay incident hits.
_LATE_POSITION = 2


def _position_probability(position_acceptance: float, k: int, decay: float, late_factor: float) -> float:
    """Probability that draft position ``k`` (from 0) is accepted, given the positions before it were."""
    return min(1.0, position_acceptance * decay**k * (late_factor if k >= _LATE_POSITION else 1.0))


def acceptance_length(position_acceptance: float, draft_length: int, decay: float = 0.97,
                      late_factor: float = 1.0) -> float:
    """Expected acceptance length (accepted drafts + the target's own token) of one round, which
    keeps the leading run of accepted positions (``late_factor`` from the third on): in [1, 1 + D].

    >>> round(acceptance_length(0.8, 4), 3)
    3.229
    >>> acceptance_length(0.0, 4), acceptance_length(1.0, 4, decay=1.0)
    (1.0, 5.0)
    >>> round(acceptance_length(0.8, 4, late_factor=0.3), 3)
    2.592
    """
    if not 0.0 <= position_acceptance <= 1.0:
        raise ValueError(f"position_acceptance must be in [0, 1], got {position_acceptance}")
    expected, run = 1.0, 1.0
    for k in range(draft_length):
        run *= _position_probability(position_acceptance, k, decay, late_factor)
        expected += run
    return expected


def bucket_acceptance_length(bucket: str, draft_length: int, late_factor: float = 1.0) -> float:
    """The true AL of a healthy bucket's rounds at D (requests' difficulty levels averaged), as
    the simulator draws them: what evaluations score advice against.

    >>> round(bucket_acceptance_length("coding", 4), 3), round(bucket_acceptance_length("coding", 1), 3)
    (3.237, 1.8)
    """
    profile = BUCKETS[_BUCKET_INDEX[bucket]]
    return sum(acceptance_length(min(0.99, profile.position_acceptance * level), draft_length,
                                 profile.acceptance_decay, late_factor)
               for level in _DIFFICULTY_LEVELS) / len(_DIFFICULTY_LEVELS)


def _accepted_cdf(position_acceptance: float, draft_length: int, decay: float,
                  late_factor: float = 1.0) -> list[float]:
    """P(accepted <= j) for j in 0..D-1: thresholds for drawing a round's accepted run."""
    cdf, run, total = [], 1.0, 0.0
    for k in range(draft_length):
        p = _position_probability(position_acceptance, k, decay, late_factor)
        total += run * (1.0 - p)
        run *= p
        cdf.append(total)
    return cdf


def _scale_for_acceptance_length(profile: BucketProfile, draft_length: int, factor: float) -> float:
    """Multiplier on per-position acceptance that moves the bucket's AL to ``factor`` times healthy."""
    if factor >= 1.0:
        return 1.0
    healthy = acceptance_length(profile.position_acceptance, draft_length, profile.acceptance_decay)
    target = max(1.0, healthy * factor)
    low, high = 0.0, 1.0
    for _ in range(50):  # AL is monotone in the scale; 50 halvings is below float resolution
        mid = (low + high) / 2
        al = acceptance_length(profile.position_acceptance * mid, draft_length, profile.acceptance_decay)
        low, high = (mid, high) if al < target else (low, mid)
    return (low + high) / 2


# -- the cost of one engine step (H100-80GB, 8B fp8 target, tp1) -------------------------------

# A decode step reads the weights once (memory bound at these batch sizes), so verifying
# B*(1+D) tokens costs little more than B tokens; attention cost follows the KV held.
_VERIFY_BASE_MS = 7.2
_VERIFY_MS_PER_TOKEN = 0.015
_VERIFY_MS_PER_KV_KTOKEN = 0.02
# EAGLE-3 drafts serially: one light forward per drafted position over the drafting requests.
_DRAFT_MS_PER_POSITION = 0.6
_DRAFT_MS_PER_POSITION_PER_REQUEST = 0.025
_SCHEDULE_GAP_MS = 0.25
_TIMING_JITTER = 0.06  # +-3% step to step


def step_timing(requests: int, drafting: int, max_drafted: int, drafted_tokens: int,
                kv_tokens: int, draft_factor: float = 1.0) -> tuple[float, float]:
    """Draft and verify time (ms) of one engine step, before jitter.

    The serial drafter runs ``max_drafted`` positions over the ``drafting`` requests; every one
    of the ``requests`` verifies its drafts plus one target token; ``draft_factor`` slows the
    drafter (1 = healthy).

    >>> draft, verify = step_timing(16, 15, 4, 60, 96_000)
    >>> round(draft, 2), round(verify, 2)
    (3.9, 10.26)
    >>> step_timing(16, 0, 0, 0, 96_000)[0]
    0.0
    """
    draft = 0.0
    if drafting and max_drafted:
        draft = max_drafted * (_DRAFT_MS_PER_POSITION + _DRAFT_MS_PER_POSITION_PER_REQUEST * drafting)
    verify = (_VERIFY_BASE_MS + _VERIFY_MS_PER_TOKEN * (requests + drafted_tokens)
              + _VERIFY_MS_PER_KV_KTOKEN * kv_tokens / 1000.0)
    return draft * draft_factor, verify


def true_speedup(bucket: str, draft_length: int, requests: float, drafting: float, kv_tokens: float,
                 draft_factor: float = 1.0, late_factor: float = 1.0) -> float:
    """A bucket's speedup at D over standard decoding, as the simulator runs it: the oracle. The
    mean scheduling gap counts on both sides (telemetry does not report it to an advisor).

    >>> round(true_speedup("coding", 4, 16, 15, 96_000), 3), round(true_speedup("coding", 2, 16, 15, 96_000), 3)
    (2.168, 1.943)
    """
    draft, verify = step_timing(requests, drafting, draft_length, drafting * draft_length, kv_tokens, draft_factor)
    standard = step_timing(requests, 0, 0, 0, kv_tokens)[1]
    gap = _SCHEDULE_GAP_MS * 1.5  # mean of the uniform gap 0.25 * (1 + u)
    return bucket_acceptance_length(bucket, draft_length, late_factor) * (standard + gap) / (draft + verify + gap)


# Prefill runs on its own lane (chunked/disaggregated); it sets TTFT but not decode step time.
_PREFILL_BASE_MS = 12.0
_PREFILL_MS_PER_TOKEN = 0.011
_QUEUE_MEAN_MS = 3.0

# KV cache of one worker in tokens, and the share the scheduler fills with admitted prompts:
# it keeps headroom for decode growth, so a healthy worker stays below ~0.9.
_KV_CAPACITY_TOKENS = 196_608
_KV_ADMISSION_WATERMARK = 0.85
# Under a long-context surge the scheduler admits whenever blocks are free (vLLM's default).
_KV_SURGE_WATERMARK = 0.99

# Steps drawn at once while a batch is unchanged; with a flag source, fewer, so that a
# decision takes effect within about a tenth of a second of event time.
_BLOCK_STEPS = 24
_CLOSED_LOOP_BLOCK_STEPS = 8

_DEFAULT_CONCURRENCY = 16
_DEFAULT_WORKERS = 8
_WARMUP_SECONDS = 20.0  # runs before t=0 unrecorded, so the first records are steady state
_HEARTBEAT_SECONDS = 60.0
_ROLLOUT_SECONDS = 10.0  # a card change rolls over the fleet in this long

_ERROR_RATE = 0.0014
_TIMEOUT_RATE = 0.0006
_ABORT_RATE = 0.003
# Share of requests checked for a failure at a random point of their output: every failure
# rate a run can reach stays below it (thinning). It is the same for every scenario, so a
# scenario's records before its incident are exactly those of the healthy run.
_FAILURE_CHECK_SHARE = 0.1
_MAX_ERROR_FACTOR = int((_FAILURE_CHECK_SHARE - _ABORT_RATE) / (_ERROR_RATE + _TIMEOUT_RATE))
_ERROR_TEXTS = (
    "CUDA error: an illegal memory access was encountered",
    "EngineCoreError: engine core step failed",
    "RuntimeError: NCCL watchdog: collective operation failed",
)
_TIMEOUT_TEXT = "engine step watchdog: no progress for 5.0 s"

_SHADOW_FRACTION = 0.02
# While a bundle is in canary, a router checks this share of the canary's outputs against
# standard decoding: the lossless contract is what a canary must show first.
_CANARY_SHADOW_FRACTION = 0.25
_SHADOW_DELAY_SECONDS = (0.5, 2.5)  # a shadow re-run with standard decoding finishes later
_SHADOW_CHECK = "token_exact"

_DIURNAL_AMPLITUDE = 0.35
_WORKER_LOAD_SPREAD = 0.15  # workers differ by up to this much in offered concurrency
_LOAD_WOBBLE = 0.08
_LOAD_WOBBLE_PERIOD_SECONDS = 300.0


# -- scenarios and their ground truth ----------------------------------------------------------

_EXPECTED_REASON = MappingProxyType({
    "acceptance_drop": "acceptance_drop", "target_update": "bundle_changed",
    "draft_regression": "draft_overhead", "latency_tail": "latency_slo",
    "kv_pressure": "kv_pressure", "bundle_change": "bundle_changed",
    "quality_mismatch": "quality_regression", "error_burst": "error_rate",
    "canary_tail": "canary_judgement", "canary_mismatch": "canary_judgement",
    "draft_cost_doubles": "draft_overhead", "late_acceptance_decay": "acceptance_drop",
    "context_shift": "draft_overhead",
})
# Default intensity per incident kind, with the range that keeps its meaning.
_INTENSITY = MappingProxyType({
    "acceptance_drop": (0.4, 0.0, 1.0, "fraction by which the bucket's acceptance length drops"),
    "target_update": (0.5, 0.0, 1.0, "fraction by which acceptance length drops on the new target"),
    "draft_regression": (3.0, 1.0, 100.0, "multiplier on draft time"),
    "latency_tail": (5.0, 1.0, 100.0, "multiplier on e2e and TPOT of the tail requests"),
    "kv_pressure": (0.6, 0.0, 1.0, "share of long-context traffic on the affected workers"),
    "bundle_change": (1.0, 0.0, math.inf, "unused: the card changes, acceptance does not"),
    "quality_mismatch": (0.5, 0.0, 1.0, "fraction of shadow checks that mismatch"),
    "error_burst": (20.0, 1.0, float(_MAX_ERROR_FACTOR), "multiplier on the error and timeout rate"),
    "canary_tail": (5.0, 1.0, 100.0, "multiplier on e2e and TPOT of the tail requests"),
    "canary_mismatch": (0.2, 0.0, 1.0, "fraction of shadow checks that mismatch"),
    "draft_cost_doubles": (2.0, 1.0, 100.0, "multiplier on draft time"),
    "late_acceptance_decay": (0.3, 0.0, 1.0, "multiplier on acceptance at the third draft position and later"),
    "context_shift": (10.0, 1.0, 20.0, "multiplier on the bucket's prompt lengths"),
})
_LATENCY_TAIL_FRACTION = 0.10
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

_SCENARIO_SPECS: Mapping[str, _Scenario] = MappingProxyType({
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
    # Draft-length scenarios: the best D moves (`specwatch.evaluation.draft_length` scores the advice).
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

SCENARIOS: Mapping[str, str] = MappingProxyType({name: s.description for name, s in _SCENARIO_SPECS.items()})


def _checked_plan(plan: IncidentPlan) -> IncidentPlan:
    """``plan`` if the simulator can run it, else a `ValueError` naming what is wrong.

    >>> _checked_plan(IncidentPlan("error_burst", "extraction", intensity=99.0))
    Traceback (most recent call last):
    ...
    ValueError: intensity for error_burst is the multiplier on the error and timeout rate; it must be in [1.0, 48.0], got 99.0
    """
    if plan.kind not in _INTENSITY:
        raise ValueError(f"unknown incident kind {plan.kind!r}; choose one of: {', '.join(_INTENSITY)}")
    if plan.bucket is not None and plan.bucket not in _BUCKET_INDEX:
        raise ValueError(f"unknown bucket {plan.bucket!r}")
    if plan.cohort is not None and plan.cohort not in COHORTS:
        raise ValueError(f"unknown cohort {plan.cohort!r}")
    if not (plan.offset >= 0 and math.isfinite(plan.offset)):
        raise ValueError(f"offset must be seconds >= 0, got {plan.offset!r}")
    if plan.intensity is not None:
        _, low, high, meaning = _INTENSITY[plan.kind]
        if not low <= plan.intensity <= high:
            raise ValueError(f"intensity for {plan.kind} is the {meaning}; it must be in [{low}, {high}], "
                             f"got {plan.intensity!r}")
    return plan


class FlagSource(Protocol):
    """What the simulated engines ask before drafting, like `specwatch.actions.flags.FlagStore`:
    ``lookup`` answers with ``enabled`` and ``draft_limit``, like ``SpeculationState``."""

    def lookup(self, bundle_id: str, bucket: str, cohort: str): ...


def _kv_pressure_workers(workers: int) -> tuple[int, ...]:
    """The last quarter of the fleet (at least one worker) takes the long-context surge."""
    count = max(1, workers // 4)
    return tuple(range(workers - count, workers))


def _worker_name(index: int) -> str:
    return f"w{index + 1}"


def _changed_card(card: BundleCard, kind: str) -> BundleCard:
    """``card`` after a scripted card change: a retrained target, or a tokenizer fix."""
    change = {"revision": _UPDATED_REVISION} if kind == "target_update" else {
        "tokenizer_digest": _UPDATED_TOKENIZER_DIGEST}
    return card.model_copy(update={"target": card.target.model_copy(update=change)})


# -- one simulated engine worker ---------------------------------------------------------------


_STEP_FIELDS_SET = frozenset(StepRecord.model_fields) - {"kind"}
_set_attribute = object.__setattr__  # what pydantic itself uses to fill a frozen model


def _trusted_step(values: dict) -> StepRecord:
    """A `StepRecord` from ``values`` (every field, in declaration order) valid by construction:
    ``model_construct`` minus its bookkeeping, as validating costs more than simulating the step."""
    record = StepRecord.__new__(StepRecord)
    _set_attribute(record, "__dict__", values)
    # a set of its own, as pydantic gives every model: model_copy(update=...) adds to it
    _set_attribute(record, "__pydantic_fields_set__", set(_STEP_FIELDS_SET))
    _set_attribute(record, "__pydantic_extra__", None)
    _set_attribute(record, "__pydantic_private__", None)
    return record


class _Request:
    """A request's fixed facts, its progress while off the batch, and the round entries it made."""

    __slots__ = ("id", "bucket", "cohort", "level", "prompt_tokens", "output_tokens", "max_tokens",
                 "arrival", "ttft_ms", "fail_u", "fail_remaining", "tail_u", "shadow_u", "shadow_delay",
                 "error_text_u", "sampling", "prompt_sha256", "output_sha256", "entries", "speculated",
                 "remaining", "kv_tokens", "shadow_fraction")

    def end_reason(self) -> str:
        return "length" if self.output_tokens >= self.max_tokens else "stop"

    def round_entry(self, code: int, width: int) -> RoundEntry:
        # Round entries are immutable and a request repeats few (drafted, accepted) pairs,
        # so each distinct pair is built once and shared by every step that reports it.
        entry = RoundEntry(id=self.id, bucket=BUCKETS[self.bucket].name, cohort=COHORTS[self.cohort],
                           drafted=code // width, accepted=code % width)
        self.entries[code] = entry
        return entry


@dataclass
class _Conditions:
    """What incidents have changed on one worker so far (all healthy at first)."""

    acceptance_factor: list[float]
    draft_factor: float = 1.0
    tail: tuple[int, int, float] | None = None  # bucket, cohort, multiplier
    mismatch: tuple[int, float, int | None] | None = None  # bucket, fraction, cohort (None = any)
    error_factor: dict[tuple[int, int | None], float] = field(default_factory=dict)  # (bucket, cohort or None)
    surge_share: float | None = None
    late_acceptance: dict[int, float] = field(default_factory=dict)  # bucket -> factor on late positions
    prompt_factor: dict[int, float] = field(default_factory=dict)  # bucket -> multiplier on prompt length


# Columns of a worker's slot table: one row per running request, the numbers every step touches.
_ROW, _ROW_BASE, _KEY, _ALLOWED, _REMAINING, _STOP_AT, _KV = range(7)
_SLOT_COLUMNS = 7
# Per-request draws are taken from the generator in batches of this many requests.
_REQUEST_DRAW_BATCH = 64
_REQUEST_UNIFORMS = 11


class _Worker:
    """One engine worker: a continuous batch of requests stepped in event time, drawn in vectorized
    blocks over a slot table, so that Python code runs per step record, never per token."""

    def __init__(self, index: int, sim: "Simulator", rng: np.random.Generator,
                 schedule: list[tuple[float, _Plan]], emit_later: Callable[[float, int, list], None]) -> None:
        self.index = index
        self.name = _worker_name(index)
        self.sim = sim
        self.rng = rng
        self.schedule = schedule
        self.emit_later = emit_later
        self.card = DEFAULT_CARD
        self.bundle_id = bundle_digest(DEFAULT_CARD)
        self.draft_length = DEFAULT_CARD.drafter.draft_length
        self.width = self.draft_length + 1
        self.conditions = _Conditions(acceptance_factor=[1.0] * len(BUCKETS))
        self.thresholds = self._acceptance_table()
        self.step_numbers = np.arange(1, _BLOCK_STEPS + 1, dtype=np.int64)[:, None]
        self.load = 1.0 + _WORKER_LOAD_SPREAD * (2.0 * rng.random() - 1.0)
        self.wobble_phase = 2.0 * math.pi * rng.random()
        self.next_request = 0
        self.seq = 0
        self.batch: list[_Request] = []
        self.waiting: list[_Request] = []  # queue head blocked on KV, and preempted requests
        self.slots = np.zeros((0, _SLOT_COLUMNS), dtype=np.int64)
        self.kv_total = 0
        self._draws: list[tuple[list[float], list[float], str]] = []
        self._mix: list[float] | None = None  # cached cumulative mix; reset when an incident changes it
        # Stalled requests: done with their tokens, their record due at the stall's end. Until
        # then every step lists them, making no progress: [(record ts, entry)], as a real
        # engine shows a request that is running but stuck.
        self.stalled: list[tuple[float, RoundEntry]] = []

    # -- acceptance ---------------------------------------------------------------------------
    def _acceptance_table(self) -> np.ndarray:
        """Accepted-run thresholds of every (bucket, difficulty) row, row r shifted into [r, r+1)."""
        rows = []
        for b, profile in enumerate(BUCKETS):
            scale = _scale_for_acceptance_length(profile, self.draft_length, self.conditions.acceptance_factor[b])
            late = self.conditions.late_acceptance.get(b, 1.0)
            for level in _DIFFICULTY_LEVELS:
                p = min(0.99, profile.position_acceptance * level * scale)
                rows.append(_accepted_cdf(p, self.draft_length, profile.acceptance_decay, late))
        table = np.array(rows, dtype=np.float64)
        return (table + np.arange(len(rows), dtype=np.float64)[:, None]).ravel()

    # -- load and mix -------------------------------------------------------------------------
    def _concurrency(self, t: float) -> int:
        load = self.load * (1.0 + _LOAD_WOBBLE * math.sin(2 * math.pi * t / _LOAD_WOBBLE_PERIOD_SECONDS
                                                            + self.wobble_phase))
        if self.sim._scenario.diurnal:
            # One day compressed into the run, starting at the night-time trough.
            load *= 1.0 - _DIURNAL_AMPLITUDE * math.cos(2 * math.pi * t / self.sim.duration)
        return max(1, int(self.sim.concurrency * load + 0.5))

    def _cumulative_weights(self, t: float) -> list[float]:
        """Cumulative traffic mix at ``t``; fixed unless the mix shifts or a surge is on."""
        shifting = self.sim._scenario.mix_shift
        if self._mix is not None and not shifting:
            return self._mix
        weights = [self.sim._scenario.bucket_weights.get(b.name, b.weight) for b in BUCKETS]
        if shifting:
            progress = min(1.0, max(0.0, (t - 60.0) / max(1.0, self.sim.duration - 60.0)))
            weights = [w + progress * (_SHIFTED_WEIGHTS[b.name] - w) for w, b in zip(weights, BUCKETS)]
        share = self.conditions.surge_share
        if share is not None:
            lc = _BUCKET_INDEX["long_context"]
            rest = sum(w for i, w in enumerate(weights) if i != lc)
            weights = [share if i == lc else w * (1.0 - share) / rest for i, w in enumerate(weights)]
        total = sum(weights)
        self._mix = list(itertools.accumulate(w / total for w in weights[:-1]))
        return self._mix

    # -- requests -----------------------------------------------------------------------------
    def _request_draws(self) -> tuple[list[float], list[float], str]:
        if not self._draws:
            rng = self.rng
            uniforms = rng.random((_REQUEST_DRAW_BATCH, _REQUEST_UNIFORMS)).tolist()
            normals = rng.standard_normal((_REQUEST_DRAW_BATCH, 2)).tolist()
            digests = rng.bytes(64 * _REQUEST_DRAW_BATCH).hex()
            self._draws = [(u, z, digests[128 * i:128 * (i + 1)])
                           for i, (u, z) in enumerate(zip(uniforms, normals))][::-1]
        return self._draws.pop()

    def _new_request(self, t: float) -> _Request:
        u, (z0, z1), digest = self._request_draws()
        req = _Request()
        req.id = f"{self.name}-{self.next_request:07d}"
        self.next_request += 1
        req.bucket = b = bisect.bisect_right(self._cumulative_weights(t), u[0])
        req.cohort, req.shadow_fraction = self._route(u[1], bisect.bisect_right(_CUMULATIVE_COHORT_SHARES, u[1]))
        req.level = min(len(_DIFFICULTY_LEVELS) - 1, int(u[2] * len(_DIFFICULTY_LEVELS)))
        profile = BUCKETS[b]
        prompt = profile.prompt_median * math.exp(profile.prompt_sigma * z0)
        if self.conditions.surge_share is not None and b == _BUCKET_INDEX["long_context"]:
            prompt *= 1.5  # the surge brings longer documents, not just more of them
        prompt *= self.conditions.prompt_factor.get(b, 1.0)
        req.prompt_tokens = int(min(120_000, max(16, prompt)))
        output = profile.output_median * math.exp(profile.output_sigma * z1)
        req.max_tokens = profile.max_tokens
        req.output_tokens = int(min(profile.max_tokens, max(1, round(output))))
        # Failures and aborts strike at a random point of the output; whether one does is
        # decided when the request gets there, so rate changes apply from their start time.
        req.fail_u = u[3]
        req.fail_remaining = int((req.output_tokens - 1) * u[4]) if u[3] < _FAILURE_CHECK_SHARE else 0
        req.tail_u = u[5]
        req.shadow_u = u[6]
        req.shadow_delay = _SHADOW_DELAY_SECONDS[0] + (_SHADOW_DELAY_SECONDS[1] - _SHADOW_DELAY_SECONDS[0]) * u[7]
        req.error_text_u = u[8]
        queue_ms = -_QUEUE_MEAN_MS * math.log(1.0 - u[9])
        req.ttft_ms = _PREFILL_BASE_MS + _PREFILL_MS_PER_TOKEN * req.prompt_tokens * (0.95 + 0.1 * u[2]) + queue_ms
        req.arrival = t - req.ttft_ms / 1000.0
        req.sampling = Sampling(temperature=profile.temperature, top_p=profile.top_p,
                                seed=int(u[10] * 2**31), max_tokens=profile.max_tokens)
        req.prompt_sha256, req.output_sha256 = digest[:64], digest[64:]
        req.entries = [None] * (self.width * self.width)
        req.speculated = False
        req.remaining = req.output_tokens - 1  # the first token comes out of prefill
        req.kv_tokens = req.prompt_tokens + 1
        return req

    def _route(self, u: float, cohort: int) -> tuple[int, float]:
        """The cohort a router puts a request in, given the bundle's admission stage, and the
        share of such requests whose output is shadow-checked (all mirrored ones, more canary)."""
        flags = self.sim.flags
        stage_of = getattr(flags, "admission", None)
        if stage_of is None or cohort == _BASELINE:
            return cohort, _SHADOW_FRACTION
        state = stage_of(self.bundle_id)
        if state is None or state.stage not in ("shadow", "canary") or state.cohort not in _COHORT_INDEX:
            return cohort, _SHADOW_FRACTION
        if u >= state.cohort_share * (1.0 - _COHORT_SHARES[_BASELINE]):
            return _MAIN, _SHADOW_FRACTION
        return _COHORT_INDEX[state.cohort], 1.0 if state.stage == "shadow" else _CANARY_SHADOW_FRACTION

    def _admit(self, t: float, emitting: bool) -> None:
        target = self._concurrency(t)
        if len(self.batch) >= target:
            return
        watermark = _KV_SURGE_WATERMARK if self.conditions.surge_share is not None else _KV_ADMISSION_WATERMARK
        limit = int(watermark * _KV_CAPACITY_TOKENS)
        admitted: list[_Request] = []
        kv_total = self.kv_total
        while len(self.batch) + len(admitted) < target:
            req = self.waiting[0] if self.waiting else self._new_request(t)
            if kv_total + req.kv_tokens > limit and (self.batch or admitted):
                if not self.waiting:
                    self.waiting.append(req)  # the head of the queue waits for KV blocks
                break
            if self.waiting:
                self.waiting.pop(0)
            if req.remaining <= 0:  # one-token answer: done at prefill, never joins the batch
                if emitting:
                    for record in self._finish(req, t, req.end_reason()):
                        self.emit_later(record.ts, self.index, [record])
                continue
            admitted.append(req)
            kv_total += req.kv_tokens
        if admitted:
            self._append(admitted)

    def _append(self, admitted: list[_Request]) -> None:
        levels, cohorts, d = len(_DIFFICULTY_LEVELS), len(COHORTS), self.draft_length
        rows = []
        for r in admitted:
            row = r.bucket * levels + r.level
            allowed = 0 if r.cohort == _BASELINE else d
            rows.append((row, row * d, r.bucket * cohorts + r.cohort, allowed, r.remaining,
                         r.fail_remaining, r.kv_tokens))
            if self.sim.flags is None:
                r.speculated = allowed > 0
            self.kv_total += r.kv_tokens
        self.batch.extend(admitted)
        self.slots = np.concatenate([self.slots, np.array(rows, dtype=np.int64)])

    def _remove(self, slots: Sequence[int], kv_tokens: int) -> None:
        """Drop the given slots, which held ``kv_tokens`` of KV cache between them."""
        gone = set(slots)
        keep = [i for i in range(len(self.batch)) if i not in gone]
        self.batch = [self.batch[i] for i in keep]
        self.slots = self.slots[keep]
        self.kv_total -= kv_tokens

    # -- incidents ----------------------------------------------------------------------------
    def _begin(self, plan: _Plan, intensity: float) -> BundleCard | None:
        """Apply one incident to this worker; returns the new card when the card changed."""
        c = self.conditions
        bucket = _BUCKET_INDEX[plan.bucket] if plan.bucket else None
        cohort = COHORTS.index(plan.cohort) if plan.cohort else None
        if plan.kind == "acceptance_drop":
            c.acceptance_factor[bucket] = 1.0 - intensity
            self.thresholds = self._acceptance_table()
        elif plan.kind == "target_update":
            c.acceptance_factor = [1.0 - intensity] * len(BUCKETS)
            self.thresholds = self._acceptance_table()
            return _changed_card(self.card, plan.kind)
        elif plan.kind == "bundle_change":
            return _changed_card(self.card, plan.kind)
        elif plan.kind in ("draft_regression", "draft_cost_doubles"):
            c.draft_factor = intensity
        elif plan.kind == "late_acceptance_decay":
            c.late_acceptance[bucket] = intensity
            self.thresholds = self._acceptance_table()
        elif plan.kind == "context_shift":
            c.prompt_factor[bucket] = intensity
        elif plan.kind in ("latency_tail", "canary_tail"):
            c.tail = (bucket, cohort, intensity)
        elif plan.kind == "kv_pressure":
            c.surge_share = intensity
            self._mix = None
        elif plan.kind in ("quality_mismatch", "canary_mismatch"):
            c.mismatch = (bucket, intensity, cohort)
        elif plan.kind == "error_burst":
            c.error_factor[(bucket, cohort)] = intensity
        return None

    # -- one block of steps -------------------------------------------------------------------
    def _draft_positions(self) -> np.ndarray:
        """Draft positions per running request, after asking the flag source (closed loop)."""
        allowed = self.slots[:, _ALLOWED]
        flags = self.sim.flags
        if flags is None:
            return allowed
        cohorts = len(COHORTS)
        table = np.zeros(len(BUCKETS) * cohorts, dtype=np.int64)
        for b, profile in enumerate(BUCKETS):
            for c, cohort in enumerate(COHORTS):
                if c == _BASELINE:
                    continue
                state = flags.lookup(self.bundle_id, profile.name, cohort)
                if state.enabled:
                    limit = state.draft_limit
                    table[b * cohorts + c] = self.draft_length if limit is None else max(
                        0, min(self.draft_length, int(limit)))
        drafted = np.minimum(table[self.slots[:, _KEY]], allowed)
        for req, positions in zip(self.batch, drafted.tolist()):
            if positions:
                req.speculated = True
        return drafted

    def _block(self, t: float, horizon: float,
               emitting: bool) -> tuple[float, list[tuple[float, list[TelemetryRecord]]]]:
        """Run engine steps from ``t`` while the batch stays the same: the end time and, when
        emitting, ``(ts, records)`` per step. Draws past the block's end are discarded.

        A block ends after a step where a request finishes or fails, or KV overflows, after
        ``_BLOCK_STEPS``, or before a step that would start at or after ``horizon``.
        """
        n = len(self.batch)
        slots = self.slots
        block = _BLOCK_STEPS if self.sim.flags is None else _CLOSED_LOOP_BLOCK_STEPS
        drafted = self._draft_positions()
        u = self.rng.random((block, n + 3))
        # Row r's thresholds live in [r, r+1) of one sorted array, so a single searchsorted
        # counts, for every request at once, the thresholds its uniform draw passes.
        accepted = np.searchsorted(self.thresholds, u[:, :n] + slots[:, _ROW], side="right") - slots[:, _ROW_BASE]
        np.minimum(accepted, drafted, out=accepted)
        produced = accepted.cumsum(axis=0) + self.step_numbers[:block]  # every round adds the target's token
        attention = produced >= slots[:, _REMAINING] - slots[:, _STOP_AT]
        first = int(attention.argmax())  # row-major: the earliest step any request needs attention
        attention_step = first // n if attention.flat[first] else block
        steps = min(block, attention_step + 1)
        kv_total = self.kv_total
        kv_after = [kv_total + x for x in produced[:steps].sum(axis=1).tolist()]
        per_request = drafted.tolist()
        drafted_tokens = sum(per_request)
        drafting = n - per_request.count(0)
        draft_ms, verify_fixed = step_timing(n, drafting, max(per_request), drafted_tokens, 0,
                                             self.conditions.draft_factor)
        jitter = u[:steps, n:].tolist()
        out: list[tuple[float, list[TelemetryRecord]]] = []
        if emitting:
            width, seq = self.width, self.seq
            start_ts, name, bundle_id, batch = self.sim.start_ts, self.name, self.bundle_id, self.batch
            codes = (drafted * width + accepted[:steps]).tolist()
            caches = [req.entries for req in batch]
        end = t
        ran = 0
        for k in range(steps):
            if k and (end >= horizon or kv_after[k - 1] > _KV_CAPACITY_TOKENS):
                break
            j_draft, j_verify, j_gap = jitter[k]
            draft = draft_ms * (1.0 + _TIMING_JITTER * (j_draft - 0.5))
            verify = (verify_fixed + _VERIFY_MS_PER_KV_KTOKEN / 1000.0 * kv_after[k]) * (
                1.0 + _TIMING_JITTER * (j_verify - 0.5))
            end += (draft + verify + _SCHEDULE_GAP_MS * (1.0 + j_gap)) / 1000.0
            ran += 1
            if emitting:
                seq += 1
                ts = round(start_ts + end, 6)
                entries = [cache[code] or req.round_entry(code, width)
                           for req, cache, code in zip(batch, caches, codes[k])]
                if self.stalled:
                    entries += [entry for until, entry in self.stalled if ts < until]
                usage = kv_after[k] / _KV_CAPACITY_TOKENS
                out.append((ts, [_trusted_step({
                    "v": 1, "ts": ts, "kind": "step", "worker": name, "seq": seq, "bundle_id": bundle_id,
                    "draft_ms": round(draft, 3), "verify_ms": round(verify, 3),
                    "kv_usage": round(usage if usage < 1.0 else 1.0, 4), "requests": entries})]))
        steps = ran
        if self.stalled and emitting:
            done_by = round(self.sim.start_ts + end, 6)
            self.stalled = [stall for stall in self.stalled if stall[0] > done_by]
        last = produced[steps - 1]
        slots[:, _REMAINING] -= last
        slots[:, _KV] += last
        self.kv_total = kv_after[steps - 1]
        self.seq += steps
        if steps == attention_step + 1:
            # the attention row compared what the block produced with what each request had
            # left, i.e. it marks exactly the slots now at their end or failure point
            due = np.flatnonzero(attention[attention_step]).tolist()
            self._settle(due, end, out[-1][1] if emitting else None)
        if self.kv_total > _KV_CAPACITY_TOKENS:
            self._preempt()
        return end, out

    def _settle(self, due: list[int], t_end: float, records: list | None) -> None:
        """Finish, fail or pass the requests that reached their end or their failure point."""
        done: list[int] = []
        freed = 0
        remaining = self.slots[:, _REMAINING].tolist()
        kv = self.slots[:, _KV].tolist()
        for slot in due:
            req = self.batch[slot]
            if remaining[slot] <= 0:
                freed += kv[slot]
                done.append(slot)
                if records is not None:
                    records.extend(self._finish(req, t_end, req.end_reason()))
                continue
            outcome = self._failure(req)
            if outcome is None:
                self.slots[slot, _STOP_AT] = 0  # past its failure point: runs to the end
                continue
            done.append(slot)
            freed += kv[slot]
            if records is not None:
                req.output_tokens -= remaining[slot]
                records.extend(self._finish(req, t_end, outcome))
        if done:
            self._remove(done, freed)

    def _failure(self, req: _Request) -> str | None:
        factor = 1.0
        if req.speculated:
            factor = self.conditions.error_factor.get((req.bucket, req.cohort),
                                                      self.conditions.error_factor.get((req.bucket, None), 1.0))
        error, timeout = _ERROR_RATE * factor, _TIMEOUT_RATE * factor
        u = req.fail_u
        if u < error:
            return "error"
        if u < error + timeout:
            return "timeout"
        if u < error + timeout + _ABORT_RATE:
            return "abort"
        return None

    def _finish(self, req: _Request, t: float, reason: str) -> list[TelemetryRecord]:
        """The request record (and maybe a later shadow record) of a request that ended at ``t``."""
        end_ts = round(self.sim.start_ts + t, 6)
        e2e_ms = (t - req.arrival) * 1000.0
        tail = self.conditions.tail
        delayed = False
        if (tail is not None and req.speculated and req.bucket == tail[0] and req.cohort == tail[1]
                and req.tail_u < _LATENCY_TAIL_FRACTION):
            # A stalled request finishes late: its record leaves when the stall ends.
            e2e_ms = req.ttft_ms + (e2e_ms - req.ttft_ms) * tail[2]
            end_ts = max(end_ts, round(self.sim.start_ts + req.arrival + e2e_ms / 1000.0, 6))
            delayed = True
        tokens = req.output_tokens
        tpot_ms = (e2e_ms - req.ttft_ms) / (tokens - 1) if tokens > 1 else None
        error = None
        if reason == "error":
            error = _ERROR_TEXTS[min(len(_ERROR_TEXTS) - 1, int(req.error_text_u * len(_ERROR_TEXTS)))]
        elif reason == "timeout":
            error = _TIMEOUT_TEXT
        record = RequestRecord(
            v=1, ts=end_ts, worker=self.name, bundle_id=self.bundle_id, id=req.id,
            bucket=BUCKETS[req.bucket].name, cohort=COHORTS[req.cohort], speculative=req.speculated,
            ttft_ms=round(req.ttft_ms, 3), tpot_ms=None if tpot_ms is None else round(tpot_ms, 3),
            e2e_ms=round(e2e_ms, 3), output_tokens=tokens, finish_reason=reason, error=error,
            sample=self._sample(req, tokens),
        )
        out: list[TelemetryRecord] = []
        if delayed:
            self.emit_later(end_ts, self.index, [record])
            self.stalled.append((end_ts, RoundEntry(id=req.id, bucket=record.bucket, cohort=record.cohort,
                                                    drafted=0, accepted=0)))
        else:
            out.append(record)
        fraction = req.shadow_fraction
        if req.speculated and reason in ("stop", "length") and req.shadow_u < fraction:
            match = True
            mismatch = self.conditions.mismatch
            if mismatch is not None and req.bucket == mismatch[0] and mismatch[2] in (None, req.cohort):
                # shadow_u is uniform below the shadow fraction: rescale it for a second draw
                match = req.shadow_u / fraction >= mismatch[1]
            shadow_ts = round(end_ts + req.shadow_delay, 6)
            self.emit_later(shadow_ts, self.index, [ShadowRecord(
                v=1, ts=shadow_ts, bundle_id=self.bundle_id, id=req.id, bucket=BUCKETS[req.bucket].name,
                check=_SHADOW_CHECK, match=match)])
        return out

    def _sample(self, req: _Request, output_tokens: int) -> Sample:
        capture = self.sim.capture
        bucket = BUCKETS[req.bucket].name
        if capture is None or not capture.wants(req.id, bucket, req.prompt_tokens, output_tokens):
            return Sample(prompt_sha256=req.prompt_sha256, output_sha256=req.output_sha256, sampling=req.sampling)
        # A captured request gets token ids of its own (seeded by its id) and digests over them.
        rng = np.random.default_rng([self.sim.seed, *req.id.encode()])
        prompt_ids = rng.integers(0, _CAPTURE_VOCAB, req.prompt_tokens).tolist()
        output_ids = rng.integers(0, _CAPTURE_VOCAB, output_tokens).tolist()
        return Sample(prompt_sha256=token_digest(prompt_ids), output_sha256=token_digest(output_ids),
                      sampling=req.sampling, sealed=capture.seal(req.id, bucket, prompt_ids, output_ids))

    def _preempt(self) -> None:
        """Out of KV blocks: the newest requests go back to the queue (recompute), as vLLM does."""
        preempted = []
        kv = self.slots[:, _KV].tolist()
        total = self.kv_total
        for slot in range(len(self.batch) - 1, 0, -1):
            if total <= _KV_CAPACITY_TOKENS:
                break
            req = self.batch[slot]
            req.remaining = int(self.slots[slot, _REMAINING])
            req.fail_remaining = int(self.slots[slot, _STOP_AT])
            req.kv_tokens = kv[slot]
            preempted.append(slot)
            total -= kv[slot]
        self.waiting[:0] = [self.batch[s] for s in reversed(preempted)]
        self._remove(preempted, self.kv_total - total)

    # -- the worker's stream of record batches --------------------------------------------------
    def run(self) -> Iterator[tuple[float, list[TelemetryRecord]]]:
        """Batches of records, each sharing one event time (rounded ts), in non-decreasing time."""
        sim = self.sim
        t = -_WARMUP_SECONDS
        while t < 0.0:
            self._admit(t, emitting=False)
            t, _ = self._block(t, 0.0, emitting=False)
        yield round(sim.start_ts, 6), [self._bundle_record(0.0)]
        next_heartbeat = _HEARTBEAT_SECONDS
        schedule = self.schedule
        next_change = schedule[0][0] if schedule else math.inf
        while True:
            if t >= next_change:
                while schedule and schedule[0][0] <= t:
                    _, plan = schedule.pop(0)
                    card = self._begin(plan, sim._intensity(plan))
                    if card is not None:
                        self.card, self.bundle_id = card, bundle_digest(card)
                        record = self._bundle_record(t)
                        yield record.ts, [record]  # a changed card is announced at once
                        next_heartbeat = t + _HEARTBEAT_SECONDS
                next_change = schedule[0][0] if schedule else math.inf
            if t >= next_heartbeat:
                record = self._bundle_record(t)
                yield record.ts, [record]
                next_heartbeat += _HEARTBEAT_SECONDS
            self._admit(t, emitting=True)
            t, steps = self._block(t, min(next_change, next_heartbeat), emitting=True)
            yield from steps

    def _bundle_record(self, t: float) -> BundleRecord:
        return BundleRecord(v=1, ts=round(self.sim.start_ts + t, 6), worker=self.name,
                            bundle_id=self.bundle_id, card=self.card)


# -- the fleet ------------------------------------------------------------------------------


class Simulator:
    """A seeded fleet of speculative engine workers running one of `SCENARIOS`.

    ``intensity`` is the strength of a single-incident scenario's incident, in its kind's unit;
    ``flags`` (a `FlagSource`) closes the loop so that fallback decisions take effect;
    ``concurrency`` is the mean running requests per worker; a ``capture`` seals the token ids
    of the requests it takes into their samples.

    >>> sim = Simulator("acceptance_drop", seed=1, minutes=0.05)
    >>> [i.kind for i in sim.incidents], sim.bundle_cards == {sim.initial_bundle_id: DEFAULT_CARD}
    ([], True)
    >>> sim = Simulator("acceptance_drop", seed=1)
    >>> incident = sim.incidents[0]
    >>> incident.bucket, incident.expected_reason, incident.start_ts - sim.start_ts
    ('coding', 'acceptance_drop', 240.0)
    >>> Simulator("nope")
    Traceback (most recent call last):
    ...
    ValueError: unknown scenario 'nope'; choose one of: healthy, acceptance_drop, ...
    """

    def __init__(self, scenario: str = "demo", seed: int = 7, minutes: float | None = None,
                 workers: int = _DEFAULT_WORKERS, intensity: float | None = None, flags: FlagSource | None = None,
                 start_ts: float = DEFAULT_START_TS, incident_at: float | None = None,
                 concurrency: int = _DEFAULT_CONCURRENCY, capture: SampleCapture | None = None,
                 plans: Sequence[IncidentPlan] | None = None) -> None:
        if scenario not in _SCENARIO_SPECS:
            raise ValueError(f"unknown scenario {scenario!r}; choose one of: {', '.join(_SCENARIO_SPECS)}")
        spec = _SCENARIO_SPECS[scenario]
        if plans is not None:  # incidents of the caller's choosing on the scenario's traffic
            spec = replace(spec, plans=tuple(_checked_plan(plan) for plan in plans))
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        minutes = spec.minutes if minutes is None else float(minutes)
        if not (minutes > 0 and math.isfinite(minutes)):
            raise ValueError(f"minutes must be a positive number, got {minutes!r}")
        if not 1 <= int(workers) <= 4096:
            raise ValueError(f"workers must be between 1 and 4096, got {workers!r}")
        if not 1 <= int(concurrency) <= 1024:
            raise ValueError(f"concurrency must be between 1 and 1024 running requests, got {concurrency!r}")
        if not (isinstance(start_ts, (int, float)) and start_ts >= 0 and math.isfinite(start_ts)):
            raise ValueError(f"start_ts must be a non-negative unix time, got {start_ts!r}")
        if incident_at is not None and not (incident_at >= 0 and math.isfinite(incident_at)):
            raise ValueError(f"incident_at must be seconds >= 0 after start, got {incident_at!r}")
        if intensity is not None:
            if len(spec.plans) != 1:
                raise ValueError(f"scenario {scenario!r} has {len(spec.plans)} incidents; intensity applies "
                                 "only to scenarios with exactly one")
            kind = spec.plans[0].kind
            _, low, high, meaning = _INTENSITY[kind]
            if not low <= intensity <= high:
                raise ValueError(f"intensity for {kind} is the {meaning}; it must be in [{low}, {high}], "
                                 f"got {intensity!r}")
        if flags is not None and not callable(getattr(flags, "lookup", None)):
            raise ValueError("flags must have a lookup(bundle_id, bucket, cohort) method, like FlagStore")
        self.scenario = scenario
        self.seed = seed
        self.minutes = minutes
        self.workers = int(workers)
        self.intensity = intensity
        self.flags = flags
        self.start_ts = float(start_ts)
        self.incident_at = spec.incident_at if incident_at is None else float(incident_at)
        self.concurrency = int(concurrency)
        self.capture = capture
        self._scenario = spec

    @property
    def duration(self) -> float:
        """Event time covered, in seconds."""
        return self.minutes * 60.0

    @property
    def end_ts(self) -> float:
        return self.start_ts + self.duration

    @property
    def initial_bundle_id(self) -> str:
        return bundle_digest(DEFAULT_CARD)

    def _intensity(self, plan: _Plan) -> float:
        if plan.intensity is not None:
            return plan.intensity
        return _INTENSITY[plan.kind][0] if self.intensity is None else self.intensity

    def _schedule(self) -> list[list[tuple[float, _Plan]]]:
        """Per worker: (seconds after start, incident) in time order, only those inside the run."""
        per_worker: list[list[tuple[float, _Plan]]] = [[] for _ in range(self.workers)]
        surge = set(_kv_pressure_workers(self.workers))
        for plan in self._scenario.plans:
            start = self.incident_at + plan.offset
            for w in range(self.workers):
                at = start
                if plan.kind in ("target_update", "bundle_change"):
                    at = start + _ROLLOUT_SECONDS * w / self.workers
                elif plan.kind == "kv_pressure" and w not in surge:
                    continue
                if at < self.duration:
                    per_worker[w].append((at, plan))
        for items in per_worker:
            items.sort(key=lambda item: item[0])
        return per_worker

    @property
    def incidents(self) -> list[Incident]:
        """Ground truth: the incidents that start inside the run, in start order."""
        out = []
        base = self.initial_bundle_id
        for plan in self._scenario.plans:
            start = self.incident_at + plan.offset
            if start >= self.duration:
                continue
            bundle_id, workers = base, ()
            if plan.kind in ("target_update", "bundle_change"):
                bundle_id = bundle_digest(_changed_card(DEFAULT_CARD, plan.kind))
            elif plan.kind == "kv_pressure":
                workers = tuple(_worker_name(w) for w in _kv_pressure_workers(self.workers))
            out.append(Incident(plan.kind, self.start_ts + start, bundle_id, plan.bucket, plan.cohort,
                                _EXPECTED_REASON[plan.kind], workers))
        return sorted(out, key=lambda i: i.start_ts)

    @property
    def bundle_cards(self) -> dict[str, BundleCard]:
        """Every bundle the run announces: bundle_id -> fingerprint card."""
        cards = {self.initial_bundle_id: DEFAULT_CARD}
        for incident in self.incidents:
            if incident.kind in ("target_update", "bundle_change"):
                cards[incident.bundle_id] = _changed_card(DEFAULT_CARD, incident.kind)
        return cards

    def records(self) -> Iterator[TelemetryRecord]:
        """Contract-v1 records of the whole fleet in event-time order (equal times in worker order,
        then in the order a worker made them); a fresh run per call."""
        heap: list[tuple[float, int, int, list, Iterator | None]] = []
        counter = 0

        def emit_later(ts: float, rank: int, records: list) -> None:
            nonlocal counter
            counter += 1
            heapq.heappush(heap, (ts, rank, counter, records, None))

        seeds = np.random.SeedSequence(self.seed).spawn(self.workers)
        schedule = self._schedule()
        for w in range(self.workers):
            worker = _Worker(w, self, np.random.default_rng(seeds[w]), schedule[w], emit_later)
            stream = worker.run()
            ts, batch = next(stream)
            counter += 1
            heap.append((ts, w, counter, batch, stream))
        heapq.heapify(heap)
        end_ts = self.end_ts
        while heap:
            ts, rank, _, batch, stream = heap[0]
            if ts > end_ts:
                return
            if stream is None:
                heapq.heappop(heap)
            else:
                next_ts, following = next(stream)
                counter += 1
                heapq.heapreplace(heap, (next_ts, rank, counter, following, stream))
            if len(batch) == 1:
                yield batch[0]
            else:
                yield from batch
