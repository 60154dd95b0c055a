"""What a disabled scope showed while speculation was off, for or against a restore: its keys'
requests pooled, or its bundle's engine steps (`RecoveryEvidence`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .rate_tests import error_rate_limit
from specwatch.schemas.slice_stats import merge_all, round_evidence as _round

__all__ = ["RecoveryEvidence", "traffic_evidence"]

@dataclass(frozen=True)
class RecoveryEvidence:
    """What one scope showed while speculation was off, for or against a restore: its keys'
    requests (``kind`` ``"traffic"``) or its bundle's engine steps (``"kv"``)."""

    kind: str
    window_start: float
    window_end: float
    requests: int = 0
    speculative_requests: int = 0
    error_rate: float = math.nan
    error_limit: float = math.nan
    kv_peak: float = math.nan
    kv_limit: float = math.nan

    def problems(self, min_requests: int) -> list[str]:
        """Why this evidence does not clear a restore; empty when it does.

        >>> RecoveryEvidence("traffic", 0.0, 60.0, requests=400, error_rate=0.002, error_limit=0.02).problems(100)
        []
        >>> RecoveryEvidence("traffic", 0.0, 60.0, requests=400, error_rate=0.05, error_limit=0.02).problems(100)
        ['error_rate 0.05 > 0.02']
        >>> RecoveryEvidence("traffic", 0.0, 60.0, requests=30, speculative_requests=2).problems(100)
        ['requests 30 < 100', 'speculative_requests 2 > 0']
        >>> RecoveryEvidence("kv", 0.0, 60.0, kv_peak=0.97, kv_limit=0.92).problems(100)
        ['kv_peak 0.97 > 0.92']
        """
        if self.kind == "kv":
            return [f"kv_peak {self.kv_peak:.4g} > {self.kv_limit:.4g}"] if not self.kv_peak <= self.kv_limit else []
        out = []
        if self.requests < min_requests:
            out.append(f"requests {self.requests} < {min_requests}")
        if self.speculative_requests:  # the switch is not honoured yet
            out.append(f"speculative_requests {self.speculative_requests} > 0")
        if self.error_rate > self.error_limit:
            out.append(f"error_rate {self.error_rate:.4g} > {self.error_limit:.4g}")
        return out

    def evidence(self) -> dict:
        return {k: _round(v) for k, v in self.__dict__.items()}


def traffic_evidence(monitors: list, since: float, seconds: float) -> RecoveryEvidence | None:
    """The requests of several keys (their `KeyMonitor`s, one scope) in their last ``seconds`` after ``since``, pooled;
    the error limit is the error gate's, from the request-weighted baseline error rate."""
    parts = []
    weighted, weight = 0.0, 0
    for monitor in monitors:
        found = monitor.since(since, seconds)
        if found is None:
            continue
        parts.append(found)
        base = monitor.baseline.error_rate
        if not math.isnan(base) and found[0].requests:
            weighted += base * found[0].requests
            weight += found[0].requests
    if not parts:
        return None
    window = merge_all(p[0] for p in parts)
    limit = error_rate_limit(monitors[0].policy.errors, weighted / weight if weight else math.nan)
    return RecoveryEvidence("traffic", min(p[1] for p in parts), max(p[2] for p in parts),
                            requests=window.requests, speculative_requests=window.speculative_requests,
                            error_rate=window.error_rate, error_limit=limit)
