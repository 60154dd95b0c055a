"""`specwatch bench`: throughput and overhead of every path, each beside an alternative measured in the same run."""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any, Callable, TypeVar

__all__ = ["SECTIONS", "alternated", "percentile", "timed"]

# Every section of the bench, in the order a full run takes them.
SECTIONS = ("stream", "kafka", "collector", "export", "engine", "archive", "replay", "startup", "growth", "keys",
            "metrics", "gateway")

_T = TypeVar("_T")
_AS_IS = "as is"


def timed(fn: Callable[[], Any], thresholds: tuple[int, int, int] | None | str = _AS_IS,
          clock: Callable[[], float] = time.process_time) -> tuple[float, Any]:
    """Seconds of ``fn()`` on ``clock`` (CPU by default) after a full collection, and its result;
    ``thresholds`` set the cyclic collector for the call (None switches it off)."""
    gc.collect()
    before = gc.get_threshold()
    if thresholds is None:
        gc.disable()
    elif thresholds != _AS_IS:
        gc.set_threshold(*thresholds)
    try:
        start = clock()
        result = fn()
        return max(clock() - start, 1e-9), result
    finally:
        gc.enable()
        gc.set_threshold(*before)


def percentile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile, linear between the two nearest ranks; None without values.

    >>> percentile([1.0, 2.0, 3.0, 4.0], 0.5), percentile([5.0], 0.99), percentile([], 0.5)
    (2.5, 5.0, None)
    """
    if len(values) < 2:
        return values[0] if values else None
    return statistics.quantiles(values, n=1000, method="inclusive")[round(q * 1000) - 1]


def alternated(runs: dict[str, Callable[[], _T]], turns: int) -> dict[str, list[_T]]:
    """Every run ``turns`` times, in reverse order on odd turns, so that load falls on all alike."""
    out: dict[str, list[_T]] = {name: [] for name in runs}
    for turn in range(turns):
        for name in (list(runs) if turn % 2 == 0 else list(runs)[::-1]):
            out[name].append(runs[name]())
    return out
