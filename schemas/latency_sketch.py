"""Mergeable latency quantile sketch (fastdigest's t-digest) for TTFT/TPOT/e2e percentiles,
wrapped so the choice can change."""

from __future__ import annotations

import itertools
import math
from typing import Iterable, Sequence

import numpy as np
from fastdigest import TDigest

__all__ = ["LatencySketch", "quantiles_of"]

# 100 centroids keep p99 error well under 1% and a serialized sketch under ~2 KB,
# which bounds per-key state (many keys x many slices) in stream processor tables.
_DEFAULT_MAX_CENTROIDS = 100


class LatencySketch:
    """Quantiles of a stream of non-negative durations, mergeable across partials.

    Parameters
    ----------
    max_centroids
        Compression of the underlying t-digest.

    >>> s = LatencySketch()
    >>> for ms in (10.0, 20.0, 30.0, 40.0): s.add(ms)
    >>> s.count, round(s.quantile(0.5), 1)
    (4, 25.0)
    >>> t = LatencySketch(); t.add(1000.0); s.merge(t); s.count
    5
    >>> math.isnan(LatencySketch().quantile(0.99))
    True
    """

    __slots__ = ("_digest", "_pending", "max_centroids")

    def __init__(self, max_centroids: int = _DEFAULT_MAX_CENTROIDS) -> None:
        if max_centroids < 10:
            raise ValueError(f"max_centroids must be >= 10 for usable tails, got {max_centroids}")
        self.max_centroids = max_centroids
        self._digest: TDigest | None = None
        # values are buffered and folded in batches: batch_update is several times
        # cheaper per value than update
        self._pending: list[float] = []

    def add(self, value: float) -> None:
        self._pending.append(value)
        if len(self._pending) >= 256:
            self._fold()

    def _fold(self) -> None:
        if not self._pending:
            return
        if self._digest is None:
            self._digest = TDigest.from_values(self._pending, max_centroids=self.max_centroids)
        else:
            self._digest.batch_update(self._pending)
        self._pending = []

    def merge(self, other: "LatencySketch") -> None:
        other._fold()
        if other._digest is None:
            return
        self._fold()
        if self._digest is None:
            self._digest = other._digest.copy()
        else:
            self._digest.merge_inplace(other._digest)

    @property
    def count(self) -> int:
        self._fold()
        return 0 if self._digest is None else int(self._digest.n_values)

    def quantile(self, q: float) -> float:
        """The q-quantile, or NaN when nothing was added."""
        return self.quantiles((q,))[0]

    def quantiles(self, qs: Iterable[float]) -> list[float]:
        """`quantile` of each of ``qs``, in one call (a summary reads three of every sketch).

        >>> s = LatencySketch()
        >>> for ms in (10.0, 20.0, 30.0, 40.0): s.add(ms)
        >>> [round(q, 1) for q in s.quantiles((0.5, 0.99))], LatencySketch().quantiles((0.5,))
        ([25.0, 39.7], [nan])
        """
        self._fold()
        if self._digest is None or self._digest.n_values == 0:
            return [math.nan for _ in qs]
        quantile = self._digest.quantile
        return [float(quantile(q)) for q in qs]

    def count_above(self, value: float) -> float:
        """About how many of the durations added exceed ``value`` (from the digest's CDF).

        >>> s = LatencySketch()
        >>> for ms in range(1, 301): s.add(float(ms))
        >>> round(s.count_above(290.0)), s.count_above(1000.0), LatencySketch().count_above(1.0)
        (10, 0.0, 0.0)
        """
        self._fold()
        if self._digest is None or self._digest.n_values == 0:
            return 0.0
        return float(self._digest.n_values) * (1.0 - float(self._digest.cdf(value)))

    def count_past(self, value: float) -> float:
        """How many of the durations added exceed ``value``, counted by centroid: exact while each
        value is its own centroid (`count_above` interpolates), off by one centroid's weight after.

        >>> s = LatencySketch()
        >>> for ms in (10.0, 11.0, 12.0, 40.0): s.add(ms)
        >>> s.count_past(30.0), s.count_past(40.0), round(s.count_above(30.0), 2)
        (1.0, 0.0, 0.48)
        """
        self._fold()
        if self._digest is None or value >= self._digest.max():
            return 0.0
        return float(sum(weight for mean, weight in self._digest.centroids if mean > value))

    def copy(self) -> "LatencySketch":
        out = LatencySketch(self.max_centroids)
        out.merge(self)
        return out

    def to_state(self) -> dict:
        """The sketch as plain data, values not yet folded included: folding them here would make
        later quantiles depend on when a checkpoint happened to be taken.

        >>> s = LatencySketch(); s.add(5.0); restored = LatencySketch.from_state(s.to_state())
        >>> restored.to_state() == s.to_state(), restored.count
        (True, 1)
        """
        return {"max_centroids": self.max_centroids, "pending": list(self._pending),
                "digest": self._digest.to_dict() if self._digest is not None else None}

    @classmethod
    def from_state(cls, state: dict) -> "LatencySketch":
        """A sketch from `to_state`; the digest through fastdigest's own dict form (numbers only)."""
        out = cls(int(state["max_centroids"]))
        out._pending = [float(v) for v in state["pending"]]
        digest = state["digest"]
        out._digest = TDigest.from_dict(digest) if digest is not None else None
        return out

    def to_bytes(self) -> bytes:
        self._fold()
        return b"" if self._digest is None else self._digest.to_bytes()

    @classmethod
    def from_bytes(cls, data: bytes, max_centroids: int = _DEFAULT_MAX_CENTROIDS) -> "LatencySketch":
        out = cls(max_centroids)
        if data:
            out._digest = TDigest.from_bytes(data)
        return out


def quantiles_of(sketches: Sequence[LatencySketch | None], qs: Sequence[float]) -> np.ndarray:
    """`LatencySketch.quantiles` of three quantiles ``qs`` of many sketches at once, one row per
    sketch (NaN for None or an empty sketch): the library's calls with the same arguments, so
    the same floats, in one pass with no call of this class's per sketch (that wrapper cost
    twice the library's three calls).

    The centroids read out as arrays for numpy (`TDigest.to_bytes` per sketch, then fastdigest's
    ``estimate_quantile`` across sketches) gave the same floats and took longer: copying them
    out and joining the copies cost more than the quantile calls they replace.

    >>> a, b = LatencySketch(), LatencySketch()
    >>> for ms in (10.0, 20.0, 30.0, 40.0): a.add(ms)
    >>> b.add(7.0)
    >>> values = quantiles_of([a, None, b, LatencySketch()], (0.5, 0.9, 0.99))
    >>> [[round(v, 1) for v in row] for row in values.tolist()]
    [[25.0, 37.0, 39.7], [nan, nan, nan], [7.0, 7.0, 7.0], [nan, nan, nan]]
    """
    first, second, third = (float(q) for q in qs)  # three, as a summary reads (unrolled: 2x a loop)
    none = (math.nan,) * 3
    try:
        # one pass: values a sketch still buffers are folded first (`_fold` returns None)
        values = [none if sketch is None or (sketch._pending and sketch._fold()) or (digest := sketch._digest) is None
                  else (digest.quantile(first), digest.quantile(second), digest.quantile(third))
                  for sketch in sketches]
    except ValueError:  # a digest with no centroids (never made by `add` or `merge`): as `quantiles` answers
        values = [none if sketch is None else sketch.quantiles((first, second, third)) for sketch in sketches]
    return np.fromiter(itertools.chain.from_iterable(values), dtype=np.float64,
                       count=len(values) * 3).reshape(len(values), 3)
