"""Every worker's sighting of a bundle reaches the archive: `query bundles` and `bundles show`
report exactly the spans in the telemetry of a seeded 8-worker fleet whose card changes midway."""

from __future__ import annotations

import json
import os
import subprocess
from collections import defaultdict
from functools import lru_cache
from pathlib import Path

import pytest

from specwatch.archive.store import Archive
from specwatch.archive.sink import ArchiveSink
from specwatch.lab.simulation.simulator import Simulator
from specwatch.schemas.codec import encode_record
from specwatch.streams.embedded import EmbeddedPipeline

from machine import specwatch
from telemetry_log import replayed

_WORKERS = 8
_CHANGE_AT = 30.0


@lru_cache(maxsize=1)
def _records() -> tuple:
    """75 s of 8 workers; the tokenizer digest changes over the fleet from 30 s, in 10 s."""
    return tuple(Simulator("bundle_change", seed=5, minutes=1.25, workers=_WORKERS, concurrency=4,
                           incident_at=_CHANGE_AT).records())


def _expected_spans() -> dict[str, dict[str, tuple[float, float]]]:
    spans: dict[str, dict[str, list[float]]] = defaultdict(dict)
    for record in _records():
        if record.kind not in ("step", "bundle"):
            continue
        span = spans[record.bundle_id].setdefault(record.worker, [record.ts, record.ts])
        span[0], span[1] = min(span[0], record.ts), max(span[1], record.ts)
    return {bundle: {worker: tuple(span) for worker, span in workers.items()} for bundle, workers in spans.items()}


def _archived_spans(rows: list[dict]) -> dict[str, dict[str, tuple[float, float]]]:
    return {row["bundle_id"]: {s["worker"]: (s["first_seen"], s["last_seen"])
                               for s in row["sightings"]} for row in rows}


def _assert_summary(row: dict, spans: dict[str, tuple[float, float]]) -> None:
    """``row`` names the workers of ``spans`` and the time from the first sighting to the last."""
    assert row["workers"] == sorted(spans)
    assert row["first_seen"] == min(first for first, _ in spans.values())
    assert row["last_seen"] == max(last for _, last in spans.values())


def test_the_fleet_is_what_this_test_needs():
    spans = _expected_spans()
    assert len(spans) == 2  # the old card and the new one
    old, new = sorted(spans, key=lambda b: min(s[0] for s in spans[b].values()))
    assert len(spans[old]) == _WORKERS and len(spans[new]) == _WORKERS
    # Not one sighting each: first and last differ by tens of seconds on every worker.
    assert all(last - first > 20 for first, last in spans[old].values())


def test_every_worker_sighting_is_archived_with_its_span(tmp_path):
    spans = _expected_spans()
    dsn = f"chdb://{tmp_path}/archive"
    with Archive.open(dsn) as archive:
        sink = ArchiveSink(archive, spool=tmp_path / "spool")
        inserts = []
        original = archive.write_sightings
        archive.write_sightings = lambda rows: inserts.append(len(rows)) or original(rows)
        pipeline = replayed(_records(), sinks=[sink])
        sink.close()
        slices = pipeline.counters.slices
        bundles = archive.bundles()
    assert _archived_spans(bundles) == spans
    for row in bundles:
        _assert_summary(row, spans[row["bundle_id"]])
    # Cheap: the 8 spans of the first card in one insert with the slice that found them, the
    # card rows (1 each), the new card's spans as each worker rolled over (one a slice), and every
    # grown span once at close, with the last window rows: 12 inserts, 34 rows for 75 slices.
    assert slices == 75 and len(_records()) > 20_000
    assert inserts == [1, 8, 1, 1, 1, 1, 1, 1, 1, 1, 1, 16]


def _specwatch(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, SPECWATCH_ARCHIVE_SPOOL=str(tmp_path / "spool"))
    return specwatch(*argv, env=env, timeout=600)


def test_query_bundles_and_bundles_show_report_every_worker_and_the_time_span(tmp_path):
    spans = _expected_spans()
    telemetry = tmp_path / "telemetry.jsonl"
    telemetry.write_text("".join(encode_record(record) + "\n" for record in _records()))
    dsn = f"chdb://{tmp_path}/archive"
    done = _specwatch(tmp_path, "replay", str(telemetry), "--output", str(tmp_path / "decisions.jsonl"),
                      "--archive", dsn)
    assert done.returncode == 0 and done.stderr == "", done.stderr

    listed = _specwatch(tmp_path, "query", "bundles", "--json", "--archive", dsn)
    rows = [json.loads(line) for line in listed.stdout.splitlines()]
    assert [row["bundle_id"] for row in rows] == sorted(spans, key=lambda b: min(s[0] for s in spans[b].values()))
    for row in rows:
        workers = spans[row["bundle_id"]]
        _assert_summary(row, workers)
        assert row["sightings"] == [{"worker": w, "first_seen": workers[w][0], "last_seen": workers[w][1]}
                                    for w in sorted(workers)]
    table = _specwatch(tmp_path, "query", "bundles", "--archive", dsn).stdout.splitlines()
    assert [line.split()[5] for line in table[1:]] == [str(_WORKERS), str(_WORKERS)]  # the "workers" column

    old = rows[0]
    shown = _specwatch(tmp_path, "bundles", "show", old["bundle_id"], "--archive", dsn)
    assert shown.returncode == 0
    seen = next(line for line in shown.stdout.splitlines() if line.startswith("  seen: "))
    assert seen.endswith(f" on {', '.join(sorted(spans[old['bundle_id']]))}")
    shown = _specwatch(tmp_path, "bundles", "show", old["bundle_id"], "--json", "--archive", dsn)
    assert json.loads(shown.stdout)["sightings"] == old["sightings"]


@pytest.mark.parametrize("spool_first", [False, True])
def test_sightings_survive_an_outage_through_the_spool(tmp_path, spool_first):
    """Spooled spans replay into the same archive rows as spans written straight through."""
    from test_archive_outage import _unwritable

    spans = _expected_spans()
    path = tmp_path / "archive"
    with Archive.open(f"chdb://{path}") as archive:
        sink = ArchiveSink(archive, spool=tmp_path / "spool", window_batch=10_000_000)
        pipeline = EmbeddedPipeline(sinks=[sink])
        records = _records()
        half = len(records) // 2
        if spool_first:
            with _unwritable(path):
                pipeline.feed_many(records[:half])
            assert sink.stats()["spooled"] > 0
        else:
            pipeline.feed_many(records[:half])
        pipeline.feed_many(records[half:])
        pipeline.finish()
        sink.retry()
        sink.close()
        assert sink.stats()["spool_pending_bytes"] == 0
        assert _archived_spans(archive.bundles()) == spans
