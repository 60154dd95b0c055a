"""The two acceptance-rate detectors operators run today, as pure detectors to compare against:
an engine's kill switch and a Prometheus alert on vLLM's counters (docs/EVALUATION.md)."""

from __future__ import annotations

import math
from collections import deque

__all__ = ["AcceptanceKillSwitch", "PrometheusRatioAlert"]

# A Prometheus range vector needs two samples before rate() has a value.
_MIN_SAMPLES_FOR_RATE = 2


class AcceptanceKillSwitch:
    """TensorRT-LLM's switch in one engine: disables speculation for good once the mean batch
    acceptance rate of the last ``window`` speculation-enabled iterations falls below ``threshold``.

    Parameters
    ----------
    window
        Iterations in the rolling mean (``acceptance_rate_window_size``).
    threshold
        Mean acceptance rate in [0, 1] below which speculation is disabled
        (``acceptance_rate_threshold``).

    >>> import random
    >>> rng = random.Random(3)
    >>> switch = AcceptanceKillSwitch(window=50, threshold=0.5)
    >>> tripped = []
    >>> for step in range(400):
    ...     p = 0.62 if step < 200 else 0.35
    ...     drafted = 64
    ...     accepted = sum(rng.random() < p for _ in range(drafted))
    ...     switch.update(accepted, drafted)
    ...     if switch.drift_detected:
    ...         tripped.append(step)
    >>> tripped, switch.disabled
    ([222], True)
    >>> switch.update(60, 64); switch.drift_detected  # permanent: never trips twice
    False
    >>> AcceptanceKillSwitch(window=0, threshold=0.5)
    Traceback (most recent call last):
    ...
    ValueError: window must be a positive number of iterations, got 0
    """

    def __init__(self, window: int, threshold: float) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be a positive number of iterations, got {window!r}")
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"threshold is an acceptance rate and must be in [0, 1], got {threshold!r}")
        self.window = window
        self.threshold = threshold
        self._reset()

    def _reset(self) -> None:
        self._rates: deque[float] = deque(maxlen=self.window)
        self._sum = 0.0
        self.disabled = False
        self.drift_detected = False

    @property
    def warm(self) -> bool:
        """Whether the window is full, so that the switch can trip."""
        return len(self._rates) == self.window

    @property
    def rolling_rate(self) -> float:
        """Mean acceptance rate of the iterations in the window; NaN before the first."""
        return self._sum / len(self._rates) if self._rates else math.nan

    def update(self, accepted: int, drafted: int) -> None:
        """Fold one engine iteration's accepted and drafted token counts (batch totals)."""
        self.drift_detected = False
        if self.disabled or drafted <= 0:
            return  # iterations without drafts are not speculation-enabled: they do not count
        if len(self._rates) == self.window:
            self._sum -= self._rates[0]
        rate = accepted / drafted
        self._rates.append(rate)
        self._sum += rate
        if len(self._rates) == self.window and self._sum / self.window < self.threshold:
            self.disabled = True
            self.drift_detected = True


class PrometheusRatioAlert:
    """A Prometheus alerting rule on the ratio of vLLM's accepted and draft token counter rates,
    all instances summed, evaluated after each scrape (docs/EVALUATION.md, "The baselines").

    Parameters
    ----------
    threshold
        Acceptance rate (accepted / drafted tokens) below which the expression is true.
    range_seconds
        The range of ``rate(...[range])``.
    for_seconds
        How long the expression must stay true before the alert fires.
    interval_seconds
        Scrape and rule-evaluation interval.

    >>> alert = PrometheusRatioAlert(threshold=0.5, range_seconds=60, for_seconds=30, interval_seconds=10)
    >>> fired = []
    >>> for second in range(300):
    ...     accepted = 60 if second < 100 else 35   # tokens accepted per second, of 100 drafted
    ...     alert.update(float(second), accepted, 100)
    ...     if alert.drift_detected:
    ...         fired.append((second, round(alert.ratio, 3)))
    >>> fired, alert.firing
    ([(160, 0.35)], True)
    """

    def __init__(self, threshold: float, range_seconds: float = 300.0, for_seconds: float = 120.0,
                 interval_seconds: float = 15.0) -> None:
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"threshold is an acceptance rate and must be in [0, 1], got {threshold!r}")
        if not interval_seconds > 0:
            raise ValueError(f"interval_seconds must be positive, got {interval_seconds!r}")
        if not range_seconds >= interval_seconds:
            raise ValueError(f"range_seconds ({range_seconds!r}) must cover at least one scrape interval "
                             f"({interval_seconds!r}), or rate() never has two samples")
        if not for_seconds >= 0:
            raise ValueError(f"for_seconds must be >= 0, got {for_seconds!r}")
        self.threshold = threshold
        self.range_seconds = range_seconds
        self.for_seconds = for_seconds
        self.interval_seconds = interval_seconds
        self._reset()

    def _reset(self) -> None:
        self._accepted = 0
        self._drafted = 0
        self._samples: deque[tuple[float, int, int]] = deque()
        self._next_scrape: float | None = None
        self.active_since: float | None = None
        self.firing = False
        self.fired_at: float | None = None
        self.drift_detected = False
        self.ratio = math.nan
        self.evaluations = 0

    def update(self, ts: float, accepted: int, drafted: int) -> None:
        """Count one engine step's accepted and drafted tokens at event time ``ts``.

        Scrapes (and evaluations) due before ``ts`` happen first, so a step is counted
        by the first scrape after it, as a real counter would be.
        """
        self.drift_detected = False
        if self._next_scrape is None:
            self._next_scrape = math.floor(ts / self.interval_seconds) * self.interval_seconds
        while self._next_scrape <= ts:
            self._scrape(self._next_scrape)
            self._next_scrape += self.interval_seconds
        self._accepted += accepted
        self._drafted += drafted

    def _scrape(self, now: float) -> None:
        self.evaluations += 1
        samples = self._samples
        samples.append((now, self._accepted, self._drafted))
        while samples[0][0] < now - self.range_seconds:
            samples.popleft()
        self.ratio = math.nan
        if len(samples) >= _MIN_SAMPLES_FOR_RATE:
            drafted = samples[-1][2] - samples[0][2]
            if drafted > 0:
                self.ratio = (samples[-1][1] - samples[0][1]) / drafted
        # A NaN ratio (no drafts in range) makes the comparison false: no result, no alert.
        if self.ratio < self.threshold:
            if self.active_since is None:
                self.active_since = now
            if not self.firing and now - self.active_since >= self.for_seconds:
                self.firing = True
                self.fired_at = now
                self.drift_detected = True
        else:
            self.active_since = None
            self.firing = False
