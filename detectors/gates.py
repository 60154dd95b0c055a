"""Gates: threshold tests with consecutive-window counters, and a drift detector on ratios.

Each follows river's protocol: ``update(x)`` then read ``drift_detected``; settings are
stored under their own names and derived state is built in ``_reset()``.
"""

from __future__ import annotations

import math

from river.drift import ADWIN

__all__ = ["ConsecutiveGate", "DropDetector"]


class ConsecutiveGate:
    """Fires when a breach persists for ``consecutive`` evaluated windows.

    ``update(None)`` (not enough data to judge) neither extends nor breaks a streak.
    A breach that persists fires again every ``consecutive`` windows, so the action
    policy can escalate (lower D, then disable) and ignore repeats it has acted on.

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

    def rearm(self) -> None:
        """Start counting afresh (after an action changed what is being measured)."""
        self._reset()


class DropDetector:
    """ADWIN on a ratio to its baseline (1.0 = as learned); flags downward changes only.

    river's ADWIN keeps an adaptive window and signals when two sub-windows differ
    significantly; this wrapper only reports it when the recent level is also below
    ``1 - min_drop``, so upward drift (a drafter getting better) never fires.

    Parameters
    ----------
    min_drop
        Smallest relative drop worth reporting.
    delta
        ADWIN confidence; smaller means fewer false alarms and slower detection.
    clock
        Check for change every ``clock`` values. Window aggregates arrive once per
        slice, so checking every value costs little and saves tens of seconds.

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
        self._adwin = ADWIN(delta=self.delta, clock=self.clock)
        self._recent: list[float] = []
        self.drift_detected = False

    def update(self, x: float) -> None:
        self.drift_detected = False
        if math.isnan(x):
            return
        self._adwin.update(x)
        self._recent.append(x)
        if len(self._recent) > 5:
            del self._recent[0]
        if self._adwin.drift_detected:
            recent = sum(self._recent) / len(self._recent)
            if recent < 1.0 - self.min_drop:
                self.drift_detected = True

    def rearm(self) -> None:
        self._reset()
