"""The information bound of each incident: how fast any detector with specwatch's false-alarm rate could be.

A CUSUM that knows both the before and after distributions needs about ln(ARL) / KL
observations to decide, where ARL is the number of in-control observations between false
alarms and KL the divergence per observation (Lorden 1971). Each bound here is computed from
the scenario's known parameters (the simulator's rates, not what a run happened to draw) and
the key's observed traffic, so delays can be read against it.
"""

from __future__ import annotations

import math

from specwatch.simulation import simulator as sim

__all__ = ["bernoulli_kl", "information_bound", "BOUND_KINDS"]

# Incident kinds whose evidence accumulates over requests or rounds. The others are decided
# by one record or one slice (a card, a strict mismatch, KV past the watermark, the draft
# time of every step), which no bound in observations improves on.
BOUND_KINDS = ("error_burst", "latency_tail", "acceptance_drop")
# The tail scenario slows this share of its cohort's requests; each of them passes the
# latency limit (2x the baseline p99 of TPOT) at every intensity the suite runs (>= 3).
_TAIL_SHARE = 0.10
# The share of requests past the limit in healthy traffic a test can assume at best.
_HEALTHY_TAIL_SHARE = 0.005


def bernoulli_kl(p1: float, p0: float) -> float:
    """KL(Bernoulli(p1) || Bernoulli(p0)) in nats.

    >>> round(bernoulli_kl(0.01, 0.002), 5)
    0.00813
    """
    return p1 * math.log(p1 / p0) + (1.0 - p1) * math.log((1.0 - p1) / (1.0 - p0))


def _round_pmf(position_acceptance: float, draft_length: int, decay: float) -> list[float]:
    cdf = sim._accepted_cdf(position_acceptance, draft_length, decay)
    pmf, previous = [], 0.0
    for value in cdf + [1.0]:
        pmf.append(max(0.0, value - previous))
        previous = value
    return pmf


def _acceptance_kl(bucket: str, drop: float, draft_length: int = 4) -> float:
    """KL per round between the bucket's accepted-count distributions after and before the drop."""
    profile = next(b for b in sim.BUCKETS if b.name == bucket)
    scale = sim._scale_for_acceptance_length(profile, draft_length, 1.0 - drop)
    total = 0.0
    for level in sim._DIFFICULTY_LEVELS:  # requests are spread evenly over difficulty levels
        p = min(0.99, profile.position_acceptance * level)
        before = _round_pmf(p, draft_length, profile.acceptance_decay)
        after = _round_pmf(min(0.99, p * scale), draft_length, profile.acceptance_decay)
        total += sum(a * math.log(a / b) for a, b in zip(after, before) if a > 0 and b > 0)
    return total / len(sim._DIFFICULTY_LEVELS)


def information_bound(kind: str, intensity: float | None, observations_per_second: float,
                      false_alarms_per_key_hour: float, bucket: str | None = None) -> dict | None:
    """Seconds an ideal CUSUM would need on this incident, with its inputs; None if not applicable.

    ``observations_per_second`` is the incident key's finished requests per second (errors,
    tail) or speculative rounds per second (acceptance), measured before the incident.

    >>> b = information_bound("error_burst", 5.0, 10.0, 1e-3)
    >>> b["kl_per_observation"], b["observations"], b["seconds"]
    (0.00813, 2141.0, 214.1)
    """
    if kind not in BOUND_KINDS or intensity is None or observations_per_second <= 0:
        return None
    if kind == "error_burst":
        p0 = sim._ERROR_RATE + sim._TIMEOUT_RATE
        kl = bernoulli_kl(min(0.99, p0 * intensity), p0)
    elif kind == "latency_tail":
        kl = bernoulli_kl(_HEALTHY_TAIL_SHARE + _TAIL_SHARE, _HEALTHY_TAIL_SHARE)
    else:
        kl = _acceptance_kl(bucket or "coding", intensity)
    arl = observations_per_second * 3600.0 / false_alarms_per_key_hour
    observations = math.log(arl) / kl
    return {"kl_per_observation": round(kl, 5), "observations": round(observations, 1),
            "observations_per_second": round(observations_per_second, 3),
            "seconds": round(observations / observations_per_second, 1)}
