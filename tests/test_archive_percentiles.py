"""The window columns' latency percentiles read for all keys at once: the same floats, the same
sketch state after, the same archived rows and types as reading them sketch by sketch."""

from __future__ import annotations

import math
import random

import clickhouse_connect
import numpy as np
import pyarrow as pa
import pytest
from fastdigest import TDigest

from specwatch.archive.columns import WINDOW_STATS_FIELDS
from specwatch.archive.rows import window_columns_table
from specwatch.archive.store import Archive
from specwatch.schemas.latency_sketch import LatencySketch, quantiles_of
from specwatch.schemas.slice_stats import window_columns
from specwatch.schemas.outputs import WINDOW_SUMMARY_FIELDS
from specwatch.lab.simulation.simulator import Simulator

from telemetry_log import replayed

_SUMMARY = (0.5, 0.95, 0.99)
_PERCENTILES = WINDOW_SUMMARY_FIELDS[-9:]


def _seeded_sketches(count: int, seed: int) -> list[LatencySketch | None]:
    """Sketches of every shape a slice can hold: none, empty, one value, a few, more than their
    centroids (compressed), values still buffered, repeated values, merges of such."""
    rng = random.Random(seed)

    def one() -> LatencySketch:
        sketch = LatencySketch(rng.choice((10, 20, 100)))
        for _ in range(rng.choice((0, 1, 2, 3, 7, 100, 255, 256, 257, 900))):
            sketch.add(rng.choice((rng.expovariate(0.01), float(rng.randint(1, 3)), rng.lognormvariate(3.0, 2.0))))
        if rng.random() < 0.3:
            sketch.merge(one() if rng.random() < 0.7 else LatencySketch())
        return sketch

    return [None if rng.random() < 0.1 else one() for _ in range(count)]


def _bits(values: np.ndarray) -> bytes:
    return np.ascontiguousarray(values, dtype=np.float64).tobytes()


@pytest.mark.parametrize("qs", [_SUMMARY, (0.0, 0.01, 1.0)])
def test_all_at_once_gives_each_sketchs_own_quantiles_to_the_bit(qs):
    sketches = _seeded_sketches(2000, seed=11)
    # the seeded set holds every shape the reader has to get right
    held = [s for s in sketches if s is not None]
    assert sum(s is None for s in sketches) > 100 and sum(bool(s._pending) for s in held) > 1000  # not folded yet
    states = [None if s is None else s.to_state() for s in sketches]
    # (a copy folds what its original buffered: copies of the states, each folded as it is read)
    centroids = [len(LatencySketch.from_state(state).copy()._digest or ()) for state in states if state is not None]
    assert centroids.count(0) > 100 and centroids.count(1) > 100 and centroids.count(2) > 100  # empty, one, two
    assert sum(n >= s.max_centroids - 2 for n, s in zip(centroids, held)) > 500  # compressed
    by_each, at_once = ([None if state is None else LatencySketch.from_state(state) for state in states]
                        for _ in range(2))
    expected = np.array([[math.nan] * 3 if s is None else s.quantiles(qs) for s in by_each])
    values = quantiles_of(at_once, qs)
    assert values.shape == (2000, 3)
    assert _bits(values) == _bits(expected)
    # folding what was buffered leaves each sketch as its own call left it
    assert [None if s is None else s.to_state() for s in at_once] == [None if s is None else s.to_state()
                                                                      for s in by_each]
    assert _bits(quantiles_of(sketches, qs)) == _bits(expected)  # and the originals read the same
    assert int(np.isnan(values[:, 0]).sum()) == sum(s is None or s.count == 0 for s in sketches) > 200


def test_a_digest_without_centroids_reads_as_the_sketchs_own_call_reads_it():
    """fastdigest refuses the quantile of an empty digest; `LatencySketch.quantiles` answers NaN,
    and so does the reader, for that sketch and no other."""
    full, empty = LatencySketch(), LatencySketch()
    for ms in (5.0, 9.0, 30.0):
        full.add(ms)
    empty._digest = TDigest(100)
    values = quantiles_of([full, empty, None], _SUMMARY)
    assert values[0].tolist() == full.quantiles(_SUMMARY) and np.isnan(values[1:]).all()


@pytest.fixture(scope="module")
def windows():
    outputs = []
    replayed(Simulator("latency_tail", seed=7, minutes=1.0, workers=3, concurrency=12).records(),
             sinks=[outputs.append])
    return [output.windows for output in outputs]


def test_window_columns_at_once_are_the_columns_read_sketch_by_sketch(windows):
    bulk, each = window_columns(windows), window_columns(windows, per_sketch=True)
    assert len(bulk) == len(each) > 500
    with_requests = ~np.isnan(each.numbers["e2e_p99"])
    assert 0 < with_requests.sum() < len(each)  # keys with latencies and keys with none
    assert sorted(bulk.numbers) == sorted(each.numbers)
    for name in bulk.numbers:
        assert bulk.numbers[name].dtype == each.numbers[name].dtype, name
        assert bulk.numbers[name].tobytes() == each.numbers[name].tobytes(), name
    bulk_table, each_table = window_columns_table(bulk), window_columns_table(each)
    assert bulk_table.schema == each_table.schema and bulk_table.equals(each_table)
    assert {name: bulk_table.column(name).type for name in _PERCENTILES} == dict.fromkeys(_PERCENTILES, pa.float64())


def test_the_archive_stores_the_same_rows_and_types_either_way(windows, tmp_path):
    path = tmp_path / "archive"
    with Archive.open(f"chdb://{path}") as archive:
        assert archive.write_windows(windows) == sum(map(len, windows))
        client = clickhouse_connect.get_client(interface="chdb", path=str(path))
        try:
            reference = Archive(client, database="per_sketch")
            reference.ensure_schema()
            assert reference.write_windows(windows, per_sketch=True) == sum(map(len, windows))
            names = ", ".join(WINDOW_STATS_FIELDS)
            types = ", ".join(f"toTypeName({name})" for name in WINDOW_STATS_FIELDS)
            stored = {database: client.query(f"SELECT {names}, {types} FROM {database}.window_stats FINAL "
                                             "ORDER BY ts, bundle_id, bucket, cohort").result_rows
                      for database in ("specwatch", "per_sketch")}
        finally:
            client.close()
    assert len(stored["specwatch"]) == sum(map(len, windows))
    assert stored["specwatch"] == stored["per_sketch"]
    percentile = WINDOW_STATS_FIELDS.index("e2e_p99")
    assert any(row[percentile] is not None for row in stored["specwatch"])
    assert stored["specwatch"][0][len(WINDOW_STATS_FIELDS) + percentile] == "Nullable(Float64)"
