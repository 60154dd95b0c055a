"""Mergeable latency quantile sketch (fastdigest's t-digest) for TTFT/TPOT/e2e percentiles,
wrapped so the choice can change."""

from __future__ import annotations

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


# fastdigest's binary form (`TDigest.to_bytes`, format version 1): an 80-byte header (magic,
# version, centroid count, max size, then mass, sum, min and max as float64 and the value count
# as u128, each at a byte offset below), then each centroid's mean and weight as float64.
_HEADER = b"FASTDIG~" + (1).to_bytes(4, "little")
_HEADER_BYTES = 80
_MASS_AT, _COUNT_AT = 28, 60


def quantiles_of(sketches: Sequence[LatencySketch | None], qs: Sequence[float]) -> np.ndarray:
    """`LatencySketch.quantiles` of many sketches at once, one row per sketch (NaN for None or an
    empty sketch): each value the one the sketch's own call gives, to the bit.

    One call per sketch copies its centroids out (`TDigest.to_bytes`); the quantiles are then
    fastdigest's ``estimate_quantile`` (what ``TDigest.quantile`` runs) on arrays across
    sketches, with its float operations in its order. Weights are whole numbers (every value is
    added with weight 1, merges add weights), so running sums across sketches are exact and equal
    its sums sketch by sketch; anything else (another binary format, fractional or huge weights)
    is read sketch by sketch.

    >>> a, b = LatencySketch(), LatencySketch()
    >>> for ms in (10.0, 20.0, 30.0, 40.0): a.add(ms)
    >>> b.add(7.0)
    >>> [[round(v, 1) for v in row] for row in quantiles_of([a, None, b], (0.5, 0.99)).tolist()]
    [[25.0, 39.7], [nan, nan], [7.0, 7.0]]
    >>> quantiles_of([a, b], (0.5, 0.99)).tolist() == [a.quantiles((0.5, 0.99)), b.quantiles((0.5, 0.99))]
    True
    """
    qs = np.array(qs, dtype=np.float64)
    out = np.full((len(sketches), len(qs)), math.nan)
    # One pass over the sketches (a single comprehension measured cheaper than a C-level pass
    # per step): values a sketch still buffers are folded first (`_fold` returns None), then
    # its centroids are copied out.
    blobs = [b"" if sketch is None or (sketch._pending and sketch._fold()) or sketch._digest is None
             else sketch._digest.to_bytes() for sketch in sketches]
    sizes = np.fromiter(map(len, blobs), dtype=np.int64, count=len(blobs))
    joined = b"".join(blobs)
    rows = np.flatnonzero(sizes)
    if not len(rows):
        return out
    starts = (np.cumsum(sizes) - sizes)[rows]
    centroids = (sizes[rows] - _HEADER_BYTES) // 16
    data = np.frombuffer(joined, dtype=np.uint8)
    if not (data[starts[:, None] + np.arange(len(_HEADER))] == np.frombuffer(_HEADER, dtype=np.uint8)).all():
        return _each(sketches, qs, out)
    # mass and count sit 4 bytes off the 8-byte bounds the blobs start on: read through views
    # that start 4 bytes in
    shifted = (len(joined) - 4) // 8
    mass = np.frombuffer(joined, dtype="<f8", offset=4, count=shifted)[(starts + _MASS_AT - 4) // 8]
    count = np.frombuffer(joined, dtype="<u8", offset=4, count=shifted)
    counted = (count[(starts + _COUNT_AT - 4) // 8] | count[(starts + _COUNT_AT + 4) // 8]) != 0
    # `quantiles` answers NaN for a sketch that holds no values; the library raises for one with
    # values and no centroids (which `add` and `merge` never make): that is asked sketch by sketch.
    if (counted & (centroids == 0)).any():
        return _each(sketches, qs, out)
    if not counted.all():
        rows, starts, centroids, mass = rows[counted], starts[counted], centroids[counted], mass[counted]
        if not len(rows):
            return out
    first = np.cumsum(centroids) - centroids  # each sketch's first centroid among all of them
    last = first + centroids - 1
    sketch_of = np.repeat(np.arange(len(rows)), centroids)
    at = (starts + _HEADER_BYTES)[sketch_of] // 8 + 2 * (np.arange(len(sketch_of)) - first[sketch_of])
    floats = data.view("<f8")  # every blob is 80 + 16 n bytes: centroids sit on 8-byte bounds
    means, weights = floats[at], floats[at + 1]
    running = np.cumsum(weights)
    if not (weights == np.floor(weights)).all() or running[-1] >= 2.0 ** 53:
        return _each(sketches, qs, out)
    before = running - weights - np.concatenate(([0.0], running))[first][sketch_of]  # weight of the centroids before
    with np.errstate(divide="ignore", invalid="ignore"):
        # the right edge of each centroid's cumulative weight, as estimate_quantile's loop
        # computes it (NaN for a sketch of one value, whose quantiles are that value)
        right = (2.0 * before + weights - 1.0) / 2.0 / (mass[sketch_of] - 1.0)
        # the loop stops at the first centroid whose right edge reaches q; the edges rise within
        # a sketch, so its position is how many of them stay below q
        position = np.add.reduceat((~(right[:, None] >= qs)).astype(np.int64), first, axis=0)
        sizes = centroids[:, None]
        inside = (position > 0) & (position < sizes)
        at_right = np.where(inside, first[:, None] + position, first[:, None])
        left_edge = right[at_right - 1]
        fraction = (qs - left_edge) / (right[at_right] - left_edge)
        between = means[at_right - 1] * (1.0 - fraction) + means[at_right] * fraction
    ends = np.where((position == 0) | (sizes == 1), means[first][:, None], means[last][:, None])
    out[rows] = np.where(inside & (sizes > 1), between, ends)
    return out


def _each(sketches: Sequence[LatencySketch | None], qs: np.ndarray, out: np.ndarray) -> np.ndarray:
    """`quantiles_of` sketch by sketch, through the library's own calls."""
    for row, sketch in enumerate(sketches):
        if sketch is not None:
            out[row] = sketch.quantiles(qs.tolist())
    return out
