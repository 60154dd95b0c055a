"""How often CPython's cyclic garbage collector runs in a specwatch process."""

from __future__ import annotations

import gc

__all__ = ["STREAM_THRESHOLDS", "tune_collector"]

STREAM_THRESHOLDS = (100_000, 10, 10)


def tune_collector(thresholds: tuple[int, int, int] = STREAM_THRESHOLDS) -> tuple[int, int, int]:
    """Set the collector's thresholds for a stream-processing process; returns the ones replaced."""
    before = gc.get_threshold()
    gc.set_threshold(*thresholds)
    return before
