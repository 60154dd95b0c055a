"""Gates: threshold tests with consecutive-window counters, sequential tests, and a drift detector,
each with river's protocol: ``update(x)`` then read ``drift_detected``."""

from __future__ import annotations

import math

# ADWIN's core: `river.drift` would also import scipy, which a replay pays for at start-up
from river._river_rust.drift import AdaptiveWindowing

__all__ = ["BernoulliCusum", "ConsecutiveGate", "DropDetector", "cusum_threshold"]


class ConsecutiveGate:
    """Fires when a breach persists for ``consecutive`` evaluated windows, and again every
    ``consecutive`` windows it lasts; ``update(None)`` (too little data) leaves a streak as it is.

    Parameters
    ----------
    consecutive
        Windows in a row that must breach.

    >>> gate = ConsecutiveGate(consecutive=3)
    >>> fired = []
    >>> for i, breach in enumerate([True, True, None, False, True, True, True, True, True, True]):
    ...     gate.update(breach)
    ...     if gate.drift_detected:
    ...         fired.append(i)
    >>> fired
    [6, 9]
    """

    def __init__(self, consecutive: int = 3) -> None:
        if consecutive < 1:
            raise ValueError(f"consecutive must be >= 1, got {consecutive}")
        self.consecutive = consecutive
        self._reset()

    def _reset(self) -> None:
        self.streak = 0
        self.drift_detected = False

    def update(self, breach: bool | None) -> None:
        self.drift_detected = False
        if breach is None:
            return
        if not breach:
            self.streak = 0
            return
        self.streak += 1
        self.drift_detected = self.streak % self.consecutive == 0


def cusum_threshold(observations_per_hour: float, false_alarms_per_hour: float) -> float:
    """Decision threshold of a CUSUM on log-likelihood ratios, from a false-alarm budget: it runs
    at least ``e**h`` in-control observations between false alarms (Lorden 1971).

    >>> round(cusum_threshold(3600.0, 1e-3), 2)
    15.1
    >>> cusum_threshold(0.0, 1e-3) == cusum_threshold(1.0, 1e-3)
    True
    """
    return math.log(max(1.0, observations_per_hour) / false_alarms_per_hour)


class BernoulliCusum:
    """CUSUM for a rise in a rate, fed ``update(trials, hits)`` (``hits`` may be fractional).

    It sums each trial's log-likelihood ratio of ``p1`` against ``p0``, floored at zero, and
    fires at ``threshold``; ``statistic``, ``trials`` and ``hits`` then hold the evidence.

    Parameters
    ----------
    p0
        In-control rate (the baseline).
    p1
        Out-of-control rate the test is tuned to; must exceed ``p0``.
    threshold
        Evidence needed, in nats (see `cusum_threshold`).
    min_hits
        And at least this many hits since the statistic last stood at zero.

    >>> import random
    >>> rng = random.Random(4)
    >>> cusum = BernoulliCusum(p0=0.002, p1=0.01, threshold=10.0)
    >>> fired = []
    >>> for t in range(400):
    ...     rate = 0.002 if t < 200 else 0.04
    ...     cusum.update(20, sum(rng.random() < rate for _ in range(20)))
    ...     if cusum.drift_detected and not fired:
    ...         fired.append((t, cusum.trials, cusum.hits))
    >>> fired
    [(216, 280, 8.0)]
    """

    def __init__(self, p0: float, p1: float, threshold: float, min_hits: float = 1.0) -> None:
        if threshold <= 0:
            raise ValueError(f"threshold must be > 0, got {threshold}")
        self.p0 = self.p1 = math.nan  # set by retune, with their log-likelihood ratios
        self.retune(p0, p1)
        self.threshold = threshold
        self.min_hits = min_hits
        self._reset()

    def _reset(self) -> None:
        self.statistic = 0.0
        self.trials = 0  # since the statistic last stood at zero: the evidence a finding cites
        self.hits = 0.0
        self.started_at = math.nan  # event time of the first update since then
        self.drift_detected = False

    def update(self, trials: int, hits: float, at: float = math.nan) -> None:
        if self.drift_detected:  # a firing starts the next round of evidence from zero
            self.statistic, self.trials, self.hits = 0.0, 0, 0.0
        self.drift_detected = False
        if trials <= 0:
            return
        hits = min(float(trials), max(0.0, hits))
        self.statistic += hits * self._hit_llr + (trials - hits) * self._miss_llr
        if self.statistic <= 0.0:
            self.statistic, self.trials, self.hits = 0.0, 0, 0.0
            return
        if not self.trials:
            self.started_at = at
        self.trials += trials
        self.hits += hits
        self.drift_detected = self.statistic >= self.threshold and self.hits >= self.min_hits

    def retune(self, p0: float, p1: float) -> None:
        """Judge the next trials against a new baseline and alternative, keeping the evidence so far.

        >>> cusum = BernoulliCusum(p0=0.01, p1=0.04, threshold=10.0)
        >>> cusum.update(100, 4.0); round(cusum.statistic, 2)
        2.59
        >>> cusum.retune(0.04, 0.16); cusum.update(100, 4.0); round(cusum.statistic, 2)
        0.0
        """
        if not 0 < p0 < p1 < 1:
            raise ValueError(f"need 0 < p0 < p1 < 1, got p0={p0}, p1={p1}")
        if (p0, p1) == (self.p0, self.p1):
            return
        self.p0, self.p1 = p0, p1
        self._hit_llr = math.log(p1 / p0)
        self._miss_llr = math.log((1.0 - p1) / (1.0 - p0))


# river.drift.ADWIN's defaults for what DropDetector does not set
_ADWIN_MAX_BUCKETS = 5
_ADWIN_MIN_WINDOW = 5
_ADWIN_GRACE_PERIOD = 10


class DropDetector:
    """ADWIN on a ratio to its baseline (1.0 = as learned); reports a change only when the
    recent level is also below ``1 - min_drop``, so a drafter getting better never fires.

    Parameters
    ----------
    min_drop
        Smallest relative drop worth reporting.
    delta
        ADWIN confidence; smaller means fewer false alarms and slower detection.
    clock
        Check for change every ``clock`` values.

    >>> import random
    >>> rng = random.Random(7)
    >>> detector = DropDetector(min_drop=0.15)
    >>> hits = []
    >>> for t in range(400):
    ...     level = 1.0 if t < 200 else 0.6
    ...     detector.update(level + rng.gauss(0, 0.03))
    ...     if detector.drift_detected:
    ...         hits.append(t)
    >>> hits[:1]
    [227]
    """

    def __init__(self, min_drop: float = 0.15, delta: float = 0.002, clock: int = 1) -> None:
        if not 0 < min_drop < 1:
            raise ValueError(f"min_drop must be in (0, 1), got {min_drop}")
        self.min_drop = min_drop
        self.delta = delta
        self.clock = clock
        self._reset()

    def _reset(self) -> None:
        self._restart_window()
        self._recent: list[float] = []
        self.drift_detected = False

    def _restart_window(self) -> None:
        self._window = AdaptiveWindowing(delta=self.delta, clock=self.clock, max_buckets=_ADWIN_MAX_BUCKETS,
                                         min_window_length=_ADWIN_MIN_WINDOW, grace_period=_ADWIN_GRACE_PERIOD)
        self._window_changed = False

    def update(self, x: float) -> None:
        self.drift_detected = False
        if math.isnan(x):
            return
        if self._window_changed:
            self._restart_window()
        self._window_changed = self._window.update(x)
        self._recent.append(x)
        if len(self._recent) > 5:
            del self._recent[0]
        if self._window_changed:
            self.drift_detected = sum(self._recent) / len(self._recent) < 1.0 - self.min_drop
