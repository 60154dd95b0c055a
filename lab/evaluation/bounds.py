"""The information bound of each incident: how fast any detector with specwatch's false-alarm rate
could be, ln(ARL) / KL observations of an ideal CUSUM (docs/EVALUATION.md)."""

from __future__ import annotations

import itertools
import math
from typing import Sequence

from specwatch.lab.simulation import engine_model as sim

__all__ = ["bernoulli_kl", "information_bound", "BOUND_KINDS"]

# Incident kinds whose evidence accumulates over requests or rounds. The others are decided
# by one record or one slice (a card, a strict mismatch, KV past the watermark, the draft
# time of every step), which no bound in observations improves on.
BOUND_KINDS = ("error_burst", "latency_tail", "acceptance_drop")
# The tail scenario slows this share of its cohort's requests; each of them passes the
# latency limit (2x the baseline p99 of TPOT) at every intensity the suite runs (>= 3).
_TAIL_SHARE = sim.LATENCY_TAIL_FRACTION
# The share of requests past the limit in healthy traffic a test can assume at best.
_HEALTHY_TAIL_SHARE = 0.005


def bernoulli_kl(p1: float, p0: float) -> float:
    """KL(Bernoulli(p1) || Bernoulli(p0)) in nats.

    >>> round(bernoulli_kl(0.01, 0.002), 5)
    0.00813
    """
    return p1 * math.log(p1 / p0) + (1.0 - p1) * math.log((1.0 - p1) / (1.0 - p0))


def _poisson_kl_rate(after: float, before: float) -> float:
    """KL per second between Poisson streams of rates ``after`` and ``before`` (same unit).

    >>> _poisson_kl_rate(2.0, 2.0), round(_poisson_kl_rate(2.0, 1.0), 4)
    (0.0, 0.3863)
    """
    if after <= 0.0:
        return before
    return after * math.log(after / before) - after + before


def _tail_seconds(threshold: float, requests_per_second: float, intensity: float,
                  decode_seconds: Sequence[float], step: float = 0.1, cap: float = 4 * 3600.0) -> float:
    """Seconds until the tail's record streams, past the latency limit and within it, hold
    ``threshold`` nats, slow records arriving ``decode * (intensity - 1)`` late (see the docs).

    >>> round(_tail_seconds(15.0, 10.0, 5.0, [0.0]), 1)  # records at once: ln(ARL) / (rate * KL)
    6.8
    >>> round(_tail_seconds(15.0, 10.0, 5.0, [5.0]), 1)  # every slow record 20 s late
    26.2
    """
    p0, q, r = _HEALTHY_TAIL_SHARE, _TAIL_SHARE, requests_per_second
    delays = sorted(max(0.0, d) * (intensity - 1.0) for d in decode_seconds) or [0.0]
    within = _poisson_kl_rate(r * (1.0 - q) * (1.0 - p0), r * (1.0 - p0))
    information, t, arrived = 0.0, 0.0, 0
    while t < cap:
        t += step
        while arrived < len(delays) and delays[arrived] <= t:
            arrived += 1
        past = r * ((1.0 - q) * p0 + q * arrived / len(delays))
        information += (_poisson_kl_rate(past, r * p0) + within) * step
        if information >= threshold:
            return t
    return math.inf


def _round_pmf(position_acceptance: float, draft_length: int, decay: float) -> list[float]:
    cdf = sim.accepted_cdf(position_acceptance, draft_length, decay)
    return [max(0.0, b - a) for a, b in itertools.pairwise([0.0, *cdf, 1.0])]


def _acceptance_kl(bucket: str, drop: float, draft_length: int = 4) -> float:
    """KL per round between the bucket's accepted-count distributions after and before the drop."""
    profile = next(b for b in sim.BUCKETS if b.name == bucket)
    scale = sim.scale_for_acceptance_length(profile, draft_length, 1.0 - drop)
    total = 0.0
    for level in sim.DIFFICULTY_LEVELS:  # requests are spread evenly over difficulty levels
        p = min(0.99, profile.position_acceptance * level)
        before = _round_pmf(p, draft_length, profile.acceptance_decay)
        after = _round_pmf(min(0.99, p * scale), draft_length, profile.acceptance_decay)
        total += sum(a * math.log(a / b) for a, b in zip(after, before) if a > 0 and b > 0)
    return total / len(sim.DIFFICULTY_LEVELS)


def within_request_correlation(bucket: str, draft_length: int = 4) -> float:
    """Correlation of two rounds' accepted counts in one request of ``bucket``: its rounds share
    one difficulty level, so it is the spread of the levels' means over the rounds' variance.

    >>> round(within_request_correlation("coding"), 4)
    0.0172
    """
    profile = next(b for b in sim.BUCKETS if b.name == bucket)
    means, variances = [], []
    for level in sim.DIFFICULTY_LEVELS:
        pmf = _round_pmf(min(0.99, profile.position_acceptance * level), draft_length, profile.acceptance_decay)
        mean = sum(k * p for k, p in enumerate(pmf))
        means.append(mean)
        variances.append(sum((k - mean) ** 2 * p for k, p in enumerate(pmf)))
    grand = sum(means) / len(means)
    between = sum((m - grand) ** 2 for m in means) / len(means)
    within = sum(variances) / len(variances)
    return between / (between + within)


def information_bound(kind: str, intensity: float | None, observations_per_second: float,
                      false_alarms_per_key_hour: float, bucket: str | None = None,
                      decode_seconds: Sequence[float] = (), rounds_per_request: float | None = None) -> dict | None:
    """Seconds an ideal CUSUM would need on this incident, with its inputs; None if not applicable.

    ``observations_per_second`` are the key's finished requests (errors, tail) or speculative
    rounds (acceptance) per second before the incident; ``decode_seconds`` (tail) how long each
    stall holds its record back; ``rounds_per_request`` (acceptance) makes the bound count
    effective rounds (the design effect of docs/EVALUATION.md).

    >>> b = information_bound("error_burst", 5.0, 10.0, 1e-3)
    >>> b["kl_per_observation"], b["observations"], b["seconds"]
    (0.00813, 2141.0, 214.1)
    """
    if kind not in BOUND_KINDS or intensity is None or observations_per_second <= 0:
        return None
    if kind == "error_burst":
        p0 = sim.ERROR_RATE + sim.TIMEOUT_RATE
        kl = bernoulli_kl(min(0.99, p0 * intensity), p0)
    elif kind == "latency_tail":
        p0 = _HEALTHY_TAIL_SHARE
        kl = bernoulli_kl((1.0 - _TAIL_SHARE) * p0 + _TAIL_SHARE, p0)
    else:
        kl = _acceptance_kl(bucket or "coding", intensity)
    arl = observations_per_second * 3600.0 / false_alarms_per_key_hour
    observations = math.log(arl) / kl
    out = {"kl_per_observation": round(kl, 5), "observations": round(observations, 1),
           "observations_per_second": round(observations_per_second, 3),
           "seconds": round(observations / observations_per_second, 1)}
    if kind == "acceptance_drop" and rounds_per_request is not None and rounds_per_request > 1.0:
        rho = within_request_correlation(bucket or "coding")
        design_effect = 1.0 + (rounds_per_request - 1.0) * rho
        out.update(seconds=round(observations * design_effect / observations_per_second, 1),
                   seconds_independent_rounds=out["seconds"], rounds_per_request=round(rounds_per_request, 1),
                   within_request_correlation=round(rho, 5), design_effect=round(design_effect, 3))
    if kind == "latency_tail" and decode_seconds:
        seconds = _tail_seconds(math.log(arl), observations_per_second, intensity, decode_seconds)
        out.update(seconds=round(seconds, 1), records_held_back=True,
                   median_decode_s=round(sorted(decode_seconds)[len(decode_seconds) // 2], 2))
    return out
