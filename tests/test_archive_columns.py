"""Window stats from stage 2 into the archive as columns: stored as the row path stored them, into
chDB with no file, to a server DSN (a recording client: no server here) as the same Arrow table."""

from __future__ import annotations

import math

import clickhouse_connect
import numpy as np
import pytest

from specwatch.archive import store
from specwatch.archive.columns import WINDOW_STATS_FIELDS
from specwatch.archive.rows import window_columns_table, window_rows_table
from specwatch.archive.sink import ArchiveSink
from specwatch.archive.store import Archive
from specwatch.schemas.slice_stats import window_columns
from specwatch.schemas.outputs import WINDOW_SUMMARY_FIELDS, SliceWindows
from specwatch.lab.simulation.simulator import Simulator

from telemetry_log import replayed

_ORDER = "ORDER BY ts, bundle_id, bucket, cohort"


@pytest.fixture(scope="module")
def outputs():
    outputs = []
    replayed(Simulator("latency_tail", seed=5, minutes=1.0, workers=3, concurrency=12).records(), sinks=[outputs.append])
    return outputs


def _stored(client, database: str) -> list[tuple]:
    names = ", ".join(WINDOW_STATS_FIELDS)
    return client.query(f"SELECT {names} FROM {database}.window_stats FINAL {_ORDER}").result_rows


def _as_read(row: dict) -> tuple:
    """A window-stats row dict as the archive returns it: NaN ratios as NULL, lists as lists."""
    return tuple(None if isinstance(row[name], float) and math.isnan(row[name]) else row[name]
                 for name in WINDOW_STATS_FIELDS)


def _in_read_order(rows) -> list[tuple]:
    """Rows as `_ORDER` reads them back: ClickHouse sorts NULL (every bucket, every cohort) last."""
    return sorted(rows, key=lambda r: (r[0], r[1], r[2] is None, r[2] or "", r[3] is None, r[3] or ""))


def test_the_columnar_writer_stores_exactly_what_the_row_path_stored(outputs, tmp_path, monkeypatch):
    """Inserts cut at the chunk size, with no row object on the way in, store what the row path did."""
    def no_rows(self):
        raise AssertionError("a window row was built on the way into the archive")

    rows = [row for output in outputs for row in output.window_rows]
    windows = [row for output in outputs for row in output.windows]
    assert len(rows) == len(windows) == 681 and len({len(o.windows) for o in outputs}) > 1
    assert sum(1 for row in rows if math.isnan(row["speedup"])) == 168  # NULLs on the way
    widest = max(len(output.windows) for output in outputs)
    monkeypatch.setattr(store, "_DEFAULT_INSERT_CHUNK_ROWS", 100)
    monkeypatch.setattr(SliceWindows, "rows", no_rows)
    path = tmp_path / "archive"
    with Archive.open(f"chdb://{path}") as archive:
        inserts = []
        insert_table = archive._insert_table
        monkeypatch.setattr(archive, "_insert_table", lambda table, data: (
            inserts.append(data.num_rows) if table.name == "window_stats" else None, insert_table(table, data)))
        sink = ArchiveSink(archive, window_batch=250, spool=tmp_path / "spool")
        for output in outputs:
            sink(output)
        sink.close()
        assert sink.stats()["written"] > 4 and sink.stats()["spooled"] == 0
        # The row path as it was: a dict per row, and clickhouse-connect's own insert_arrow.
        client = clickhouse_connect.get_client(interface="chdb", path=str(path))
        try:
            rowpath = Archive(client, database="rowpath")
            rowpath.ensure_schema()
            assert rowpath.write_window_stats(rows) == len(rows)
            columnar, by_rows = _stored(client, "specwatch"), _stored(client, "rowpath")
        finally:
            client.close()
    assert len(columnar) == len(rows)
    assert columnar == by_rows
    assert columnar == _in_read_order(_as_read(row) for row in rows)
    assert sum(inserts) == 681 and len(inserts) >= 7 and max(inserts) < 100 + widest


def test_stage_two_columns_hold_exactly_the_numbers_of_its_rows(outputs):
    """Bit for bit, against the rows stage 2 used to build one key at a time."""
    windows = [output.windows for output in outputs]
    assert all(isinstance(window, SliceWindows) for window in windows)
    columns = window_columns(windows)
    rows = [row for window in windows for row in window.rows()]
    assert len(columns) == len(rows) == 681
    for name in WINDOW_SUMMARY_FIELDS[1:]:
        expected = np.array([row.summary[WINDOW_SUMMARY_FIELDS.index(name)] for row in rows], dtype=np.float64)
        assert columns.numbers[name].astype(np.float64).tobytes() == expected.tobytes(), name
    for name in ("steps", "plain_entries"):
        assert columns.numbers[name].tolist() == [getattr(row, name) for row in rows]
    assert columns.numbers["ts"].tolist() == [row.ts for row in rows]
    assert columns.numbers["speculation_on"].tolist() == [row.speculation_on for row in rows]
    assert [columns.texts[name] for name in ("bundle_id", "bucket", "cohort")] == \
        [[getattr(row, name) for row in rows] for name in ("bundle_id", "bucket", "cohort")]
    for name in ("accepted_at_least", "drafted_at_least"):
        flat, offsets = columns.positions[name]
        assert [flat[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])] == [getattr(row, name) for row in rows]
    assert window_columns_table(columns).equals(window_rows_table(rows))
    empty = window_columns([SliceWindows(1.0)])
    assert len(empty) == 0 and window_columns_table(empty).num_rows == 0


def test_an_insert_into_chdb_writes_no_file(outputs, tmp_path, monkeypatch):
    """clickhouse-connect's chDB backend inserts through a temporary file; the archive's own insert does not."""
    from clickhouse_connect.driver._backend import chdb_backend

    windows = [row for output in outputs[:20] for row in output.windows]
    with Archive.open(f"chdb://{tmp_path / 'archive'}") as archive:
        def no_file(*args, **kwargs):
            raise AssertionError("the insert went through a temporary file")

        monkeypatch.setattr(chdb_backend.tempfile, "NamedTemporaryFile", no_file)
        assert archive.write_window_rows(windows) == len(windows)
        assert archive.sql("SELECT count() FROM window_stats")[1] == [(len(windows),)]


class _RecordingServer:
    """Stands in for a clickhouse-connect HTTP client: answers the schema checks, keeps inserts."""

    def __init__(self, **settings):
        self.settings = settings
        self.inserts: list[tuple[str, object, dict]] = []
        self.commands: list[str] = []

    def command(self, sql):
        self.commands.append(sql)

    def query(self, sql, parameters=None):
        return type("Result", (), {"result_rows": [], "column_names": []})()

    def insert_arrow(self, table, data, settings=None):
        self.inserts.append((table, data, settings))

    def close(self):
        pass


def test_a_server_dsn_gets_the_same_arrow_table_through_insert_arrow(outputs, monkeypatch):
    servers = []

    def get_client(**settings):
        assert settings.get("interface") != "chdb"
        servers.append(_RecordingServer(**settings))
        return servers[-1]

    monkeypatch.setattr(clickhouse_connect, "get_client", get_client)
    windows = [row for output in outputs[:40] for row in output.windows]
    with Archive.open("http://ops:pw@ch.internal:8123/postmortems", environ={}) as archive:
        assert archive.write_window_rows(windows) == len(windows)
        assert archive.write_windows([output.windows for output in outputs[:40]]) == len(windows)
    (server,) = servers
    assert (server.settings["host"], server.settings["port"], server.settings["username"]) == ("ch.internal", 8123, "ops")
    (table, data, settings), (_, columns, _) = server.inserts
    assert table == "postmortems.window_stats" and settings == {"optimize_on_insert": 0}
    assert data.equals(window_rows_table(windows)) and columns.equals(data)
    assert "CREATE DATABASE IF NOT EXISTS postmortems" in server.commands


def test_a_bad_window_row_is_refused_naming_its_row_and_column(outputs):
    rows = [row for output in outputs[:3] for row in output.windows][:6]
    for bad, message in ((rows[5]._replace(ts=math.nan), "window stats row 12: 'ts' is a finite slice end time, not nan"),
                         (rows[5]._replace(drafted_at_least=[3, -1]),
                          r"window stats row 12: 'drafted_at_least' is a list of counts, not \[3, -1\]"),
                         (rows[5]._replace(steps=2.5), "window stats row 12: 'steps' is a count, not 2.5"),
                         (rows[5]._replace(bundle_id=None), "window stats row 12: 'bundle_id' is a bundle id string")):
        with pytest.raises(ValueError, match=message):
            window_rows_table(rows[:5] + [bad], 7)
    assert window_rows_table(rows, 7).num_rows == 6
