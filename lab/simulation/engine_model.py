"""What one simulated engine worker does, as numbers: the deployment card, task buckets and
cohorts, per-position acceptance, the cost of a step, KV capacity, failure and shadow rates, load."""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

from specwatch.schemas import BundleCard, DrafterCard, RuntimeCard, TargetCard

__all__ = ["ABORT_RATE", "BASELINE", "BUCKETS", "BUCKET_INDEX", "CANARY_SHADOW_FRACTION", "COHORTS", "COHORT_INDEX",
           "COHORT_SHARES", "CUMULATIVE_COHORT_SHARES", "DEFAULT_CARD", "DIFFICULTY_LEVELS", "DIURNAL_AMPLITUDE",
           "ERROR_RATE", "ERROR_TEXTS", "FAILURE_CHECK_SHARE", "KV_ADMISSION_WATERMARK", "KV_CAPACITY_TOKENS",
           "KV_SURGE_WATERMARK", "LATENCY_TAIL_FRACTION", "LOAD_WOBBLE", "LOAD_WOBBLE_PERIOD_SECONDS", "MAIN",
           "MAX_ERROR_FACTOR", "PREFILL_BASE_MS", "PREFILL_MS_PER_TOKEN", "QUEUE_MEAN_MS", "SCHEDULE_GAP_MS",
           "SHADOW_CHECK", "SHADOW_DELAY_SECONDS", "SHADOW_FRACTION", "TIMEOUT_RATE", "TIMEOUT_TEXT", "TIMING_JITTER",
           "VERIFY_MS_PER_KV_KTOKEN", "WORKER_LOAD_SPREAD", "BucketProfile", "acceptance_length", "accepted_cdf",
           "bucket_acceptance_length", "scale_for_acceptance_length", "step_timing", "true_speedup"]

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
BUCKET_INDEX = MappingProxyType({b.name: i for i, b in enumerate(BUCKETS)})

# The shadow cohort gets traffic only while admission mirrors it there (its default share is 0).
COHORTS: tuple[str, ...] = ("main", "canary", "baseline", "shadow")
COHORT_SHARES = (0.90, 0.05, 0.05, 0.0)
MAIN = COHORTS.index("main")
BASELINE = COHORTS.index("baseline")
_SHADOW_COHORT = COHORTS.index("shadow")
COHORT_INDEX = MappingProxyType({name: i for i, name in enumerate(COHORTS)})
CUMULATIVE_COHORT_SHARES = tuple(float(x) for x in np.cumsum(COHORT_SHARES)[:-1])

# Requests differ in how predictable they are even inside one bucket; a few difficulty levels
# (multipliers on per-position acceptance) give per-request spread at table-lookup cost.
DIFFICULTY_LEVELS = (0.94, 0.97, 1.0, 1.03, 1.06)

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
    profile = BUCKETS[BUCKET_INDEX[bucket]]
    return sum(acceptance_length(min(0.99, profile.position_acceptance * level), draft_length,
                                 profile.acceptance_decay, late_factor)
               for level in DIFFICULTY_LEVELS) / len(DIFFICULTY_LEVELS)


def accepted_cdf(position_acceptance: float, draft_length: int, decay: float,
                  late_factor: float = 1.0) -> list[float]:
    """P(accepted <= j) for j in 0..D-1: thresholds for drawing a round's accepted run."""
    cdf, run, total = [], 1.0, 0.0
    for k in range(draft_length):
        p = _position_probability(position_acceptance, k, decay, late_factor)
        total += run * (1.0 - p)
        run *= p
        cdf.append(total)
    return cdf


def scale_for_acceptance_length(profile: BucketProfile, draft_length: int, factor: float) -> float:
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
VERIFY_MS_PER_KV_KTOKEN = 0.02
# EAGLE-3 drafts serially: one light forward per drafted position over the drafting requests.
_DRAFT_MS_PER_POSITION = 0.6
_DRAFT_MS_PER_POSITION_PER_REQUEST = 0.025
SCHEDULE_GAP_MS = 0.25
TIMING_JITTER = 0.06  # +-3% step to step


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
              + VERIFY_MS_PER_KV_KTOKEN * kv_tokens / 1000.0)
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
    gap = SCHEDULE_GAP_MS * 1.5  # mean of the uniform gap 0.25 * (1 + u)
    return bucket_acceptance_length(bucket, draft_length, late_factor) * (standard + gap) / (draft + verify + gap)


# Prefill runs on its own lane (chunked/disaggregated); it sets TTFT but not decode step time.
PREFILL_BASE_MS = 12.0
PREFILL_MS_PER_TOKEN = 0.011
QUEUE_MEAN_MS = 3.0

# KV cache of one worker in tokens, and the share the scheduler fills with admitted prompts:
# it keeps headroom for decode growth, so a healthy worker stays below ~0.9.
KV_CAPACITY_TOKENS = 196_608
KV_ADMISSION_WATERMARK = 0.85
# Under a long-context surge the scheduler admits whenever blocks are free (vLLM's default).
KV_SURGE_WATERMARK = 0.99


# -- failures, shadow checks and offered load ---------------------------------------------------

ERROR_RATE = 0.0014
TIMEOUT_RATE = 0.0006
ABORT_RATE = 0.003
# Share of requests checked for a failure at a random point of their output: every failure
# rate a run can reach stays below it (thinning). It is the same for every scenario, so a
# scenario's records before its incident are exactly those of the healthy run.
FAILURE_CHECK_SHARE = 0.1
MAX_ERROR_FACTOR = int((FAILURE_CHECK_SHARE - ABORT_RATE) / (ERROR_RATE + TIMEOUT_RATE))
ERROR_TEXTS = (
    "CUDA error: an illegal memory access was encountered",
    "EngineCoreError: engine core step failed",
    "RuntimeError: NCCL watchdog: collective operation failed",
)
TIMEOUT_TEXT = "engine step watchdog: no progress for 5.0 s"
# Share of a key's requests that stall while a latency-tail incident is on.
LATENCY_TAIL_FRACTION = 0.10

SHADOW_FRACTION = 0.02
# While a bundle is in canary, a router checks this share of the canary's outputs against
# standard decoding: the lossless contract is what a canary must show first.
CANARY_SHADOW_FRACTION = 0.25
SHADOW_DELAY_SECONDS = (0.5, 2.5)  # a shadow re-run with standard decoding finishes later
SHADOW_CHECK = "token_exact"

DIURNAL_AMPLITUDE = 0.35
WORKER_LOAD_SPREAD = 0.15  # workers differ by up to this much in offered concurrency
LOAD_WOBBLE = 0.08
LOAD_WOBBLE_PERIOD_SECONDS = 300.0
