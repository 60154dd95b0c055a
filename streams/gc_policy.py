"""How often CPython's cyclic garbage collector runs in a specwatch process.

Stage 2 keeps each key's last slices for its windows, so a fleet of many keys keeps many
objects. CPython runs a full collection, a walk over every object the process keeps,
whenever the objects that outlived two young collections have grown by a quarter; with
the default young threshold (700 allocations) the partials of a slice being folded
outlive them, and at 10,000 keys those walks cost about as much as the work itself
(`specwatch bench --section keys`: ``pipeline_default_collector``). A young threshold of
100,000 lets most of a slice's short-lived objects go by reference counting before a
collection sees them. Cycles are still collected, only later.
"""

from __future__ import annotations

import gc

__all__ = ["STREAM_THRESHOLDS", "tune_collector"]

STREAM_THRESHOLDS = (100_000, 10, 10)


def tune_collector(thresholds: tuple[int, int, int] = STREAM_THRESHOLDS) -> tuple[int, int, int]:
    """Set the collector's thresholds for a stream-processing process; returns the ones replaced."""
    before = gc.get_threshold()
    gc.set_threshold(*thresholds)
    return before
